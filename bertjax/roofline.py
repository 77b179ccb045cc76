"""The roofline of a compiled train step, from XLA's cost analysis: its FLOPs at a chip's peak
against its bytes at the chip's HBM bandwidth, every layer counted (XLA counts a loop's body
once), and the operations per layer. `python -m bertjax.aot` prints it beside its memory check."""

from __future__ import annotations

from bertjax import layercost, train


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


# `all_layers_counted_as` where nothing could count every layer of a scanned step.
BODY_ONCE = "each layer loop's body once, not every layer"


def layer_figures(training: train.Training, compiled, second=None) -> dict:
  """XLA's FLOPs and bytes per chip with every layer counted, and the operations per layer.

  XLA counts a loop's body once: a scanned step's cost is its executable's plus each layer
  loop's body costed alone for each further iteration (layercost.loop_cost); where a body cannot
  be costed alone, from `second`, the step compiled with layercost.second_unroll's k layers per
  iteration (layercost.honest_cost, an upper bound), and without it each body once (BODY_ONCE).
  An unrolled step's is XLA's own."""
  mc = training.model_config
  text = compiled.as_text()
  cost = layercost.cost(compiled)
  counted = "XLA's count of the executable"
  if mc.scan_layers and mc.scan_unroll < mc.num_layers:
    every = layercost.loop_cost(compiled, mc.num_layers, mc.scan_unroll)
    counted = "each loop body's own cost once per iteration"
    if every is None and second is not None:
      every = layercost.honest_cost(cost, layercost.cost(second), mc.num_layers, mc.scan_unroll)
      counted = "a second compile's extra layers (an upper bound on the bytes)"
    cost, counted = (cost, BODY_ONCE) if every is None else (every, counted)
  out = {"xla_tflop_per_chip_all_layers": round4(cost["flops"] / 1e12),
         "xla_gb_per_chip_all_layers": round4(cost["bytes"] / 1e9),
         "ops_per_layer": layercost.layer_ops(text, mc.num_layers, mc.scan_layers,
                                              mc.scan_unroll),
         "all_layers_counted_as": counted}
  if mc.scan_layers:
    # Writes of whole [layers, ...] buffers inside the layer loops: traffic at every layer that
    # grows with the depth (the CPU's bfloat16 conversion was one); none expected.
    out["whole_stack_writes_per_layer"] = layercost.stack_writes(text, mc.num_layers,
                                                                 mc.scan_unroll)
  return out


def extrapolated_layer_figures(training: train.Training, shallow, deeper, depth: int) -> dict:
  """`layer_figures` for the whole depth from the step compiled at `depth` (`shallow`) and
  2 x `depth` layers (`deeper`), each with its layers as straight code (no loop: XLA counts every
  operation): each layer costs (deeper - shallow) / depth, and the rest of the step, the same in
  both (embeddings, heads, the optimizer's update of what is not a layer), counts once. The
  compiled step grows linearly with the layer count (tests/test_layer_cost.py)."""
  mc = training.model_config
  total = layercost.extrapolate(layercost.cost(shallow), layercost.cost(deeper), depth,
                                mc.num_layers)
  ops = (layercost.module_op_count(deeper.as_text())
         - layercost.module_op_count(shallow.as_text())) // depth
  return {"xla_tflop_per_chip_all_layers": round4(total["flops"] / 1e12),
          "xla_gb_per_chip_all_layers": round4(total["bytes"] / 1e9),
          "ops_per_layer": ops,
          "roofline_layers": f"extrapolated from {depth} and {2 * depth} layers compiled as "
                             f"straight code to {mc.num_layers}"}
