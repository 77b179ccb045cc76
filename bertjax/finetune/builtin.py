"""The built-in fine-tuning task of `make finetune`: NEXT, made from the built-in corpus offline.

Does sentence B directly follow sentence A in the same document (label "1"), or was B drawn from
another document (label "0")? Labels come from the text itself: every sentence with a successor
gives one pair of each. It is the coherence
judgement pre-training's next-sentence objective practises, asked of a new classifier on the pooled
output with a few thousand labeled pairs: a task where pre-training should visibly transfer.

The split follows pre-training's: training pairs come from the documents pre-training trained on,
dev and test pairs from its held-out documents only (`corpus.is_heldout`, the same hash and
fraction), so no document scored here was seen in pre-training. Held-out documents go to dev or test
by a second hash. The files are GLUE's pair layout (`index sentence1 sentence2 label`, tests
without the label), read by the same TSV reader as RTE or QNLI.
"""

from __future__ import annotations

import hashlib
import json
import os
import random

from bertjax.data import corpus

NAME = "NEXT"
SPLITS = ("train", "dev", "test")


def _pairs(docs, rng: random.Random, limit: int) -> list[tuple[str, str, str]]:
  """(A, B, label): for each sentence A with a successor, (A, its successor, "1") and (A, a
  sentence of another document, "0"), so the labels are balanced exactly. At most `limit` pairs,
  drawn at random."""
  pairs = []
  for d, doc in enumerate(docs):
    for i in range(len(doc) - 1):
      other = rng.randrange(len(docs) - 1)
      other += other >= d  # any document but this one
      pairs.append((doc[i], doc[i + 1], "1"))
      pairs.append((doc[i], rng.choice(docs[other]), "0"))
  rng.shuffle(pairs)
  return pairs[:limit] if limit else pairs


def _clean(text: str) -> str:
  # A tab or newline inside a sentence would break the TSV row.
  return " ".join(text.split())


def _test_half(doc) -> bool:
  return hashlib.sha1(("test|" + "\n".join(doc)).encode()).digest()[0] % 2 == 1


def write_task(data_dir: str, *, eval_fraction: float = 0.1, seed: int = 12345,
               max_train_pairs: int = 8000) -> dict[str, int]:
  """Writes data_dir/NEXT/{train,dev,test}.tsv (skipped if all three exist); returns row counts."""
  folder = os.path.join(data_dir, NAME)
  paths = {split: os.path.join(folder, f"{split}.tsv") for split in SPLITS}
  if all(os.path.exists(p) for p in paths.values()):
    return {split: sum(1 for _ in open(p, encoding="utf-8")) - 1 for split, p in paths.items()}
  docs = [doc for doc in corpus.builtin_documents() if len(doc) >= 2]
  train_docs = [d for d in docs if not corpus.is_heldout(d, eval_fraction)]
  held = [d for d in docs if corpus.is_heldout(d, eval_fraction)]
  rng = random.Random(seed)
  rows = {"train": _pairs(train_docs, rng, max_train_pairs),
          "dev": _pairs([d for d in held if not _test_half(d)], rng, 0),
          "test": _pairs([d for d in held if _test_half(d)], rng, 0)}
  os.makedirs(folder, exist_ok=True)
  counts = {}
  for split, pairs in rows.items():
    header = "index\tsentence1\tsentence2" + ("" if split == "test" else "\tlabel")
    body = "".join(f"{i}\t{_clean(a)}\t{_clean(b)}" + ("" if split == "test" else f"\t{y}")
                   + "\n" for i, (a, b, y) in enumerate(pairs))
    # Write-then-rename: an interrupted run never leaves a half file that looks complete.
    with open(paths[split] + ".tmp", "w", encoding="utf-8") as f:
      f.write(header + "\n" + body)
    os.replace(paths[split] + ".tmp", paths[split])
    counts[split] = len(pairs)
  return counts


def compare(pretrained_workdir: str, random_workdir: str) -> str:
  """The two runs' held-out scores side by side (from their results.json)."""
  rows = []
  for label, workdir in (("pre-trained encoder", pretrained_workdir),
                         ("random init", random_workdir)):
    with open(os.path.join(workdir, "results.json"), encoding="utf-8") as f:
      results = json.load(f)
    best = results["best"] or {"scores": {"main": float("nan")}, "epoch": 0}
    with open(os.path.join(workdir, "config.json"), encoding="utf-8") as f:
      train = json.load(f).get("train") or {}  # a run of older bertjax may not record them
    # Each side's own settings: a comparison is fair only where the table says what each got.
    settings = (f"lr {train['learning_rate']:.1e}".replace("e-0", "e-")
                + f", {train['num_epochs']:g} epochs" if "learning_rate" in train
                else "settings not recorded")
    rows.append((label, best["scores"]["main"], results["final"].get("main", float("nan")),
                 best["epoch"], settings))
  lines = [f"{NAME} dev accuracy (held-out documents, {_dev_size(pretrained_workdir)} pairs):"]
  lines += [f"  {label:<20} best {best:.4f} (epoch {epoch:g})   last {last:.4f}   ({settings})"
            for label, best, last, epoch, settings in rows]
  lines.append(f"  pre-training adds {rows[0][1] - rows[1][1]:+.4f}")
  return "\n".join(lines)


def _dev_size(workdir: str) -> int:
  with open(os.path.join(workdir, "config.json"), encoding="utf-8") as f:
    recorded = json.load(f)
  # config.json of a run from before data.data_dir held the key: data_dir at the top
  data_dir = recorded["data"]["data_dir"] if "data" in recorded else recorded["data_dir"]
  with open(os.path.join(data_dir, NAME, "dev.tsv"), encoding="utf-8") as f:
    return sum(1 for _ in f) - 1


def define_flags() -> None:
  """The command's flags; defined only when run as a command (bertjax.aot's pattern), so that
  importing this module beside another command's in one process does not collide."""
  from absl import flags  # pylint: disable=import-outside-toplevel
  flags.DEFINE_string("data_dir", None, "write: where the NEXT task's TSV files go.")
  flags.DEFINE_float("eval_fraction", 0.1, "write: pre-training's data.eval_fraction (the "
                     "held-out documents).")


def main(argv) -> None:
  """`write --data_dir=DIR` the NEXT task's TSV files, or `compare PRETRAINED_WORKDIR
  RANDOM_WORKDIR`: print two NEXT runs' scores side by side."""
  from absl import app, flags  # pylint: disable=import-outside-toplevel
  args = flags.FLAGS
  command, rest = (argv[1], argv[2:]) if len(argv) > 1 else (None, [])
  if command == "write" and not rest and args.data_dir:
    counts = write_task(args.data_dir, eval_fraction=args.eval_fraction)
    print(f"{NAME} task in {os.path.join(args.data_dir, NAME)}: "
          + ", ".join(f"{k} {v} pairs" for k, v in counts.items()))
  elif command == "compare" and len(rest) == 2:
    print(compare(*rest))
  else:
    raise app.UsageError("Usage: write --data_dir=DIR [--eval_fraction=F], or compare "
                         f"PRETRAINED_WORKDIR RANDOM_WORKDIR (got {argv[1:]}).")


if __name__ == "__main__":
  from bertjax import cli  # pylint: disable=ungrouped-imports
  define_flags()
  cli.run(main)
