"""CoNLL-2003, the benchmark of the tagging family: its label set, its column files (IOB1 or
IOB2, the original release's and others') and its TFDS dataset, read to IOB2 `Sentence`s. The
words, tag schemes and column files of any tagged text are bertjax/inputs/tagged.py's; the word
windows, bertjax/inputs/word_windows.py's; the conlleval scores and predictions, the family's
(bertjax/finetune/families/tagging.py).
"""

from __future__ import annotations

import logging
from typing import Iterable, Mapping, Sequence

from bertjax.data import corpus
from bertjax.errors import Refusal
from bertjax.inputs import tagged

CONLL2003_LABELS = ("O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC", "B-MISC", "I-MISC")


def _check_tags(tags: Sequence[str], kinds: set[str], where_of, labels) -> None:
  for i, tag in enumerate(tags):
    prefix, kind = tagged.split_tag(tag)
    if not prefix or (prefix != "O" and kind not in kinds):
      raise Refusal(f"{where_of(i)}: tag {tag!r} is not one of {list(labels)} (IOB1 or IOB2); "
                    f"pass labels=... for another tag set.")


def read_conll(path: str, word_column: int = 0, tag_column: int = -1,
               labels: Sequence[str] = CONLL2003_LABELS) -> list[tagged.Sentence]:
  """Sentences of a CoNLL column file (`tagged.read_columns`) with tags of `labels` (IOB1 or
  IOB2), as IOB2."""
  kinds = {tagged.split_tag(t)[1] for t in labels} - {""}
  sentences, converted = [], 0
  for first_line, words, tags in tagged.read_columns(path, word_column, tag_column):
    _check_tags(tags, kinds, lambda i, at=first_line: f"{path}:{at + i}", labels)
    iob2 = tagged.to_iob2(tags)
    converted += sum(a != b for a, b in zip(tags, iob2))
    sentences.append(tagged.Sentence(f"{path}:{first_line}", tuple(words), tuple(iob2)))
  if converted:
    logging.info("%s: %d IOB1 tag(s) rewritten to IOB2.", path, converted)
  longest = max(sentences, key=lambda s: len(s.words))
  if len(longest.words) > tagged.LONG_SENTENCE:
    # CoNLL-2003's longest sentence has 124 words: far more means sentences run together.
    logging.warning("%s: a sentence of %d words (at %s): are the blank lines between sentences "
                    "missing? A CoNLL file holds one word per line and a blank line after each "
                    "sentence.", path, len(longest.words), longest.where)
  return sentences


def sentences_from_tfds(rows: Iterable[Mapping], tag_names: Sequence[str], where: str,
                        labels: Sequence[str] = CONLL2003_LABELS) -> list[tagged.Sentence]:
  """Sentences from TFDS conll2003 rows (numpy: `tokens` bytes, `ner` ids into tag_names)."""
  kinds = {tagged.split_tag(t)[1] for t in labels} - {""}
  sentences = []
  for n, row in enumerate(rows):
    words = tuple(w.decode("utf-8") if isinstance(w, bytes) else str(w) for w in row["tokens"])
    tags = [tag_names[int(k)] for k in row["ner"]]
    if not words:
      continue  # TFDS keeps the empty sentences of DOCSTART lines
    _check_tags(tags, kinds, lambda i: f"{where} #{n} word {i}", labels)
    sentences.append(tagged.Sentence(f"{where} #{n}", words, tuple(tagged.to_iob2(tags))))
  if not sentences:
    raise Refusal(f"{where}: the split holds no sentences.")
  return sentences


def read_conll_tfds(data_dir: str | None, split: str) -> list[tagged.Sentence]:
  """CoNLL-2003 from the TFDS `conll2003` dataset built under data_dir; nothing is downloaded."""
  import tensorflow_datasets as tfds
  builder = corpus.built_tfds("conll2003", data_dir, "read the CoNLL column files instead")
  ds = builder.as_dataset(split=split, shuffle_files=False)
  return sentences_from_tfds(tfds.as_numpy(ds), builder.info.features["ner"].feature.names,
                             f"tfds conll2003 {split}")
