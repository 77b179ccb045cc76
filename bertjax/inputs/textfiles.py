"""A user's own example files: CSV, TSV, JSON Lines and Parquet rows with named columns.

The format follows the file's name (`.csv`, `.tsv`, `.jsonl` / `.json`, `.parquet`) unless
config.data.format says it. Rows come with the line they start on (Parquet: the row group and
row), so every error can name `file:line`:

- CSV is read by Python's `csv` module: a quoted field may hold commas, quotes ("") and newlines,
  and a row spanning several lines is one example.
- TSV fields are split on tabs, with no quoting (GLUE's files and most exports hold quote
  characters as text); a field cannot hold a tab or a newline.
- JSON Lines: one object per line; a value may be a string, a number or (tagging) a list.
- Parquet (the Hub's format of task datasets): a row per example, read by pyarrow a batch at a
  time; a value is what its column holds (a string, a number, a list), a null is None.

A UTF-8 byte-order mark and CRLF line endings are accepted in every format. A line with no
characters is no row; every other line is one (in a one-column file, `""` or spaces are a row
whose text is blank), so the rows keep the file's order and count. The first row of a CSV
or TSV file names the columns. `iter_rows` streams (prediction reads files of any size through it);
`read_rows` checks the columns a task needs and returns them all.
"""

from __future__ import annotations

import csv
import io
import json
import os
from typing import Any, Iterator, Sequence

from bertjax import files
from bertjax.errors import Refusal

FORMATS = ("csv", "tsv", "jsonl", "parquet")
_EXTENSIONS = {".csv": "csv", ".tsv": "tsv", ".jsonl": "jsonl", ".json": "jsonl",
               ".ndjson": "jsonl", ".parquet": "parquet"}


class Row(dict):
  """One example's columns, and where it starts (`file:line`)."""

  where: str = ""


def format_of(path: str, fmt: str = "") -> str:
  if fmt:
    if fmt not in FORMATS:
      raise Refusal(f"config.data.format={fmt!r}: use one of {FORMATS} or '' (from the file's "
                    "extension).")
    return fmt
  ext = os.path.splitext(path.lower().removesuffix(".gz"))[1]
  if ext not in _EXTENSIONS:
    raise Refusal(f"{path}: cannot tell the format from the extension {ext or '(none)'!r}; "
                  f"name it .csv, .tsv, .jsonl or .parquet, or set config.data.format to one of "
                  f"{FORMATS}.")
  return _EXTENSIONS[ext]


def _text_stream(path: str):
  if not files.exists(path):
    raise FileNotFoundError(f"No file {path}.")
  raw = files.open_file(path, "rb")
  # utf-8-sig drops a byte-order mark; newline="" hands CRLF to csv, which treats it as one end.
  return io.TextIOWrapper(raw, encoding="utf-8-sig", newline="")


def _header(path: str, fields: Sequence[str]) -> list[str]:
  names = [f.strip() for f in fields]
  if not any(names):
    raise Refusal(f"{path}:1: the first row names no columns; a {format_of(path)} file's first "
                  "row is its header (e.g. text,label).")
  dupes = sorted({n for n in names if names.count(n) > 1 and n})
  if dupes:
    raise Refusal(f"{path}:1: the header names the column(s) {dupes} more than once.")
  return names


# Byte-order marks of the encodings a spreadsheet or an editor saves as "Unicode" (longest first:
# UTF-32's little-endian mark begins with UTF-16's).
_BOMS = ((b"\xff\xfe\x00\x00", "UTF-32"), (b"\x00\x00\xfe\xff", "UTF-32"),
         (b"\xff\xfe", "UTF-16"), (b"\xfe\xff", "UTF-16"))


def _first_bad_byte(path: str) -> tuple[int, int, bytes]:
  """(line, byte within it counted from 1, the bytes there) of the file's first byte that is not
  UTF-8. The text decoder works in chunks, so the place it reports is not the line's: the file is
  read again as bytes, a line at a time."""
  with files.open_file(path, "rb") as f:
    for number, raw in enumerate(f, start=1):
      try:
        raw.decode("utf-8")
      except UnicodeDecodeError as err:
        return number, err.start + 1, raw[err.start:err.start + 4]
  return 0, 0, b""


def _decode_error(path: str) -> Refusal:
  with files.open_file(path, "rb") as f:
    head = f.read(4)
  for bom, name in _BOMS:
    if head.startswith(bom):
      return Refusal(f"{path}: {name} (its byte-order mark), not UTF-8; save it as UTF-8 "
                     f"(e.g. iconv -f {name} -t UTF-8 {os.path.basename(path)} > new.csv, or "
                     "your editor's 'UTF-8' choice).")
  line, byte, found = _first_bad_byte(path)
  return Refusal(f"{path}:{line}: not UTF-8 (byte {byte} of the line: {found!r}); save the file "
                 "as UTF-8 (from Windows-1252/Latin-1: iconv -f cp1252 -t utf-8; check the "
                 "encoding your program wrote first).")


def _csv_rows(path: str, delimiter: str) -> Iterator[Row]:
  with _text_stream(path) as stream:
    quoting = csv.QUOTE_MINIMAL if delimiter == "," else csv.QUOTE_NONE
    reader = csv.reader(stream, delimiter=delimiter, quoting=quoting, strict=True)
    names, start = None, 1
    try:
      for fields in reader:
        line, start = start, reader.line_num + 1
        if names is None:
          names = _header(path, fields)
          continue
        if not fields or (len(names) > 1 and len(fields) == 1 and not fields[0].strip()):
          # A line with no characters is no row. Nor is one of spaces where the header names
          # several columns; in a one-column file it is a row whose text is blank, as is `""`
          # (what csv writes for an empty string): skipping those would shift every later row.
          continue
        if len(fields) != len(names):
          raise Refusal(f"{path}:{line}: {len(fields)} field(s) where the header has "
                        f"{len(names)} ({names}); "
                        + ("quote a field holding a comma or a newline (\"...\")"
                              if delimiter == "," else "a field holding a tab?"))
        row = Row(zip(names, fields))
        row.where = f"{path}:{line}"
        yield row
    except csv.Error as err:
      if "field larger than field limit" in str(err):
        raise Refusal(
            f"{path}:{start}: a field longer than {csv.field_size_limit():,} characters, the "
            "limit of Python's csv reader (and nothing past max_seq_length tokens is read); "
            "shorten the text, or write the file as JSON Lines, which has no such limit."
        ) from None
      raise Refusal(f"{path}:{reader.line_num}: {err} (a quote opened and not closed?)"
                    ) from None
    except UnicodeDecodeError:
      raise _decode_error(path) from None
  if names is None:
    raise Refusal(f"{path}: the file is empty; its first row names the columns.")


def _jsonl_rows(path: str) -> Iterator[Row]:
  with _text_stream(path) as stream:
    line = 0
    try:
      for line, text in enumerate(stream, start=1):
        if not text.strip():
          continue
        try:
          value = json.loads(text)
        except json.JSONDecodeError as err:
          raise Refusal(f"{path}:{line}: not JSON ({err.msg} at column {err.colno}); JSON Lines "
                        "holds one object per line.") from None
        if not isinstance(value, dict):
          raise Refusal(f"{path}:{line}: a {type(value).__name__}, not an object; JSON Lines "
                        'holds one object per line ({"text": ..., "label": ...}).')
        row = Row(value)
        row.where = f"{path}:{line}"
        yield row
    except UnicodeDecodeError:
      raise _decode_error(path) from None


def _parquet_rows(path: str) -> Iterator[Row]:
  # lazy: pyarrow takes a second to import, and only Parquet files need it
  import pyarrow as pa  # pylint: disable=import-outside-toplevel
  import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel
  if not files.exists(path):
    raise FileNotFoundError(f"No file {path}.")
  with files.open_file(path, "rb") as raw:
    group = 0
    try:
      table = pq.ParquetFile(raw)
      for group in range(table.metadata.num_row_groups):
        number = 0
        for batch in table.iter_batches(batch_size=1024, row_groups=[group]):
          for values in batch.to_pylist():
            row = Row(values)
            row.where = f"{path}, row group {group}, row {number}"
            number += 1
            yield row
    except (pa.ArrowException, OSError) as err:
      raise Refusal(f"{path}, row group {group}: not a readable Parquet file "
                    f"({type(err).__name__}: {' '.join(str(err).split())}): truncated or "
                    "corrupt; write or copy it again.") from None


def iter_rows(path: str, fmt: str = "") -> Iterator[Row]:
  """Every row of the file, in order, streamed."""
  fmt = format_of(path, fmt)
  if fmt == "jsonl":
    return _jsonl_rows(path)
  if fmt == "parquet":
    return _parquet_rows(path)
  return _csv_rows(path, "," if fmt == "csv" else "\t")


# The keys that name a file's columns, as a refusal says them (a reader may say its own).
COLUMN_KEYS = "text_a / text_b / label (tagging: tokens / tags)"


def require(row: Row, columns: Sequence[str], what: str = "config.data",
            keys: str = COLUMN_KEYS) -> None:
  """Every one of `columns` is in `row`, or an error listing the columns found."""
  missing = [c for c in columns if c not in row]
  if missing:
    named = f"{what}{'' if what.endswith('-') else '.'}{keys}"  # --text_a, config.data.text_a
    raise Refusal(f"{row.where}: no column {missing[0]!r}; the file has {sorted(row)}. Name "
                  f"the columns with {named}.")


def read_rows(path: str, columns: Sequence[str], fmt: str = "",
              keys: str = COLUMN_KEYS) -> list[Row]:
  """Every row, each checked to hold `columns`; an empty file is an error."""
  rows = []
  for row in iter_rows(path, fmt):
    require(row, columns, keys=keys)
    rows.append(row)
  if not rows:
    raise Refusal(f"{path}: no examples (only a header, or blank lines).")
  return rows


def text_of(row: Row, column: str) -> str:
  value = row[column]
  if value is None:
    return ""
  if isinstance(value, (list, dict)):
    raise Refusal(f"{row.where}: column {column!r} holds a {type(value).__name__}, not text.")
  return str(value)


def list_of(row: Row, column: str) -> list[str]:
  """A tagging column: a JSON list, or (CSV/TSV) a string holding one, or space-separated words."""
  value: Any = row[column]
  if isinstance(value, str):
    text = value.strip()
    if text.startswith("["):
      try:
        value = json.loads(text)
      except json.JSONDecodeError as err:
        raise Refusal(f"{row.where}: column {column!r} is not a JSON list ({err.msg}); write "
                      'it as ["w1", "w2", ...] or as words separated by spaces.') from None
    else:
      value = text.split()
  if not isinstance(value, list) or not all(isinstance(v, (str, int, float)) for v in value):
    raise Refusal(f"{row.where}: column {column!r} is not a list of words or tags.")
  return [str(v) for v in value]
