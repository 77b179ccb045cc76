"""Throughput of the real train step on synthetic batches: `python -m bertjax.benchmark --config=...`
(`python -m bertjax.benchmark train`; the other benchmarks are its other subcommands,
bertjax/benchmark/commands.py).

    python -m bertjax.benchmark --config=configs/bert_base.py --config.train.batch_size=8 \
        --config.data.max_seq_length=128 --steps=5

Prints compile time, step time, sequences/s, tokens/s, model TFLOP/s (total and per device), MFU
against the device's peak (TPU v4/v5e/v5p/v6e, NVIDIA A100/H100/H200; none on CPU), XLA's own
FLOP count, peak device memory (or XLA's estimate where the device reports none), and whether
host memory came on huge pages (`bertjax.parallel.hostmem`: start it with
GLIBC_TUNABLES=glibc.malloc.hugetlb=1, or BERTJAX_HUGE_PAGES=restart).

It imports jax, flax, optax and ml_collections only (no TensorFlow, no transformers), so it runs
on any machine that can train. `bertjax.benchmark.hf` compares against Hugging Face.

Model FLOPs (`train_flops`) count matmuls only, 2 FLOPs per multiply-add, training = 3x forward
(the backward computes the gradients of both inputs of every matmul). Per sequence, forward:
    encoder  num_layers * L * (8 D^2 + 4 D F + 4 L D)   (Q, K, V, output; MLP; QK^T and PV)
    pooler + NSP        2 D^2 + 4 D
    MLM head        M * (2 D^2 + 2 D V)                  (only the M masked positions)
Rematerialisation is not counted (it is not useful work), so MFU is comparable across remat
policies. Embedding lookups, softmax, LayerNorm, GELU and the optimizer are not counted either;
together they are a few percent of XLA's count (tests/test_benchmark.py checks within 10%).
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import jax
import numpy as np
from absl import flags

from bertjax import cli
from bertjax.data.config import DataConfig
from bertjax.parallel import hostmem
from bertjax.perf import opprofile
from bertjax.training import flops, train
from bertjax.training.flops import peak_tflops, train_flops

def synthetic_batch(batch_size: int, seq_len: int, max_predictions: int, vocab_size: int,
                    seed: int = 0, sequences_per_row: int = 0) -> dict[str, np.ndarray]:
  """Full-length rows (no padding), M distinct masked positions per row, random NSP labels.

  `sequences_per_row` S > 0: packed rows of S sequences of L // S tokens each, with
  `max_predictions` / S masked positions in each, as `data.packing` feeds the step."""
  if sequences_per_row:
    return _packed_synthetic_batch(batch_size, seq_len, max_predictions, vocab_size, seed,
                                   sequences_per_row)
  rng = np.random.default_rng(seed)
  positions = np.argsort(rng.random((batch_size, seq_len - 1)), axis=1)[:, :max_predictions] + 1
  return {
      "input_ids": rng.integers(0, vocab_size, (batch_size, seq_len), dtype=np.int32),
      "input_mask": np.ones((batch_size, seq_len), np.int32),
      "segment_ids": (np.arange(seq_len)[None, :] >= seq_len // 2).astype(np.int32).repeat(
          batch_size, 0),
      "masked_lm_positions": np.sort(positions, axis=1).astype(np.int32),
      "masked_lm_ids": rng.integers(0, vocab_size, (batch_size, max_predictions), dtype=np.int32),
      "masked_lm_weights": np.ones((batch_size, max_predictions), np.float32),
      "next_sentence_labels": rng.integers(0, 2, (batch_size,), dtype=np.int32),
  }


def _packed_synthetic_batch(batch_size, seq_len, max_predictions, vocab_size, seed, s):
  length, m = seq_len // s, max_predictions // s
  if m < 1 or length <= m:
    raise ValueError(f"{s} sequences per row do not fit {seq_len} tokens and {max_predictions} "
                     "masked slots; lower data.max_sequences_per_row")
  parts = [synthetic_batch(batch_size, length, m, vocab_size, seed * s + k) for k in range(s)]
  batch = {name: np.concatenate([p[name] for p in parts], axis=1)
           for name in ("input_ids", "input_mask", "segment_ids", "masked_lm_ids",
                        "masked_lm_weights")}
  batch["masked_lm_positions"] = np.concatenate(
      [p["masked_lm_positions"] + k * length for k, p in enumerate(parts)], axis=1)
  batch["next_sentence_labels"] = np.stack([p["next_sentence_labels"] for p in parts], axis=1)
  batch["sequence_ids"] = np.repeat(np.arange(1, s + 1, dtype=np.int32), length)[None].repeat(
      batch_size, 0)
  batch["nsp_positions"] = (np.arange(s, dtype=np.int32) * length)[None].repeat(batch_size, 0)
  batch["nsp_weights"] = np.ones((batch_size, s), np.float32)
  pad = seq_len - s * length  # a remainder of L // S stays padding
  for name in ("input_ids", "input_mask", "segment_ids", "sequence_ids"):
    batch[name] = np.pad(batch[name], ((0, 0), (0, pad)))
  return batch


def xla_flops(compiled) -> float | None:
  """FLOPs of a compiled executable by XLA's cost analysis (per device program), if reported."""
  try:
    analysis = compiled.cost_analysis()
  except Exception:  # some backends do not implement it
    return None
  if isinstance(analysis, (list, tuple)):
    analysis = analysis[0] if analysis else None
  return float(analysis["flops"]) if analysis and "flops" in analysis else None


def peak_memory_bytes(compiled) -> tuple[float | None, str]:
  """Peak device memory: measured by the device if it can, else XLA's static estimate."""
  stats = jax.local_devices()[0].memory_stats() or {}
  if "peak_bytes_in_use" in stats:
    return float(stats["peak_bytes_in_use"]), "measured"
  try:
    m = compiled.memory_analysis()
    total = (m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes
             - m.alias_size_in_bytes)
    return float(total), "XLA estimate"
  except Exception:
    return None, "unavailable"


def time_steps(run_one, steps: int) -> list[float]:
  """Wall seconds of each call of `run_one` (which must block until its result is ready)."""
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    run_one()
    times.append(time.perf_counter() - start)
  return times


class StepRunner:
  """Compiles bertjax's train step for one synthetic batch and runs it, keeping the state.

  `allocate=False` lowers the step against the state's shapes alone and stops there: `compile()`
  may then run on another thread (XLA releases the GIL while it compiles, so several cases
  compile at once), and `allocate()` creates the state when the case's turn comes, so only one
  case's state is on the device at a time."""

  def __init__(self, config, seq_len: int, max_predictions: int, devices=None,
               sequences_per_row: int = 0, allocate: bool = True):
    # vocab_size 0 means "the tokenizer's"; there is none here, so take the released English one.
    vocab = int(config.model.vocab_size) or flops.DEFAULT_VOCAB_SIZE
    self.training = train.from_config(config, devices=devices, vocab_size=vocab)
    self.cfg = self.training.model_config
    tc = self.training.train_config
    self.batch_size, self.seq_len, self.max_predictions = tc.batch_size, seq_len, max_predictions
    self.sequences_per_row = sequences_per_row
    host = synthetic_batch(tc.batch_size // jax.process_count(), seq_len, max_predictions,
                           self.cfg.vocab_size, seed=jax.process_index(),
                           sequences_per_row=sequences_per_row)
    self.batch = self.training.to_global(host)
    self._init_rng, self.rng = train.rng_streams(tc.seed)  # self.rng: the dropout stream
    # The abstract state carries the step's shardings, so this is the executable the real
    # state would have lowered to.
    self.lowered = self.training.train_step.lower(self.training.abstract_state, self.batch,
                                                  self.rng)
    self.state = self.compiled = None
    if allocate:
      self.compile()
      self.allocate()

  def compile(self):
    start = time.perf_counter()
    self.compiled = self.lowered.compile()
    self.compile_seconds = time.perf_counter() - start
    return self

  def allocate(self) -> None:
    self.state = self.training.init_state(self._init_rng)

  def release(self) -> None:
    self.state = None

  def step(self):
    self.state, metrics = self.compiled(self.state, self.batch, self.rng)
    jax.block_until_ready(metrics)
    return metrics


def _significant(x: float) -> float:
  # 4 significant digits: FLOP figures span 1e-4 TFLOP (a tiny model on CPU) to 1e3 (a pod).
  return float(f"{x:.4g}")


def report(runner: StepRunner, times: list[float]) -> dict:
  """The figures of a finished run as a dict (also what the command prints)."""
  step_s = statistics.median(times)
  flops = train_flops(runner.cfg, runner.batch_size, runner.seq_len, runner.max_predictions)
  n = runner.training.mesh.size
  device = jax.devices()[0]
  peak = peak_tflops(device.device_kind)
  tflops = flops / step_s / 1e12
  memory, memory_kind = peak_memory_bytes(runner.compiled)
  xla = xla_flops(runner.compiled)
  return {
      "device": f"{n} x {device.device_kind} ({device.platform})",
      "mesh": dict(runner.training.mesh.shape),
      "batch_size": runner.batch_size, "seq_len": runner.seq_len,
      "max_predictions": runner.max_predictions, "dtype": runner.cfg.dtype,
      "remat_policy": runner.cfg.remat_policy, "scan_layers": runner.cfg.scan_layers,
      "num_microbatches": runner.training.train_config.num_microbatches,
      "compile_s": round(runner.compile_seconds, 2),
      "step_s": round(step_s, 4), "step_s_min": round(min(times), 4),
      "sequences_per_row": runner.sequences_per_row or 1,
      "sequences_per_s": round(runner.batch_size * (runner.sequences_per_row or 1) / step_s, 2),
      "tokens_per_s": round(runner.batch_size * runner.seq_len / step_s, 1),
      "model_tflop_per_step": _significant(flops / 1e12),
      "xla_tflop_per_step_per_device": None if xla is None else _significant(xla / 1e12),
      "model_tflops": _significant(tflops), "model_tflops_per_device": _significant(tflops / n),
      "peak_tflops_per_device": peak,
      "mfu": None if peak is None else round(tflops / (n * peak), 4),
      "peak_memory_gib": None if memory is None else round(memory / 2**30, 3),
      "peak_memory_kind": memory_kind,
      # Whether malloc advised huge pages (bertjax.parallel.hostmem): on a CPU it moves the step by ~20%.
      "host_huge_pages": hostmem.huge_pages_in_use(),
  }


FLAGS = flags.FLAGS


def define_flags() -> None:
  """The command's flags (bertjax.benchmark.hf's too), defined when it runs (see bertjax/cli.py)."""
  cli.define_config_flag()
  flags.DEFINE_integer("steps", 5, "timed steps (the median is reported)")
  flags.DEFINE_integer("warmup_steps", 1, "untimed steps after compiling")
  flags.DEFINE_string("json", "", "also write the figures to this file")
  flags.DEFINE_integer("profile_steps", 0, "also trace this many steps and print where the time "
                       "goes by kind of operation (bertjax/perf/opprofile.py)")
  flags.mark_flag_as_required("config")


def print_report(figures: dict, out=sys.stdout) -> None:
  width = max(len(k) for k in figures)
  for key, value in figures.items():
    print(f"{key:<{width}}  {value}", file=out)


def main(argv):
  del argv
  config = FLAGS.config
  seq_len, max_predictions, per_row = flops.rows_shape(DataConfig.from_config(config.data))
  runner = StepRunner(config, seq_len, max_predictions, sequences_per_row=per_row)
  time_steps(runner.step, FLAGS.warmup_steps)
  figures = report(runner, time_steps(runner.step, FLAGS.steps))
  print_report(figures)
  if FLAGS.profile_steps:
    result = opprofile.profile(runner.step, runner.compiled.as_text(), FLAGS.profile_steps)
    opprofile.print_profile(result)
    figures["profile"] = result
  if FLAGS.json:
    with open(FLAGS.json, "w") as f:
      json.dump(figures, f, indent=1)
