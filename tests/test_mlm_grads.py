"""The recomputed MLM head's backward kernel (bertjax/model/kernels/mlm_grads.py: the logits made
again and their gradient read in VMEM, never written) against the float32 loss's automatic
gradients and heads.decoded_scores' XLA backward. On a CPU it runs in Pallas' interpreter;
tests/test_aot.py compiles a TPU train step."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from bertjax.model import heads
from bertjax.model.kernels import mlm_grads
from bertjax.parallel import sharding


def _arrays(rows, vocab, width):
  keys = jax.random.split(jax.random.key(5), 5)
  x = (jax.random.normal(keys[0], (rows, width)) * width ** -0.5).astype(jnp.bfloat16)
  w = jax.random.normal(keys[1], (vocab, width)).astype(jnp.bfloat16)
  bias = jax.random.normal(keys[2], (vocab,)) * 0.5
  labels = jax.random.randint(keys[3], (rows,), 0, vocab)
  # A prediction's cotangent is its weight in the loss; padding's is 0.
  g = jnp.where(jnp.arange(rows) % 5 == 4, 0.0, jax.random.uniform(keys[4], (rows,)))
  return x, w, bias, labels, g


def _float32_grads(x, w, bias, labels, g):
  def loss(x, w, bias):
    logits = x @ w.T + bias
    nll = jax.nn.logsumexp(logits, axis=1) - jnp.take_along_axis(logits, labels[:, None], 1)[:, 0]
    return jnp.sum(nll * g)
  x, w = x.astype(jnp.float32), w.astype(jnp.float32)
  log_z = jax.nn.logsumexp(x @ w.T + bias, axis=1)
  return log_z, jax.grad(loss, argnums=(0, 1, 2))(x, w, bias)


@pytest.mark.parametrize("vocab,cores", [(1000, 1), (1000, 2), (700, 2), (1024, 2)])
def test_the_kernel_gives_the_losss_gradients(vocab, cores, monkeypatch):
  # Blocks of 256 columns: 1,000 takes four, the last partial (its rows past V read as a
  # partial block's undefined padding, their gradient zero); 700 takes three over two cores,
  # the second core's last step past the vocabulary; 1,024 four whole. 96 predictions walked
  # in blocks of 32, every fifth a padding's (cotangent 0).
  monkeypatch.setattr(mlm_grads, "VOCAB_BLOCK", 256)
  monkeypatch.setattr(mlm_grads, "ROW_BLOCKS", (32, 8))
  x, w, bias, labels, g = _arrays(96, vocab, 128)
  log_z, want = _float32_grads(x, w, bias, labels, g)
  dx, dw, db = mlm_grads.grads(x, w, bias, labels, log_z, g, interpret=True, cores=cores)
  assert dx.shape == (cores, 96, 128) and dx.dtype == jnp.bfloat16
  assert dw.shape == (vocab, 128) and dw.dtype == jnp.float32 and db.shape == (vocab,)
  got = (dx.astype(jnp.float32).sum(0), dw, db)
  # The logits' gradient is rounded to bfloat16 before the products (as XLA's backward does):
  # errors of its order against the float32 loss's, on gradients of order one.
  for name, a, b in zip(("x", "W", "bias"), got, want):
    scale = float(jnp.max(jnp.abs(b)))
    np.testing.assert_allclose(a, b, atol=1e-2 * scale, rtol=0, err_msg=name)
  # Every column of the last, partial block has its gradient; no NaN from the padding.
  assert bool(jnp.all(jnp.isfinite(dw))) and float(jnp.max(jnp.abs(dw[-8:]))) > 0


def test_the_head_s_backward_is_the_kernel_on_a_tpu_and_xla_elsewhere(monkeypatch):
  # decoded_scores' backward: the kernel in a program for a TPU where the device's predictions
  # fit it, XLA's elsewhere; on the CPU (XLA's path) the same gradients as the kernel's.
  x, w, bias, labels, g = _arrays(24, 97, 32)
  x, labels, g = x.reshape(2, 12, 32), labels.reshape(2, 12), g.reshape(2, 12)
  loss = lambda x, w, b: jnp.sum(heads.decoded_scores(x, w, b, labels, jnp.bfloat16).nll_BxM * g)
  shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (x, w, bias)]
  export = lambda platform: jax.export.export(jax.jit(jax.grad(loss, argnums=(0, 1, 2))),
                                              platforms=[platform])(*shapes).mlir_module()
  for platform, kernel in (("tpu", True), ("cuda", False), ("cpu", False)):
    assert ("mlm_scores_bwd" in export(platform)) == kernel, platform
  # Predictions no multiple of 8 (a whole number of the kernel's least block): XLA's.
  odd = [jax.ShapeDtypeStruct((2, 11, 32), x.dtype)] + shapes[1:]
  loss_odd = lambda x, w, b: jnp.sum(heads.decoded_scores(x, w, b, labels[:, :11],
                                                          jnp.bfloat16).nll_BxM)
  assert "mlm_scores_bwd" not in jax.export.export(
      jax.jit(jax.grad(loss_odd, argnums=(0, 1, 2))), platforms=["tpu"])(*odd).mlir_module()
  xla = jax.grad(loss, argnums=(0, 1, 2))(x, w, bias)
  log_z = jax.nn.logsumexp(heads.tied_decoder(x, w, bias, jnp.bfloat16), axis=-1)
  dx, dw, db = mlm_grads.grads(x.reshape(24, 32), w, bias, labels.reshape(24),
                               log_z.reshape(24), g.reshape(24), interpret=True, cores=1)
  for name, a, b in zip(("x", "W", "bias"), (dx[0].reshape(2, 12, 32), dw, db), xla):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               atol=2e-2 * float(jnp.max(jnp.abs(b))), rtol=0, err_msg=name)


# D 256 split over fsdp's 2 gives shards of 128 columns, whole tiles of lanes: W's gradient
# written [V, D] and reduce-scattered along D. D 192 gives 96 columns, no whole tile of lanes but
# whole tiles of rows: written [D, V], reduce-scattered along D and turned to the table's [V, D]
# (a TPU stores such a shard column-major: the turn is no copy there).
@pytest.mark.parametrize("width,written", [(256, "1x300x256xf32>) -> tensor<1x300x128xf32>"),
                                           (192, "1x192x300xf32>) -> tensor<1x96x300xf32>")])
def test_under_a_mesh_each_device_runs_its_predictions_and_ws_gradient_is_summed(width, written,
                                                                                 monkeypatch):
  # data x fsdp x tensor = 2 x 2 x 2: each device's 24 of the 96 predictions, W whole; W's
  # gradient reduce-scattered over fsdp (split as the table's) and summed over data, the bias'
  # summed over the devices. Two cores a device: their sums of x's gradient added. The same
  # gradients as one device's.
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), sharding.MESH_AXES)
  x, w, bias, labels, g = _arrays(96, 300, width)
  log_z, _ = _float32_grads(x, w, bias, labels, g)
  want = mlm_grads.grads(x, w, bias, labels, log_z, g, interpret=True, cores=1)
  with sharding.logical_context(mesh):
    assert not mlm_grads.stored_transposed((300, width))  # a CPU's chip is none of v5p's
    # This CPU's chip ("") taken as one whose shards are written transposed.
    monkeypatch.setattr(mlm_grads, "TRANSPOSED_ON", ("",))
    assert mlm_grads.stored_transposed((300, width)) == (width == 192)
  rows = NamedSharding(mesh, PartitionSpec(sharding.BATCH_AXES))
  shape = lambda a: jax.device_put(a.reshape((8, 12) + a.shape[1:]), rows)
  run = jax.jit(sharding.logical_context(mesh)(
      lambda *a: mlm_grads.sharded(*a, interpret=True, cores=2)))
  args = (shape(x), w, bias, shape(labels), shape(log_z), shape(g))
  assert run.lower(*args).as_text().count("(tensor<" + written) == 1, "reduce-scatter"
  dx, dw, db = run(*args)
  assert dw.shape == (300, width) and dw.sharding.spec == PartitionSpec(None, "fsdp")
  np.testing.assert_allclose(dx.reshape(96, width), want[0][0].astype(jnp.float32), atol=2e-2)
  np.testing.assert_allclose(dw, want[1], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(db, want[2], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("transposed", [False, True])
def test_more_predictions_than_a_call_holds_take_calls_that_add_ws_gradient(transposed,
                                                                            monkeypatch):
  # A core's VMEM that holds 128 predictions a call: 296 take three calls (128, 128, 40), each
  # adding W's and the bias' gradients to the last call's (their buffers reused); x's
  # gradients side by side. The same gradients as one call's.
  monkeypatch.setattr(mlm_grads, "VOCAB_BLOCK", 256)
  x, w, bias, labels, g = _arrays(296, 1000, 128)
  log_z, _ = _float32_grads(x, w, bias, labels, g)
  small = int(128.5 * mlm_grads._row_bytes(128, 2) / mlm_grads.SHARE)
  assert mlm_grads.most(128, 2, small) == 128
  run = lambda x, vmem: mlm_grads.grads(x, w, bias, labels, log_z, g, interpret=True, cores=2,
                                        vmem=vmem, transposed=transposed)
  calls = [e for e in jax.make_jaxpr(lambda x: run(x, small))(x).jaxpr.eqns
           if e.primitive.name == "pallas_call"]
  assert [e.invars[1].aval.shape[0] for e in calls] == [128, 128, 40]
  assert [len(e.invars) for e in calls] == [6, 8, 8]
  if transposed:  # W's gradient [D, V]: the same as [V, D]'s, turned
    one = mlm_grads.grads(x, w, bias, labels, log_z, g, interpret=True, cores=2)[1]
    np.testing.assert_allclose(run(x, small)[1].T, one, rtol=1e-5, atol=1e-5)
  for got, want in zip(run(x, small), run(x, 1 << 30)):
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=1e-5, atol=1e-5)


def test_the_released_steps_calls_fit_a_core_s_vmem():
  # Every released BERT step's predictions a chip (length 128: 60 a row of three sequences,
  # 64 rows a chip on v5p-8, 32 on v6e-8 and v5e-8; length 512: 228 a row) with Mosaic's room:
  # at 128 one call on every chip; BERT-Large at 512 on v5p-8 in four.
  for chip, rows in (("v5p", 64), ("v5e", 32), ("v6e", 32)):
    vmem = pltpu.get_tpu_info_for_chip(pltpu.ChipVersion(chip), 1).vmem_capacity_bytes
    for width in (768, 1024):
      assert mlm_grads.most(width, 2, vmem) >= rows * 60, (chip, width)
      call = min(mlm_grads.most(width, 2, vmem), rows * 228)
      need = mlm_grads._need(call, 512, width, 2)
      assert int(need * 1.25) + (2 << 20) <= vmem, (chip, width, need)
  v5p = pltpu.get_tpu_info_for_chip(pltpu.ChipVersion("v5p"), 1).vmem_capacity_bytes
  assert -(-64 * 228 // mlm_grads.most(1024, 2, v5p)) == 4
