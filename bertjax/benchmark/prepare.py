"""Preparation's throughput (MB of text per second, end to end) by driver and worker count.

  python -m bertjax.benchmark prepare --corpus=builtin --drivers=local,beam --workers=1,2
  python -m bertjax.benchmark prepare --corpus=generated --mb=200 --files=16

Corpora, written once under --dir: `builtin` is the built-in corpus as one text file (Python's
docstrings and help topics, mostly short documents); `generated` is --files files of about --mb MB
in all, of documents of 10 to 60 sentences drawn (seeded) from the built-in corpus's sentences.
Each run prepares into a fresh folder (wall-clock and CPU seconds, this process and its workers) with configs/base.py's data settings (length 128,
dupe_factor 5, 16 + 2 shards) and the vocabulary --vocab (default: the built-in corpus's). It works
on older checkouts too (without the `beam` driver), to compare with the code before it.
"""

import dataclasses
import os
import random
import resource
import shutil
import time

from absl import app, flags

from bertjax.configs import base
from bertjax.data import corpus, prepare, tokenizer as tokenizer_lib
from bertjax.data.config import DataConfig

FLAGS = flags.FLAGS


def define_flags() -> None:
  flags.DEFINE_string("corpus", "builtin", "builtin or generated.")
  flags.DEFINE_float("mb", 20.0, "Size of the generated corpus in MB.")
  flags.DEFINE_integer("files", 8, "Files of the generated corpus.")
  flags.DEFINE_string("drivers", "local", "Comma-separated: local, beam.")
  flags.DEFINE_string("workers", "1,2", "Comma-separated worker counts.")
  flags.DEFINE_string("vocab", "", "Vocabulary (default: the built-in corpus's SentencePiece).")
  flags.DEFINE_string("dir", "/tmp/bertjax-benchmark-prepare", "Where corpora and output go.")


def write_corpus(kind: str, folder: str, mb: float, files: int) -> str:
  """The corpus's source pattern, written unless already there."""
  os.makedirs(folder, exist_ok=True)
  docs = list(corpus.builtin_documents())
  if kind == "builtin":
    path = os.path.join(folder, "builtin.txt")
    if not os.path.exists(path):
      with open(path, "w", encoding="utf-8") as f:
        f.write("".join("\n".join(d) + "\n\n" for d in docs))
    return path
  sub = os.path.join(folder, f"generated-{mb:g}mb-{files}")
  if not os.path.isdir(sub):
    sentences = [s for d in docs for s in d]
    rng = random.Random(0)
    os.makedirs(sub + ".tmp", exist_ok=True)
    for i in range(files):
      size = 0
      with open(os.path.join(sub + ".tmp", f"part-{i:03d}.txt"), "w", encoding="utf-8") as f:
        while size < mb * 1e6 / files:
          start = rng.randrange(len(sentences))
          text = "\n".join(sentences[start:start + rng.randint(10, 60)]) + "\n\n"
          f.write(text)
          size += len(text.encode())
    os.rename(sub + ".tmp", sub)
  return os.path.join(sub, "*.txt")


def config(source: str, out: str, workers: int, driver: str, vocab: str) -> DataConfig:
  c = DataConfig.from_config(base.get_config().data)
  extra = {"prepare_engine": driver} if driver != "local" else {}
  return dataclasses.replace(c, source=source, prepared_dir=out, prepare_workers=workers,
                             vocab_path=vocab or tokenizer_lib.vocab_path_of(c), **extra)


def _cpu_seconds() -> float:
  """CPU time of this process and its finished worker processes: on a shared machine a fairer
  per-worker rate than the wall clock, which other users' load stretches."""
  own, children = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
  return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  source = write_corpus(FLAGS.corpus, FLAGS.dir, FLAGS.mb, FLAGS.files)
  for driver in FLAGS.drivers.split(","):
    for workers in [int(w) for w in FLAGS.workers.split(",")]:
      out = os.path.join(FLAGS.dir, "out")
      shutil.rmtree(out, ignore_errors=True)
      c = config(source, out, workers, driver, FLAGS.vocab)
      tok = tokenizer_lib.load_tokenizer(c)
      cpu0 = _cpu_seconds()
      t0 = time.perf_counter()
      m = prepare.ensure_prepared(c, tok)
      wall = time.perf_counter() - t0
      cpu = _cpu_seconds() - cpu0
      mb = m["corpus"]["bytes"] / 1e6
      print(f"RESULT corpus={FLAGS.corpus} driver={driver} workers={workers} mb={mb:.2f} "
            f"seconds={wall:.1f} mb_per_s={mb / wall:.3f} cpu_seconds={cpu:.1f} "
            f"mb_per_cpu_s={mb / max(cpu, 1e-9):.3f} "
            f"instances={m['splits']['train']['instances']}", flush=True)


if __name__ == "__main__":
  from bertjax import cli  # pylint: disable=ungrouped-imports
  define_flags()
  cli.run(main)
