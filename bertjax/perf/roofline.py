"""The roofline of a compiled train step, from XLA's cost analysis: its FLOPs at a chip's peak
against its bytes at the chip's HBM bandwidth, every layer counted (XLA counts a loop's body
once), and the operations per layer. `python -m bertjax.aot` prints it beside its memory check."""

from __future__ import annotations

import dataclasses
import math
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from bertjax.model.config import BertConfig
from bertjax.parallel import sharding
from bertjax.perf import hlocost, hlotext, layercost
from bertjax.training import flops as flops_lib, train


def round4(x: float) -> float:
  return float(f"{x:.4g}")  # 4 significant digits: figures span 1e-4 (tiny) to 1e6


def roofline(flops_per_chip: float, bytes_per_chip: float, peak_tflops: float,
             hbm_gbps: float) -> dict:
  """The step time a chip's roofline allows: its FLOPs at the peak rate against its bytes at the
  HBM bandwidth; the larger bounds it."""
  compute_s = flops_per_chip / (peak_tflops * 1e12)
  memory_s = bytes_per_chip / (hbm_gbps * 1e9)
  return {"roofline_compute_s": round4(compute_s), "roofline_memory_s": round4(memory_s),
          "roofline_step_s": round4(max(compute_s, memory_s)),
          "roofline_bound": "compute" if compute_s >= memory_s else "memory"}


def step_roofline(layers: dict, model_flops_per_chip: float, peak_tflops: float,
                  hbm_gbps: float, bound: dict | None = None) -> dict:
  """The roofline of a step from its figures with every layer counted (`layer_figures`): its
  FLOPs at the peak against its HBM bytes at the bandwidth (XLA's bytes where nothing counted
  HBM's alone, which on a TPU overstates them: "roofline_bytes" says which), the model's FLOPs
  over that time (roofline MFU), and each count of bytes over `bound` (bytes_bound's)."""
  hbm = layers.get("hbm_gb_per_chip_all_layers")
  gb = layers["xla_gb_per_chip_all_layers"] if hbm is None else hbm
  out = roofline(layers["xla_tflop_per_chip_all_layers"] * 1e12, gb * 1e9, peak_tflops, hbm_gbps)
  out["roofline_bytes"] = ("HBM's alone" if hbm is not None
                           else "XLA's, every memory (no HBM count: an overstatement on a TPU)")
  out["roofline_mfu"] = round(model_flops_per_chip / (peak_tflops * 1e12)
                              / out["roofline_step_s"], 3)
  if bound:
    out.update(bound)
    out["xla_over_bound"] = round(layers["xla_gb_per_chip_all_layers"]
                                  / bound["bound_gb_per_chip"], 2)
    if hbm is not None:
      out["hbm_over_bound"] = round(hbm / bound["bound_gb_per_chip"], 2)
    if layers.get("hbm_gb_per_layer") is not None:
      out["hbm_over_bound_per_layer"] = round(layers["hbm_gb_per_layer"]
                                              / bound["bound_gb_per_layer"], 2)
  return out


# `all_layers_counted_as`: how the figures counted every layer.
EVERY_INSTRUCTION = "every instruction costed alone, each loop body once per iteration"
BODY_ONCE = "each layer loop's body once, not every layer"


def _counted(compiled, opaque_flops=None, num_layers: int = 0, scan_unroll: int = 1):
  """hlocost.program_cost of a compiled step, with each layer's share where its layers run in
  loops (`num_layers` > 0: what the layer loops' bodies, and all they call, cost a step, over
  the layers); None where jaxlib cannot cost its instructions alone (then XLA's count of the
  executable serves, without an HBM figure)."""
  text = compiled.as_text()
  try:
    rows = hlocost.program_rows(text, opaque_flops)
  except ValueError:
    return None
  cost = hlocost.total(rows)
  cost["by_part"] = dict(bytes_by_part(rows)[:8])
  bodies = layercost.layer_loops(text, num_layers, scan_unroll) if num_layers else []
  if bodies:
    inside = set(hlotext.reachable(hlotext.blocks(text), bodies))
    per_layer = hlocost.total([r for r in rows if r["computation"] in inside])
    cost.update({f"{key}_per_layer": per_layer[key] / num_layers for key in ("bytes", "hbm_bytes")})
  return cost


def _figures(cost: dict, counted_as: str) -> dict:
  out = {"xla_tflop_per_chip_all_layers": round4(cost["flops"] / 1e12),
         "xla_gb_per_chip_all_layers": round4(cost["bytes"] / 1e9)}
  if cost.get("hbm_bytes") is not None:
    out["hbm_gb_per_chip_all_layers"] = round4(cost["hbm_bytes"] / 1e9)
  for key in ("bytes", "hbm_bytes"):
    if cost.get(f"{key}_per_layer") is not None:
      name = "xla_gb_per_layer" if key == "bytes" else "hbm_gb_per_layer"
      out[name] = round4(cost[f"{key}_per_layer"] / 1e9)
  if cost.get("by_part"):
    out["hbm_gb_by_part"] = cost["by_part"]
  if cost.get("opaque"):  # kernels whose FLOPs nothing could count: the figure is short of them
    out["uncounted_kernels"] = sorted(set(cost["opaque"]))
  if cost.get("upper_bound"):  # a branch the program alone cannot name, counted by the dearest
    out["conditionals_counted_by_dearest_branch"] = cost["upper_bound"]
  out["all_layers_counted_as"] = counted_as
  return out


def layer_figures(training: train.Training, compiled, second=None, opaque_flops=None) -> dict:
  """XLA's FLOPs and bytes per chip with every layer counted, the bytes among them that cross
  HBM, and the operations per layer.

  Every instruction is costed alone and each loop's body once per iteration
  (hlocost.program_cost): XLA's bytes (every memory) and HBM's alone, which the roofline takes.
  Where jaxlib cannot cost an instruction alone: XLA's count of the executable, a scanned step's
  layers from `second`, the step compiled with layercost.second_unroll's k layers per iteration
  (layercost.honest_cost, an upper bound), or without it each body once (BODY_ONCE); no HBM
  figure then. `opaque_flops` counts a kernel XLA cannot see into (hlocost)."""
  mc = training.model_config
  text = compiled.as_text()
  cost = _counted(compiled, opaque_flops, mc.num_layers if mc.scan_layers else 0,
                  mc.scan_unroll)
  counted = EVERY_INSTRUCTION
  if cost is None:
    cost, counted = layercost.cost(compiled), "XLA's count of the executable"
    if mc.scan_layers and mc.scan_unroll < mc.num_layers:
      cost, counted = (
          (cost, BODY_ONCE) if second is None else
          (layercost.honest_cost(cost, layercost.cost(second), mc.num_layers, mc.scan_unroll),
           "a second compile's extra layers (an upper bound on the bytes)"))
  out = _figures(cost, counted)
  out["ops_per_layer"] = layercost.layer_ops(text, mc.num_layers, mc.scan_layers,
                                             mc.scan_unroll)
  if mc.scan_layers:
    # Writes of whole [layers, ...] buffers inside the layer loops: traffic at every layer that
    # grows with the depth (the CPU's bfloat16 conversion was one); none expected.
    out["whole_stack_writes_per_layer"] = layercost.stack_writes(text, mc.num_layers,
                                                                 mc.scan_unroll)
  return out


def extrapolated_layer_figures(training: train.Training, shallow, deeper, depth: int,
                               opaque_flops=None) -> dict:
  """`layer_figures` for the whole depth from the step compiled at `depth` (`shallow`) and
  2 x `depth` layers (`deeper`), each with its layers as straight code (no loop): each layer costs
  (deeper - shallow) / depth, and the rest of the step, the same in both (embeddings, heads, the
  optimizer's update of what is not a layer), counts once. The compiled step grows linearly with
  the layer count (tests/test_layer_cost.py)."""
  mc = training.model_config
  costs = [_counted(c, opaque_flops) for c in (shallow, deeper)]
  counted = EVERY_INSTRUCTION
  if None in costs:
    costs, counted = [layercost.cost(c) for c in (shallow, deeper)], "XLA's count"
  keys = [k for k in ("flops", "bytes", "hbm_bytes") if k in costs[0]]
  total = layercost.extrapolate(*[{k: c[k] for k in keys} for c in costs], depth, mc.num_layers)
  total["opaque"] = costs[1].get("opaque")  # (by part: only a whole step's own compile says)
  out = _figures(total, counted)
  out["ops_per_layer"] = (layercost.module_op_count(deeper.as_text())
                          - layercost.module_op_count(shallow.as_text())) // depth
  out["roofline_layers"] = (f"extrapolated from {depth} and {2 * depth} layers compiled as "
                            f"straight code to {mc.num_layers}")
  return out


def _per_chip_bytes(tree) -> int:
  """Bytes of one device's shard of each array of an abstract tree (whole where unsharded)."""
  total = 0
  for x in jax.tree.leaves(tree):
    shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) else x.shape
    total += math.prod(shape) * np.dtype(x.dtype).itemsize
  return total


def _gathered_bytes(tree, itemsize: int) -> int:
  """Bytes, in the compute dtype, of what a chip computes with but does not hold: of each array
  split over more than the tensor axis (fsdp), the rest of its tensor-axis share, which the chip
  gathers for its matmuls."""
  total = 0
  for x in jax.tree.leaves(tree):
    sharding = getattr(x, "sharding", None)
    if sharding is None or not hasattr(sharding, "spec"):
      continue
    sizes = dict(sharding.mesh.shape)
    tensor = math.prod(sizes[axis] for entry in sharding.spec if entry is not None
                       for axis in ((entry,) if isinstance(entry, str) else entry)
                       if axis == "tensor")
    own = math.prod(sharding.shard_shape(x.shape))
    total += (math.prod(x.shape) // tensor - own) * itemsize
  return total


def residual_bytes(model_config: BertConfig, num_layers: int, rows: int, seq_len: int,
                    max_predictions: int, per_row: int) -> int:
  """Bytes of what the backward pass keeps from the forward (jax's residuals of the loss's vjp, at
  the config's remat policy), for `rows` rows and `num_layers` straight layers."""
  # The logits are the bound's own term (bytes_bound): measured without them, whichever way the
  # config's head keeps them (automatic differentiation keeps the float32 logits).
  config = dataclasses.replace(model_config, num_layers=num_layers, scan_layers=False,
                               recompute_mlm_logits=True)
  model = train.PRETRAINING.make_model(config)
  batch = train.dummy_batch(rows, seq_len, max_predictions, per_row)
  inputs = train.model_inputs(batch)
  params = jax.eval_shape(lambda r: model.init({"params": r}, **inputs, deterministic=True),
                          jax.random.PRNGKey(0))["params"]
  denominators = train.PRETRAINING.denominators(batch)
  loss = lambda p: train.loss_fn(p, model, batch, jax.random.PRNGKey(0), denominators)[0]
  pullback = jax.eval_shape(lambda p: jax.vjp(loss, p)[1], nn.unbox(params))
  return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(pullback))


# XLA makes elementwise work again from what the step keeps, unasked: a step that keeps every
# residual (remat "none") need not write them all (BERT-Base L 128 on v5e-8, straight layers,
# moves 4.82 GB a chip against 7.43 counted at "none"'s residuals; docs/performance.md, "The
# analytic floor"). It does not run a matmul or a kernel twice of its own accord, so the floor
# counts at most the activations this policy keeps: every matmul's output and the kernels'.
FLOOR_POLICY = "dots_kernels"


def _residual_shares(mc: BertConfig, seq_len: int, max_predictions: int,
                     per_row: int) -> tuple[int, int]:
  """(a row's residual bytes outside the layers, a row's in each layer) at mc's remat policy:
  from one and two rows and layers, so that what does not grow with rows drops out."""
  residual = {(r, n): residual_bytes(mc, n, r, seq_len, max_predictions, per_row)
              for r in (1, 2) for n in (1, 2)}
  per_row_layer = residual[2, 2] - residual[2, 1] - residual[1, 2] + residual[1, 1]
  return (residual[2, 1] - residual[1, 1]) - per_row_layer, per_row_layer


def _floor_shares(mc: BertConfig, seq_len: int, max_predictions: int,
                  per_row: int) -> tuple[int, int]:
  """_residual_shares at mc's remat policy, or at FLOOR_POLICY where that keeps fewer."""
  return min((_residual_shares(dataclasses.replace(mc, remat_policy=p),
                               seq_len, max_predictions, per_row)
              for p in {mc.remat_policy, FLOOR_POLICY}),
             key=lambda shares: shares[0] + mc.num_layers * shares[1])


def bytes_bound(training: train.Training, seq_len: int, max_predictions: int,
                per_row: int = 0) -> dict:
  """An analytic floor on the HBM bytes a chip moves in one train step: its parameters, their
  gradients and the optimizer state each read and written once (its own shard of each); with
  the state split (fsdp), the weights it gathers for its matmuls (written by the gather, read
  once) and their gradients before the reduce-scatter (written once, read once), in the compute
  dtype; the activations the backward keeps written once and read once; the MLM head's logits
  written once and read once where the backward keeps them (none where it makes them again);
  the batch read once. Per layer and for the whole step.

  The activations are jax's own residuals of the loss at the config's remat policy, or at
  FLOOR_POLICY where that keeps fewer, measured on one and two rows and one and two layers (so a
  row's and a layer's share are their differences, and what does not grow with rows, the
  parameters the backward reuses, drops out)."""
  mc, tc = training.model_config, training.train_config
  rows = tc.batch_size // sharding.batch_axis_size(training.mesh)
  state = training.abstract_state
  params = _per_chip_bytes(state.params)
  layer_leaves = [x for path, x in jax.tree_util.tree_leaves_with_path(state.params)
                  if re.search(r"layer", jax.tree_util.keystr(path))]
  layer_params = _per_chip_bytes(layer_leaves) / mc.num_layers
  opt = _per_chip_bytes(state.opt_state)
  # Read and written once each: parameters, gradients (their size), optimizer state.
  state_bytes = 2 * (2 * params + opt)
  layer_state = 2 * layer_params * (2 + opt / params)
  itemsize = jnp.dtype(mc.dtype).itemsize
  gathered = 4 * _gathered_bytes(state.params, itemsize)
  layer_gathered = 4 * _gathered_bytes(layer_leaves, itemsize) / mc.num_layers
  per_row_rest, per_row_layer = _floor_shares(mc, seq_len, max_predictions, per_row)
  activations = 2 * rows * (per_row_rest + mc.num_layers * per_row_layer)
  # Kept for the backward, the float32 logits are written once and read once; made again in
  # it (recompute_mlm_logits), a TPU's step need never write them (mlm_kernel's forward and
  # mlm_grads' backward make and read them in VMEM), and the floor counts none.
  logits = 0 if mc.recompute_mlm_logits else 2 * rows * max_predictions * mc.vocab_size * 4
  batch = rows * sum(x.nbytes // x.shape[0] for x in
                     train.dummy_batch(1, seq_len, max_predictions, per_row).values())
  total = state_bytes + gathered + activations + logits + batch
  return {"bound_gb_per_chip": round4(total / 1e9),
          "bound_gb_per_layer": round4(
              (layer_state + layer_gathered + 2 * rows * per_row_layer) / 1e9),
          "bound_parts_gb": {"state": round4(state_bytes / 1e9),
                             "gathered_weights": round4(gathered / 1e9),
                             "activations": round4(activations / 1e9),
                             "mlm_logits": round4(logits / 1e9)}}


def _known_cases(n: int, m: int, dtype) -> list[tuple]:
  """(name, function, argument shapes (sharded over the devices or not), FLOPs a chip, HBM bytes a
  chip that the work needs, whether it must be compute-bound) of the cost model's known-answer
  cases on `n` devices at matmul size `m`: large enough that a TPU's roofline is clearly on one
  side (a square bf16 matmul of m has m / 3 FLOPs a byte, 1,365 at 4,096; the ridge points of the
  chips in flops.CHIPS are 166-560)."""
  rows, size = 4 * m, np.dtype(dtype).itemsize
  mm, f32 = dtype, jnp.float32
  return [
      ("matmul", lambda a, b: a @ b, [((n * m, m), mm, True), ((m, m), mm, False)],
       2 * m**3, 3 * m * m * size, True),
      ("elementwise", lambda a, b: a * 2 + b,
       [((n * rows, 1024), f32, True), ((n * rows, 1024), f32, True)], 2 * rows * 1024,
       3 * rows * 1024 * 4, False),
      # A matmul whose large operand a TPU's compiler prefetches into the chip's own memory: XLA's
      # bytes count the copy's read, its write and the matmul's read (hlocost's docstring).
      ("prefetched matmul", lambda a, b: a @ b,
       [((n * 2 * m, m), mm, True), ((m, m // 2), mm, False)], 2 * (2 * m) * m * (m // 2),
       (2 * m * m + m * m // 2 + 2 * m * m // 2) * size, True),
  ]


def check_cost_model(devices, tolerance: float = 0.05, size: int = 4096,
                     dtype=jnp.bfloat16) -> list[dict]:
  """XLA's cost analysis and bertjax's HBM count on cases whose answer is known, compiled for
  `devices` (a TPU slice's compile-only devices, or CPUs): each case's FLOPs and bytes over the
  known figures, the roofline MFU of the compute-bound case, and whether the HBM count and the
  FLOPs are within `tolerance` of the answer (and the matmul's roofline of 1.0). Trust the
  roofline of a train step only where every case is "ok". The matmuls are in `dtype` (a CPU
  computes a bfloat16 matmul in float32, converting its operands: float32 there)."""
  mesh = jax.sharding.Mesh(np.array(devices), ("chips",))
  kind = devices[0].device_kind
  peak, bandwidth = flops_lib.peak_tflops(kind), flops_lib.hbm_gbps(kind)
  out = []
  for name, fn, shapes, want_flops, want_bytes, compute_bound in _known_cases(len(devices), size, dtype):
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec("chips" if split else None)))
        for shape, dtype, split in shapes]
    compiled = jax.jit(fn).lower(*args).compile()
    counted = hlocost.program_cost(compiled.as_text())
    row = {"case": name, "flops_over_known": round(counted["flops"] / want_flops, 3),
           "xla_bytes_over_known": round(counted["bytes"] / want_bytes, 3),
           "hbm_bytes_over_known": round(counted["hbm_bytes"] / want_bytes, 3)}
    ok = (abs(row["flops_over_known"] - 1) <= tolerance
          and abs(row["hbm_bytes_over_known"] - 1) <= tolerance)
    if peak and bandwidth:
      bound = roofline(counted["flops"], counted["hbm_bytes"], peak, bandwidth)
      row["roofline_mfu"] = round(want_flops / (peak * 1e12) / bound["roofline_step_s"], 3)
      by_xla = roofline(counted["flops"], counted["bytes"], peak, bandwidth)
      row["roofline_mfu_by_xla_bytes"] = round(
          want_flops / (peak * 1e12) / by_xla["roofline_step_s"], 3)
      ok = ok and (row["roofline_mfu"] >= 1 - tolerance) == compute_bound
    row["ok"] = ok
    out.append(row)
  return out


# The part of the step an instruction belongs to, from the name jax gives it (its op_name):
# (part, pattern), first match wins; the backward pass's names wrap the forward's in transpose().
_PARTS = (("attention dropout bits", r"/attention/.*(threefry|_where|broadcast_in_dim|shift)"),
          ("attention scores and softmax", r"/attention/(bqnk|bnqs|sub|exp|reduce_max|div|ge"
                                           r"|jit\(_where\)|select|add|convert_element_type)"),
          # attention._projections: q, k and v as one product (qkv_product "one").
          ("attention projections", r"/attention/(query|key|value|output|attention\._projections)"),
          ("attention kernel", r"splash|dot_product_attention|fused_attention"),
          # A post-norm layer's attention end by end_kernel.py: projection, dropout, sum, norm.
          ("attention end kernel", r"fused_end"),
          ("MLP", r"/mlp/"), ("hidden dropout", r"[Dd]ropout"), ("LayerNorm", r"layer_norm"),
          ("embeddings", r"/embeddings/"), ("MLM head", r"/mlm/|cls/predictions"),
          ("NSP head and pooler", r"/nsp|/pooler"),
          ("layer loop: stacks in and out", r"dynamic_update_slice|dynamic_slice|/while/"),
          ("loss", r"log_softmax|integer_pow|reduce_sum|/neg"))


def part_of(row: dict) -> str:
  """Where in the step an instruction of `hlocost.program_rows` belongs: a part of the model
  (forward or backward), the optimizer's update (named outside the model), or a move between
  memories or chips that jax did not name."""
  name = row["op_name"]
  if not name:
    return ("collectives" if row["opcode"].startswith(("all-", "reduce-scatter", "collective"))
            else "copies between memories (unnamed)")
  for part, pattern in _PARTS:
    if re.search(pattern, name):
      return part + (" (backward)" if "transpose(" in name else "")
  if "jvp(" not in name:
    return "optimizer update and the step's own"
  return "other" + (" (backward)" if "transpose(" in name else "")


def bytes_by_part(rows: list[dict], key: str = "hbm_bytes") -> list[tuple[str, float]]:
  """GB a step of `key` by `part_of`, largest first: where the bytes go."""
  parts = {}
  for row in rows:
    parts[part_of(row)] = parts.get(part_of(row), 0.0) + row["times"] * row[key]
  return sorted(((p, round4(b / 1e9)) for p, b in parts.items()), key=lambda x: -x[1])
