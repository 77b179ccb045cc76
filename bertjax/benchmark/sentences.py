"""Sentence segmenters side by side: the 48 English golden rules, texts in other scripts, and the
speed on one core, beside the preparation's own tokenizer stage.

  taskset -c 0 python -m bertjax.benchmark sentences [--seconds=10] [--vocab=...]

Measures bertjax's segmenter (bertjax/data/corpora/sentences.py: sentencex and its list rule), the
built-in corpus's regex (bertjax/data/corpora/builtin_corpus.py) and each candidate library that is
installed (pip install pysbd blingfire syntok segtok spacy sentencex; none is needed by bertjax
but sentencex): right cases of bertjax/data/corpora/sentence_cases.py, and MB/s of CPU time on the
built-in corpus's text as paragraphs of five sentences (documents as web text has them). The
tokenizer stage is the vocabulary's `encode_batch` on the same sentences (--vocab; default the
built-in corpus's SentencePiece, trained into the cache if absent). nltk's punkt is left out: its
model is downloaded, which bertjax never does. Run under `taskset -c 0` for one core: the
tokenizer may use more.
"""

import importlib.metadata
import time

from absl import app, flags

from bertjax.configs import base
from bertjax.data import corpus, tokenizer as tokenizer_lib
from bertjax.data.config import DataConfig
from bertjax.data.corpora import builtin_corpus, sentence_cases, sentences

FLAGS = flags.FLAGS


def define_flags() -> None:
  flags.DEFINE_float("seconds", 10.0, "CPU seconds of text each segmenter splits, at most.")
  flags.DEFINE_string("vocab", "", "The tokenizer stage's vocabulary (default: the built-in "
                      "corpus's SentencePiece).")


def _pysbd():
  import pysbd  # pylint: disable=import-outside-toplevel
  made = {}

  def segment(text, language):
    if language not in made:
      try:
        made[language] = pysbd.Segmenter(language=language, clean=False)
      except ValueError:  # no rules for it: English's
        made[language] = pysbd.Segmenter(language="en", clean=False)
    return made[language].segment(text)
  return segment


def _blingfire():
  import blingfire  # pylint: disable=import-outside-toplevel
  return lambda text, language: blingfire.text_to_sentences(text).split("\n")


def _sentencex():
  import sentencex  # pylint: disable=import-outside-toplevel
  return lambda text, language: list(sentencex.segment(language, text))


def _syntok():
  from syntok import segmenter  # pylint: disable=import-outside-toplevel
  return lambda text, language: ["".join(t.spacing + t.value for t in sentence)
                                 for paragraph in segmenter.process(text)
                                 for sentence in paragraph]


def _segtok():
  from segtok.segmenter import split_single  # pylint: disable=import-outside-toplevel
  return lambda text, language: list(split_single(text))


def _spacy():
  import spacy  # pylint: disable=import-outside-toplevel
  made = {}

  def segment(text, language):
    if language not in made:
      try:
        made[language] = spacy.blank(language)
      except ImportError:  # no language class of its own: the multi-language one
        made[language] = spacy.blank("xx")
      made[language].add_pipe("sentencizer")
    return [s.text for s in made[language](text).sents]
  return segment


# Name -> (its distribution, what makes its segment(text, language)); None: bertjax's own.
SEGMENTERS = {
    "bertjax (sentencex + list rule)": ("sentencex", lambda: sentences.split_document),
    "regex (built-in corpus)": (None, lambda: lambda text, language:
                                builtin_corpus.split_sentences(text)),
    "sentencex": ("sentencex", _sentencex),
    "pysbd": ("pysbd", _pysbd),
    "blingfire": ("blingfire", _blingfire),
    "syntok": ("syntok", _syntok),
    "segtok": ("segtok", _segtok),
    "spacy sentencizer": ("spacy", _spacy),
}


def speed_text() -> list[str]:
  """The built-in corpus's documents, a line of five sentences at a time."""
  return ["\n".join(" ".join(d[i:i + 5]) for i in range(0, len(d), 5))
          for d in corpus.builtin_documents()]


def megabytes_per_second(segment, texts: list[str], seconds: float) -> float:
  segment(texts[0], "en")  # warm up: rules compiled, models loaded
  done, t0 = 0, time.process_time()
  for text in texts:
    segment(text, "en")
    done += len(text.encode())
    if time.process_time() - t0 > seconds:
      break
  return done / 1e6 / max(time.process_time() - t0, 1e-9)


def measure(name: str, texts: list[str], seconds: float) -> dict | None:
  """One row of the table; None where the library is not installed."""
  dist, make = SEGMENTERS[name]
  try:
    segment = make()
  except ImportError:
    return None
  golden, _ = sentence_cases.score(segment)
  other, wrong = sentence_cases.score(segment, sentence_cases.OTHER_SCRIPTS)
  missed = [lang for lang, text, _ in sentence_cases.OTHER_SCRIPTS if text in wrong]
  return {"name": name, "version": importlib.metadata.version(dist) if dist else "",
          "golden": golden, "other": other, "missed": missed,
          "mb_per_s": megabytes_per_second(segment, texts, seconds)}


def tokenizer_speed(vocab: str, texts: list[str], seconds: float) -> tuple[str, float]:
  """(vocabulary, MB/s of `encode_batch` on the texts' sentences, in batches of 1,000)."""
  if not vocab:
    builtin = DataConfig.from_config(base.get_config().data)
    vocab = tokenizer_lib.ensure_sentencepiece(builtin)
  tok = tokenizer_lib.load_tokenizer(vocab)
  flat = [s for t in texts for s in sentences.split_document(t)]
  done, t0 = 0, time.process_time()
  for i in range(0, len(flat), 1000):
    batch = flat[i:i + 1000]
    tok.encode_batch(batch)
    done += sum(len(s.encode()) + 1 for s in batch)
    if time.process_time() - t0 > seconds:
      break
  return vocab, done / 1e6 / max(time.process_time() - t0, 1e-9)


def format_table(rows: list[dict], n_other: int) -> str:
  lines = ["| segmenter | version | golden rules | other scripts | MB/s (one core) |",
           "|---|---|---|---|---|"]
  for r in rows:
    missed = f" (not {', '.join(r['missed'])})" if r["missed"] else ""
    lines.append(f"| {r['name']} | {r['version']} | {r['golden']}/"
                 f"{len(sentence_cases.GOLDEN_RULES)} | {r['other']}/{n_other}{missed} | "
                 f"{r['mb_per_s']:.2f} |")
  return "\n".join(lines)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  texts = speed_text()
  rows, absent = [], []
  for name in SEGMENTERS:
    row = measure(name, texts, FLAGS.seconds)
    if row is None:
      absent.append(name)
    else:
      rows.append(row)
      print(f"{name}: {row['golden']}/48, {row['other']}, {row['mb_per_s']:.2f} MB/s", flush=True)
  vocab, rate = tokenizer_speed(FLAGS.vocab, texts, FLAGS.seconds)
  print()
  print(format_table(rows, len(sentence_cases.OTHER_SCRIPTS)))
  print(f"\ntokenizer stage ({vocab}): {rate:.2f} MB/s; text "
        f"{sum(len(t.encode()) for t in texts) / 1e6:.2f} MB" +
        (f"; not installed: {', '.join(absent)}" if absent else ""))


if __name__ == "__main__":
  from bertjax import cli  # pylint: disable=ungrouped-imports
  define_flags()
  cli.run(main)
