"""Corpus sources, each yielding documents (lists of sentences), and the held-out split.

Sources (`config.data.source`):
  "builtin"                      English prose shipped with Python: the standard library's
                                 docstrings (one document per module) and `pydoc_data.topics`
                                 (one document per help topic). No download.
  "path/*.txt,gs://b/x.txt.gz"   text files in the original format: one sentence per line, a blank
                                 line between documents; plain or gzip; globs; any tf.io.gfile path.
  "tfds:name/config:feature"     a TFDS dataset, one example per document, split into sentences.
  "gs://b/fineweb/*.parquet"     Parquet files, a row per document, its text in the column
                                 `text_column`, split into sentences (bertjax/data/corpora/records.py).
  "docs/*.jsonl.zst"             JSON Lines (.jsonl, .jsonl.gz, .jsonl.zst), a line per document,
                                 its text in the field `text_column`, split into sentences.
Sentences of the last three come from bertjax/data/corpora/sentences.py (in `language`'s rules).
"""

import dataclasses
import hashlib
import logging
from typing import Iterable, Iterator

from bertjax.data.config import DataConfig
from bertjax.data.corpora import builtin_corpus, inputfiles, records, sentences
from bertjax.errors import Refusal

Document = list[str]

# What the readers and the sentence splitter make of a source. Vocabularies and prepared shards
# cached under a source's name carry it, so a change that alters the documents or sentences (bump
# it then) never reuses caches made from the old text. 2: titles and abbreviations end no sentence.
# The sources cut into sentences by a library also carry its release (`text_settings`).
TEXT_VERSION = 2
_EMPTY_SOURCE = ("config.data.source is empty: use 'builtin', file globs (text, .parquet, .jsonl, "
                 ".jsonl.gz, .jsonl.zst) or tfds:name:feature.")


@dataclasses.dataclass
class CorpusStats:
  """Counts of what reading saw and repaired; prepare reports them in the manifest."""
  files: int = 0
  bytes: int = 0
  documents: int = 0
  sentences: int = 0
  invalid_utf8_lines: int = 0  # lines with bytes that are not UTF-8, decoded with U+FFFD
  invalid_utf8_chars: int = 0  # U+FFFD characters those replacements introduced
  empty_rows: int = 0  # Parquet or JSON Lines rows whose text is null, empty or blank: skipped
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


def plan_inputs(source: str, split_bytes: int, text_column: str = "text") -> list[dict]:
  """The source as independent pieces of input ("units"), read in parallel: byte ranges of plain
  files cut at document boundaries, whole compressed files, runs of a Parquet file's row groups; a
  TFDS split or the built-in corpus is one."""
  import tensorflow as tf
  if not source:
    raise Refusal(_EMPTY_SOURCE)
  if source == "builtin" or source.startswith("tfds:"):
    return [{"input": source, "start": 0, "end": 0}]
  units = []
  for path in inputfiles.expand_patterns(source):
    kind = inputfiles.kind_of(path)
    if kind == inputfiles.PARQUET:
      units += records.parquet_units(path, text_column, split_bytes)
      continue
    inputfiles.check_not_misnamed(path)
    cuts = inputfiles.cut_points(path, tf.io.gfile.stat(path).length, split_bytes,
                                 blank=kind == inputfiles.TEXT)
    units += [{"input": path, "start": a, "end": b} for a, b in zip(cuts, cuts[1:])] or \
        [{"input": path, "start": 0, "end": 0}]
  return units


def file_range_documents(path: str, start: int, end: int | None, stats: CorpusStats,
                         limits: InputLimits = InputLimits()) -> Iterator[Document]:
  """The documents of bytes [start, end) of `path` (end None: to its end)."""
  if start == 0:
    stats.files += 1
  hint = "" if path.endswith((".gz", ".zst")) else \
      " (compressed? only names ending in .gz or .zst are unpacked)"
  check = _InputCheck(path, limits, stats, hint)
  doc = []
  where = "line {}" if start == 0 else "line {} after byte " + str(start)
  for number, raw_line in enumerate(inputfiles.lines(path, start, end), 1):
    stats.bytes += len(raw_line)
    text, replaced = inputfiles.decode_line(raw_line, stats)
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


def record_documents(unit: dict, stats: CorpusStats, limits: InputLimits = InputLimits(),
                     text_column: str = "text", language: str = "en") -> Iterator[Document]:
  """The documents of a unit of Parquet or JSON Lines (`records`), a row each, in sentences."""
  path = unit["input"]
  if inputfiles.kind_of(path) == inputfiles.PARQUET:
    stats.files += unit["row_groups"][0] == 0
    rows = records.parquet_rows(unit, text_column, stats)
  else:
    start, end = unit["start"], unit["end"] or None
    stats.files += start == 0
    where = "line {}" if start == 0 else "line {} after byte " + str(start)
    rows = records.jsonl_rows(path, inputfiles.lines(path, start, end), where, text_column, stats)
  yield from _segmented(rows, _InputCheck(path, limits, stats), stats, language)


def _segmented(rows, check: _InputCheck, stats: CorpusStats, language: str) -> Iterator[Document]:
  """Each (where, text, replaced characters) of `rows` as a document of its sentences."""
  for where, text, replaced in rows:
    doc = sentences.split_document(text, language)
    for i, sentence in enumerate(doc):
      check.line(sentence, replaced if i == 0 else 0, f"a sentence of {where}")
    if doc:
      stats.documents += 1
      stats.sentences += len(doc)
      yield doc
  check.finish()


def unit_documents(unit: dict, data: DataConfig, stats: CorpusStats) -> Iterator[Document]:
  """The documents of one piece of `plan_inputs`."""
  name = unit["input"]
  if name == "builtin" or name.startswith("tfds:"):
    yield from documents_from_source(name, stats, tfds_data_dir=data.tfds_data_dir,
                                     tfds_split=data.tfds_split, limits=limits_of(data),
                                     language=data.language)
  elif inputfiles.kind_of(name) != inputfiles.TEXT:
    yield from record_documents(unit, stats, limits_of(data), data.text_column, data.language)
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
                   split: str = "train", limits: InputLimits = InputLimits(),
                   language: str = "en") -> Iterator[Document]:
  """`tfds:name[/config]:feature`: one example per document, cut into sentences; never
  downloads."""
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

  def rows():
    for number, example in enumerate(ds.as_numpy_iterator()):
      stats.bytes += len(example[feature])
      yield f"example {number} ({split})", *inputfiles.decode_line(example[feature], stats)
  yield from _segmented(rows(), _InputCheck(spec, limits, stats), stats, language)


def builtin_documents(stats: CorpusStats | None = None) -> Iterator[Document]:
  """The built-in corpus: about 340,000 words on CPython 3.11, no download."""
  stats = stats if stats is not None else CorpusStats()
  stats.files += 1
  for doc in builtin_corpus.documents():
    stats.documents += 1
    stats.sentences += len(doc)
    stats.bytes += sum(len(s.encode()) + 1 for s in doc) + 1
    yield list(doc)


def documents_from_source(source: str, stats: CorpusStats | None = None, *,
                          tfds_data_dir: str | None = None, tfds_split: str = "train",
                          limits: InputLimits = InputLimits(), text_column: str = "text",
                          language: str = "en") -> Iterator[Document]:
  if not source:
    raise Refusal(_EMPTY_SOURCE)
  if source == "builtin":
    return builtin_documents(stats)
  if source.startswith("tfds:"):
    return tfds_documents(source, stats, data_dir=tfds_data_dir, split=tfds_split, limits=limits,
                          language=language)
  return file_documents(source, stats, limits, text_column, language)


def file_documents(patterns: str, stats: CorpusStats | None = None,
                   limits: InputLimits = InputLimits(), text_column: str = "text",
                   language: str = "en") -> Iterator[Document]:
  """The documents of every file the patterns name, each file read whole in its format."""
  stats = stats if stats is not None else CorpusStats()
  for path in inputfiles.expand_patterns(patterns):
    kind = inputfiles.kind_of(path)
    if kind == inputfiles.TEXT:
      yield from file_range_documents(path, 0, None, stats, limits)
    else:
      whole = {"input": path, "row_groups": [0, None]} if kind == inputfiles.PARQUET else \
          {"input": path, "start": 0, "end": 0}
      yield from record_documents(whole, stats, limits, text_column, language)


def read_documents(data: DataConfig, stats: CorpusStats | None = None) -> Iterator[Document]:
  return documents_from_source(data.source, stats, tfds_data_dir=data.tfds_data_dir,
                               tfds_split=data.tfds_split, limits=limits_of(data),
                               text_column=data.text_column, language=data.language)


def text_settings(data: DataConfig) -> dict:
  """What decides the text of the source's documents besides the source itself, recorded with
  what is made of them (prepared shards, the cached vocabulary): TEXT_VERSION, and for a source
  cut into sentences (TFDS, Parquet, JSON Lines) the segmenter's release and language, and the
  column read. Read from the source's patterns (`_check_format` holds their files to them)."""
  settings = {"text_version": TEXT_VERSION}
  tfds = data.source.startswith("tfds:")
  records_read = not tfds and {inputfiles.kind_of(p.strip()) for p in data.source.split(",")} - {
      inputfiles.TEXT}
  if tfds or records_read:
    settings.update(segmenter=sentences.segmenter(),
                    language=sentences.check_language(data.language))
  if records_read:
    settings["text_column"] = data.text_column
  return settings


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
