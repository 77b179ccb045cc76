"""The accelerator check in one command: `python -m bertjax.benchmark accel` on a GPU or TPU host.

    python -m bertjax.benchmark accel                     # BERT-Base and -Large, L 128 and 512
    python -m bertjax.benchmark accel --size=tiny         # a 1-layer model: any machine
    python -m bertjax.benchmark accel --budget_s=300 --json=accel.json --profile="cudnn unpacked"

Prints one line per measured case, all in bfloat16 matmuls (parameters float32), scanned layers
(--noscan_layers: unrolled):
  train   the real train step (bertjax/benchmark/train.py's StepRunner) of BERT-Base and BERT-Large at
          L 128 and 512: sequences/s, MFU, memory; attention by XLA ("xla": [B, N, L, L] logits
          in memory) and by the platform's fused kernel ("cudnn" on NVIDIA GPUs, "splash" on
          TPUs), unpacked rows and rows packed with 2 (L 128) or 4 (L 512) sequences;
  local   ModernBERT-base (configs/modern_base.py) at L 1024 with its local layers (a window of
          128 keys in two of three layers) and with every layer global;
  predict bertjax.predict's pass over texts of real lengths (bertjax/benchmark/predict.py's
          log-normal spread) against transformers' PyTorch model on the GPU, where torch with
          CUDA and transformers are installed (said where not).
Train batches hold --tokens_per_device positions per device (64 rows of 128, 16 of 512), and so
do prediction's calls (bertjax/predict/predictor.py: length_groups).

MFU = model FLOPs (bertjax/training/flops.py: matmuls, 3x forward) / step time / (devices x peak). The
peaks are dense bfloat16 TFLOP/s per chip from the vendors' data sheets, flops.PEAK_TFLOPS (the
table is printed first); a device without an entry (a CPU) gets none. Memory is XLA's figure for
the case's own executable (arguments + outputs + temporaries - aliased), and at the end the
device's measured peak over the whole run where it reports one.

A fresh GPU host spends most of the check compiling (18 train cases, 14-68 s each on an H200):
they compile --compile_threads at a time before the first is timed; the whole check took 384 s
there. --budget_s bounds it inside a time-limited lease (later cases are reported as skipped);
a case that fails prints its error and the rest still run (the command then exits non-zero).

It imports jax, flax, optax, orbax and ml_collections only (tests/test_benchmark.py checks that
importing it loads no TensorFlow, transformers or torch; torch and transformers are looked for
only by the prediction case, where installed).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import importlib
import importlib.util
import json
import statistics
import time
from typing import Any

import jax
import numpy as np
from absl import app, flags

from bertjax import cli
from bertjax.benchmark import train as benchmark, predict as benchmark_predict
from bertjax.model.config import BertConfig
from bertjax.perf import opprofile
from bertjax.training import flops

SIZES = ("full", "tiny")
TINY = dict(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, vocab_size=512)


@dataclasses.dataclass
class Case:
  kind: str  # train, local, predict
  model: str
  seq_len: int
  attention: str = "xla"
  per_row: int = 0  # sequences packed in a row (0: unpacked)
  window: bool = False  # ModernBERT's local layers on


def fused_attention() -> str | None:
  """The platform's fused attention: cudnn (NVIDIA), splash (TPU), none elsewhere."""
  platform = jax.devices()[0].platform
  return {"gpu": "cudnn", "tpu": "splash"}.get(platform)


def cases(size: str, fused: str | None) -> list[Case]:
  """What `size` measures; at tiny one model at one length (the same code, a few compiles)."""
  lengths = (16,) if size == "tiny" else (128, 512)
  out = []
  for model in ("bert_base",) if size == "tiny" else ("bert_base", "bert_large"):
    for length in lengths:
      per_row = 2 if length <= 128 else 4
      if size != "tiny":  # tiny: the packed row alone (it runs the unpacked code and more)
        out.append(Case("train", model, length, "xla"))
      out.append(Case("train", model, length, "xla", per_row))
      if fused:
        out.append(Case("train", model, length, fused))
        out.append(Case("train", model, length, fused, per_row))
  local_len = 32 if size == "tiny" else 1024
  for window in (True,) if size == "tiny" else (True, False):
    out.append(Case("local", "modern_base", local_len, fused or "xla", 0, window))
  out.append(Case("predict", "bert_base", lengths[0]))
  return out


def step_config(case: Case, size: str, tokens_per_device: int, devices: int,
                scan_layers: bool = True):
  """The ml_collections config of a train-step case (the released config, bf16, scanned unless
  `scan_layers` is False)."""
  config = released_config(case.model)
  m, d, t = config.model, config.data, config.train
  if size == "tiny":
    for key, value in TINY.items():
      setattr(m, key, value)
    if case.model == "modern_base":  # one global layer, one local: the window still acts
      m.num_layers, m.global_every, m.local_window = 2, 2, 8
  m.vocab_size = m.vocab_size or flops.DEFAULT_VOCAB_SIZE
  m.dtype, m.scan_layers, m.remat_policy = "bfloat16", scan_layers, "none"
  m.attention_impl = case.attention
  m.attention_dropout = 0.0  # the fused kernels have none; the XLA rows match them
  if case.model == "modern_base" and not case.window:
    m.global_every, m.local_window = 1, 0
  m.max_position_embeddings = max(m.max_position_embeddings, case.seq_len)
  d.max_seq_length = case.seq_len
  d.max_predictions_per_seq = max(1, round(0.15 * case.seq_len / max(case.per_row, 1)))
  t.batch_size = max(1, tokens_per_device // case.seq_len) * devices
  t.num_microbatches = 1
  return config


def released_config(name: str):
  """The released config `name`'s get_config() (bertjax.configs, the repository's configs/)."""
  # lazy: the case names its config; importing all of them would import the fine-tuning families
  return importlib.import_module(f"bertjax.configs.{name}").get_config()


def memory_gib(compiled) -> float | None:
  try:
    m = compiled.memory_analysis()
    total = (m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes
             - m.alias_size_in_bytes)
  except Exception:  # pylint: disable=broad-except
    return None  # a backend without the analysis
  return round(total / 2**30, 3)


def prepare_train(case: Case, size: str, tokens_per_device: int, devices=None,
                  scan_layers: bool = True):
  """The case's StepRunner, lowered but neither compiled nor holding a state (see StepRunner)."""
  config = step_config(case, size, tokens_per_device, len(devices or jax.devices()), scan_layers)
  slots = config.data.max_predictions_per_seq * max(case.per_row, 1)
  return benchmark.StepRunner(config, case.seq_len, slots, devices=devices,
                              sequences_per_row=case.per_row, allocate=False)


def run_train(runner, steps: int, profile_steps: int = 0) -> tuple[dict | None, dict]:
  """(the op profile or None, the figures) of a compiled runner's step, profiled by kind of
  operation when `profile_steps`; its state lives on the device only meanwhile."""
  runner.allocate()
  try:
    benchmark.time_steps(runner.step, 1)
    figures = benchmark.report(runner, benchmark.time_steps(runner.step, steps))
    profiled = (opprofile.profile(runner.step, runner.compiled.as_text(), profile_steps)
                if profile_steps else None)
  finally:
    runner.release()
  return profiled, {"seq_per_s": figures["sequences_per_s"], "mfu": figures["mfu"],
          "tflops_per_device": figures["model_tflops_per_device"],
          "memory_gib": memory_gib(runner.compiled), "batch": figures["batch_size"],
          "step_s": figures["step_s"], "compile_s": figures["compile_s"]}


def run_predict(case: Case, size: str, tokens_per_device: int, steps: int, devices=None) -> dict:
  shape = TINY if size == "tiny" else benchmark_predict.SHAPES["base"]
  cfg = BertConfig(**{"vocab_size": benchmark_predict.VOCAB, **shape, "dtype": "bfloat16",
                      "max_position_embeddings": 512, "hidden_dropout": 0.0,
                      "attention_dropout": 0.0})
  n = 256 if size == "tiny" else 8192
  lengths_N = np.minimum(benchmark_predict.lengths(n), case.seq_len)
  f = benchmark_predict.features(lengths_N)
  f = {k: v[:, :case.seq_len] for k, v in f.items()}
  ours = benchmark_predict.bertjax_predictor(cfg, devices, tokens_per_device)
  ours.run(f)  # compiles every width
  rates = []
  for _ in range(steps):
    start = time.perf_counter()
    ours.run(f)
    rates.append(n / (time.perf_counter() - start))
  out = {"seq_per_s": round(statistics.median(rates), 1), "texts": n}
  out["torch_cuda_seq_per_s"], out["torch_note"] = _torch_cuda(cfg, f, lengths_N, steps)
  return out


def _torch_cuda(cfg: BertConfig, f, lengths_N, steps: int):
  """transformers' model on the GPU in bfloat16, texts sorted by length, batches of 64."""
  if not (importlib.util.find_spec("torch") and importlib.util.find_spec("transformers")):
    return None, "torch or transformers not installed"
  import torch  # lazy: optional, and heavy; only the GPU comparison needs it
  if not torch.cuda.is_available():
    return None, "torch sees no CUDA device"
  model = benchmark_predict.torch_model(cfg).to("cuda", dtype=torch.bfloat16)
  order = np.argsort(lengths_N, kind="stable")
  lengths_sorted = lengths_N[order]
  batches = []
  for at in range(0, len(order), 64):
    width = int(lengths_sorted[at:at + 64].max())
    rows = order[at:at + 64]
    batches.append({name: torch.from_numpy(f[key][rows, :width]).long().cuda()
                    for name, key in (("input_ids", "input_ids"), ("attention_mask", "input_mask"),
                                      ("token_type_ids", "segment_ids"))})

  def one_pass():
    with torch.inference_mode():
      for batch in batches:
        model(**batch)
    torch.cuda.synchronize()

  one_pass()
  rates = []
  for _ in range(steps):
    start = time.perf_counter()
    one_pass()
    rates.append(len(order) / (time.perf_counter() - start))
  return round(statistics.median(rates), 1), "transformers, bf16, sorted batches of 64"


def describe(case: Case) -> str:
  if case.kind == "local":
    return (f"{case.model} L{case.seq_len} {case.attention} "
            f"{'local windows' if case.window else 'all global'}")
  if case.kind == "predict":
    return f"predict {case.model} (texts up to {case.seq_len} tokens)"
  packed = f"packed x{case.per_row}" if case.per_row else "unpacked"
  return f"{case.model} L{case.seq_len} {case.attention} {packed}"


def versions() -> str:
  out = []
  for name in ("jax", "jaxlib", "flax", "optax", "orbax.checkpoint"):
    try:
      out.append(f"{name} {importlib.import_module(name).__version__}")
    except Exception:  # pylint: disable=broad-except
      out.append(f"{name} ?")
  return ", ".join(out)


def _error(e: BaseException) -> dict:
  return {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"}


def check(size: str = "full", tokens_per_device: int = 8192, steps: int = 3, devices=None,
          out=None, budget_s: float = 0.0, compile_threads: int = 4, json_path: str = "",
          profile: str = "", scan_layers: bool = True) -> list:
  """Runs every case, printing a line each; returns [(description, figures), ...].

  The train cases are lowered one after another and compiled `compile_threads` at a time (a
  fresh accelerator host spends most of the check compiling), all before the first is timed:
  XLA's GPU autotuner runs kernels on the device while it compiles, which would slow a step
  timed meanwhile (seen on an H200). A case that fails prints its error and the rest go on;
  after `budget_s` seconds (0: none) the cases not yet started are reported as skipped, so a
  check inside a time-limited lease still returns what it measured. `json_path` is rewritten
  after every case. Train cases whose description contains `profile` are also profiled
  (bertjax/perf/opprofile.py: time by kind of operation)."""
  started = time.perf_counter()
  device = (devices or jax.devices())[0]
  fused = fused_attention()
  print(f"{len(devices or jax.devices())} x {device.device_kind} ({device.platform}); "
        f"{versions()}", file=out, flush=True)
  print("bf16 peaks used for MFU (TFLOP/s per chip): "
        + ", ".join(f"{k} {v:g}" for k, v in flops.PEAK_TFLOPS), file=out, flush=True)
  peak = flops.peak_tflops(device.device_kind)
  print(f"this device's peak: {peak if peak else 'none known (MFU not computed)'}; fused "
        f"attention: {fused or 'none on this platform (XLA rows only)'}",
        file=out, flush=True)
  all_cases = cases(size, fused)
  pending: dict[int, Any] = {}
  pool = concurrent.futures.ThreadPoolExecutor(max(1, compile_threads))
  for i, case in enumerate(all_cases):
    if case.kind == "predict":
      continue
    try:
      runner = prepare_train(case, size, tokens_per_device, devices, scan_layers)
      pending[i] = pool.submit(runner.compile)
    except Exception as e:  # pylint: disable=broad-except
      pending[i] = e
  compiling = [f for f in pending.values() if not isinstance(f, Exception)]
  remaining = budget_s - (time.perf_counter() - started) if budget_s else None
  concurrent.futures.wait(compiling, timeout=max(remaining, 0) if budget_s else None)
  print(f"compiled in {time.perf_counter() - started:.0f} s", file=out, flush=True)
  results, profiled = [], None
  try:
    for i, case in enumerate(all_cases):
      if budget_s and time.perf_counter() - started > budget_s:
        figures = {"skipped": f"over the {budget_s:g} s budget"}
      else:
        try:
          if case.kind == "predict":
            figures = run_predict(case, size, tokens_per_device, steps, devices)
          elif isinstance(pending[i], Exception):
            raise pending[i]
          else:
            profiled, figures = run_train(
                pending.pop(i).result(), steps,
                profile_steps=2 if profile and profile in describe(case) else 0)
        except Exception as e:  # pylint: disable=broad-except
          figures = _error(e)
      pending.pop(i, None)
      results.append((describe(case), figures))
      print(f"  {describe(case):<44} " + "  ".join(f"{k} {v}" for k, v in figures.items()),
            file=out, flush=True)
      if profiled:
        opprofile.print_profile(profiled, out)
        profiled = None
      if json_path:
        with open(json_path, "w") as f:
          json.dump([{"case": name, **fig} for name, fig in results], f, indent=1)
  finally:
    pool.shutdown(wait=False, cancel_futures=True)
  stats = device.memory_stats() or {}
  if "peak_bytes_in_use" in stats:
    print(f"device peak memory over the run: {stats['peak_bytes_in_use'] / 2**30:.2f} GiB",
          file=out, flush=True)
  print(f"{time.perf_counter() - started:.0f} s in all", file=out, flush=True)
  return results


def define_flags() -> None:
  flags.DEFINE_enum("size", "full", SIZES, "full: BERT-Base/Large, ModernBERT-base; tiny: "
                    "one layer of 32 at L 16 (32 with windows), one case of each kind (packed "
                    "rows, local windows, prediction): a CPU, the test suite.")
  flags.DEFINE_integer("tokens_per_device", 8192, "Positions per device in a train batch "
                       "(rows = this / L).", lower_bound=1)
  flags.DEFINE_integer("steps", 3, "Timed steps (or prediction passes) per case; the median "
                       "is printed.", lower_bound=1)
  flags.DEFINE_string("json", "", "Also write the figures to this file (after every case).")
  flags.DEFINE_float("budget_s", 0.0, "Start no case after this many seconds (0: no limit); the "
                     "rest are reported as skipped.", lower_bound=0.0)
  flags.DEFINE_integer("compile_threads", 4, "Train cases compiled at once, all before the "
                       "first is timed.", lower_bound=1)
  flags.DEFINE_bool("scan_layers", True, "Train cases with the layers under one scan (the "
                    "released configs); --noscan_layers unrolls them.")
  flags.DEFINE_string("profile", "", "Also profile the train cases whose description contains "
                      "this (e.g. 'bert_large L512 cudnn unpacked'): time by kind of operation.")


def main(argv) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  args = flags.FLAGS
  results = check(args.size, args.tokens_per_device, args.steps, budget_s=args.budget_s,
                  compile_threads=args.compile_threads, json_path=args.json,
                  profile=args.profile, scan_layers=args.scan_layers)
  failed = [name for name, figures in results if "error" in figures]
  if failed:
    raise SystemExit(f"{len(failed)} case(s) failed: {'; '.join(failed)}")


if __name__ == "__main__":
  define_flags()
  cli.run(main)
