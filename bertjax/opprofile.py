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
      if match:
        kinds[match.group(1)] = _kind(opcodes([line]))
  return kinds


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
      for _ in range(steps):
        run_step()
    files = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not files:
      raise RuntimeError(f"the profiler wrote no trace under {trace_dir}")
    data = jax.profiler.ProfileData.from_file(files[0])
  per_op = collections.Counter()
  for plane in data.planes:
    for line in plane.lines:
      for event in line.events:
        if event.name in kinds:  # operations only: not the executor's or Python's own events
          per_op[event.name] += event.duration_ns / 1e6 / steps
  by_kind = collections.Counter({kind: 0.0 for kind in KINDS})
  for name, ms in per_op.items():
    by_kind[kinds[name]] += ms
  total = sum(by_kind.values()) or 1.0
  return {"ms_per_step": {k: round(v, 1) for k, v in by_kind.most_common()},
          "share": {k: round(v / total, 3) for k, v in by_kind.most_common()},
          "top": [(round(ms, 1), kinds[name], name) for name, ms in per_op.most_common(12)]}


def print_profile(result: dict, out=None) -> None:
  print("time by kind of operation (ms per step, summed over threads):", file=out)
  for kind, ms in result["ms_per_step"].items():
    print(f"  {kind:<12} {ms:9.1f}  {100 * result['share'][kind]:5.1f}%", file=out)
  print("largest operations:", file=out)
  for ms, kind, name in result["top"]:
    print(f"  {ms:9.1f}  {kind:<12} {name}", file=out)
