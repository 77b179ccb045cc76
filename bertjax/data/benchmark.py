"""Throughput of the data side: preparation (MB of text/s) and the online pipeline (sequences/s).

  python -m bertjax.data.benchmark [--seq_lengths=128,512] [--batch_size=256] [--seconds=20]

Uses the default SentencePiece vocabulary (trained into .cache if absent) and, as text, the built-in
corpus written out `--copies` times as a text file in the original format. Preparation runs fresh
into a temporary folder; its rate is given end to end (reading, process start-up, both stages) and
per process for stage 2 (tokenize, draw pairs, write). The pipeline figure is what one host's
tf.data produces (read, shuffle, parse, dynamic masking, batching) with the training step doing
nothing.
"""

import argparse
import logging
import os
import sys
import tempfile
import time

from bertjax.data import corpus, pipeline, prepare
from bertjax.data import tokenizer as tokenizer_lib


def _config(seq_length: int, prepared_dir: str, workers: int, source: str):
  # Imported here so the module also works from an installed package without configs/ on the path.
  sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
  from configs import base
  c = base.get_config().data
  c.source = source
  c.max_seq_length = seq_length
  c.max_predictions_per_seq = 20 if seq_length <= 128 else 76  # the original's / MLPerf's values
  c.prepared_dir = prepared_dir
  c.prepare_workers = workers
  # The vocabulary of the built-in corpus (the one `make pretrain` trains), whatever the text.
  builtin = base.get_config().data
  c.vocab_path = c.vocab_path or tokenizer_lib.vocab_path_of(builtin)
  return c


def measure_pipeline(c, batch_size: int, seconds: float) -> float:
  p = pipeline.make_pipeline(c, split="train", global_batch_size=batch_size)
  for _ in range(5):  # warm up: graph tracing, file opening, prefetch fill
    next(p)
  n, t0 = 0, time.perf_counter()
  while time.perf_counter() - t0 < seconds:
    n += len(next(p)["input_ids"])
  return n / (time.perf_counter() - t0)


def main(argv=None):
  ap = argparse.ArgumentParser(prog="python -m bertjax.data.benchmark")
  ap.add_argument("--seq_lengths", default="128,512")
  ap.add_argument("--batch_size", type=int, default=256)
  ap.add_argument("--seconds", type=float, default=20.0, help="pipeline measurement per length")
  ap.add_argument("--workers", type=int, default=0, help="preparation processes (0 = one per CPU)")
  ap.add_argument("--copies", type=int, default=4, help="times the built-in corpus is repeated")
  args = ap.parse_args(argv)
  logging.basicConfig(level=logging.WARNING)
  lengths = [int(x) for x in args.seq_lengths.split(",")]
  with tempfile.TemporaryDirectory() as tmp:
    first = _config(lengths[0], "", args.workers, "builtin")
    vocab = tokenizer_lib.ensure_sentencepiece(first)
    text = "".join("\n".join(d) + "\n\n" for d in corpus.builtin_documents())
    source = os.path.join(tmp, "corpus.txt")
    with open(source, "w", encoding="utf-8") as f:
      for _ in range(args.copies):
        f.write(text)
    print(f"vocabulary {vocab}; {os.cpu_count()} CPU(s); batch {args.batch_size}; "
          f"text {args.copies} x the built-in corpus")
    for L in lengths:
      c = _config(L, os.path.join(tmp, f"L{L}"), args.workers, source)
      t0 = time.perf_counter()
      m = prepare.ensure_prepared(c)
      wall = time.perf_counter() - t0
      mb = m["corpus"]["bytes"] / 1e6
      sp = m["splits"]
      per_process = (sp["train"]["text_bytes"] + sp["eval"]["text_bytes"]) / 1e6 / (
          sp["train"]["shard_seconds"] + sp["eval"]["shard_seconds"])
      print(f"prepare  L={L}: {mb:.2f} MB of text -> {sp['train']['instances']} train + "
            f"{sp['eval']['instances']} eval sequences in {wall:.1f} s = {mb / wall:.2f} MB/s end "
            f"to end; stage 2 {per_process:.2f} MB/s per process (dupe_factor {c.dupe_factor})")
      rate = measure_pipeline(c, args.batch_size, args.seconds)
      print(f"pipeline L={L}: {rate:,.0f} sequences/s")


if __name__ == "__main__":
  main(sys.argv[1:])
