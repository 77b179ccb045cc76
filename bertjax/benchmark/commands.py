"""The subcommands of `python -m bertjax.benchmark`: every benchmark of bertjax under one name.

    python -m bertjax.benchmark train --config=configs/bert_base.py --steps=5
    python -m bertjax.benchmark predict --shape=small --rounds=5
    python -m bertjax.benchmark SUBCOMMAND --help

`train` (the default: `python -m bertjax.benchmark --config=...` is the same command) is
bertjax/benchmark/train.py's own; each other one runs its module as that module's own command runs it,
with the flags after the subcommand.
"""

import runpy
import sys
from typing import Sequence

from bertjax import cli

# Subcommand -> (module, what it measures). The modules are run by name, never imported here: a
# benchmark sits in the layer of what it measures (prediction's above fine-tuning), and this table
# below them all.
SUBCOMMANDS = {
    "train": ("bertjax.benchmark", "the train step's throughput and MFU on synthetic batches"),
    "hf": ("bertjax.benchmark.hf", "bertjax's train step side by side with Hugging Face's"),
    "predict": ("bertjax.benchmark.predict",
                "bertjax.predict side by side with PyTorch, and its memory while streaming"),
    "data": ("bertjax.benchmark.data", "preparation and the input pipeline, packing off and on"),
    "prepare": ("bertjax.benchmark.prepare",
                "preparation's MB/s by driver (local, beam) and worker count"),
    "finetune": ("bertjax.benchmark.finetune", "fine-tuning's host-side data speed (SQuAD)"),
    "accel": ("bertjax.benchmark.accel", "the accelerator check: BERT-Base/Large train steps (MFU, "
              "memory, attention kernels, packing), ModernBERT's windows, prediction vs PyTorch"),
    "layers": ("bertjax.benchmark.layers", "where a scanned layer's time goes on a GPU: the train "
               "step under XLA's flags and the model's variants, its loops and its trace"),
    "retrieval": ("bertjax.benchmark.retrieval", "the embeddings family: a retriever trained "
                  "from pairs against its untrained encoder and BM25; global against per-device "
                  "negatives and GradCache, step time"),
    "sentences": ("bertjax.benchmark.sentences", "sentence segmenters on the golden rules, "
                  "other scripts and MB/s, beside the tokenizer stage"),
}
DEFAULT = "train"


def usage() -> str:
  return "subcommands: " + "; ".join(f"{name}: {what}" for name, (_, what) in SUBCOMMANDS.items())


def dispatch(argv: Sequence[str]) -> None:
  """Reads the subcommand of `python -m bertjax.benchmark [SUBCOMMAND] [--flag ...]` (argv:
  sys.argv). Returns for `train`, or for no subcommand (a first word that is a flag), with the word
  taken off sys.argv: the caller runs its own benchmark. Runs any other subcommand's module as
  `__main__` and exits with its status. An unknown word ends the command with a usage error."""
  word = argv[1] if len(argv) > 1 else None
  if word is None or word.startswith("-"):
    if word in cli.HELP_FLAGS:
      print(f"python -m bertjax.benchmark [SUBCOMMAND] [--flag ...]; {usage()}. "
            f"Without one: {DEFAULT}, whose flags follow.\n", flush=True)
    return
  if word not in SUBCOMMANDS:
    cli.usage_error(f"unknown benchmark {word!r}: the first word says which, one of "
                    f"{', '.join(SUBCOMMANDS)} ({DEFAULT} where the first word is a flag)",
                    "bertjax.benchmark")
  sys.argv = [argv[0], *argv[2:]]
  if word == DEFAULT:
    return
  cli.PROGRAM = f"bertjax.benchmark {word}"
  cli.quiet_tensorflow()  # before the module's imports load TensorFlow, as cli.run would after
  runpy.run_module(SUBCOMMANDS[word][0], run_name="__main__", alter_sys=True)
  sys.exit(0)
