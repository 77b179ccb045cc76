"""The files of a corpus source: which ones its patterns name (each of the format its pattern's
name ends in), their raw lines (plain, gzip or zstd), and where a plain one is cut into units of
work without reading it all. bertjax/data/corpus.py reads their documents.
"""

import gzip
import zlib
from typing import Iterator

from bertjax.errors import Refusal

_COMPRESSED = (".gz", ".zst")  # entered only from the start: a whole file is one unit
PARQUET, JSONL, TEXT = "parquet", "jsonl", "text"
_JSONL_ENDINGS = (".jsonl", ".jsonl.gz", ".jsonl.zst")
# Leading bytes of a format, for a file whose name says another (read as text, it would be
# trained on as binary noise): (magic, the format, the ending its name wants).
MAGIC = ((b"\x1f\x8b", "gzip-compressed", ".gz"), (b"\x28\xb5\x2f\xfd", "zstd-compressed", ".zst"),
         (b"PAR1", "a Parquet file", ".parquet"))
_ZSTD_CHUNK = 1 << 20


def kind_of(path: str) -> str:
  """The format a file (or a pattern of files) is read as, by how its name ends."""
  name = path.lower()
  if name.endswith(".parquet"):
    return PARQUET
  return JSONL if name.endswith(_JSONL_ENDINGS) else TEXT


def decode_line(raw: bytes, stats) -> tuple[str, int]:
  """The text and how many U+FFFD the decoding introduced (counted in `stats`, a
  corpus.CorpusStats)."""
  try:
    return raw.decode("utf-8"), 0
  except UnicodeDecodeError:
    text = raw.decode("utf-8", errors="replace")
    replaced = text.count("\ufffd") - raw.count("\ufffd".encode())
    stats.invalid_utf8_lines += 1
    stats.invalid_utf8_chars += replaced
    return text, replaced


def expand_patterns(patterns: str) -> list[str]:
  """Comma-separated globs -> sorted files; a pattern that matches nothing is an error."""
  import tensorflow as tf
  files = []
  for pattern in [p.strip() for p in patterns.split(",") if p.strip()]:
    matched = sorted(tf.io.gfile.glob(pattern))
    if not matched:
      raise FileNotFoundError(f"No file matches {pattern!r} (from source {patterns!r}).")
    for path in matched:
      if tf.io.gfile.isdir(path):
        raise IsADirectoryError(
            f"{path} (from source {patterns!r}) is a directory; config.data.source takes files: "
            f"use e.g. '{path.rstrip('/')}/*.txt' (or '{path.rstrip('/')}/*.txt.gz').")
      _check_format(path, pattern)
    files.extend(matched)
  if not files:
    raise FileNotFoundError(f"Source {patterns!r} names no file pattern.")
  return files


def _check_format(path: str, pattern: str):
  """A pattern's files are read as the format its name ends in (`records.kind_of`): that, not the
  files found, names the source's settings (`text_settings`), and a folder of Parquet shards
  often holds a README or a JSON description that must not be read as sentences."""
  kind, want = kind_of(path), kind_of(pattern)
  if kind != want:
    raise Refusal(f"{path} (a {kind} file by its name) matches {pattern!r} of config.data.source, "
                  f"whose files are read as {want}. Give each format its own pattern, ending as "
                  f"its files do, comma-separated (e.g. 'dir/*.parquet,dir/*.jsonl.zst').")


def check_not_misnamed(path: str):
  """A compressed or Parquet file whose name does not say so would be read as (binary) text."""
  import tensorflow as tf
  with tf.io.gfile.GFile(path, "rb") as raw:
    head = raw.read(4)
  for magic, what, ending in MAGIC:
    if head.startswith(magic) and not path.endswith(ending):
      raise Refusal(f"{path} is {what} but its name does not end in {ending}, so it would be "
                    f"read as text. Rename it to end in {ending} (e.g. .txt.gz, .jsonl.zst, "
                    f".parquet), or decompress it.")


def lines(path: str, start: int = 0, end: int | None = None) -> Iterator[bytes]:
  """The raw lines of a plain, gzip (`.gz`) or zstd (`.zst`) file, or of the bytes [start, end) of
  a plain one (cut at a line start, `cut_points`); damaged or misnamed gzip or zstd is an error."""
  import tensorflow as tf
  if start == 0:
    check_not_misnamed(path)
  with tf.io.gfile.GFile(path, "rb") as raw:
    if path.endswith(".zst"):
      yield from zstd_lines(raw, path)
      return
    if path.endswith(".gz"):
      try:
        yield from gzip.GzipFile(fileobj=raw)
      except (EOFError, gzip.BadGzipFile, zlib.error) as err:
        raise Refusal(f"{path} is not a valid gzip file ({type(err).__name__}: {err}): "
                      f"truncated or corrupt. Check it with `gzip -t {path}`, then copy or "
                      f"compress it again, or leave it out of config.data.source.") from None
      return
    if end is None:
      yield from raw
      return
    raw.seek(start)
    pos = start
    for line in raw:
      if pos >= end:
        return
      pos += len(line)
      yield line


def cut_points(path: str, size: int, split_bytes: int, blank: bool = True) -> list[int]:
  """Offsets that cut a plain file into pieces of about `split_bytes`, each just after a blank line
  (a document boundary; with `blank` False, after any line end: JSON Lines), so every piece holds
  whole documents. Reads only from each nominal offset to the next cut: no reader of the whole
  file."""
  import tensorflow as tf
  cuts = [0]
  if path.endswith(_COMPRESSED) or split_bytes <= 0:
    return cuts + [size]  # gzip and zstd cannot be entered in the middle: one piece
  with tf.io.gfile.GFile(path, "rb") as f:
    for nominal in range(split_bytes, size, split_bytes):
      if nominal <= cuts[-1]:
        continue  # the previous cut went past this nominal offset (a long document)
      f.seek(nominal)
      f.readline()  # the rest of the line holding `nominal`
      if not blank:  # JSON Lines: every line end is a record's
        if f.tell() < size:
          cuts.append(f.tell())
        continue
      while True:
        line = f.readline()
        if not line:
          break
        if not blank or not line.strip():  # ASCII-blank: a blank line for the reader too
          if f.tell() < size:
            cuts.append(f.tell())
          break
  return cuts + [size]


def zstd_lines(raw, path: str) -> Iterator[bytes]:
  """The lines of a zstd-compressed file (any number of frames), refusing one cut short: zstd's
  stream reader ends quietly where the data ends, so a frame left open says it here."""
  # lazy: zstandard is needed only for .zst sources
  import zstandard  # pylint: disable=import-outside-toplevel
  fix = (f"Check it with `zstd -t {path}`, then copy or compress it again, or leave it out of "
         f"config.data.source.")
  decompress, pending, open_frame = zstandard.ZstdDecompressor().decompressobj(), b"", False
  while chunk := raw.read(_ZSTD_CHUNK):
    while chunk:
      try:
        pending += decompress.decompress(chunk)
      except zstandard.ZstdError as err:
        raise Refusal(f"{path} is not valid zstd data ({err}): corrupt. {fix}") from None
      open_frame, chunk = not decompress.eof, b""
      if decompress.eof:  # a frame ends: the next one starts in what it left unused
        chunk = decompress.unused_data
        decompress = zstandard.ZstdDecompressor().decompressobj()
    *done, pending = pending.split(b"\n")
    for line in done:
      yield line + b"\n"
  if open_frame:
    raise Refusal(f"{path} is cut short: its last zstd frame does not end. {fix}")
  if pending:
    yield pending
