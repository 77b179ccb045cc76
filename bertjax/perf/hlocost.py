"""XLA's cost of a compiled program instruction by instruction, and the bytes that cross HBM.

XLA's `compiled.cost_analysis()` sums, over every instruction, the bytes of each operand it reads
and each result it writes, in whatever memory they lie. On a TPU, XLA keeps some buffers in the
chip's own memory (memory space 1, `S(1)` in a layout: VMEM), moving them there with copies of
their own (`copy-start`/`copy-done`, `slice-start`). Such a buffer counts three times in XLA's
total: the copy's read from HBM, its write into VMEM, and each read of an operation that uses it
there, where HBM saw one read. A bandwidth roofline wants the bytes that cross HBM alone (the
known-answer cases are `bertjax.perf.roofline.check_cost_model`'s; docs/performance.md).

So, from the optimised module's text:

  instruction_costs  each instruction of a computation costed by XLA's HloCostAnalysis on its
                     own (a module of that one instruction, its operands as parameters), with the
                     bytes of each operand and of each result, and where each of them lies;
  program_cost       the whole program: the entry's instructions, a loop's body times its trip
                     count, a called computation's own; {"flops", "bytes" (XLA's way: every memory),
                     "hbm_bytes" (the operands and results in HBM alone), "opaque"}. A custom call
                     (a Pallas kernel) whose backend config carries its own cost estimate counts by
                     it; one without counts its bytes and, as FLOPs, what `opaque_flops` says (the
                     caller knows the kernel); the names of those it could not count are in
                     "opaque".

The analysis runs through the CPU client whatever platform compiled the module: jaxlib's parser
and HloCostAnalysis are XLA's own, the same on every platform (on a TPU train step's entry: 7.48
GB where libtpu's own analysis of the executable gives 7.75; a layer's body 2.74 GB against 2.75).
"""

from __future__ import annotations

import functools
import json
import re
from typing import Callable

from bertjax.perf import hlotext

_KEY = re.compile(r"^bytes accessed(\d+|out)\{([\d,]*)\}$")
# (the custom call's line, its operands' shapes, its result's shape) -> the kernel's FLOPs, or
# None for a kernel the caller does not know.
OpaqueFlops = Callable[[str, list, str], "float | None"]

# Custom calls that are kernels of their own (Pallas on TPU and GPU, Triton): XLA sees no
# FLOPs inside them (it says -1). Other custom calls of a TPU program are views and hints
# (ConcatBitcast, AssumeGatherIndicesInBound): bytes alone.
_KERNEL_TARGETS = re.compile(r'custom_call_target="(tpu_custom_call|mosaic_gpu\w*|'
                             r'__gpu\$xla\.gpu\.triton|triton_kernel_call)"')
# The second half of an asynchronous pair: its traffic is counted at the start.
_DONE = re.compile(r"-(done|update)$")


def _hbm_fraction(shape: str) -> float:
  whole = hlotext.array_bytes(shape)
  return hlotext.array_bytes(shape, "hbm") / whole if whole else 0.0


def analyse(module_text: str) -> dict | None:
  """XLA's HloCostAnalysis of a module's text through the CPU client: its properties (flops,
  "bytes accessed", and per operand "bytes accessed{i}{index}", per result
  "bytes accessedout{index}"), or None where jaxlib cannot parse or cost it."""
  try:
    import jax  # pylint: disable=import-outside-toplevel
    # Private on purpose: jax 0.10.2 has no public way to parse HLO text or to cost a module
    # (jax.extend.mlir.hlo_to_stablehlo takes a proto, and compiling a piece again would fuse it
    # anew for the CPU, not cost the TPU's). Without them callers count another way or say so
    # (tests/test_layer_cost.py and tests/test_hlocost.py hold that fallback).
    from jax._src.lib import xla_client  # pylint: disable=import-outside-toplevel
    # The stack frames the metadata points at are the whole module's, not this text's.
    module_text = re.sub(r"\s*stack_frame_id=\d+", "", module_text)
    module = xla_client.hlo.hlo_module_from_text(module_text)
    return dict(xla_client._xla.hlo_module_cost_analysis(  # pylint: disable=protected-access
        jax.devices("cpu")[0].client, module))
  except (AttributeError, ImportError, RuntimeError, ValueError):
    return None


def _alone(header: str, comps: dict[str, list[str]], shapes: dict[str, str], line: str,
           opcode: str) -> tuple[str, list[str]]:
  """A module holding `line`'s instruction alone, its operands as parameters (one for each
  distinct operand); and the names of its operands in order, repeats included (XLA's analysis
  numbers operands so)."""
  operands = [o for o in hlotext.operands(line, opcode) if o in shapes]
  params, body = [], line
  for i, name in enumerate(dict.fromkeys(operands)):
    params.append(f"  %p.{i} = {shapes[name]} parameter({i})")
    body = re.sub(rf"%{re.escape(name)}(?=[,)\s])", f"%p.{i}", body)
  # Ordering among the old computation's instructions means nothing alone.
  body = re.sub(r",\s*control-predecessors=\{[^}]*\}", "", body)
  body = "  ROOT " + re.sub(r"^\s*ROOT\s+", "", body).strip()
  called = hlotext.reachable(comps, hlotext.called(line))
  text = [header] + [l for c in called for l in comps[c]] + ["ENTRY %alone {"] + params + [body,
                                                                                           "}"]
  # A called computation printed as the old entry keeps no ENTRY mark.
  return "\n".join(l[6:] if l.startswith("ENTRY ") and l != "ENTRY %alone {" else l
                   for l in text), operands


def _own_estimate(line: str) -> dict | None:
  """A custom call's cost estimate in its backend config (Pallas' `cost_estimate`)."""
  found = re.search(r'"cost_estimate"\s*:\s*(\{[^}]*\})', line)
  if not found:
    return None
  try:
    estimate = json.loads(found.group(1))
  except ValueError:
    return None
  return {"flops": float(estimate.get("flops", 0)),
          "bytes": float(estimate.get("bytes_accessed", estimate.get("bytesAccessed", 0)))}


def _hbm_of(analysis: dict, operand_shapes: list[str], result_shape: str) -> float:
  """The bytes of `analysis` (one instruction's) that lie in HBM: each operand's and result's
  count where that buffer is in memory space 0. A tuple's count is given whole ("{}") and by
  element ("{0}", "{1}"): the elements are read where they are given."""
  keys = {}
  for key, value in analysis.items():
    found = _KEY.match(key)
    if found:
      keys[found.groups()] = max(0.0, value)
  leaves = {(which, index): value for (which, index), value in keys.items()
            if not any(w == which and i != index and i.startswith(index + "," if index else "")
                       for w, i in keys)}
  # A fusion's analysis may number inputs past its operands (a dynamic slice's indices inside
  # it): those are read where the operands are, on the whole.
  inputs = _hbm_fraction(" ".join(operand_shapes))
  hbm = counted = 0.0
  for (which, index), value in leaves.items():
    if which != "out" and int(which) >= len(operand_shapes):
      hbm += value * inputs
    else:
      shape = result_shape if which == "out" else operand_shapes[int(which)]
      hbm += value * _hbm_fraction(hlotext.sub_shape(shape, index))
    counted += value
  whole = max(0.0, analysis.get("bytes accessed", 0.0))
  if counted > whole > 0:  # an in-place update's operand, counted whole, is not all read
    return hbm * whole / counted
  return hbm + (whole - counted) * _hbm_fraction(result_shape)


def _async_copy_hbm(opcode: str, shape: str, operand_shapes: list[str]) -> float:
  """The HBM bytes of a copy between memories (copy-start, slice-start): what it reads from its
  source where that is HBM, and writes to its destination (the result tuple's first element, a
  slice's second) where that is HBM."""
  parts = hlotext.elements(shape)
  dest = parts[1] if opcode == "slice-start" and len(parts) > 1 else parts[0]
  source = operand_shapes[0] if operand_shapes else dest
  return hlotext.array_bytes(dest) * _hbm_fraction(source) + hlotext.array_bytes(dest, "hbm")


def instruction_costs(hlo_text: str, computation: str,
                      opaque_flops: OpaqueFlops | None = None) -> list[dict]:
  """Each instruction of `computation` with its cost ({"name", "opcode", "shape", "flops",
  "bytes", "hbm_bytes", "op_name", "calls"}); loops, calls and conditionals carry the
  computations they run in "calls" and no cost of their own (program_cost adds them)."""
  comps = hlotext.blocks(hlo_text)
  header = re.sub(r"^(HloModule [\w.\-]+).*", r"\1", hlo_text.split("\n", 1)[0])
  found = hlotext.parse(comps[computation][1:])
  shapes = {name: shape for name, shape, _, _ in found}
  out = []
  for name, shape, opcode, line in found:
    if opcode in hlotext.PLUMBING:
      continue
    op_name = re.search(r'op_name="([^"]*)"', line)
    row = {"name": name, "opcode": opcode, "shape": shape,
           "op_name": op_name.group(1) if op_name else "", "calls": []}
    if opcode in ("while", "call", "conditional", "async-start"):
      row.update(flops=0.0, bytes=0.0, hbm_bytes=0.0, calls=hlotext.called(line))
      if opcode == "while":
        row.update(trips=hlotext.trip_count(comps, line, computation),
                   calls=[hlotext.BODY.search(line).group(1)])
      out.append(row)
      continue
    if _DONE.search(opcode):
      # Costed alone it has no start to pair with; XLA counts its result once.
      row.update(flops=0.0, bytes=float(hlotext.array_bytes(shape)), hbm_bytes=0.0)
      out.append(row)
      continue
    module, operands = _alone(header, comps, shapes, line, opcode)
    operand_shapes = [shapes[o] for o in operands]
    analysis = analyse(module)
    if analysis is None:
      raise ValueError(f"XLA's cost analysis could not cost {name} ({opcode}) of {computation}")
    # XLA says -1 where it cannot tell (a custom call's view of a buffer): nothing moves.
    row.update(flops=max(0.0, float(analysis.get("flops", 0.0))),
               bytes=max(0.0, float(analysis.get("bytes accessed", 0.0))),
               hbm_bytes=(_async_copy_hbm(opcode, shape, operand_shapes)
                          if opcode in ("copy-start", "slice-start")
                          else _hbm_of(analysis, operand_shapes, shape)))
    if opcode == "custom-call" and _KERNEL_TARGETS.search(line):
      # XLA's analysis knows nothing of a kernel's traffic (it says -1): its operands read once
      # and its results written once, where no estimate of its own says otherwise.
      io = operand_shapes + [shape]
      row.update(flops=0.0, bytes=float(sum(hlotext.array_bytes(x) for x in io)),
                 hbm_bytes=float(sum(hlotext.array_bytes(x, "hbm") for x in io)))
      own = _own_estimate(line)
      flops = _kernel_flops(line, operand_shapes, shape, opaque_flops)
      if own:
        scale = row["hbm_bytes"] / row["bytes"] if row["bytes"] else 1.0
        row.update(bytes=own["bytes"], hbm_bytes=own["bytes"] * scale)
      if flops is None:
        row["opaque"] = True
      else:
        row["flops"] = float(flops)
    elif opcode == "fusion":
      # XLA may fuse a kernel with what its results feed (a kernel's output written into a
      # scanned loop's stack): the fusion's bytes are its own operands and results, but XLA
      # counts no FLOPs for the kernel inside it, so they are added here.
      inner = _fused_kernels(comps, line)
      if inner:
        flops = [_kernel_flops(k_line, k_operands, k_shape, opaque_flops)
                 for k_line, k_operands, k_shape in inner]
        row["flops"] += sum(f for f in flops if f is not None)
        if None in flops:
          row["opaque"] = True
    out.append(row)
  return out


def _kernel_flops(line: str, operand_shapes: list[str], shape: str,
                  opaque_flops: OpaqueFlops | None) -> float | None:
  """A kernel's FLOPs: its own estimate's, or what `opaque_flops` says, or None (unknown)."""
  own = _own_estimate(line)
  if own:
    return own["flops"]
  return opaque_flops(line, operand_shapes, shape) if opaque_flops else None


def _fused_kernels(comps: dict[str, list[str]], line: str) -> list[tuple[str, list[str], str]]:
  """(line, operands' shapes, result's shape) of each kernel custom call inside the computations
  a fusion runs."""
  out = []
  for name in hlotext.reachable(comps, hlotext.called(line)):
    found = hlotext.parse(comps[name][1:])
    shapes = {n: shape for n, shape, _, _ in found}
    out += [(l, [shapes[o] for o in hlotext.operands(l, op) if o in shapes], shape)
            for _, shape, op, l in found if op == "custom-call" and _KERNEL_TARGETS.search(l)]
  return out


def program_rows(hlo_text: str, opaque_flops: OpaqueFlops | None = None,
                 default_trips: int = 1) -> list[dict]:
  """`instruction_costs`'s rows for every computation the program runs, each with "times" (how
  often it runs a step: its loops' trip counts multiplied; a loop of unknown trip count taken
  `default_trips` times, its row marked "unknown_trips") and "computation". Raises ValueError
  where XLA's analysis cannot cost an instruction (jaxlib without the parser)."""
  comps = hlotext.blocks(hlo_text)
  costed = functools.lru_cache(maxsize=None)(
      lambda name: instruction_costs(hlo_text, name, opaque_flops))
  out = []

  def runs(row: dict) -> int:  # how often a row's callees run each time it does
    return (row["trips"] or default_trips) if row["opcode"] == "while" else 1

  @functools.lru_cache(maxsize=None)
  def whole(computation: str, key: str) -> float:
    """`key` of a computation with all it runs (a conditional's dearest branch)."""
    cost = 0.0
    for row in costed(computation):
      inner = [whole(c, key) for c in row["calls"] if c in comps]
      cost += row[key] + (max(inner, default=0.0) if row["opcode"] == "conditional"
                          else sum(inner) * runs(row))
    return cost

  def visit(computation: str, times: int) -> None:
    for row in costed(computation):
      out.append(dict(row, times=times, computation=computation))
      callees = [c for c in row["calls"] if c in comps]
      if row["opcode"] == "conditional" and callees:
        # One branch runs, which the program alone does not say (ModernBERT's global and local
        # layers in one scanned loop): its rows are the branch of most HBM bytes with all it
        # runs, and a row of its own adds the FLOPs by which another branch has more. An upper
        # bound on both; marked, for the figures to say so.
        callees = [max(callees, key=lambda c: whole(c, "hbm_bytes"))]
        extra = max(whole(c, "flops") for c in row["calls"] if c in comps) \
            - whole(callees[0], "flops")
        if extra > 0:
          out.append(dict(row, name=row["name"] + ".dearest_flops", flops=extra, calls=[],
                          times=times, computation=computation, upper_bound=True))
      for callee in callees:
        visit(callee, times * runs(row))

  visit(hlotext.entry_name(hlo_text), 1)
  return out


def total(rows: list[dict]) -> dict:
  """{"flops", "bytes" (XLA's way: every memory), "hbm_bytes" (HBM's alone), "opaque" (kernels
  whose FLOPs nothing counted), "unknown_trips" (loops counted a default number of times),
  "upper_bound" (conditionals whose branches cost differently, counted by the dearest)} of
  `program_rows`' rows (or some of them), each as often as it runs."""
  out = {key: sum(r["times"] * r[key] for r in rows) for key in ("flops", "bytes", "hbm_bytes")}
  out["opaque"] = [r["name"] for r in rows if r.get("opaque")]
  out["unknown_trips"] = [r["name"] for r in rows if r["opcode"] == "while" and not r.get("trips")]
  out["upper_bound"] = sorted({r["name"].rsplit(".dearest", 1)[0] for r in rows
                               if r.get("upper_bound")})
  return out


def program_cost(hlo_text: str, opaque_flops: OpaqueFlops | None = None,
                 default_trips: int = 1) -> dict:
  """`total` of the whole program: every instruction of the entry, every iteration of its loops,
  each called computation's instructions (`program_rows`)."""
  return total(program_rows(hlo_text, opaque_flops, default_trips))
