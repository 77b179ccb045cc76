"""Corpus sources, each yielding documents (lists of sentences), and the held-out split.

Sources (`config.data.source`):
  "builtin"                      English prose shipped with Python: the standard library's
                                 docstrings (one document per module) and `pydoc_data.topics`
                                 (one document per help topic). No download.
  "path/*.txt,gs://b/x.txt.gz"   text files in the original format: one sentence per line, a blank
                                 line between documents; plain or gzip; globs; any tf.io.gfile path.
  "tfds:name/config:feature"     a TFDS dataset, one example per document, split into sentences.
"""

import ast
import dataclasses
import functools
import gzip
import hashlib
import logging
import os
import re
import sysconfig
import zlib
from typing import Iterable, Iterator

from bertjax.data.config import DataConfig
from bertjax.errors import Refusal

Document = list[str]

# Ends a sentence: . ! or ? (optionally closing quotes/brackets), whitespace, then a likely start.
# What the readers and the sentence splitter make of a source. Vocabularies and prepared shards
# cached under a source's name carry it, so a change that alters the documents or sentences (bump
# it then) never reuses caches made from the old text. 2: titles and abbreviations end no sentence.
TEXT_VERSION = 2
_SENTENCE_END = re.compile(r"(?:(?<=[.!?])|(?<=[.!?][\"')\]]))\s+(?=[\"'(\[]?[A-Z0-9])")
_ONLY_PUNCT = re.compile(r"^[\W_]+$")
# A piece ending so is no sentence end: a title or a common abbreviation. (Not initials: in
# technical prose "A. B" is more often a variable ending a sentence than a name.)
_NOT_AN_END = re.compile(r"(?:^|[\s(\"'])(?:Mr|Mrs|Ms|Dr|Prof|Sr|Jr|St|Mt|Gen|Col|Lt|Sgt|Capt|Rev|"
                         r"Hon|vs|cf|Fig|Vol|pp|approx|e\.g|i\.e)\.$")


@dataclasses.dataclass
class CorpusStats:
  """Counts of what reading saw and repaired; prepare reports them in the manifest."""
  files: int = 0
  bytes: int = 0
  documents: int = 0
  sentences: int = 0
  invalid_utf8_lines: int = 0  # lines with bytes that are not UTF-8, decoded with U+FFFD
  invalid_utf8_chars: int = 0  # U+FFFD characters those replacements introduced
  # input (file or dataset) -> [replaced characters, characters], for inputs with any replaced
  replaced_by_input: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class InputLimits:
  """What reading refuses (`config.data.max_replaced_char_share`, `max_line_chars`)."""
  max_replaced_char_share: float = 0.01
  max_line_chars: int = 20_000  # 0: no limit


def limits_of(data: DataConfig) -> InputLimits:
  return InputLimits(data.max_replaced_char_share, data.max_line_chars)


class _InputCheck:
  """Per input file (or dataset): refuses over-long lines and mostly-undecodable content."""

  # Checked every this many characters as well as at the end, so a large binary file fails early.
  _EVERY = 1 << 20

  def __init__(self, name: str, limits: InputLimits, stats: CorpusStats, hint: str = ""):
    self.name, self.limits, self.stats, self.hint = name, limits, stats, hint
    self.chars = self.replaced = self._next_check = 0

  def line(self, text: str, replaced: int, where: str):
    n = len(text)
    if self.limits.max_line_chars and n > self.limits.max_line_chars:
      raise Refusal(
          f"{self.name}, {where}: {n:,} characters, above config.data.max_line_chars="
          f"{self.limits.max_line_chars:,}. The format wants one sentence per line; one line this "
          f"long would be cut into thousands of one-sentence pieces that dominate the training "
          f"pairs. Split it into sentences or remove it, or raise max_line_chars (0: no limit).")
    self.chars += n
    self.replaced += replaced
    if self.chars >= self._next_check:
      self._check_share()
      self._next_check = self.chars + self._EVERY

  def finish(self):
    self._check_share()
    if self.replaced:
      self.stats.replaced_by_input[self.name] = [self.replaced, self.chars]
      logging.warning("%s: %d of %d characters (%.3f%%) were not valid UTF-8 and were replaced by "
                      "U+FFFD.", self.name, self.replaced, self.chars,
                      100 * self.replaced / max(self.chars, 1))

  def _check_share(self):
    share = self.replaced / max(self.chars, 1)
    if share > self.limits.max_replaced_char_share:
      raise Refusal(
          f"{self.name}: {self.replaced:,} of the first {self.chars:,} characters ({share:.1%}) are "
          f"not valid UTF-8, above config.data.max_replaced_char_share="
          f"{self.limits.max_replaced_char_share}: it is binary data{self.hint} or text in another "
          f"encoding, not UTF-8 text. Leave it out of config.data.source, convert it to UTF-8 "
          f"(e.g. `iconv -f latin1 -t utf-8`), or raise max_replaced_char_share.")


def split_sentences(text: str) -> list[str]:
  """Rule-based splitter (no model to download): newlines, then sentence-final punctuation not
  after a title, a common abbreviation or an initial."""
  out = []
  for line in text.splitlines():
    line = " ".join(line.split())
    if not line:
      continue
    pieces = [s for s in _SENTENCE_END.split(line) if s.strip()]
    for i, piece in enumerate(pieces):
      if i and _NOT_AN_END.search(pieces[i - 1]):
        out[-1] += " " + piece
      else:
        out.append(piece)
  return out


def _decode_line(raw: bytes, stats: CorpusStats) -> tuple[str, int]:
  """The text and how many U+FFFD the decoding introduced."""
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
    files.extend(matched)
  if not files:
    raise FileNotFoundError(f"Source {patterns!r} names no file pattern.")
  return files


def check_not_misnamed_gzip(path: str):
  """A gzip file whose name does not end in .gz would be read as (binary) text."""
  import tensorflow as tf
  if path.endswith(".gz"):
    return
  with tf.io.gfile.GFile(path, "rb") as raw:
    if raw.read(2) == b"\x1f\x8b":
      raise Refusal(f"{path} is gzip-compressed but its name does not end in .gz, so it would "
                    f"be read as text. Rename it to end in .gz (e.g. .txt.gz) or decompress it.")


def _lines(path: str, start: int = 0, end: int | None = None) -> Iterator[bytes]:
  """The raw lines of a plain or gzip (`.gz`) file, or of the bytes [start, end) of a plain one
  (cut at a line start, `cut_points`); damaged or misnamed gzip is an error."""
  import tensorflow as tf
  if start == 0:
    check_not_misnamed_gzip(path)
  with tf.io.gfile.GFile(path, "rb") as raw:
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


def cut_points(path: str, size: int, split_bytes: int) -> list[int]:
  """Offsets that cut a plain file into pieces of about `split_bytes`, each just after a blank line
  (a document boundary), so every piece holds whole documents. Reads only from each nominal offset
  to the next blank line: no reader of the whole file."""
  import tensorflow as tf
  cuts = [0]
  if path.endswith(".gz") or split_bytes <= 0:
    return cuts + [size]  # gzip cannot be entered in the middle: one piece
  with tf.io.gfile.GFile(path, "rb") as f:
    for nominal in range(split_bytes, size, split_bytes):
      if nominal <= cuts[-1]:
        continue  # the previous cut went past this nominal offset (a long document)
      f.seek(nominal)
      f.readline()  # the rest of the line holding `nominal`
      while True:
        line = f.readline()
        if not line:
          break
        if not line.strip():  # ASCII-blank: a blank line for the reader too
          if f.tell() < size:
            cuts.append(f.tell())
          break
  return cuts + [size]


def plan_inputs(source: str, split_bytes: int) -> list[dict]:
  """The source as independent pieces of input ("units"), read in parallel: byte ranges of plain
  files cut at document boundaries, whole gzip files; a TFDS split or the built-in corpus is one."""
  import tensorflow as tf
  if not source:
    raise Refusal("config.data.source is empty: use 'builtin', file globs or tfds:name:feature.")
  if source == "builtin" or source.startswith("tfds:"):
    return [{"input": source, "start": 0, "end": 0}]
  units = []
  for path in expand_patterns(source):
    check_not_misnamed_gzip(path)
    cuts = cut_points(path, tf.io.gfile.stat(path).length, split_bytes)
    units += [{"input": path, "start": a, "end": b} for a, b in zip(cuts, cuts[1:])] or \
        [{"input": path, "start": 0, "end": 0}]
  return units


def text_file_documents(patterns: str, stats: CorpusStats | None = None,
                        limits: InputLimits = InputLimits()) -> Iterator[Document]:
  """Documents of files in the original format; U+FFFD replaces invalid UTF-8 (counted per file,
  a file over `limits.max_replaced_char_share` refused) and over-long lines are refused."""
  stats = stats if stats is not None else CorpusStats()
  for path in expand_patterns(patterns):
    yield from file_range_documents(path, 0, None, stats, limits)


def file_range_documents(path: str, start: int, end: int | None, stats: CorpusStats,
                         limits: InputLimits = InputLimits()) -> Iterator[Document]:
  """The documents of bytes [start, end) of `path` (end None: to its end)."""
  if start == 0:
    stats.files += 1
  hint = "" if path.endswith(".gz") else " (compressed? only names ending in .gz are unpacked)"
  check = _InputCheck(path, limits, stats, hint)
  doc = []
  where = "line {}" if start == 0 else "line {} after byte " + str(start)
  for number, raw_line in enumerate(_lines(path, start, end), 1):
    stats.bytes += len(raw_line)
    text, replaced = _decode_line(raw_line, stats)
    text = text.rstrip("\r\n")
    check.line(text, replaced, where.format(number))
    line = " ".join(text.split())
    if line:
      doc.append(line)
    elif doc:
      stats.documents += 1
      stats.sentences += len(doc)
      yield doc
      doc = []
  check.finish()
  if doc:  # a file's (or piece's: cut after a blank line) end closes its last document
    stats.documents += 1
    stats.sentences += len(doc)
    yield doc


def unit_documents(unit: dict, data: DataConfig, stats: CorpusStats) -> Iterator[Document]:
  """The documents of one piece of `plan_inputs`."""
  name = unit["input"]
  if name == "builtin" or name.startswith("tfds:"):
    yield from documents_from_source(name, stats, tfds_data_dir=data.tfds_data_dir,
                                     tfds_split=data.tfds_split, limits=limits_of(data))
  elif unit["end"] > unit["start"] or unit["start"] == 0:
    end = None if unit["start"] == 0 and unit["end"] == 0 else unit["end"]
    yield from file_range_documents(name, unit["start"], end, stats, limits_of(data))


def built_tfds(name: str, data_dir: str | None, otherwise: str):
  """The TFDS builder of `name` already built under `data_dir`: bertjax never downloads, so one
  that is not built is an error saying where it looked and what to do instead (`otherwise`)."""
  import tensorflow_datasets as tfds  # pylint: disable=import-outside-toplevel
  builder = tfds.builder(name, data_dir=data_dir or None)
  if not builder.is_prepared():
    raise FileNotFoundError(
        f"TFDS dataset {name} is not built under {builder.data_dir}; bertjax never downloads. "
        f"Build it where there is network (`tfds build {name} --data_dir=DIR`) and copy it, or "
        f"{otherwise}.")
  return builder


def tfds_documents(spec: str, stats: CorpusStats | None = None, *, data_dir: str | None = None,
                   split: str = "train", limits: InputLimits = InputLimits()) -> Iterator[Document]:
  """`tfds:name[/config]:feature`: one example per document; never downloads."""
  stats = stats if stats is not None else CorpusStats()
  body = spec[len("tfds:"):]
  name, sep, feature = body.rpartition(":")
  if not sep or not name or not feature:
    raise Refusal(f"TFDS source {spec!r} must look like tfds:name/config:feature, "
                  f"e.g. tfds:wikipedia/20230601.en:text.")
  builder = built_tfds(name, data_dir, "set config.data.tfds_data_dir to where it is built")
  features = builder.info.features
  if feature not in features:
    raise KeyError(f"TFDS dataset {name} has no feature {feature!r}; it has {sorted(features)}.")
  ds = builder.as_dataset(split=split, shuffle_files=False)
  stats.files += 1
  check = _InputCheck(spec, limits, stats)
  for number, example in enumerate(ds.as_numpy_iterator()):
    raw = example[feature]
    stats.bytes += len(raw)
    text, replaced = _decode_line(raw, stats)
    doc = split_sentences(text)
    for i, sentence in enumerate(doc):
      check.line(sentence, replaced if i == 0 else 0, f"a sentence of example {number} ({split})")
    if doc:
      stats.documents += 1
      stats.sentences += len(doc)
      yield doc
  check.finish()


def _clean_prose(text: str) -> list[str]:
  """Sentences of a docstring or help topic, without code blocks, doctests and heading rules."""
  sentences = []
  for para in re.split(r"\n\s*\n", text):
    lines = para.split("\n")
    # Indented paragraphs are code examples or tables in reST; doctests start with >>>.
    if not lines or lines[0][:1].isspace() or lines[0].lstrip().startswith(">>>"):
      continue
    kept = [ln for ln in lines if not _ONLY_PUNCT.match(ln.strip() or "x")
            and not ln.lstrip().startswith((">>>", "... "))]
    sentences.extend(split_sentences(" ".join(kept)))
  return sentences


def _module_docstrings(path: str) -> list[list[str]]:
  """The sentences of each docstring of a module (module, classes, functions), in source order;
  docstrings without prose left out."""
  try:
    with open(path, encoding="utf-8") as f:
      tree = ast.parse(f.read())
  except (SyntaxError, UnicodeDecodeError, ValueError):
    return []  # a few stdlib files are deliberately invalid (lib2to3 test data and the like)
  nodes = [n for n in ast.walk(tree)
           if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
  nodes.sort(key=lambda n: getattr(n, "lineno", 0))  # source order: a module reads top to bottom
  texts = (ast.get_docstring(node, clean=True) for node in nodes)
  return [sentences for sentences in (_clean_prose(t) for t in texts if t) if sentences]


@functools.lru_cache(maxsize=1)
def builtin_modules() -> tuple[tuple[tuple[str, ...], ...], ...]:
  """Each stdlib module's docstrings (their sentences), in a sorted walk of the library: the
  built-in documents' first ones, one a module, with the docstring boundaries they drop."""
  root = sysconfig.get_paths()["stdlib"]
  skip_dirs = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__",
               "pydoc_data"}
  modules = []
  for dirpath, dirnames, filenames in os.walk(root):
    # Sorted walk: the same Python installation always gives the same corpus in the same order.
    dirnames[:] = sorted(d for d in dirnames if d not in skip_dirs)
    for name in sorted(filenames):
      if name.endswith(".py"):
        docstrings = _module_docstrings(os.path.join(dirpath, name))
        if docstrings:
          modules.append(tuple(tuple(d) for d in docstrings))
  return tuple(modules)


@functools.lru_cache(maxsize=1)
def _builtin_documents() -> tuple[tuple[str, ...], ...]:
  import pydoc_data.topics
  docs = [tuple(s for d in docstrings for s in d) for docstrings in builtin_modules()]
  for key in sorted(pydoc_data.topics.topics):
    doc = _clean_prose(pydoc_data.topics.topics[key])
    if doc:
      docs.append(tuple(doc))
  return tuple(docs)


def builtin_documents(stats: CorpusStats | None = None) -> Iterator[Document]:
  """The built-in corpus: about 340,000 words on CPython 3.11, no download."""
  stats = stats if stats is not None else CorpusStats()
  stats.files += 1
  for doc in _builtin_documents():
    stats.documents += 1
    stats.sentences += len(doc)
    stats.bytes += sum(len(s.encode()) + 1 for s in doc) + 1
    yield list(doc)


def documents_from_source(source: str, stats: CorpusStats | None = None, *,
                          tfds_data_dir: str | None = None, tfds_split: str = "train",
                          limits: InputLimits = InputLimits()) -> Iterator[Document]:
  if not source:
    raise Refusal("config.data.source is empty: use 'builtin', file globs or tfds:name:feature.")
  if source == "builtin":
    return builtin_documents(stats)
  if source.startswith("tfds:"):
    return tfds_documents(source, stats, data_dir=tfds_data_dir, split=tfds_split, limits=limits)
  return text_file_documents(source, stats, limits)


def read_documents(data: DataConfig, stats: CorpusStats | None = None) -> Iterator[Document]:
  return documents_from_source(data.source, stats, tfds_data_dir=data.tfds_data_dir,
                               tfds_split=data.tfds_split, limits=limits_of(data))


def is_heldout(doc: Document, eval_fraction: float) -> bool:
  """Held out by a hash of the document's text: stable across runs, order and sharding."""
  digest = hashlib.sha1("\n".join(doc).encode("utf-8", errors="replace")).digest()
  return int.from_bytes(digest[:8], "big") < eval_fraction * 2.0**64


def split_documents(docs: Iterable[Document], split: str, eval_fraction: float) -> Iterator[Document]:
  if split not in ("train", "eval"):
    raise ValueError(f"split must be 'train' or 'eval', got {split!r}.")
  want_eval = split == "eval"
  for doc in docs:
    if is_heldout(doc, eval_fraction) == want_eval:
      yield doc


def word_count(docs: Iterable[Document]) -> int:
  return sum(len(s.split()) for d in docs for s in d)


def main(argv) -> None:
  """`python -m bertjax.data.corpus`: the size of the built-in corpus."""
  if len(argv) > 1:
    from absl import app  # pylint: disable=import-outside-toplevel
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  all_docs = list(builtin_documents())
  print(f"builtin corpus: {len(all_docs)} documents, {sum(map(len, all_docs))} sentences, "
        f"{word_count(all_docs)} words")


if __name__ == "__main__":
  from bertjax import cli
  cli.run(main)
