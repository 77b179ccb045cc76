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
from typing import Iterable, Iterator

Document = list[str]

# Ends a sentence: . ! or ? (optionally closing quotes/brackets), whitespace, then a likely start.
_SENTENCE_END = re.compile(r"(?:(?<=[.!?])|(?<=[.!?][\"')\]]))\s+(?=[\"'(\[]?[A-Z0-9])")
_ONLY_PUNCT = re.compile(r"^[\W_]+$")


@dataclasses.dataclass
class CorpusStats:
  """Counts of what reading saw and repaired; prepare reports them in the manifest."""
  files: int = 0
  bytes: int = 0
  documents: int = 0
  sentences: int = 0
  invalid_utf8_lines: int = 0  # lines with bytes that are not UTF-8, decoded with U+FFFD
  invalid_utf8_chars: int = 0  # U+FFFD characters those replacements introduced

  def add(self, other: "CorpusStats"):
    for f in dataclasses.fields(self):
      setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


def split_sentences(text: str) -> list[str]:
  """Rule-based splitter (no model to download): newlines, then sentence-final punctuation."""
  out = []
  for line in text.splitlines():
    line = " ".join(line.split())
    if line:
      out.extend(s for s in _SENTENCE_END.split(line) if s.strip())
  return out


def _decode_line(raw: bytes, stats: CorpusStats) -> str:
  try:
    return raw.decode("utf-8")
  except UnicodeDecodeError:
    text = raw.decode("utf-8", errors="replace")
    stats.invalid_utf8_lines += 1
    stats.invalid_utf8_chars += text.count("\ufffd") - raw.count("\ufffd".encode())
    return text


def expand_patterns(patterns: str) -> list[str]:
  """Comma-separated globs -> sorted files; a pattern that matches nothing is an error."""
  import tensorflow as tf
  files = []
  for pattern in [p.strip() for p in patterns.split(",") if p.strip()]:
    matched = sorted(tf.io.gfile.glob(pattern))
    if not matched:
      raise FileNotFoundError(f"No file matches {pattern!r} (from source {patterns!r}).")
    files.extend(matched)
  if not files:
    raise FileNotFoundError(f"Source {patterns!r} names no file pattern.")
  return files


def text_file_documents(patterns: str, stats: CorpusStats | None = None) -> Iterator[Document]:
  """Documents of files in the original format; U+FFFD replaces invalid UTF-8 (counted)."""
  import tensorflow as tf
  stats = stats if stats is not None else CorpusStats()
  for path in expand_patterns(patterns):
    stats.files += 1
    with tf.io.gfile.GFile(path, "rb") as raw:
      f = gzip.GzipFile(fileobj=raw) if path.endswith(".gz") else raw
      doc = []
      for raw_line in f:
        stats.bytes += len(raw_line)
        line = " ".join(_decode_line(raw_line, stats).split())
        if line:
          doc.append(line)
        elif doc:
          stats.documents += 1
          stats.sentences += len(doc)
          yield doc
          doc = []
      if doc:  # a file's end closes its last document
        stats.documents += 1
        stats.sentences += len(doc)
        yield doc


def tfds_documents(spec: str, stats: CorpusStats | None = None, *, data_dir: str | None = None,
                   split: str = "train") -> Iterator[Document]:
  """`tfds:name[/config]:feature`: one example per document; never downloads."""
  import tensorflow_datasets as tfds
  stats = stats if stats is not None else CorpusStats()
  body = spec[len("tfds:"):]
  name, sep, feature = body.rpartition(":")
  if not sep or not name or not feature:
    raise ValueError(f"TFDS source {spec!r} must look like tfds:name/config:feature, "
                     f"e.g. tfds:wikipedia/20230601.en:text.")
  builder = tfds.builder(name, data_dir=data_dir or None)
  if not builder.is_prepared():
    raise FileNotFoundError(f"TFDS dataset {name} is not prepared under {builder.data_dir}; build "
                            f"it first (e.g. `tfds build {name}`) or set config.data.tfds_data_dir.")
  features = builder.info.features
  if feature not in features:
    raise KeyError(f"TFDS dataset {name} has no feature {feature!r}; it has {sorted(features)}.")
  ds = builder.as_dataset(split=split, shuffle_files=False)
  stats.files += 1
  for example in ds.as_numpy_iterator():
    raw = example[feature]
    stats.bytes += len(raw)
    doc = split_sentences(_decode_line(raw, stats))
    if doc:
      stats.documents += 1
      stats.sentences += len(doc)
      yield doc


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


def _module_documents(path: str) -> Document:
  try:
    with open(path, encoding="utf-8") as f:
      tree = ast.parse(f.read())
  except (SyntaxError, UnicodeDecodeError, ValueError):
    return []  # a few stdlib files are deliberately invalid (lib2to3 test data and the like)
  nodes = [n for n in ast.walk(tree)
           if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
  nodes.sort(key=lambda n: getattr(n, "lineno", 0))  # source order: a module reads top to bottom
  doc = []
  for node in nodes:
    text = ast.get_docstring(node, clean=True)
    if text:
      doc.extend(_clean_prose(text))
  return doc


@functools.lru_cache(maxsize=1)
def _builtin_documents() -> tuple[tuple[str, ...], ...]:
  import pydoc_data.topics
  root = sysconfig.get_paths()["stdlib"]
  skip_dirs = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__",
               "pydoc_data"}
  docs = []
  for dirpath, dirnames, filenames in os.walk(root):
    # Sorted walk: the same Python installation always gives the same corpus in the same order.
    dirnames[:] = sorted(d for d in dirnames if d not in skip_dirs)
    for name in sorted(filenames):
      if name.endswith(".py"):
        doc = _module_documents(os.path.join(dirpath, name))
        if doc:
          docs.append(tuple(doc))
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
                          tfds_data_dir: str | None = None,
                          tfds_split: str = "train") -> Iterator[Document]:
  if not source:
    raise ValueError("config.data.source is empty: use 'builtin', file globs or tfds:name:feature.")
  if source == "builtin":
    return builtin_documents(stats)
  if source.startswith("tfds:"):
    return tfds_documents(source, stats, data_dir=tfds_data_dir, split=tfds_split)
  return text_file_documents(source, stats)


def read_documents(data_config, stats: CorpusStats | None = None) -> Iterator[Document]:
  return documents_from_source(data_config.source, stats, tfds_data_dir=data_config.tfds_data_dir,
                               tfds_split=data_config.tfds_split)


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


if __name__ == "__main__":
  logging.basicConfig(level=logging.INFO)
  all_docs = list(builtin_documents())
  print(f"builtin corpus: {len(all_docs)} documents, {sum(map(len, all_docs))} sentences, "
        f"{word_count(all_docs)} words")
