"""What a compiled train step does per encoder layer, read from the compiled program itself.

XLA's `compiled.cost_analysis()` gives FLOPs and bytes accessed of a whole executable, but it
counts the body of a loop once, not once per iteration: a scanned encoder's twelve layers count
as one. And a cost that grows with the layer count inside each iteration (the CPU's whole stacked
buffer converted at every layer, bertjax/residuals.py) does not show in a single total at all.
So, from the optimised HLO text and XLA's own figures:

  layer_loops     the compiled loops that run the scanned layers: while loops whose known trip
                  count is num_layers / scan_unroll and whose state holds [num_layers, ...] arrays
                  (the forward pass's loop and the backward pass's);
  op_count        operations of a computation (fusions count once; parameters, tuples, bitcasts
                  and constants are plumbing, not operations);
  stack_writes    operations inside those loops that write a whole [num_layers, ...] array other
                  than by updating one layer's slice in place: each is traffic that grows with the
                  layer count, at every layer;
  layer_ops       the operations per layer, scanned (the loops' bodies) or unrolled (the
                  operations named after one middle layer, `layer_i/`);
  honest_cost     the cost with every iteration counted: from two compiles of a scanned step,
                  `scan_unroll` u and 2u (XLA counts a body of u layers, then of 2u), the cost of
                  u layers is their difference.

Used by bertjax.aot (the roofline of a TPU executable), tests/test_layer_cost.py (the step's cost
grows linearly with the layer count) and bertjax/layer_probe.py (the GPU's loop bodies).
"""

from __future__ import annotations

import collections
import math
import re

PLUMBING = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant"}
# An in-place update of one slice: what a stacked buffer should see inside a layer loop.
IN_PLACE = {"dynamic-update-slice"}

_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\(.*?\)|[\w]+\[[\d,]*\](?:\{[^}]*\})?|[\w]+\[\])\s+"
    r"([a-z][\w\-]*)\(")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_BODY = re.compile(r"body=%?([\w.\-]+)")


def computations(hlo_text: str) -> dict[str, list[str]]:
  """{computation name: its instruction lines} of an HLO module's text."""
  comps, current = {}, None
  for line in hlo_text.splitlines():
    match = _COMPUTATION.match(line)
    if match:
      current = match.group(1)
      comps[current] = []
    elif current is not None and line.strip() != "}":
      comps[current].append(line)
  return comps


def instructions(lines: list[str]) -> list[tuple[str, str, str, str]]:
  """(name, shape text, opcode, line) of each instruction among `lines`."""
  out = []
  for line in lines:
    match = _INSTRUCTION.match(line)
    if match:
      out.append((match.group(1), match.group(2), match.group(3), line))
  return out


def op_count(lines: list[str]) -> int:
  return sum(1 for _, _, op, _ in instructions(lines) if op not in PLUMBING)


def _fused(comps: dict[str, list[str]]) -> set[str]:
  """Computations that are the insides of fusions (their operations run as one)."""
  return {callee for lines in comps.values() for _, _, op, line in instructions(lines)
          if op == "fusion" for callee in _CALLS.findall(line)}


def module_op_count(hlo_text: str) -> int:
  """Operations of the whole module as its runtime executes them: a fusion counts once, a loop's
  body once (not once per iteration)."""
  comps = computations(hlo_text)
  fused = _fused(comps)
  return sum(op_count(lines) for name, lines in comps.items() if name not in fused)


def _stacked(shape: str, num_layers: int) -> bool:
  """Whether an array shape (or a tuple's element) has num_layers as its leading dimension."""
  return bool(re.search(rf"(?:^|[(,]\s*)\w+\[{num_layers},", shape))


def layer_loops(hlo_text: str, num_layers: int, scan_unroll: int = 1) -> list[str]:
  """The bodies of the loops that run the scanned layers (forward first, as compiled)."""
  trips = num_layers // scan_unroll  # jax stacks an unrolled scan's arrays as [trips, u, ...]
  bodies = []
  for _, shape, op, line in instructions(hlo_text.splitlines()):
    trip = _TRIP_COUNT.search(line)
    if op == "while" and trip and int(trip.group(1)) == trips and _stacked(shape, trips):
      bodies.append(_BODY.search(line).group(1))
  return bodies


def _root_opcodes(comps: dict[str, list[str]], name: str) -> set[str]:
  """The opcodes a fused computation's result comes from, through tuples and bitcasts."""
  found = instructions(comps.get(name, []))
  by_name = {n: (op, line) for n, _, op, line in found}
  roots = [n for n, _, _, line in found if line.lstrip().startswith("ROOT")]
  out, seen = set(), set()
  while roots:
    name = roots.pop()
    if name in seen or name not in by_name:
      continue
    seen.add(name)
    op, line = by_name[name]
    if op in ("tuple", "bitcast"):
      roots += re.findall(r"%([\w.\-]+)", line.split("(", 1)[1] if "(" in line else "")
    else:
      out.add(op)
  return out


def _bytes(shape: str) -> int:
  """Bytes of an array shape's text (a tuple's elements summed), e.g. "bf16[3,4]" -> 24."""
  total = 0
  for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", shape):
    bits = int(re.sub(r"\D", "", dtype) or 8) if dtype != "pred" else 8
    total += bits // 8 * math.prod(int(d) for d in dims.split(",") if d)
  return total


def stack_writes(hlo_text: str, num_layers: int, scan_unroll: int = 1) -> dict[str, int]:
  """{"opcode:dtype": bytes written per iteration} of the operations of the layer loops that
  write a whole [num_layers, ...] array but not one slice in place (see the module docstring):
  traffic at every layer that grows with the layer count. Empty when there is none."""
  comps = computations(hlo_text)
  writes = collections.Counter()
  trips = num_layers // scan_unroll
  for body in layer_loops(hlo_text, num_layers, scan_unroll):
    for _, shape, op, line in instructions(comps.get(body, [])):
      if op in PLUMBING or not _stacked(shape, trips):
        continue
      callee = _CALLS.search(line)
      roots = _root_opcodes(comps, callee.group(1)) if op == "fusion" and callee else {op}
      if not roots <= IN_PLACE:
        dtype = re.match(r"\(?(\w+)", shape).group(1)
        writes[f"{'+'.join(sorted(roots))}:{dtype}"] += _bytes(shape)
  return dict(writes.most_common())


def layer_ops(hlo_text: str, num_layers: int, scanned: bool, scan_unroll: int = 1) -> int:
  """Operations per encoder layer: the layer loops' bodies (divided by the layers each holds),
  or, unrolled, the operations named after a middle layer."""
  comps = computations(hlo_text)
  if scanned:
    bodies = layer_loops(hlo_text, num_layers, scan_unroll)
    return sum(op_count(comps[b]) for b in bodies) // max(1, scan_unroll)
  layer = num_layers // 2
  fused = _fused(comps)
  return sum(1 for name, lines in comps.items() if name not in fused
             for _, _, op, line in instructions(lines)
             if op not in PLUMBING and re.search(rf"/layer_{layer}/", line))


def cost(compiled) -> dict[str, float]:
  """{"flops", "bytes"} of XLA's cost analysis of a compiled executable (one device's)."""
  analysis = compiled.cost_analysis()
  if isinstance(analysis, (list, tuple)):
    analysis = analysis[0] if analysis else {}
  analysis = analysis or {}
  return {"flops": float(analysis.get("flops", 0.0)),
          "bytes": float(analysis.get("bytes accessed", 0.0))}


def honest_cost(once: dict[str, float], twice: dict[str, float], num_layers: int,
                scan_unroll: int = 1) -> dict[str, float]:
  """The cost with every layer counted, from XLA's costs of the same scanned step compiled with
  `scan_unroll` u (`once`: u layers in the body) and 2u (`twice`): each layer costs
  (twice - once) / u, and `once` holds u of the num_layers."""
  out = {}
  for key in once:
    per_layer = (twice[key] - once[key]) / scan_unroll
    out[key] = once[key] + (num_layers - scan_unroll) * per_layer
    out[f"{key}_per_layer"] = per_layer
  return out
