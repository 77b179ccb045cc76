"""Host-side speed of fine-tuning data, on synthetic data of realistic size (nothing downloaded).

  python -m bertjax.benchmark finetune squad

SQuAD: a SQuAD-v1.1-sized training file (87,599 questions over 18,896 contexts of about 120 words)
and dev set (10,570 questions over 2,067 contexts) in the official JSON format, with a WordPiece
vocabulary written here; prints questions/s of reading + feature creation and the seconds of
post-processing (n-best 20) of random logits. Targets: 2,000 questions/s, 30 s.
"""

import json
import os
import tempfile
import time
from typing import Sequence

import numpy as np
from absl import app, flags

from bertjax.data import tokenizer as tokenizer_lib
from bertjax.finetune.kit import squad_metrics, squad_postprocess
from bertjax.inputs import questions

_SYLLABLES = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"] + ["th", "st", "er", "an"]
# Real contexts are not all ASCII: names with accents, dashes, curly quotes.
_UNICODE_WORDS = ["Caf\u00e9", "M\u00fcller", "1990\u20132000", "\u201cquoted\u201d", "Zo\u00eb",
                  "S\u00e3o", "na\u00efve", "Dvo\u0159\u00e1k"]


def _lexicon(rng, n_words: int) -> list[str]:
  lengths = rng.integers(1, 5, n_words)
  picks = rng.integers(0, len(_SYLLABLES), (n_words, 4))
  return sorted({"".join(_SYLLABLES[p] for p in picks[i, :lengths[i]]) for i in range(n_words)})


def write_vocab(path: str, lexicon: Sequence[str], n_whole: int) -> str:
  """Specials, punctuation, the n_whole most frequent words whole, and every syllable as a word
  start and a ## continuation (so rarer words split into pieces instead of [UNK])."""
  chars = sorted(set("".join(_UNICODE_WORDS).lower()) | set(".,?!;:'\"()-"))
  pieces = (tokenizer_lib.SPECIAL_TOKENS + tuple(chars) + tuple("##" + c for c in chars)
            + tuple(_SYLLABLES) + tuple("##" + s for s in _SYLLABLES) + tuple(lexicon[:n_whole]))
  with open(path, "w", encoding="utf-8") as f:
    f.write("\n".join(dict.fromkeys(pieces)) + "\n")
  return path


def synthetic_squad(rng, lexicon, n_contexts: int, n_questions: int):
  """A SQuAD JSON document: contexts of about 120 words (20 to 600, a few longer than one
  window), Zipf-distributed words, capitals, punctuation, some unicode; every question's answer
  (1 to 4 words) is a real span of its context at the right offset."""
  n_words = np.clip(rng.lognormal(np.log(110), 0.45, n_contexts), 20, 600).astype(int)
  ranks = np.minimum(rng.zipf(1.2, n_words.sum()), len(lexicon)) - 1
  offsets = np.concatenate([[0], np.cumsum(n_words)])
  per_context = np.bincount(rng.integers(0, n_contexts, n_questions), minlength=n_contexts)
  paragraphs, qid = [], 0
  for c in range(n_contexts):
    words = [lexicon[r] for r in ranks[offsets[c]:offsets[c + 1]]]
    for i in range(0, len(words), 12):  # a sentence every 12 words
      words[i] = words[i].capitalize()
      words[min(i + 11, len(words) - 1)] += "."
    if c % 3 == 0:
      words[rng.integers(len(words))] = _UNICODE_WORDS[c % len(_UNICODE_WORDS)]
    starts = np.cumsum([0] + [len(w) + 1 for w in words])
    context = " ".join(words)
    qas = []
    for _ in range(per_context[c]):
      a = int(rng.integers(0, len(words) - 4))
      n = int(rng.integers(1, 5))
      answer = " ".join(words[a:a + n])
      question = " ".join(lexicon[r] for r in rng.integers(0, 2000, 10)) + "?"
      qas.append({"id": f"q{qid}", "question": question.capitalize(),
                  "answers": [{"text": answer, "answer_start": int(starts[a])}]})
      qid += 1
    paragraphs.append({"context": context, "qas": qas})
  return {"version": "1.1", "data": [{"title": "synthetic", "paragraphs": paragraphs}]}


def bench_squad(args) -> None:
  rng = np.random.default_rng(args.seed)
  with tempfile.TemporaryDirectory() as tmp:
    lexicon = _lexicon(rng, 40_000)
    rng.shuffle(lexicon)  # frequency rank independent of spelling
    tok = tokenizer_lib.load_tokenizer(write_vocab(os.path.join(tmp, "vocab.txt"), lexicon,
                                                   args.whole_words))
    paths = {}
    for split, n_ctx, n_q in (("train", args.train_contexts, args.train_questions),
                              ("dev", args.dev_contexts, args.dev_questions)):
      paths[split] = os.path.join(tmp, f"{split}.json")
      with open(paths[split], "w", encoding="utf-8") as f:
        json.dump(synthetic_squad(rng, lexicon, n_ctx, n_q), f)
    print(f"vocabulary {tok.vocab_size} pieces; train {args.train_questions} questions / "
          f"{args.train_contexts} contexts, dev {args.dev_questions} / {args.dev_contexts}; "
          f"{os.cpu_count()} cpus", flush=True)

    t0 = time.perf_counter()
    train = questions.read_squad_json(paths["train"], is_training=True)
    t1 = time.perf_counter()
    feats = questions.make_features(train.examples, tok)
    t2 = time.perf_counter()
    n = len(train.examples)
    print(f"train features: {n} questions -> {feats['input_ids'].shape[0]} features; read "
          f"{t1 - t0:.1f} s, features {t2 - t1:.1f} s: {n / (t2 - t0):,.0f} questions/s "
          f"(target 2,000)", flush=True)
    del feats

    dev = questions.read_squad_json(paths["dev"], is_training=False)
    feats = questions.make_features(dev.examples, tok)
    F, L = feats["input_ids"].shape
    start, end = rng.normal(size=(2, F, L)).astype(np.float32)
    gold = squad_metrics.gold_answers(dev.examples)
    for v2 in (False, True):
      t0 = time.perf_counter()
      result = squad_postprocess.postprocess(dev.examples, feats, start, end,
                                             version_2_with_negative=v2)
      t1 = time.perf_counter()
      squad_postprocess.write_predictions(result, os.path.join(tmp, f"out{int(v2)}"))
      t2 = time.perf_counter()
      # Timed only: the figures on random logits mean nothing.
      if v2:
        squad_metrics.evaluate_v2(gold, result.predictions, result.null_odds)
      else:
        squad_metrics.evaluate_v1(gold, result.predictions)
      t3 = time.perf_counter()
      print(f"post-processing {'v2.0' if v2 else 'v1.1'}: {len(dev.examples)} questions, {F} "
            f"features, n-best 20: {t1 - t0:.1f} s, writing the json files {t2 - t1:.1f} s, "
            f"evaluation {t3 - t2:.1f} s (target 30 s)", flush=True)


FLAGS = flags.FLAGS


def define_flags() -> None:
  """The command's flags; defined only when run as a command (bertjax.aot's pattern), so that
  importing this module beside another command's in one test process does not collide."""
  flags.DEFINE_integer("train_questions", 87_599, "Questions of the training file.")
  flags.DEFINE_integer("train_contexts", 18_896, "Contexts of the training file.")
  flags.DEFINE_integer("dev_questions", 10_570, "Questions of the dev file.")
  flags.DEFINE_integer("dev_contexts", 2_067, "Contexts of the dev file.")
  flags.DEFINE_integer("whole_words", 20_000,
                       "Lexicon words in the vocabulary whole (the rest split into syllables).")
  flags.DEFINE_integer("seed", 0, "Seed of the synthetic data.")


def main(argv):
  if argv[1:] != ["squad"]:  # the one benchmark so far, named so that others can join it
    raise app.UsageError(f"Say which benchmark: squad (got {argv[1:]}).")
  bench_squad(FLAGS)


if __name__ == "__main__":
  from bertjax import cli  # pylint: disable=ungrouped-imports
  define_flags()
  cli.run(main)
