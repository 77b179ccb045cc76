"""What a compiled train step does per encoder layer, read from the compiled program itself.

XLA's `compiled.cost_analysis()` gives FLOPs and bytes accessed of a whole executable, but it
counts the body of a loop once, not once per iteration: a scanned encoder's twelve layers count
as one. And a cost that grows with the layer count inside each iteration (the CPU's whole stacked
buffer converted at every layer, bertjax/model/residuals.py) does not show in a single total at all.
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
  honest_cost     the cost with every layer counted where jaxlib cannot cost a loop's body alone
                  (bertjax/perf/hlocost.py's program_cost does, from one compile), from two compiles
                  of a scanned step, `scan_unroll` u and k (XLA counts a body of u layers, then of k): the
                  cost of k - u layers is their difference. An upper bound on the bytes: jax's
                  unrolled scan body adds block buffers of its own;
  extrapolate     the cost at any depth from two shallow compiles (N and 2N layers), the step
                  growing linearly with depth (bertjax.aot --roofline_layers).

Used by bertjax.aot (the roofline of a TPU executable), tests/test_layer_cost.py (the step's cost
grows linearly with the layer count) and bertjax/benchmark/layers.py (the GPU's loop bodies).
"""

from __future__ import annotations

import collections
import re

from bertjax.perf import hlotext, opprofile

# An in-place update of one slice: what a stacked buffer should see inside a layer loop.
IN_PLACE = {"dynamic-update-slice"}

_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_BODY = re.compile(r"body=%?([\w.\-]+)")


def op_count(lines: list[str]) -> int:
  return sum(1 for _, _, op, _ in hlotext.parse(lines) if op not in hlotext.PLUMBING)


def _fused(comps: dict[str, list[str]]) -> set[str]:
  """Computations that are the insides of fusions (their operations run as one)."""
  return {callee for lines in comps.values() for _, _, op, line in hlotext.parse(lines)
          if op == "fusion" for callee in _CALLS.findall(line)}


def module_op_count(hlo_text: str) -> int:
  """Operations of the whole module as its runtime executes them: a fusion counts once, a loop's
  body once (not once per iteration)."""
  comps = opprofile.computations(hlo_text)
  fused = _fused(comps)
  return sum(op_count(lines) for name, lines in comps.items() if name not in fused)


def _stacked(shape: str, num_layers: int) -> bool:
  """Whether an array shape (or a tuple's element) has num_layers as its leading dimension."""
  return bool(re.search(rf"(?:^|[(,]\s*)\w+\[{num_layers},", shape))


def layer_loops(hlo_text: str, num_layers: int, scan_unroll: int = 1) -> list[str]:
  """The bodies of the loops that run the scanned layers (forward first, as compiled)."""
  trips = num_layers // scan_unroll  # jax stacks an unrolled scan's arrays as [trips, u, ...]
  comps = opprofile.computations(hlo_text)
  bodies = []
  for _, shape, op, line in hlotext.parse(hlo_text.splitlines()):
    if op == "while" and _stacked(shape, trips) and trips in hlotext.trip_counts(comps, line):
      bodies.append(_BODY.search(line).group(1))
  return bodies


def _roots(comps: dict[str, list[str]], name: str) -> list[tuple[str, str]]:
  """(opcode, shape) of each result of a fused computation, through tuples and bitcasts."""
  found = hlotext.parse(comps.get(name, []))
  by_name = {n: (shape, op, line) for n, shape, op, line in found}
  pending = [n for n, _, _, line in found if line.lstrip().startswith("ROOT")]
  out, seen = [], set()
  while pending:
    name = pending.pop()
    if name in seen or name not in by_name:
      continue
    seen.add(name)
    shape, op, line = by_name[name]
    if op in ("tuple", "bitcast"):
      pending += re.findall(r"%([\w.\-]+)", line[line.index(op + "("):])
    else:
      out.append((op, shape))
  return out


def stack_writes(hlo_text: str, num_layers: int, scan_unroll: int = 1) -> dict[str, int]:
  """{"opcode:dtype": bytes written per iteration} of the operations of the layer loops that
  write a whole [num_layers, ...] array but not one slice in place (see the module docstring):
  traffic at every layer that grows with the layer count. Empty when there is none."""
  comps = opprofile.computations(hlo_text)
  writes = collections.Counter()
  trips = num_layers // scan_unroll
  for body in layer_loops(hlo_text, num_layers, scan_unroll):
    for _, shape, op, line in hlotext.parse(comps.get(body, [])):
      if op in hlotext.PLUMBING or not _stacked(shape, trips):
        continue
      callee = _CALLS.search(line)
      roots = _roots(comps, callee.group(1)) if op == "fusion" and callee else [(op, shape)]
      for root, root_shape in roots:
        if root not in IN_PLACE and _stacked(root_shape, trips):
          dtype = re.match(r"\(?(\w+)", root_shape).group(1)
          writes[f"{root}:{dtype}"] += hlotext.array_bytes(root_shape)
  return dict(writes.most_common())


def layer_ops(hlo_text: str, num_layers: int, scanned: bool, scan_unroll: int = 1) -> int:
  """Operations per encoder layer: the layer loops' bodies (divided by the layers each holds),
  or, unrolled, the operations named after a middle layer."""
  comps = opprofile.computations(hlo_text)
  if scanned:
    bodies = layer_loops(hlo_text, num_layers, scan_unroll)
    return sum(op_count(comps[b]) for b in bodies) // max(1, scan_unroll)
  layer = num_layers // 2
  fused = _fused(comps)
  return sum(1 for name, lines in comps.items() if name not in fused
             for _, _, op, line in hlotext.parse(lines)
             if op not in hlotext.PLUMBING and re.search(rf"/layer_{layer}/", line))


def cost(compiled) -> dict[str, float]:
  """{"flops", "bytes"} of XLA's cost analysis of a compiled executable (one device's)."""
  analysis = compiled.cost_analysis()
  if isinstance(analysis, (list, tuple)):
    analysis = analysis[0] if analysis else {}
  analysis = analysis or {}
  return {"flops": float(analysis.get("flops", 0.0)),
          "bytes": float(analysis.get("bytes accessed", 0.0))}


def second_unroll(num_layers: int, scan_unroll: int = 1) -> int:
  """The scan_unroll k of the second compile `honest_cost` reads: the smallest multiple of
  `scan_unroll` above it that divides num_layers (2 for 12 or 24 layers; all of them for a prime
  count, when the compiled loop disappears and XLA counts every layer itself). A k that does not
  divide num_layers would leave the remainder's layers outside the loop, in neither figure."""
  return next((k for k in range(2 * scan_unroll, num_layers + 1, scan_unroll)
               if num_layers % k == 0), num_layers)


def extrapolate(shallow: dict[str, float], deeper: dict[str, float], depth: int,
                num_layers: int) -> dict[str, float]:
  """The cost at num_layers from the costs of the same step at `depth` and 2 x `depth` layers,
  every layer counted in both (no loop, or a loop XLA unrolled): each layer costs their
  difference over `depth`, the rest of the step is in both once (honest_cost's count, the
  layers here straight code rather than a loop's body)."""
  return honest_cost(shallow, deeper, num_layers, depth, 2 * depth)


def honest_cost(once: dict[str, float], other: dict[str, float], num_layers: int,
                scan_unroll: int = 1, other_unroll: int | None = None) -> dict[str, float]:
  """The cost with every layer counted, from XLA's costs of the same scanned step compiled with
  `scan_unroll` u (`once`: u layers in the loop's body) and k = `other_unroll` (`other`, by
  default `second_unroll`'s): each layer costs (other - once) / (k - u), and `once` holds u of
  the num_layers. Per-iteration costs that are not per layer (the loop's own) count once."""
  k = other_unroll or second_unroll(num_layers, scan_unroll)
  out = {}
  for key in once:
    per_layer = (other[key] - once[key]) / (k - scan_unroll)
    out[key] = once[key] + (num_layers - scan_unroll) * per_layer
    out[f"{key}_per_layer"] = per_layer
  return out
