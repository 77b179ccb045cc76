"""Where a compiled step spends its time, by kind of operation: what `benchmark --profile_steps`
prints.

A profiler trace records one event per executed XLA operation (a fusion, a matmul, a copy): on a
CPU named after it, on a GPU as the kernels it launched, named after the library routine that
ran and carrying the operation's name in their "hlo_op" stat (`attribute` keys on it); the
compiled module's text says what each operation computes. Each one is put in one kind:

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


def computations(hlo_text: str) -> dict[str, list[str]]:
  """{computation name: its instruction lines} of an HLO module's text (bertjax/perf/layercost.py
  reads the layer loops from the same)."""
  comps, current = {}, None
  for line in hlo_text.splitlines():
    match = _COMPUTATION.match(line)
    if match:
      current = match.group(1)
      comps[current] = []
    elif current is not None and line.strip() != "}":
      comps[current].append(line)
  return comps


def classify(hlo_text: str) -> dict[str, str]:
  """{instruction name: kind} for every instruction of the module, fusions by their contents."""
  comps = computations(hlo_text)

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


# The stat naming the HLO instruction an event ran: a GPU kernel's event carries it (its own name is
# the kernel's: a cuBLAS or cuDNN routine, or a fusion's name with a suffix); so may a CPU's.
HLO_OP_STATS = ("hlo_op",)


def event_stat(event, names) -> str | None:
  try:
    stats = list(event.stats)
  except Exception:  # pylint: disable=broad-except  # an event without stats
    return None
  for name, value in stats:
    if str(name) in names:
      return str(value)
  return None


def _is_device_stream(plane, line) -> bool:
  """A GPU's stream line: its events are kernels (and copies) as they ran on the device."""
  return "GPU" in plane.name and line.name.startswith("Stream")


def attribute(planes, kinds: dict[str, str], steps: int) -> tuple[dict[str, float], float]:
  """({instruction: ms per step}, ms per step of device kernels no instruction was found for).

  On a GPU the kernels on its stream lines are the operations as run, each keyed on its HLO
  stat (XLA's "XLA Ops" line holds only the operations launched one by one, not those replayed
  inside command buffers, CUDA graphs: 3.4 of a 75 ms step on an H200); the "XLA Ops" line is
  read where no kernel names an instruction. On a CPU the threads' events are the operations.
  An event is keyed on its stat, else on its own name."""
  per_op, unattributed = collections.Counter(), 0.0
  for plane in planes:
    streams = [line for line in plane.lines if _is_device_stream(plane, line)]
    found = collections.Counter()
    for line in streams:
      for event in line.events:
        name = event_stat(event, HLO_OP_STATS) or event.name
        if name in kinds:
          found[name] += event.duration_ns / 1e6 / steps
        else:
          unattributed += event.duration_ns / 1e6 / steps
    if found:
      per_op.update(found)
      continue
    lines = [line for line in plane.lines if line.name == "XLA Ops"] or [
        line for line in plane.lines if line not in streams]
    for line in lines:
      for event in line.events:
        name = event_stat(event, HLO_OP_STATS) or event.name
        if name in kinds:  # operations only: not the executor's or Python's own events
          per_op[name] += event.duration_ns / 1e6 / steps
  return dict(per_op), unattributed


def summarise(per_op: dict[str, float], kinds: dict[str, str], wall_ms: float,
              unattributed_ms: float = 0.0) -> dict:
  """The figures `print_profile` prints, from `attribute`'s."""
  by_kind = collections.Counter({kind: 0.0 for kind in KINDS})
  for name, ms in per_op.items():
    by_kind[kinds[name]] += ms
  total = sum(by_kind.values()) or 1.0
  top = sorted(per_op.items(), key=lambda item: -item[1])[:12]
  return {"wall_ms_per_step": round(wall_ms, 1),
          "ms_per_step": {k: round(v, 1) for k, v in by_kind.most_common()},
          "share": {k: round(v / total, 3) for k, v in by_kind.most_common()},
          "unattributed_device_ms_per_step": round(unattributed_ms, 1),
          "top": [(round(ms, 1), kinds[name], name) for name, ms in top]}


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
  per_op, unattributed = attribute(data.planes, kinds, steps)
  return summarise(per_op, kinds, wall_ms, unattributed)


def print_profile(result: dict, out=None) -> None:
  # Traced time far below the wall means operations the trace did not itemise: on a GPU, those
  # XLA replays inside command buffers (CUDA graphs) are absent (seen on an H200: 3.4 of 75 ms).
  traced = sum(result["ms_per_step"].values())
  print(f"operations traced: {traced:.1f} ms per step, summed over threads or streams, in a step "
        f"of {result['wall_ms_per_step']:.1f} ms wall ({100 * traced / result['wall_ms_per_step']:.0f}%; "
        "profiled, so slower than untraced)", file=out)
  if result.get("unattributed_device_ms_per_step"):
    print(f"device time of kernels naming no instruction: "
          f"{result['unattributed_device_ms_per_step']:.1f} ms per step", file=out)
  print("time by kind of operation (ms per step, summed over threads):", file=out)
  for kind, ms in result["ms_per_step"].items():
    print(f"  {kind:<12} {ms:9.1f}  {100 * result['share'][kind]:5.1f}%", file=out)
  print("largest operations:", file=out)
  for ms, kind, name in result["top"]:
    print(f"  {ms:9.1f}  {kind:<12} {name}", file=out)
