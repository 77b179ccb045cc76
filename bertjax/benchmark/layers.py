"""Where a scanned layer's time goes on a GPU, in one command: `python -m bertjax.benchmark layers`.

    python -m bertjax.benchmark layers --out=$OUT                  # ~9 minutes on an H100/H200
    python -m bertjax.benchmark layers --out=$OUT --parts=accel    # then the accelerator check
    python -m bertjax.benchmark layers --size=tiny --out=/tmp/p    # a CPU: the command runs

On one H200 the train step's time followed the layer count, not its work: about 5 ms a scanned
layer beyond its FLOPs (docs/performance.md#on-one-nvidia-h200). Each group below runs in a
process of its own (XLA's flags are read once, when jax starts), all on the accelerator check's
"bert_base L128 cudnn unpacked" case (16,384 positions a step, bf16 matmuls, scanned layers,
no remat) and variants of it; each variant is compiled, warmed up twice and timed over 7 steps
(median and fastest), as `bertjax.benchmark accel` times its cases:

  A  default flags: base; unrolled layers (scan=0); two layers per loop iteration (scan_unroll=2);
     no hidden dropout; full remat; 32,768 positions; BERT-Large; also the compiled program's
     layer loops (bertjax/perf/layercost.py: operations per layer, writes of whole [layers, ...]
     buffers, opcodes of the loop bodies) of base and unrolled, and a trace of base (the GPU
     streams' busy time against the step's wall, kernels per step, the first events' stats);
  B  XLA command buffers off (--xla_gpu_enable_command_buffer=): base, traced;
  C  XLA's full while-loop unrolling (--xla_gpu_enable_while_loop_unrolling=...FULL_UNROLL);
  D  command buffers that hold the loops too (WHILE and CONDITIONAL added);
  E  packed rows on cuDNN: the mask (a bias, whose gradient cuDNN computes) against segments
     (model.cudnn_packing=segments, attention.cudnn_segments), at L 128 x2 and L 512 x4;
  accel  `python -m bertjax.benchmark accel` with the time left (--budget_s).

Each group writes OUT/<group>.json as its variants finish (and OUT/<group>.log); a group that
overruns its share is stopped and says so; OUT/summary.json gathers every figure at the end.
docs/performance.md says what each reading would mean. It imports jax, flax, optax and orbax
only (no TensorFlow: the GPU image has none).
"""

from __future__ import annotations

import collections
import concurrent.futures
import glob
import gzip
import json
import os
import subprocess
import sys
import tempfile
import time

import jax
from absl import app, flags

from bertjax import cli
from bertjax.benchmark import train as benchmark, accel as benchmark_accel
from bertjax.model import attention
from bertjax.perf import hlotext, layercost, opprofile

AUTOTUNE_CACHE = "--xla_gpu_per_fusion_autotune_cache_dir=/tmp/bertjax_autotune"
DEFAULT_BUDGET_S = 540.0
# (group, XLA flags, seconds it may take, variants, variants whose HLO is read, variant traced)
GROUPS = (
    ("A", "", 200, ("base:", "noscan:scan=0", "unroll2:scan_unroll=2", "nodrop:hidden_dropout=0.0",
                    "remat:remat_policy=full", "tok32k:tokens=32768", "large:model=bert_large"),
     ("base", "noscan"), "base"),
    ("B", "--xla_gpu_enable_command_buffer=", 80, ("base:",), (), "base"),
    ("C", "--xla_gpu_enable_while_loop_unrolling=WHILE_LOOP_UNROLLING_FULL_UNROLL", 80,
     ("base:",), ("base",), ""),
    ("D", "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,"
     "CONDITIONAL", 70, ("base:",), (), ""),
    ("E", "", 110, ("mask2:per_row=2", "seg2:per_row=2,cudnn_packing=segments",
                    "mask4:L=512,per_row=4", "seg4:L=512,per_row=4,cudnn_packing=segments"),
     (), ""),
)


def runner(spec: str, size: str):
  """(name, StepRunner lowered only) of "name:key=value,...": the base case with the keys set
  (scan, tokens, L, per_row, model, attn, or any model key)."""
  name, _, pairs = spec.partition(":")
  options = dict(p.split("=", 1) for p in pairs.split(",") if p)
  tiny = size == "tiny"
  length = int(options.pop("L", 16 if tiny else 128))
  case = benchmark_accel.Case("train", options.pop("model", "bert_base"), length,
                              options.pop("attn", benchmark_accel.fused_attention() or "xla"),
                              int(options.pop("per_row", 0)))
  tokens = min(int(options.pop("tokens", 16384)), 256) if tiny else int(options.pop("tokens", 16384))
  config = benchmark_accel.step_config(case, size, tokens, 1, options.pop("scan", "1") == "1")
  for key, value in options.items():
    setattr(config.model, key, type(getattr(config.model, key))(value))
  slots = config.data.max_predictions_per_seq * max(case.per_row, 1)
  return name, benchmark.StepRunner(config, length, slots, devices=jax.devices()[:1],
                                    sequences_per_row=case.per_row, allocate=False)


def hlo_figures(text: str, num_layers: int, scan_unroll: int = 1) -> dict:
  """The compiled program per layer (bertjax/perf/layercost.py) and the opcodes of its layer loops."""
  comps = opprofile.computations(text)
  bodies = layercost.layer_loops(text, num_layers, scan_unroll)
  opcodes = {body: dict(collections.Counter(
      op for _, _, op, _ in hlotext.parse(comps[body])
      if op not in hlotext.PLUMBING).most_common()) for body in bodies}
  return {"ops": layercost.module_op_count(text),
          "ops_per_layer": layercost.layer_ops(text, num_layers, bool(bodies), scan_unroll),
          "whole_stack_writes_per_layer": layercost.stack_writes(text, num_layers, scan_unroll),
          "layer_loop_opcodes": opcodes}


def _busy_ns(intervals) -> int:
  """Time covered by the union of (start, end) intervals."""
  busy, start, end = 0, 0, 0
  for s, e in sorted(intervals):
    if s > end:
      busy, start, end = busy + end - start, s, e
    else:
      end = max(end, e)
  return busy + end - start


def trace(run_step, steps: int = 2) -> dict:
  """The device's streams busy against the wall over `steps` traced steps, and each trace line's
  events, busiest first (names and the first event's stats: what a GPU's kernels carry)."""
  folder = tempfile.mkdtemp()
  with jax.profiler.trace(folder):
    start = time.perf_counter()
    for _ in range(steps):
      run_step()
    wall = (time.perf_counter() - start) / steps
  data = jax.profiler.ProfileData.from_file(
      glob.glob(f"{folder}/**/*.xplane.pb", recursive=True)[0])
  lines, device, named_ns, kernel_ns = [], [], 0, 0
  for plane in data.planes:
    for line in plane.lines:
      events = list(line.events)
      if not events:
        continue
      spans = [(e.start_ns, e.start_ns + e.duration_ns) for e in events]
      if "GPU" in plane.name and line.name.startswith("Stream"):
        device += spans
        for e in events:  # what --profile keys on (opprofile.HLO_OP_STATS)
          kernel_ns += e.duration_ns
          named_ns += e.duration_ns if opprofile.event_stat(e, opprofile.HLO_OP_STATS) else 0
      top = collections.Counter()
      for e in events:
        top[e.name[:70]] += e.duration_ns
      try:
        stats = [(str(k), str(v)[:80]) for k, v in list(events[0].stats)[:8]]
      except Exception:  # pylint: disable=broad-except  # an event without stats
        stats = []
      lines.append({"plane": plane.name, "line": line.name, "events_per_step": len(events) / steps,
                    "busy_ms": round(_busy_ns(spans) / steps / 1e6, 2), "first_event_stats": stats,
                    "top_ms": [(k, round(v / steps / 1e6, 2)) for k, v in top.most_common(10)]})
  lines.sort(key=lambda x: -x["busy_ms"])
  return {"traced_wall_ms": round(wall * 1e3, 1),
          "device_streams_busy_ms": round(_busy_ns(device) / steps / 1e6, 2) if device else None,
          "kernel_time_naming_an_hlo_op": round(named_ns / kernel_ns, 3) if kernel_ns else None,
          "lines": lines[:20]}


def run_group(tag: str, specs, out: str, size: str = "full", hlo=(), traced: str = "") -> dict:
  """Compiles the variants in threads, then times each (and reads or traces those named);
  OUT/<tag>.json is rewritten after each."""
  os.makedirs(out, exist_ok=True)
  start = time.perf_counter()
  runners = dict(runner(spec, size) for spec in specs)
  with concurrent.futures.ThreadPoolExecutor(len(runners)) as pool:
    futures = {name: pool.submit(r.compile) for name, r in runners.items()}
    concurrent.futures.wait(futures.values())
  print(f"[{tag}] XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}: {len(runners)} compiled in "
        f"{time.perf_counter() - start:.0f} s; {benchmark_accel.versions()}", flush=True)
  results = {}
  for name, r in runners.items():
    try:
      futures[name].result()
      r.allocate()
      benchmark.time_steps(r.step, 2)
      f = benchmark.report(r, benchmark.time_steps(r.step, 7))
      got = {k: f[k] for k in ("step_s", "step_s_min", "mfu", "batch_size", "compile_s",
                               "sequences_per_s")}
      got.update(layers=r.cfg.num_layers, xla_gib=benchmark_accel.memory_gib(r.compiled),
                 ms_per_layer=round(f["step_s"] * 1e3 / r.cfg.num_layers, 2))
      if r.cfg.cudnn_packing == "segments":  # jax's private packed layout, or the mask after all
        got["cudnn_packed_layout"] = ("jax's packed layout" if attention.cudnn_packed_layout()
                                      else "the public mask (no packed layout in this jax)")
      print(f"[{tag}] {name:<8} step {f['step_s'] * 1e3:7.1f} ms (fastest "
            f"{f['step_s_min'] * 1e3:.1f}), MFU {f['mfu']}, {got['ms_per_layer']} ms a layer, "
            f"compiled in {f['compile_s']} s", flush=True)
      if name in hlo:
        text = r.compiled.as_text()
        with gzip.open(os.path.join(out, f"{tag}_{name}.hlo.txt.gz"), "wt") as fh:
          fh.write(text)
        got["hlo"] = hlo_figures(text, r.cfg.num_layers, r.cfg.scan_unroll)
        print(f"[{tag}] {name} operations per layer {got['hlo']['ops_per_layer']}, whole-stack "
              f"writes {got['hlo']['whole_stack_writes_per_layer']}", flush=True)
      if name == traced:
        got["trace"] = t = trace(r.step)
        print(f"[{tag}] {name} traced {t['traced_wall_ms']} ms a step, device streams busy "
              f"{t['device_streams_busy_ms']} ms", flush=True)
    except Exception as e:  # pylint: disable=broad-except  # the other variants still run
      got = {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"}
      print(f"[{tag}] {name} failed: {got['error']}", flush=True)
    r.release()
    results[name] = got
    with open(os.path.join(out, f"{tag}.json"), "w") as fh:
      json.dump(results, fh, indent=1)
  return results


def _autotune_flag() -> str:
  """XLA's autotuning cache shared by the groups' processes, where this jaxlib knows the flag."""
  probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], capture_output=True,
                         env={**os.environ, "XLA_FLAGS": AUTOTUNE_CACHE}, timeout=120, check=False)
  return AUTOTUNE_CACHE if probe.returncode == 0 else ""


def _with_xla_flags(*extra: str) -> dict:
  """This process's environment with `extra` flags before the user's XLA_FLAGS. Never an
  XLA_FLAGS of blanks: XLA takes a value not starting with "--" for a file of flags, and dies."""
  flags_ = " ".join(f for f in (*extra, os.environ.get("XLA_FLAGS", "")) if f.strip()).strip()
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  return {**env, "XLA_FLAGS": flags_} if flags_ else env


def _read(path: str):
  if not os.path.exists(path):
    return {"error": "no figures written"}
  with open(path) as fh:
    return json.load(fh)


def run_all(out: str, parts: list[str], budget_s: float, size: str) -> dict:
  """Each group in a process of its own, inside its share of `budget_s`; then the accelerator
  check with what is left. Returns (and writes to OUT/summary.json) every group's figures."""
  os.makedirs(out, exist_ok=True)
  end = time.monotonic() + budget_s
  shared = _autotune_flag() if size == "full" else ""
  # Each group's share of the budget: its seconds in GROUPS (which fill DEFAULT_BUDGET_S),
  # scaled to the budget given for the groups asked.
  asked = [g for g in GROUPS if g[0] in parts]
  scale = budget_s / max(1, sum(g[2] for g in asked)) if "accel" not in parts else 1.0
  summary = {}
  for tag, xla_flags, seconds, specs, hlo, traced in asked:
    left = end - time.monotonic()
    seconds *= scale
    if left < 45:
      summary[tag] = {"skipped": f"{left:.0f} s left"}
      continue
    command = [sys.executable, "-m", "bertjax.benchmark", "layers", f"--out={out}",
               f"--size={size}", f"--group={tag}"]
    env = _with_xla_flags(shared, xla_flags)
    with open(os.path.join(out, f"{tag}.log"), "w") as log:
      try:
        subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                       timeout=min(seconds, left), check=False)
      except subprocess.TimeoutExpired:
        print(f"[{tag}] stopped after {min(seconds, left):.0f} s", file=log, flush=True)
    with open(os.path.join(out, f"{tag}.log")) as log:
      print("".join(line for line in log if line.startswith(f"[{tag}]")), end="", flush=True)
    summary[tag] = _read(os.path.join(out, f"{tag}.json"))
  left = end - time.monotonic()
  if "accel" in parts:
    if left >= 120:
      accel = [sys.executable, "-m", "bertjax.benchmark", "accel", f"--size={size}",
               f"--budget_s={left - 30:.0f}", f"--json={out}/accel.json", "--steps=5",
               "--compile_threads=8"] + (["--tokens_per_device=16384"] if size == "full" else [])
      with open(os.path.join(out, "accel.log"), "w") as log:
        subprocess.run(accel, stdout=log, stderr=subprocess.STDOUT, timeout=left, check=False,
                       env=_with_xla_flags(shared))
      summary["accel"] = _read(os.path.join(out, "accel.json"))
    else:
      summary["accel"] = {"skipped": f"{left:.0f} s left"}
  with open(os.path.join(out, "summary.json"), "w") as fh:
    json.dump(summary, fh, indent=1)
  return summary


def define_flags() -> None:
  flags.DEFINE_string("out", os.environ.get("OUT", "/tmp/bertjax_layers"), "Folder of the "
                      "figures (JSON per group, logs, compiled HLO of the variants read).")
  flags.DEFINE_list("parts", ["A", "B", "C", "D", "E"], "Groups to run (A-E, module docstring) "
                    "and 'accel' for the accelerator check with the time left.")
  flags.DEFINE_float("budget_s", DEFAULT_BUDGET_S, "Seconds for everything: each group stops at "
                     "its share (GROUPS' seconds, scaled to this without accel); one device call "
                     "may run 600.", lower_bound=60.0)
  flags.DEFINE_enum("size", "full", benchmark_accel.SIZES, "tiny: a 1-layer model at L 16, on "
                    "any machine (the command's own test).")
  flags.DEFINE_string("group", "", "Internal: run this one group here (XLA_FLAGS already set).")


def main(argv) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  args = flags.FLAGS
  if args.group:
    _, _, _, specs, hlo, traced = next(g for g in GROUPS if g[0] == args.group)
    run_group(args.group, specs, args.out, args.size, hlo, traced)
    return
  run_all(args.out, args.parts, args.budget_s, args.size)


if __name__ == "__main__":
  define_flags()
  cli.run(main)
