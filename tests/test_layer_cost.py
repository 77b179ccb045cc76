"""The compiled train step costs the same per encoder layer at every depth, scanned and unrolled.

A cost per layer that grows with the layer count (the CPU's whole stacked residual buffer
converted at every layer: bertjax/model/residuals.py) makes a deep model's step grow with the square of
its depth. Held here on the compiled program (bertjax/perf/layercost.py): XLA's FLOPs and bytes
accessed (`compiled.cost_analysis()`) and the operations, per added layer, unrolled; scanned,
where XLA counts the loop's body once, the operations of the layer loops per layer and the bytes
they write to whole [layers, ...] buffers at every iteration (none: each layer updates its slice).
"""

import functools

import jax
import pytest

from bertjax.benchmark import train as benchmark
from bertjax.configs import base
from bertjax.model import residuals
from bertjax.perf import hlocost, layercost

# The figures read here come from the optimised HLO, which these leave as it is; the machine code
# LLVM makes of it is not read, and unoptimised it compiles in half the time.
UNOPTIMISED_CODE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
SHAPE = dict(hidden_size=32, num_heads=2, intermediate_size=64, vocab_size=128, dtype="bfloat16")


@functools.lru_cache(maxsize=None)
def _compiled(num_layers: int, scan: bool, unroll: int = 1):
  config = base.get_config()
  config.model.update(SHAPE, num_layers=num_layers, scan_layers=scan, scan_unroll=unroll)
  config.data.update(max_seq_length=16, max_predictions_per_seq=2)
  config.train.batch_size = 2
  # One device: the per-device program, as a single accelerator compiles it.
  runner = benchmark.StepRunner(config, 16, 2, devices=jax.devices()[:1], allocate=False)
  return runner.lowered.compile(compiler_options=UNOPTIMISED_CODE)


def _compiled_text(num_layers: int, scan: bool, unroll: int = 1):
  compiled = _compiled(num_layers, scan, unroll)
  return layercost.cost(compiled), compiled.as_text()


def _close(a: float, b: float, rel: float = 1e-3) -> bool:
  return abs(a - b) <= rel * max(abs(a), abs(b))


def test_an_unrolled_step_adds_the_same_cost_with_each_layer():
  costs, ops = [], []
  for n in (1, 2, 3):
    cost, text = _compiled_text(n, scan=False)
    costs.append(cost)
    ops.append(layercost.module_op_count(text))
  for key in ("flops", "bytes"):
    first, second = costs[1][key] - costs[0][key], costs[2][key] - costs[1][key]
    assert first > 0 and _close(first, second), (key, [c[key] for c in costs])
  assert ops[1] - ops[0] == ops[2] - ops[1] > 0, ops
  # What bertjax.aot --roofline_layers=1 reads: the third layer's step from the first two's.
  third = layercost.extrapolate(costs[0], costs[1], 1, 3)
  assert all(_close(third[key], costs[2][key]) for key in ("flops", "bytes")), (third, costs[2])
  print(f"unrolled: {ops[1] - ops[0]} operations per layer; per layer "
        f"{(costs[1]['flops'] - costs[0]['flops']) / 1e6:.3f} MFLOP, "
        f"{(costs[1]['bytes'] - costs[0]['bytes']) / 1e6:.3f} MB accessed")


def test_a_scanned_step_runs_the_same_operations_per_layer_at_any_depth():
  # Depths no other dimension of the model shares (the [layers, ...] arrays are found by it).
  (_, three), (_, six) = _compiled_text(3, scan=True), _compiled_text(6, scan=True)
  assert len(layercost.layer_loops(three, 3)) == 2  # the forward pass's loop, the backward's
  ops = [layercost.layer_ops(three, 3, scanned=True), layercost.layer_ops(six, 6, scanned=True)]
  assert ops[0] == ops[1] > 0, ops
  assert layercost.stack_writes(three, 3) == layercost.stack_writes(six, 6) == {}
  print(f"scanned: {ops[0]} operations per layer (the two loop bodies)")


def test_every_scanned_layer_counted_does_the_flops_of_unrolled_layers():
  # XLA counts the loop's body once; bertjax.aot's roofline counts every layer from a second
  # compile with two layers per iteration (layercost.honest_cost). Against six unrolled layers
  # (1 + 5 increments of the unrolled test's compiles): the same FLOPs within a few percent,
  # where the body counted once is a third short; and no fewer bytes (the scanned loop also
  # moves each layer's parameters, gradients and residuals in and out of the stacked arrays).
  (once, _), (second, _) = _compiled_text(6, True), _compiled_text(6, True, 2)
  honest = layercost.honest_cost(once, second, 6)
  (one, _), (two, _) = _compiled_text(1, False), _compiled_text(2, False)
  unrolled = {key: one[key] + 5 * (two[key] - one[key]) for key in ("flops", "bytes")}
  assert abs(honest["flops"] / unrolled["flops"] - 1) < 0.05, (honest, unrolled)
  assert once["flops"] < 0.8 * unrolled["flops"]
  assert honest["bytes"] > 0.95 * unrolled["bytes"] > once["bytes"]
  print(f"six layers, scanned and every layer counted / unrolled: FLOPs "
        f"{honest['flops'] / unrolled['flops']:.3f}, bytes {honest['bytes'] / unrolled['bytes']:.3f}")
  assert [layercost.second_unroll(n) for n in (6, 12, 24, 3, 22)] == [2, 2, 2, 3, 2]


def test_the_whole_buffer_conversion_is_a_write_to_every_layer_at_every_layer(monkeypatch):
  # What the test above sees with residuals.py undone: XLA's CPU backend converting each whole
  # bfloat16 [layers, ...] residual buffer to float32 and back to store one layer's slice.
  monkeypatch.setattr(residuals, "saving_bits", lambda f: f)
  text = _compiled.__wrapped__(3, scan=True).as_text()  # compiled afresh, not the cached one
  writes = layercost.stack_writes(text, 3)
  assert writes.get("convert:bf16", 0) > 0, writes


def test_a_loop_body_costed_alone_counts_each_iteration():
  # A loop whose body's cost is known: eight iterations of a [64, 64] matmul. XLA's count of the
  # compiled loop has the body once; every instruction costed alone and the body once per
  # iteration (hlocost.program_cost), the loop's FLOPs are eight matmuls' (2 x 64^3 each),
  # within the few elementwise operations of the loop.
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  def loop(w, xs):
    return jax.lax.scan(lambda x, w_i: (jnp.tanh(x @ w_i), None), xs, w)[0]

  w, x = jnp.ones((8, 64, 64)), jnp.ones((64, 64))
  compiled = jax.jit(loop).lower(w, x).compile(compiler_options=UNOPTIMISED_CODE)
  matmul = 2 * 64 ** 3
  assert layercost.cost(compiled)["flops"] < 2 * matmul  # the body counted once
  every = hlocost.program_cost(compiled.as_text())
  assert every["unknown_trips"] == [] and every["opaque"] == []
  assert 8 * matmul <= every["flops"] < 8.8 * matmul, every
  assert every["bytes"] > layercost.cost(compiled)["bytes"] + 7 * 64 * 64 * 4
  assert every["hbm_bytes"] == every["bytes"]  # a CPU has no other memory space


def test_a_scanned_step_counted_from_one_compile_does_the_flops_of_unrolled_layers():
  # bertjax.aot's roofline of a scanned step: every instruction costed alone, each loop's body
  # once per iteration (hlocost.program_cost), against six unrolled layers counted the same way
  # (the dropout bits' own small loops run in both): the same FLOPs within a few percent, and
  # no fewer bytes; at most a little over the two-compile count's (honest_cost, from XLA's counts
  # of the executables, which take those small loops' bodies once).
  one, two = (hlocost.program_cost(_compiled(n, False).as_text()) for n in (1, 2))
  unrolled = {key: one[key] + 5 * (two[key] - one[key]) for key in ("flops", "bytes")}
  every = hlocost.program_cost(_compiled(6, True).as_text())
  honest = layercost.honest_cost(_compiled_text(6, True)[0], _compiled_text(6, True, 2)[0], 6)
  assert abs(every["flops"] / unrolled["flops"] - 1) < 0.05, (every, unrolled)
  assert 0.95 * unrolled["bytes"] < every["bytes"] <= 1.05 * honest["bytes"], (every, unrolled,
                                                                                honest)
  print(f"six scanned layers, every instruction costed / unrolled: FLOPs "
        f"{every['flops'] / unrolled['flops']:.3f}, bytes {every['bytes'] / unrolled['bytes']:.3f}"
        f"; / two compiles' bytes {every['bytes'] / honest['bytes']:.3f}")


def test_without_jaxlibs_parser_the_roofline_counts_from_a_second_compile(monkeypatch):
  # hlocost.analyse uses jaxlib's private HLO parser and cost analysis (no public name in jax
  # 0.10.2). Where a jaxlib lacks them, a scanned step is counted from the second compile
  # (honest_cost), and without one each body once, saying so; there is no HBM figure then.
  import types  # pylint: disable=import-outside-toplevel
  from jax._src.lib import xla_client  # pylint: disable=import-outside-toplevel
  from bertjax.perf import roofline  # pylint: disable=import-outside-toplevel
  private = xla_client._xla  # pylint: disable=protected-access
  monkeypatch.delattr(private, "hlo_module_cost_analysis")
  compiled, second = _compiled(6, True), _compiled(6, True, 2)
  assert hlocost.analyse(compiled.as_text()) is None
  with pytest.raises(ValueError, match="could not cost"):
    hlocost.program_cost(compiled.as_text())
  training = types.SimpleNamespace(model_config=types.SimpleNamespace(
      num_layers=6, scan_layers=True, scan_unroll=1))
  honest = layercost.honest_cost(layercost.cost(compiled), layercost.cost(second), 6)
  figures = roofline.layer_figures(training, compiled, second)
  assert figures["xla_gb_per_chip_all_layers"] == roofline.round4(honest["bytes"] / 1e9)
  assert "second compile" in figures["all_layers_counted_as"]
  assert "hbm_gb_per_chip_all_layers" not in figures
  alone = roofline.layer_figures(training, compiled)
  assert alone["all_layers_counted_as"] == roofline.BODY_ONCE
  once = layercost.cost(compiled)["bytes"]
  assert alone["xla_gb_per_chip_all_layers"] == roofline.round4(once / 1e9)
