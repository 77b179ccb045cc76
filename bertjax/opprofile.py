"""Where a compiled step spends its time, by kind of operation: what `benchmark --profile_steps`
prints.

A profiler trace records one event per executed XLA operation (a fusion, a matmul, a copy); the
compiled module's text says what each one computes. Each operation is put in one kind:

  matmul       a dot or convolution (with whatever XLA fused into it)
  rng          random bits (threefry's xor/shift arithmetic: dropout masks)
  layout       copies and transposes: data moved, no arithmetic
  reduce       reductions (sums, maxima, norms)
  gather       gathers and scatters (the masked positions, the embedding lookup and its gradient)
  elementwise  everything else (activations, softmax, LayerNorm arithmetic, the optimizer update)

The times are summed over the threads that ran them, so on a multi-core CPU they add up to more
than the step's wall time; the shares are what to read. A kind's time includes the operations
fused into it.
"""

from __future__ import annotations

import collections
import glob
import os
import re
import tempfile
import time
from typing import Callable

import jax

KINDS = ("matmul", "rng", "layout", "reduce", "gather", "elementwise")

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*.*?\b([a-z][\w\-]*)\(")
_CALLS = re.compile(r"(?:calls|to_apply)=%?([\w.\-]+)")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")


def _computations(hlo_text: str) -> dict[str, list[str]]:
  comps, current = {}, None
  for line in hlo_text.splitlines():
    match = _COMPUTATION.match(line)
    if match:
      current = match.group(1)
      comps[current] = []
    elif current is not None:
      comps[current].append(line)
  return comps


def classify(hlo_text: str) -> dict[str, str]:
  """{instruction name: kind} for every instruction of the module, fusions by their contents."""
  comps = _computations(hlo_text)

  def opcodes(lines, depth=0):
    ops = set()
    for line in lines:
      match = _INSTRUCTION.match(line)
      if match:
        ops.add(match.group(2))
      if depth < 4:
        for callee in _CALLS.findall(line):
          ops |= opcodes(comps.get(callee, []), depth + 1)
    return ops

  kinds = {}
  for lines in comps.values():
    for line in lines:
      match = _INSTRUCTION.match(line)
      # A loop's or a call's own event spans its body's operations, which have events of their
      # own (a scanned encoder runs its layers inside a while): counted once, through them.
      if match and match.group(2) not in _CONTROL:
        kinds[match.group(1)] = _kind(opcodes([line]))
  return kinds


_CONTROL = {"while", "conditional", "call"}


def _kind(ops: set[str]) -> str:
  if ops & {"dot", "convolution", "custom-call"}:
    return "matmul"
  if ops & {"xor", "shift-right-logical", "rng-bit-generator"}:
    return "rng"
  if ops & {"gather", "scatter", "dynamic-slice", "dynamic-update-slice"}:
    return "gather"
  if ops & {"reduce", "reduce-window"}:
    return "reduce"
  data_movement = {"copy", "transpose", "bitcast", "reshape", "broadcast", "slice", "concatenate",
                   "pad", "parameter", "constant", "tuple", "get-tuple-element", "fusion"}
  if ops and ops <= data_movement and ops & {"copy", "transpose", "concatenate", "pad", "slice"}:
    return "layout"
  return "elementwise"


def profile(run_step: Callable[[], object], hlo_text: str, steps: int = 3) -> dict:
  """Traces `steps` calls of `run_step` (each waits for its step) and returns
  {"ms_per_step": {kind: ms}, "share": {kind: fraction}, "top": [(ms, kind, name), ...]}."""
  kinds = classify(hlo_text)
  with tempfile.TemporaryDirectory() as trace_dir:
    with jax.profiler.trace(trace_dir):
      start = time.perf_counter()
      for _ in range(steps):
        run_step()
      wall_ms = (time.perf_counter() - start) * 1e3 / steps
    files = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not files:
      raise RuntimeError(f"the profiler wrote no trace under {trace_dir}")
    data = jax.profiler.ProfileData.from_file(files[0])
  per_op = collections.Counter()
  for plane in data.planes:
    # A GPU's plane has the operations once on its "XLA Ops" line and again as kernels on its
    # stream lines (kernels named like their fusions); a CPU's has them on the threads' lines.
    lines = [line for line in plane.lines if line.name == "XLA Ops"] or plane.lines
    for line in lines:
      for event in line.events:
        if event.name in kinds:  # operations only: not the executor's or Python's own events
          per_op[event.name] += event.duration_ns / 1e6 / steps
  by_kind = collections.Counter({kind: 0.0 for kind in KINDS})
  for name, ms in per_op.items():
    by_kind[kinds[name]] += ms
  total = sum(by_kind.values()) or 1.0
  return {"wall_ms_per_step": round(wall_ms, 1),
          "ms_per_step": {k: round(v, 1) for k, v in by_kind.most_common()},
          "share": {k: round(v / total, 3) for k, v in by_kind.most_common()},
          "top": [(round(ms, 1), kinds[name], name) for name, ms in per_op.most_common(12)]}


def print_profile(result: dict, out=None) -> None:
  # Traced time far below the wall means operations the trace did not itemise: on a GPU, those
  # XLA replays inside command buffers (CUDA graphs) are absent (seen on an H200: 3.4 of 75 ms).
  print(f"operations traced: {sum(result['ms_per_step'].values()):.1f} ms per step, summed "
        f"over threads, in a step of {result['wall_ms_per_step']:.1f} ms wall "
        "(profiled, so slower than untraced)", file=out)
  print("time by kind of operation (ms per step, summed over threads):", file=out)
  for kind, ms in result["ms_per_step"].items():
    print(f"  {kind:<12} {ms:9.1f}  {100 * result['share'][kind]:5.1f}%", file=out)
  print("largest operations:", file=out)
  for ms, kind, name in result["top"]:
    print(f"  {ms:9.1f}  {kind:<12} {name}", file=out)
