"""Throughput of the data side: preparation (MB of text/s), the online pipeline (sequences/s), and
what packing gains (fill, useful tokens/s).

  python -m bertjax.benchmark data [--seq_lengths=128,512] [--batch_size=256] [--seconds=20]

Uses the default SentencePiece vocabulary (trained into .cache if absent) and two texts in the
original format, each written `--copies` times: the built-in corpus (its documents as they are:
Python's docstrings and help topics, mostly short) and a corpus of long documents made from the
same sentences (`--long_document_sentences` consecutive sentences of the built-in corpus per
document, as an encyclopedia's articles are long). Preparation runs fresh into a temporary
folder; its rate is given end to end (reading, process start-up, both stages) and per process
for stage 2 (tokenize, draw pairs, write). The pipeline figures are what one host's tf.data
produces (read, shuffle, parse, dynamic masking, packing, batching) with the training step doing
nothing, with packing off and on: fill (the share of row positions that hold a token), sequences
per row, sequences/s and useful (non-padding) tokens/s. A training step costs the same whatever
its rows hold, so on an accelerator that the host keeps fed, packing multiplies the useful tokens
of every step by the ratio of the two fills (the `gain` column).
"""

import dataclasses
import logging
import os
import tempfile
import time

from absl import app, flags

from bertjax.configs import base
from bertjax.data import corpus, pipeline, prepare, tokenizer as tokenizer_lib
from bertjax.data.config import DataConfig


def _config(seq_length: int, prepared_dir: str, workers: int, source: str) -> DataConfig:
  builtin = DataConfig.from_config(base.get_config().data)
  return dataclasses.replace(
      builtin, source=source, max_seq_length=seq_length,
      max_predictions_per_seq=20 if seq_length <= 128 else 76,  # the original's / MLPerf's values
      prepared_dir=prepared_dir, prepare_workers=workers,
      # The vocabulary of the built-in corpus (the one `make pretrain` trains), whatever the text.
      vocab_path=builtin.vocab_path or tokenizer_lib.vocab_path_of(builtin))


def measure_pipeline(c: DataConfig, tok: tokenizer_lib.Tokenizer, batch_size: int,
                     seconds: float) -> dict:
  """What the pipeline yields in `seconds` after a warm-up: rows, sequences and tokens per second,
  and the fill of its rows."""
  p = pipeline.make_pipeline(c, tok, split="train", global_batch_size=batch_size)
  for _ in range(5):  # warm up: graph tracing, file opening, prefetch fill, the first window
    next(p)
  rows = sequences = tokens = 0
  t0 = time.perf_counter()
  while time.perf_counter() - t0 < seconds:
    b = next(p)
    rows += len(b["input_ids"])
    sequences += int(b["sequence_ids"].max(axis=1).sum()) if "sequence_ids" in b else len(
        b["input_ids"])
    tokens += int(b["input_mask"].sum())
  dt = time.perf_counter() - t0
  return {"rows_per_s": rows / dt, "sequences_per_s": sequences / dt, "tokens_per_s": tokens / dt,
          "fill": tokens / (rows * c.max_seq_length), "sequences_per_row": sequences / rows}


def long_documents(sentences_per_document: int) -> list[list[str]]:
  """The built-in corpus's sentences, in order, regrouped into documents of this many."""
  sentences = [s for d in corpus.builtin_documents() for s in d]
  return [sentences[i:i + sentences_per_document]
          for i in range(0, len(sentences), sentences_per_document)]


def _write(path: str, docs, copies: int) -> str:
  text = "".join("\n".join(d) + "\n\n" for d in docs)
  with open(path, "w", encoding="utf-8") as f:
    for _ in range(copies):
      f.write(text)
  return path


FLAGS = flags.FLAGS


def define_flags() -> None:
  """The command's flags; defined only when run as a command (bertjax.aot's pattern), so that
  importing this module beside another command's in one test process does not collide."""
  flags.DEFINE_string("seq_lengths", "128,512", "Sequence lengths, comma-separated.")
  flags.DEFINE_integer("batch_size", 256, "Rows per batch of the pipeline.")
  flags.DEFINE_float("seconds", 20.0, "Pipeline measurement per row of the table.")
  flags.DEFINE_integer("workers", 0, "Preparation processes (0 = one per CPU).")
  flags.DEFINE_integer("copies", 4, "Times each corpus is repeated.")
  flags.DEFINE_integer("long_document_sentences", 500,
                       "Sentences per document of the long-document corpus.")
  flags.DEFINE_integer("max_sequences_per_row", 3, "S: most sequences a packed row holds.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  args = FLAGS
  logging.basicConfig(level=logging.WARNING)
  lengths = [int(x) for x in args.seq_lengths.split(",")]
  table = []
  with tempfile.TemporaryDirectory() as tmp:
    first = _config(lengths[0], "", args.workers, "builtin")
    vocab = tokenizer_lib.ensure_sentencepiece(first)
    tok = tokenizer_lib.load_tokenizer(first)  # every corpus below is read with this vocabulary
    sources = {
        "built-in": _write(os.path.join(tmp, "builtin.txt"), corpus.builtin_documents(),
                           args.copies),
        "long documents": _write(os.path.join(tmp, "long.txt"),
                                 long_documents(args.long_document_sentences), args.copies)}
    print(f"vocabulary {vocab}; {os.cpu_count()} CPU(s); batch {args.batch_size}; each text "
          f"{args.copies} x; long documents of {args.long_document_sentences} sentences; "
          f"packing up to {args.max_sequences_per_row} sequences per row")
    for name, source in sources.items():
      for L in lengths:
        c = dataclasses.replace(_config(L, os.path.join(tmp, f"{name[:4]}-L{L}"), args.workers,
                                        source), max_sequences_per_row=args.max_sequences_per_row)
        t0 = time.perf_counter()
        m = prepare.ensure_prepared(c, tok)
        wall = time.perf_counter() - t0
        mb = m["corpus"]["bytes"] / 1e6
        sp = m["splits"]
        per_process = (sp["train"]["text_bytes"] + sp["eval"]["text_bytes"]) / 1e6 / (
            sp["train"]["shard_seconds"] + sp["eval"]["shard_seconds"])
        print(f"prepare  {name} L={L}: {mb:.2f} MB of text -> {sp['train']['instances']} train + "
              f"{sp['eval']['instances']} eval sequences in {wall:.1f} s = {mb / wall:.2f} MB/s "
              f"end to end; stage 2 {per_process:.2f} MB/s per process (dupe_factor "
              f"{c.dupe_factor})", flush=True)
        figures = {}
        for on in (False, True):
          figures[on] = measure_pipeline(dataclasses.replace(c, packing=on), tok, args.batch_size,
                                         args.seconds)
          table.append((name, L, "on" if on else "off", figures[on],
                        figures[on]["fill"] / figures[False]["fill"]))
          print(f"pipeline {name} L={L} packing {'on ' if on else 'off'}: "
                f"{figures[on]['sequences_per_s']:,.0f} sequences/s", flush=True)
  print()
  print(format_table(table))


def format_table(table) -> str:
  lines = ["| corpus | L | packing | fill | sequences/row | sequences/s | useful tokens/s | gain |",
           "|---|---|---|---|---|---|---|---|"]
  for name, L, on, f, gain in table:
    lines.append(f"| {name} | {L} | {on} | {100 * f['fill']:.1f}% | {f['sequences_per_row']:.2f} "
                 f"| {f['sequences_per_s']:,.0f} | {f['tokens_per_s']:,.0f} | {gain:.2f}x |")
  return "\n".join(lines)


if __name__ == "__main__":
  from bertjax import cli  # pylint: disable=ungrouped-imports
  define_flags()
  cli.run(main)
