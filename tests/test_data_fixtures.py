"""Shared helpers of the data tests (no tests here): a tiny WordPiece vocabulary and corpus."""

import os
import random

from bertjax.data.config import DataConfig
from bertjax.configs import base

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
_SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
# 400 distinct lower-case words of two syllables, plus a few continuation pieces for whole words.
WORDS = sorted({a + b for a in _SYLLABLES for b in _SYLLABLES})[:400]
SUFFIXES = ["##s", "##ing", "##ed"]


def write_vocab(path: str, specials=SPECIALS) -> str:
  with open(path, "w") as f:
    f.write("\n".join(list(specials) + [".", ","] + WORDS + SUFFIXES) + "\n")
  return path


def random_documents(n_docs: int, sents_per_doc: int, seed: int = 0, words=(3, 12)):
  rng = random.Random(seed)
  docs = []
  for _ in range(n_docs):
    doc = []
    for _ in range(sents_per_doc):
      ws = [rng.choice(WORDS) + ("s" if rng.random() < 0.1 else "")
            for _ in range(rng.randint(*words))]
      doc.append(" ".join(ws).capitalize() + ".")
    docs.append(doc)
  return docs


def write_corpus(path: str, docs) -> str:
  with open(path, "w") as f:
    f.write("\n\n".join("\n".join(d) for d in docs) + "\n")
  return path


def data_section(tmp_path, *, n_docs=40, sents_per_doc=20, **overrides):
  """config.data (a ConfigDict, as a run's config holds it) on a WordPiece vocabulary and a
  synthetic corpus written under tmp_path."""
  tmp = str(tmp_path)
  os.makedirs(tmp, exist_ok=True)
  c = base.get_config().data
  c.tokenizer = "wordpiece"
  c.vocab_path = write_vocab(os.path.join(tmp, "vocab.txt"))
  if n_docs:
    c.source = write_corpus(os.path.join(tmp, "corpus.txt"), random_documents(n_docs, sents_per_doc))
  c.cache_dir = os.path.join(tmp, "cache")
  c.max_seq_length = 64
  c.max_predictions_per_seq = 10
  c.num_shards = 4
  c.num_eval_shards = 1
  c.dupe_factor = 2
  c.eval_dupe_factor = 2
  c.eval_fraction = 0.1
  c.prepare_workers = 1
  c.shuffle_window = 64
  for k, v in overrides.items():
    c[k] = v
  return c


def data_config(tmp_path, **kwargs) -> DataConfig:
  """`data_section` typed, as a run types it where it starts: what the data modules take."""
  return DataConfig.from_config(data_section(tmp_path, **kwargs))
