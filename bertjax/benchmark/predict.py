"""bertjax.predict side by side with what a user would otherwise run: transformers' PyTorch
`BertForSequenceClassification` under `torch.inference_mode()`, same shape, same texts.

    python -m bertjax.benchmark.predict --shape=small --rounds=5     # 4 layers x 256
    python -m bertjax.benchmark.predict --shape=base --rounds=3      # BERT-Base
    python -m bertjax.benchmark.predict --extras=compile,bf16,bertjax_bf16   # more sides
    python -m bertjax.benchmark.predict --rss --lines=10000,1000000  # memory while streaming

Inputs: N sequences of real lengths (log-normal around 24 tokens, 4 to max_seq_length 128, the
spread of short support messages and reviews), 8 labels. PyTorch takes batches of 64 padded to
their longest sequence (transformers' DataCollatorWithPadding: the usual way); bertjax packs
texts into rows and computes the last layer at their [CLS] alone (bertjax/predict/rows.py).
Both run with every core of the machine (torch's intra-op threads = the cores, XLA's CPU client
alike), weights random (speed does not depend on them), one warm-up pass each, then rounds interleaved so background load hits both
alike; PyTorch also runs the texts sorted by length (its batches then pad as little as bertjax's,
so what is left is the engine). `--extras` adds what a user tries next on a CPU: the sorted
PyTorch loop under `torch.compile` (inductor, dynamic shapes; it needs a C++ compiler, not the
network) or bf16 autocast, and bertjax with bf16 matmuls (with how far its probabilities move).
Printed: sequences/s of each per round, the ratios' range, the FLOP/s achieved (the matmul FLOPs
of the positions computed, bertjax/training/flops.py) against a large jitted float32 matmul's on this
machine, the practical ceiling, and the load average (the machine's other work moves the figures;
the interleaved rounds share it out, but PyTorch's threads suffer more from it than XLA's).

`--rss` runs `python -m bertjax.predict` in a subprocess per line count on a 2-layer model and
prints its peak resident memory: flat in the number of lines if the input streams.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from bertjax import cli
from bertjax.data import tokenizer as tokenizer_lib, vocab_record
from bertjax.finetune import families
from bertjax.finetune.families import classification
from bertjax.formats import converted, taskspec
from bertjax.model.config import BertConfig
from bertjax.predict import predictor as predict, rows as prediction_rows
from bertjax.training import flops

SHAPES = {"small": dict(hidden_size=256, num_layers=4, num_heads=4, intermediate_size=1024),
          "base": dict(hidden_size=768, num_layers=12, num_heads=12, intermediate_size=3072)}
VOCAB, LABELS, MAX_LEN = 30522, 8, 128


def lengths(n: int, seed: int = 0) -> np.ndarray:
  rng = np.random.default_rng(seed)
  return np.clip(np.round(rng.lognormal(np.log(24), 0.6, n)), 4, MAX_LEN).astype(int)


def features(lengths_N: np.ndarray, seed: int = 0) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  n = len(lengths_N)
  ids = rng.integers(5, VOCAB, (n, MAX_LEN)).astype(np.int32)
  mask = (np.arange(MAX_LEN)[None, :] < lengths_N[:, None]).astype(np.int32)
  return {"input_ids": ids * mask, "input_mask": mask, "segment_ids": np.zeros_like(ids)}


def matmul_gflops(size: int = 2048, reps: int = 10) -> float:
  a = jnp.ones((size, size), jnp.float32)
  f = jax.jit(lambda x: x @ x)
  f(a).block_until_ready()
  start = time.perf_counter()
  for _ in range(reps):
    f(a).block_until_ready()
  return 2 * size ** 3 * reps / (time.perf_counter() - start) / 1e9


def bertjax_predictor(cfg: BertConfig, devices=None,
                      tokens_per_device: int = predict.TOKENS_PER_DEVICE):
  spec = taskspec.TaskSpec("bench", "classification", tuple(f"l{k}" for k in range(LABELS)),
                           MAX_LEN)
  model = families.get(spec.family).objective(spec).make_model(cfg)
  dummy = {k: jnp.zeros((1, 8), jnp.int32) for k in ("input_ids", "input_mask", "segment_ids")}
  params = jax.jit(lambda: model.init(jax.random.PRNGKey(0), dummy["input_ids"],
                                      dummy["input_mask"], dummy["segment_ids"])["params"])()
  params = jax.tree.map(lambda x: x.unbox() if hasattr(x, "unbox") else x, params,
                        is_leaf=lambda x: hasattr(x, "unbox"))
  return predict.Predictor(cfg, params, None, spec, devices=devices,
                           tokens_per_device=tokens_per_device)


def torch_model(cfg: BertConfig):
  import torch  # pylint: disable=import-outside-toplevel
  from transformers import BertConfig as HfConfig, BertForSequenceClassification
  torch.set_num_threads(os.cpu_count())
  hf = HfConfig(vocab_size=VOCAB, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
                num_attention_heads=cfg.num_heads, intermediate_size=cfg.intermediate_size,
                max_position_embeddings=512, num_labels=LABELS, attn_implementation="sdpa")
  return BertForSequenceClassification(hf).eval()


def torch_pass(model, f: dict[str, np.ndarray], lengths_N: np.ndarray, batch: int = 64) -> None:
  import torch  # pylint: disable=import-outside-toplevel
  with torch.inference_mode():
    for at in range(0, len(lengths_N), batch):
      width = int(lengths_N[at:at + batch].max())
      sl = slice(at, at + batch)
      model(input_ids=torch.from_numpy(f["input_ids"][sl, :width]).long(),
            attention_mask=torch.from_numpy(f["input_mask"][sl, :width]).long(),
            token_type_ids=torch.from_numpy(f["segment_ids"][sl, :width]).long())


def computed_flops(cfg: BertConfig, widths) -> float:
  return sum(flops.forward_flops_per_sequence(cfg, int(w), 0) for w in widths)


def packed_plan(cfg: BertConfig, f: dict[str, np.ndarray], tokens: int) -> tuple[int, float]:
  """The positions and matmul FLOPs bertjax's packed prediction computes (one device; empty rows
  counted): every layer at every position of a row but the last, which computes keys and values
  at every position and the rest at the row's [CLS] slots."""
  positions, total = 0, 0.0
  last = cfg.num_layers - 1
  for arrays, _, _ in prediction_rows.packed_calls(f, tokens, 1):
    (rows, width), n_slots = arrays[0].shape, arrays[4].shape[1]
    positions += rows * width
    total += rows * (sum(flops.layer_flops(cfg, i, width) for i in range(last))
                     + flops.layer_flops(cfg, last, width, n_slots))
  return positions, total


EXTRAS = ("compile", "bf16", "bertjax_bf16")


def torch_extra(model, extra: str):
  """What a user tries next on a CPU, as a pass like torch_pass: `torch.compile` (inductor,
  shapes marked dynamic: one graph for every batch width) or bf16 autocast."""
  import torch  # pylint: disable=import-outside-toplevel
  if extra == "compile":
    compiled = torch.compile(model, dynamic=True)
    return lambda f, lengths_N: torch_pass(compiled, f, lengths_N)

  def autocast(f, lengths_N):
    with torch.autocast("cpu", dtype=torch.bfloat16):
      torch_pass(model, f, lengths_N)
  return autocast


def speed(shape: str, n: int, rounds: int, extras=()) -> dict:
  """Prints (and returns) each side's seq/s per round and the ratios; `extras` adds sides of
  EXTRAS: PyTorch compiled or in bf16 autocast (sorted texts), bertjax with bf16 matmuls."""
  cfg = BertConfig(vocab_size=VOCAB, max_position_embeddings=512, hidden_dropout=0.0,
                   attention_dropout=0.0, **SHAPES[shape])
  lengths_N = lengths(n)
  f = features(lengths_N)
  ours, theirs = bertjax_predictor(cfg), torch_model(cfg)
  # Every position a call computes, the empty rows that fill a group included (one device).
  ours_plan = packed_plan(cfg, f, ours.tokens_per_device)
  theirs_widths = [int(lengths_N[at:at + 64].max()) for at in range(0, n, 64)
                   for _ in lengths_N[at:at + 64]]
  # PyTorch again with the texts sorted by length first, so its batches pad as little as ours:
  # what is left of the difference is the engine's.
  order = np.argsort(lengths_N, kind="stable")
  f_sorted, lengths_sorted = {k: v[order] for k, v in f.items()}, lengths_N[order]
  sorted_widths = [int(lengths_sorted[at:at + 64].max()) for at in range(0, n, 64)
                   for _ in lengths_sorted[at:at + 64]]
  # Each side: (run, (positions, FLOPs) computed).
  plan = lambda widths: (sum(widths), computed_flops(cfg, widths))
  sides = {"bertjax": (lambda: ours.run(f), ours_plan),
           "torch": (lambda: torch_pass(theirs, f, lengths_N), plan(theirs_widths)),
           "torch sorted": (lambda: torch_pass(theirs, f_sorted, lengths_sorted),
                            plan(sorted_widths))}
  notes = {}
  for extra in extras:
    if extra == "bertjax_bf16":
      bf16 = bertjax_predictor(dataclasses.replace(cfg, dtype="bfloat16"))
      sides["bertjax bf16"] = (lambda: bf16.run(f), ours_plan)
      # The same weights (seed 0): how far bf16 matmuls move the class probabilities.
      p32, p16 = (jax.nn.softmax(p.run(f)["logits"], -1) for p in (ours, bf16))
      notes["bertjax bf16"] = f"max |probability - float32's| {float(jnp.abs(p32 - p16).max()):.4f}"
    else:
      run_extra = torch_extra(theirs, extra)
      sides[f"torch sorted {extra}"] = (
          lambda run_extra=run_extra: run_extra(f_sorted, lengths_sorted), plan(sorted_widths))
  compile_s = {}
  for name, (fn, _) in sides.items():  # warm-up: compiles every width (and torch.compile's graph)
    start = time.perf_counter()
    fn()
    compile_s[name] = time.perf_counter() - start
  rates = {name: [] for name in sides}
  for _ in range(rounds):
    for name, (fn, _) in sides.items():
      start = time.perf_counter()
      fn()
      rates[name].append(n / (time.perf_counter() - start))
  peak = matmul_gflops()
  print(f"{shape}: {cfg.num_layers} layers x {cfg.hidden_size}, {n} sequences "
        f"(lengths {int(lengths_N.min())}-{int(lengths_N.max())}, median "
        f"{int(np.median(lengths_N))}), PyTorch batch 64, bertjax {ours.tokens_per_device} "
        f"positions a call, {os.cpu_count()} cores; load average {os.getloadavg()[0]:.1f}")
  for name, (_, (positions, flops_computed)) in sides.items():
    r = rates[name]
    gf = flops_computed * statistics.median(r) / n / 1e9
    print(f"  {name:20s} {min(r):8.1f}-{max(r):8.1f} seq/s (median {statistics.median(r):.1f}); "
          f"padded positions {positions / lengths_N.sum():.2f}x the real ones; "
          f"{gf:.1f} GFLOP/s computed; first pass {compile_s[name]:.0f} s"
          + (f"; {notes[name]}" if name in notes else ""))
  ratios = {}
  for other in (k for k in sides if k.startswith("torch")):
    ratios[other] = [a / b for a, b in zip(rates["bertjax"], rates[other])]
    print(f"  bertjax / {other}: {min(ratios[other]):.2f}-{max(ratios[other]):.2f}x over "
          f"{rounds} rounds")
  print(f"  a jitted 2048^2 float32 matmul: {peak:.1f} GFLOP/s")
  return {"rates": rates, "ratios": ratios}


def rss(lines: str) -> None:
  """Peak RSS of `python -m bertjax.predict`'s work over files of each line count (comma-separated;
  a 2-layer model)."""
  with tempfile.TemporaryDirectory() as tmp:
    workdir = _tiny_workdir(tmp)
    for count in (int(x) for x in lines.split(",")):
      path = os.path.join(tmp, f"in-{count}.csv")
      rng = np.random.default_rng(0)
      words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
      with open(path, "w") as out:
        out.write("text\n")
        for _ in range(count):
          out.write(" ".join(rng.choice(words, rng.integers(3, 30))) + "\n")
      start = time.perf_counter()
      proc = subprocess.run(
          [sys.executable, "-c", "import resource, sys; from bertjax import predict; "
           "predict.run(*sys.argv[1:]); "
           "print('maxrss_kb', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)",
           workdir, path, path + ".jsonl"],
          capture_output=True, text=True, check=False)
      if proc.returncode:
        sys.exit(f"predict failed on {count} lines:\n{proc.stderr[-2000:]}")
      peak = next(line.split()[1] for line in proc.stdout.splitlines()
                  if line.startswith("maxrss_kb"))
      print(f"{count:>9,} lines: peak RSS {int(peak) / 1024:.0f} MiB, "
            f"{time.perf_counter() - start:.0f} s")


def _tiny_workdir(root: str) -> str:
  """A fine-tuning-shaped folder for the RSS run: a converted 2-layer model with a head, its
  vocabulary and task.json (no training: memory does not depend on the weights)."""
  vocab = os.path.join(root, "vocab.txt")
  with open(vocab, "w") as f:
    f.write("\n".join(list(tokenizer_lib.SPECIAL_TOKENS) + ["alpha", "beta", "gamma", "delta",
                                                            "epsilon", "zeta", "eta", "theta"]))
  cfg = BertConfig(vocab_size=13, hidden_size=32, num_layers=2, num_heads=2,
                   intermediate_size=64, max_position_embeddings=128)
  model = classification.objective_of(2).make_model(cfg)
  z = jnp.zeros((1, 8), jnp.int32)
  params = model.init(jax.random.PRNGKey(0), z, z, z)["params"]
  params = jax.tree.map(lambda x: x.unbox() if hasattr(x, "unbox") else x, params,
                        is_leaf=lambda x: hasattr(x, "unbox"))
  folder = os.path.join(root, "model")
  converted.save_params(folder, params, cfg)
  lower = True
  fingerprint = tokenizer_lib.load_vocabulary(vocab, "wordpiece", lower).fingerprint
  vocab_record.copy_to_workdir(vocab, "wordpiece", fingerprint, folder, lower)
  taskspec.write(taskspec.TaskSpec("bench", "classification", ("a", "b"), 128), folder)
  return folder


def define_flags() -> None:
  flags.DEFINE_enum("shape", "small", sorted(SHAPES), "The model: small (4 layers x 256) or base "
                    "(BERT-Base).")
  flags.DEFINE_integer("n", 1024, "Sequences per round.", lower_bound=1)
  flags.DEFINE_integer("rounds", 5, "Rounds of each side, interleaved.", lower_bound=1)
  flags.DEFINE_list("extras", [], f"More sides, of {', '.join(EXTRAS)}: PyTorch with "
                    "torch.compile or bf16 autocast (sorted texts), bertjax with bf16 matmuls.")
  flags.DEFINE_bool("rss", False, "Measure memory while streaming instead (--lines).")
  flags.DEFINE_string("lines", "10000,1000000", "--rss: the input files' line counts.")


def main(argv) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  args = flags.FLAGS
  if args.rss:
    rss(args.lines)
  else:
    unknown = sorted(set(args.extras) - set(EXTRAS))
    if unknown:
      raise app.UsageError(f"--extras={','.join(unknown)}: choose among {','.join(EXTRAS)}")
    speed(args.shape, args.n, args.rounds, args.extras)


if __name__ == "__main__":
  define_flags()
  cli.run(main)
