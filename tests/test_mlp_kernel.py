"""The fused MLP kernels (bertjax/model/kernels/mlp_kernel.py, `model.mlp_impl="pallas"` and
"pallas_kept") against the XLA path: the same values and gradients, the same parameters, under a
mesh too. On a CPU the kernels run in Pallas' interpreter; tests/test_aot.py compiles them for a
TPU."""

import dataclasses
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from bertjax.errors import Refusal
from bertjax.model import dropout
from bertjax.model.kernels import devices, mlp_arithmetic, mlp_choice, mlp_kernel
from bertjax.model.config import ACTIVATIONS, BertConfig
from bertjax.model.encoder import BertModel
from bertjax.parallel import platforms, sharding

CFG = BertConfig(vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=384,
                 max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0)


def _reference(x, w1, b1, w2, b2, act):
  return act(x @ w1 + b1) @ w2 + b2


def _probe(shape):
  # A fixed random direction to read the output along: sum(out ** 2) of a LayerNorm's output is
  # the same whatever the parameters (its gradient is rounding noise).
  return jax.random.normal(jax.random.key(7), shape)


def _arrays(tokens, width, hidden, dtype):
  keys = jax.random.split(jax.random.key(0), 6)
  normal = lambda k, shape, scale: (jax.random.normal(k, shape) * scale)
  return (normal(keys[0], (tokens, width), 1.0).astype(dtype),
          normal(keys[1], (width, hidden), 0.1).astype(dtype), normal(keys[2], (hidden,), 0.1),
          normal(keys[3], (hidden, width), 0.1).astype(dtype), normal(keys[4], (width,), 0.1),
          normal(keys[5], (tokens, width), 1.0).astype(dtype))


@pytest.mark.parametrize("act", sorted(ACTIVATIONS))
def test_the_kernels_give_the_mlp_and_its_gradients(act):
  # 1,024 tokens: the forward in two blocks of 512, the backward in four of 256 (its gradient
  # sums carried over them). F = 384: three chunks of 128 a block.
  *args, dy = _arrays(1024, 32, 384, jnp.float32)
  assert (mlp_kernel.token_block(1024), mlp_kernel.token_block(1024, 256)) == (512, 256)
  fn = ACTIVATIONS[act]
  got, pull = jax.vjp(lambda *a: mlp_kernel.mlp(*a, fn), *args)
  expected, pull_ref = jax.vjp(lambda *a: _reference(*a, fn), *args)
  np.testing.assert_allclose(got, expected, atol=2e-5, rtol=1e-5)
  for name, g, e in zip(("x", "w1", "b1", "w2", "b2"), pull(dy), pull_ref(dy)):
    assert g.dtype == e.dtype, name
    np.testing.assert_allclose(g, e, atol=2e-4, rtol=2e-5, err_msg=f"d/d{name}")


@pytest.mark.parametrize("keep", [False, True])
def test_in_bfloat16_within_its_rounding(keep):
  # keep: the pre-activation rounded to bfloat16 once more (as XLA's product is), the same bound.
  *args, dy = _arrays(256, 32, 128, jnp.bfloat16)
  fn = ACTIVATIONS["gelu"]
  got, pull = jax.vjp(lambda *a: mlp_kernel.mlp(*a, fn, keep=keep), *args)
  # Not differentiated (prediction writes nothing for a backward): the same values, bit for bit.
  np.testing.assert_array_equal(mlp_kernel.mlp(*args, fn, keep=keep), got)
  # The reference in float32 from the same bfloat16 inputs: the kernel rounds only its products'
  # inputs (as the MXU takes them) and its outputs.
  up = [a.astype(jnp.float32) for a in args]
  expected, pull_ref = jax.vjp(lambda *a: _reference(*a, fn), *up)
  assert got.dtype == jnp.bfloat16
  np.testing.assert_allclose(got.astype(jnp.float32), expected, atol=3e-2, rtol=2e-2)
  for name, g, e in zip(("x", "w1", "b1", "w2", "b2"), pull(dy), pull_ref(dy.astype(jnp.float32))):
    scale = float(jnp.abs(e).max())
    err = float(jnp.abs(g.astype(jnp.float32) - e).max())
    assert err <= 2e-2 * scale, (name, err, scale)


def test_the_weights_gradients_leave_the_backward_in_their_dtype_made_in_float32():
  # bfloat16 weights: dW1 and dW2 are summed in float32 VMEM and written once in bfloat16, dW1
  # [D, F] a chunk of 128 columns at a time (F = 384: three), dW2 [F, D] (W2's own layout) a
  # chunk of 128 rows at a time, or as [D, F] as dW1, on one core and on two; each is the
  # float32 sum rounded once. The bias' sums stay float32.
  *args, dy = _arrays(1024, 32, 384, jnp.bfloat16)
  x, w1, b1, w2, _ = args
  fn = ACTIVATIONS["gelu"]
  assert mlp_kernel._chunk(384) == 128
  _, dpre = mlp_arithmetic.pulled(
      fn, [jnp.dot(x, w1, preferred_element_type=jnp.float32) + b1], jnp.dot(
          dy, w2.T, preferred_element_type=jnp.float32))
  h = fn(jnp.dot(x, w1, preferred_element_type=jnp.float32) + b1).astype(jnp.bfloat16)
  want_w1 = jnp.dot(x.T, dpre[0].astype(jnp.bfloat16), preferred_element_type=jnp.float32)
  want_w2 = jnp.dot(h.T, dy, preferred_element_type=jnp.float32)
  for cores, w2_rows in ((1, True), (2, True), (2, False)):
    _, dw1, db1, dw2 = mlp_kernel._backward(x, dy, w1, b1.astype(jnp.float32)[None], w2, None,
                                            None, fn, interpret=True, cores=cores,
                                            w2_rows=w2_rows)
    assert (dw1.dtype, dw2.dtype, db1.dtype) == (jnp.bfloat16, jnp.bfloat16, jnp.float32)
    assert (dw1.shape, dw2.shape) == ((cores, 32, 384), (cores,) + (
        (384, 32) if w2_rows else (32, 384)))
    for got, want in ((dw1, want_w1), (dw2, want_w2 if w2_rows else want_w2.T)):
      got = got.astype(jnp.float32).sum(0)
      # bfloat16's rounding of each core's sum (2**-8 of it, relative), and the products'.
      np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * float(jnp.abs(want).max()))


@pytest.mark.parametrize("layers,impl", [
    ({}, "pallas"), ({"scan_layers": True, "remat_policy": "dots"}, "pallas"),
    ({"scan_layers": True, "remat_policy": "dots_mlp"}, "pallas"),
    ({"scan_layers": True, "remat_policy": "dots_kernels"}, "pallas_kept"),
    ({"mlp_type": "gated", "mlp_bias": False}, "pallas_kept"),
    ({"mlp_type": "gated", "mlp_bias": False, "norm_position": "pre", "norm_bias": False},
     "pallas_kept"), ({"norm_position": "pre", "norm_type": "rmsnorm"}, "pallas")])
def test_a_model_takes_the_same_parameters_and_gives_the_same_values(layers, impl):
  # Straight layers, and the released configs' scanned layers with remat "dots" (the kernels'
  # forward runs again in the backward there: its output is no matmul's for the policy to keep);
  # "pallas_kept" with the policy that keeps its pre-activation through the scan; ModernBERT's
  # gated MLP without biases, its two projections' parameters as the XLA path has them; pre-norm
  # layers, whose norm before the MLP the kernels make (its parameters where the norm keeps them).
  ids = np.random.default_rng(0).integers(0, 97, (4, 16))
  config = dataclasses.replace(CFG, **layers)
  fused = dataclasses.replace(config, mlp_impl=impl)
  params = nn.unbox(BertModel(config).init(jax.random.key(0), ids)["params"])
  params_fused = nn.unbox(BertModel(fused).init(jax.random.key(0), ids)["params"])
  # The same tree and initial values: a checkpoint moves between the two settings.
  assert jax.tree.structure(params) == jax.tree.structure(params_fused)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params_fused)):
    np.testing.assert_array_equal(a, b)

  def loss(p, cfg):
    out, pooled = BertModel(cfg).apply({"params": p}, ids)
    return jnp.sum(out * _probe(out.shape)) + jnp.sum(pooled)

  value, grads = jax.value_and_grad(loss)(params, config)
  value_f, grads_f = jax.value_and_grad(loss)(params, fused)
  np.testing.assert_allclose(value_f, value, rtol=1e-5)
  for (path, g), e in zip(jax.tree_util.tree_leaves_with_path(grads_f), jax.tree.leaves(grads)):
    np.testing.assert_allclose(g, e, atol=1e-4, rtol=1e-4, err_msg=jax.tree_util.keystr(path))


def test_under_a_mesh_each_device_runs_its_rows_and_the_gradients_are_summed():
  # data x fsdp x tensor = 2 x 2 x 2: the kernels run in shard_map on a quarter of the rows each,
  # the weights whole; the weights' gradients are reduce-scattered over fsdp (which splits
  # their D) and summed over data, each device's as the kernel wrote it, the cores' sums added
  # after (devices.per_device's "summed").
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), sharding.MESH_AXES)
  ids = np.random.default_rng(1).integers(0, 97, (8, 16))
  config = dataclasses.replace(CFG, num_layers=1)  # one layer: the interpreter runs 8 devices
  fused = dataclasses.replace(config, mlp_impl="pallas")
  params = nn.unbox(BertModel(config).init(jax.random.key(0), ids)["params"])

  def loss(p, cfg, batch):
    out, _ = BertModel(cfg).apply({"params": p}, batch)
    return jnp.sum(out * _probe(out.shape))

  expected = jax.value_and_grad(loss)(params, config, ids)
  run = jax.jit(sharding.logical_context(mesh)(jax.value_and_grad(
      lambda p, b: loss(p, fused, b))))
  rows = jax.device_put(ids, NamedSharding(mesh, PartitionSpec(sharding.BATCH_AXES)))
  text = run.lower(params, rows).as_text()
  # Each device's program: its 32 tokens, its core's sums of dW1 and dW2 [1, D 32, F 384] (dW2
  # as its transpose: D 32 split two ways is no whole tile of lanes), reduce-scattered over
  # fsdp's 2 along D and all-reduced over data's 2.
  assert 'manual_axes={"data", "fsdp", "tensor"}' in text
  assert "tensor<4x32x384xf32>" not in text
  assert text.count("(tensor<1x32x384xf32>) -> tensor<1x16x384xf32>") == 2
  assert text.count('"stablehlo.reduce_scatter"') == 2
  value, grads = run(params, rows)
  np.testing.assert_allclose(value, expected[0], rtol=1e-5)
  # Eight devices sum in another order than one: each leaf within 1e-4 of the largest gradient
  # entry (not of its own: the key bias's true gradient is zero, softmax being blind to it; a
  # gradient summed over a quarter of the rows would be off by most of itself).
  scale = max(float(jnp.abs(e).max()) for e in jax.tree.leaves(expected[1]))
  for (path, g), e in zip(jax.tree_util.tree_leaves_with_path(grads),
                          jax.tree.leaves(expected[1])):
    err = float(jnp.abs(g - e).max()) / scale
    assert err < 1e-4, (jax.tree_util.keystr(path), err)


def test_a_gradient_is_split_over_the_chips_in_the_kernels_shard_map_where_shards_are_tiles():
  # devices.summed: reduce-scattered along D where fsdp splits it into whole tiles (16 rows, or
  # 128 lanes along the last axis); else stacked for XLA to add. No mesh: never.
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), sharding.MESH_AXES)
  cases = {(0, (32, 384)): True, (0, (24, 384)): False, (1, (384, 256)): True,
           (1, (384, 32)): False, (1, (384, 250)): False}
  assert not devices.splits(devices.summed(0, (32, 384)))
  with sharding.logical_context(mesh):
    got = {(axis, shape): devices.splits(devices.summed(axis, shape)) for axis, shape in cases}
  assert got == cases


@pytest.mark.parametrize("rate", [0.0, 0.1])
def test_a_post_norm_layer_s_end_is_made_inside_the_kernels(rate):
  # BERT's layer end, LN(x + dropout(MLP(x))): values and every gradient (the norm's weights'
  # and the output bias' too) against the formula written out by XLA with the decisions of
  # dropout.token_decisions for tokens 0..N-1; made again and kept; the XLA fallback and two
  # cores against the kernel. 1,024 tokens: the forward's two blocks, the backward's four.
  *args, dy = _arrays(1024, 32, 384, jnp.float32)
  keys = jax.random.split(jax.random.key(4), 3)
  weights = jnp.stack([1.0 + 0.1 * jax.random.normal(keys[0], (32,)),
                       0.1 * jax.random.normal(keys[1], (32,))])
  words = dropout.key_words(keys[2])
  fn, eps = ACTIVATIONS["gelu"], 1e-12
  keep = dropout.token_decisions(*words.astype(jnp.uint32), jnp.uint32(0), 1024, 32, rate)
  if rate:  # about `rate` of the outputs dropped
    assert abs(float(1.0 - keep.mean()) - rate) < 0.02
  scale = 1.0 / (1.0 - dropout.quantised_rate(rate))

  def written_out(x, w1, b1, w2, b2, weights):
    s = x + jnp.where(keep, _reference(x, w1, b1, w2, b2, fn) * scale, 0.0)
    c = s - s.mean(-1, keepdims=True)
    return c / jnp.sqrt((c * c).mean(-1, keepdims=True) + eps) * weights[0] + weights[1]

  expected, pull_ref = jax.vjp(written_out, *args, weights)
  for kept in (False, True):
    got, pull = jax.vjp(lambda *a: mlp_kernel.mlp(
        *a[:5], fn, keep=kept, post=(a[5], eps, True, rate, words)), *args, weights)
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=1e-4)
    for name, g, e in zip(("x", "w1", "b1", "w2", "b2", "norm"), pull(dy), pull_ref(dy)):
      np.testing.assert_allclose(g, e, atol=5e-4, rtol=1e-4, err_msg=f"d/d{name} keep={kept}")
  post = (eps, True, rate)
  key = jnp.concatenate([words, jnp.zeros((2,), jnp.int32)])[None]
  x, w1, b1, w2, b2 = args
  b1, b2 = b1[None], b2[None]
  out, s = mlp_kernel._forward(x, w1, b1, w2, b2, None, fn, interpret=True, post=post,
                               tail_in=(weights, key))
  # The sum comes as its bits (kept so through remat, no rounding pass): as floats, the same.
  assert s.dtype == jnp.uint32
  float_of = lambda a: jax.lax.bitcast_convert_type(a, jnp.float32)
  for got, want in zip((out, float_of(s)), mlp_arithmetic.products(
      x, w1, b1, w2, b2, None, fn, post=post, tail_in=(weights, key))):
    np.testing.assert_allclose(got, float_of(want) if want.dtype == jnp.uint32 else want,
                               atol=1e-5)
  tail_in = (weights, key, s)
  kernel = mlp_kernel._backward(x, dy, w1, b1, w2, None, None, fn, interpret=True, post=post,
                                tail_in=tail_in)
  xla = mlp_arithmetic.xla_backward(x, dy, w1, b1, w2, None, None, fn, post=post,
                                    tail_in=tail_in)
  split = mlp_kernel._backward(x, dy, w1, b1, w2, None, None, fn, interpret=True, post=post,
                               tail_in=tail_in, cores=2)
  assert len(kernel) == len(xla) == len(split) == 6
  for got, want, two in zip(kernel, xla, split):
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-5)
    np.testing.assert_allclose(two.sum(0) if two.ndim == 3 else two,
                               got.sum(0) if got.ndim == 3 else got, atol=2e-4, rtol=1e-5)


def test_a_post_norm_backward_over_a_core_s_vmem_takes_half_blocks_with_the_same_results(
    monkeypatch):
  # BERT-Large's backward with the post-norm end needs more than v5p's 64 MiB a core at blocks
  # of 256 tokens: it takes blocks of 128 (the weights read once either way), the same sums.
  import re  # pylint: disable=import-outside-toplevel
  *args, dy = _arrays(1024, 32, 384, jnp.float32)
  x, w1, b1, w2, _ = args
  tail_in = (jnp.ones((2, 32)), jnp.asarray([[3, 4, 0, 0]], jnp.int32),
             jax.lax.bitcast_convert_type(jax.random.normal(jax.random.key(1), (1024, 32)),
                                          jnp.uint32))
  run = lambda: mlp_kernel._backward(x, dy, w1, b1[None], w2, None, None, ACTIVATIONS["gelu"],
                                     interpret=True, post=(1e-12, True, 0.1), tail_in=tail_in)
  # A new function each time: make_jaxpr would reuse its trace of the same one.
  grids = lambda: re.findall(r"grid=\(([^)]*)\)", str(jax.make_jaxpr(lambda: run())()))
  whole = run()
  assert grids() == ["1, 4"]
  monkeypatch.setattr(platforms, "vmem_bytes", lambda: 1 << 17)
  assert grids() == ["1, 8"]
  for got, want in zip(run(), whole):  # the sums over 8 blocks, not 4: another order
    np.testing.assert_allclose(got, want, atol=1e-5 * float(jnp.abs(want).max()), rtol=1e-5)


def test_a_post_norm_layer_s_dropout_in_the_kernels_is_the_same_on_a_mesh():
  # BERT (post-norm) with hidden dropout through the kernels: each device draws the decisions of
  # its own tokens by their index in the global batch, so 8 devices (data x fsdp x tensor) give
  # what one does, and another dropout key other decisions.
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), sharding.MESH_AXES)
  ids = np.random.default_rng(2).integers(0, 97, (8, 16))
  config = dataclasses.replace(CFG, num_layers=1, hidden_dropout=0.1, mlp_impl="pallas")
  params = nn.unbox(BertModel(config).init(jax.random.key(0), ids)["params"])

  def loss(p, batch, key):
    out, _ = BertModel(config).apply({"params": p}, batch, deterministic=False,
                                     rngs={"dropout": key})
    return jnp.sum(out * _probe(out.shape))

  key = jax.random.key(3)
  expected = jax.value_and_grad(loss)(params, ids, key)
  other = loss(params, ids, jax.random.key(4))
  assert abs(float(other - expected[0])) > 1e-3 * abs(float(expected[0]))
  run = jax.jit(sharding.logical_context(mesh)(jax.value_and_grad(loss)))
  rows = jax.device_put(ids, NamedSharding(mesh, PartitionSpec(sharding.BATCH_AXES)))
  value, grads = run(params, rows, key)
  np.testing.assert_allclose(value, expected[0], rtol=1e-5)
  scale = max(float(jnp.abs(e).max()) for e in jax.tree.leaves(expected[1]))
  for (path, g), e in zip(jax.tree_util.tree_leaves_with_path(grads),
                          jax.tree.leaves(expected[1])):
    assert float(jnp.abs(g - e).max()) / scale < 1e-4, jax.tree_util.keystr(path)


@pytest.mark.parametrize("act", ["gelu", "silu"])
def test_the_gated_form_takes_both_projections_side_by_side(act):
  # GeGLU and SwiGLU: W1 and G as one [D, 2F] argument; F = 384 in three chunks of 128, each
  # reading its columns of both. Made again and kept, against the formula by XLA.
  *args, dy = _arrays(512, 32, 768, jnp.float32)
  x, w1g, b1g, _, b2 = args
  w2 = jax.random.normal(jax.random.key(3), (384, 32)) * 0.1
  fn = ACTIVATIONS[act]
  gated = lambda x, w, b, w2, b2: (
      fn(x @ w[:, :384] + b[:384]) * (x @ w[:, 384:] + b[384:])) @ w2 + b2
  expected, pull_ref = jax.vjp(gated, x, w1g, b1g, w2, b2)
  for keep in (False, True):
    got, pull = jax.vjp(lambda *a: mlp_kernel.mlp(*a, fn, keep=keep), x, w1g, b1g, w2, b2)
    np.testing.assert_allclose(got, expected, atol=2e-5, rtol=1e-5)
    for name, g, e in zip(("x", "w1g", "b1g", "w2", "b2"), pull(dy), pull_ref(dy)):
      assert g.shape == e.shape, name
      np.testing.assert_allclose(g, e, atol=2e-4, rtol=2e-5, err_msg=f"d/d{name} keep={keep}")
  # The kept pre-activation is both halves, and the XLA fallback (no Mosaic) reads it the same.
  y, pre = mlp_kernel._forward(x, w1g, b1g[None], w2, b2[None], None, fn, interpret=True,
                               kept=True)
  assert pre.shape == (512, 768)
  kernel = mlp_kernel._backward(x, dy, w1g, b1g[None], w2, pre, None, fn, interpret=True)
  for got, want in zip(kernel,
                       mlp_arithmetic.xla_backward(x, dy, w1g, b1g[None], w2, pre, None, fn)):
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("centred,shifted,residual", [(True, True, False), (True, False, True),
                                                      (False, False, True)])
def test_a_pre_norm_is_made_inside_the_kernels_with_its_backward(centred, shifted, residual):
  # LayerNorm with and without its bias, and RMSNorm, of the rows the kernels read (a pre-norm
  # layer's MLP, GeGLU), and the layer's sum with those rows: values and every gradient, the
  # norm's weights' too, against the norm and the sum written out by XLA around the MLP; made
  # again and kept, and by the XLA fallback.
  *args, dy = _arrays(512, 32, 768, jnp.float32)
  r, w1g, b1g, _, b2 = args
  r = r * 3.0 + 1.5  # rows whose mean and scale the norm must take out
  w2 = jax.random.normal(jax.random.key(3), (384, 32)) * 0.1
  keys = jax.random.split(jax.random.key(4), 2)
  weights = jnp.stack([1.0 + 0.1 * jax.random.normal(keys[0], (32,)),
                       0.1 * jax.random.normal(keys[1], (32,)) * shifted])
  fn, eps = ACTIVATIONS["gelu"], 1e-5

  def written_out(r, weights, w, b, w2, b2):
    c = r - r.mean(-1, keepdims=True) if centred else r
    x = c / jnp.sqrt((c * c).mean(-1, keepdims=True) + eps) * weights[0] + weights[1]
    y = (fn(x @ w[:, :384] + b[:384]) * (x @ w[:, 384:] + b[384:])) @ w2 + b2
    return y + r if residual else y

  expected, pull_ref = jax.vjp(written_out, r, weights, w1g, b1g, w2, b2)
  for keep in (False, True):
    got, pull = jax.vjp(lambda r, n, w, b, w2, b2: mlp_kernel.mlp(
        r, w, b, w2, b2, fn, keep=keep, norm=(n, eps, centred), residual=residual),
        r, weights, w1g, b1g, w2, b2)
    np.testing.assert_allclose(got, expected, atol=2e-5, rtol=1e-5)
    for name, g, e in zip(("r", "norm", "w1g", "b1g", "w2", "b2"), pull(dy), pull_ref(dy)):
      np.testing.assert_allclose(g, e, atol=5e-4, rtol=1e-4, err_msg=f"d/d{name} keep={keep}")
  norm = (eps, centred)
  kernel = mlp_kernel._backward(r, dy, w1g, b1g[None], w2, None, weights, fn, interpret=True,
                                norm=norm, residual=residual)
  xla = mlp_arithmetic.xla_backward(r, dy, w1g, b1g[None], w2, None, weights, fn, norm=norm,
                                 residual=residual)
  assert len(kernel) == len(xla) == 5
  for got, want in zip(kernel, xla):
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-5)
  # A chip of two TensorCores (v5p) runs a sequence of blocks on each, each with its own sums
  # ([2, ...]), which the caller adds: the same gradients.
  split = mlp_kernel._backward(r, dy, w1g, b1g[None], w2, None, weights, fn, interpret=True,
                               norm=norm, residual=residual, cores=2)
  np.testing.assert_allclose(split[0], kernel[0], atol=1e-5)
  for got, want in zip(split[1:], kernel[1:]):
    assert got.shape == (2,) + want.shape[1:]
    np.testing.assert_allclose(got.sum(0), want.sum(0), atol=2e-4, rtol=1e-5)


def test_an_unknown_mlp_impl_is_refused_with_the_choices():
  with pytest.raises(ValueError, match="mlp_impl='triton'; choose one of"):
    BertConfig(mlp_impl="triton")
  # The norm and the residual sum inside the MLP are the kernels': XLA's MLP says so rather
  # than leave them out.
  from bertjax.model.mlp import Mlp  # pylint: disable=import-outside-toplevel
  x = jnp.ones((1, 4, 32))
  with pytest.raises(ValueError, match="the kernels'.*not mlp_impl='xla'.*residual_normed"):
    Mlp(CFG).init(jax.random.key(0), x, residual=True)


def test_weights_over_a_core_s_vmem_are_refused_when_traced_with_the_fix(monkeypatch):
  # BERT-Base's MLP (768 x 3,072 in bf16: 9 MB of weights, 18 MiB with the forward's blocks)
  # on v4's 16 MiB a core: said when the step is traced for the TPU, not by libtpu's refusal
  # of the compile. With v5p's 64 MiB the same trace goes through; Pallas' interpreter on a
  # CPU has no VMEM to fit.
  *args, _ = _arrays(512, 768, 3072, jnp.bfloat16)
  shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
  for vmem, refused in ((64 << 20, False), (16 << 20, True)):
    monkeypatch.setattr(platforms, "vmem_bytes", lambda vmem=vmem: vmem)
    # A function of its own each time: jit would reuse the first trace.
    tpu = jax.export.export(jax.jit(lambda *a: mlp_kernel.mlp(*a, ACTIVATIONS["gelu"])),
                            platforms=["tpu"])
    if refused:
      with pytest.raises(Refusal, match=r"needs 1[0-9.]+ MiB, the chips compiled for have 16 "
                         r"MiB a core; use mlp_impl='auto' or 'xla'"):
        tpu(*shapes)
    else:
      assert "fused_mlp_fwd" in tpu(*shapes).mlir_module()


def test_without_mosaic_xla_computes_what_the_kernels_do():
  # A GPU has no Mosaic: there the same forward and backward run as XLA's products, so a config
  # that asks for the kernels still trains (the GPU probe, docs/performance.md).
  *args, dy = _arrays(512, 32, 128, jnp.float32)
  fn = ACTIVATIONS["gelu"]
  b1, b2 = args[2][None, :], args[4][None, :]
  forward = mlp_kernel._forward(args[0], args[1], b1, args[3], b2, None, fn, interpret=True)
  np.testing.assert_allclose(mlp_arithmetic.products(args[0], args[1], b1, args[3], b2, None, fn),
                             forward, atol=1e-5)
  kernel = mlp_kernel._backward(args[0], dy, args[1], b1, args[3], None, None, fn, interpret=True)
  xla = mlp_arithmetic.xla_backward(args[0], dy, args[1], b1, args[3], None, None, fn)
  for name, got, expected in zip(("dx", "dw1", "db1", "dw2"), xla, kernel):
    assert got.shape == expected.shape, name
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=1e-5, err_msg=name)
  # "pallas_kept": the forward also gives the pre-activation, and the backward reads the one it
  # is given (here not x W1 + b1, so a backward that made it again from x would differ).
  y, pre = mlp_kernel._forward(args[0], args[1], b1, args[3], b2, None, fn, interpret=True,
                               kept=True)
  for got, expected in zip((y, pre), mlp_arithmetic.products(args[0], args[1], b1, args[3], b2,
                                                              None, fn, kept=True)):
    np.testing.assert_allclose(got, expected, atol=1e-5)
  np.testing.assert_allclose(pre, args[0] @ args[1] + b1, atol=1e-5)
  shifted = pre + 0.5
  kernel = mlp_kernel._backward(args[0], dy, args[1], b1, args[3], shifted, None, fn,
                                interpret=True)
  xla = mlp_arithmetic.xla_backward(args[0], dy, args[1], b1, args[3], shifted, None, fn)
  made_again = mlp_arithmetic.xla_backward(args[0], dy, args[1], b1, args[3], None, None, fn)
  for name, got, expected, other in zip(("dx", "dw1", "db1", "dw2"), xla, kernel, made_again):
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=1e-5, err_msg=name)
    assert float(jnp.abs(expected - other).max()) > 1e-2, name
  # And it is what a program lowered for a GPU holds: XLA's products, no TPU kernel.
  shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
  for keep in (False, True):
    grad = jax.jit(jax.grad(lambda *a, keep=keep: jnp.sum(mlp_kernel.mlp(*a, fn, keep=keep)),
                            argnums=(0, 1, 2, 3, 4)))
    for platform, kernels in (("cuda", False), ("tpu", True)):
      text = jax.export.export(grad, platforms=[platform])(*shapes).mlir_module()
      assert ("tpu_custom_call" in text) == kernels, (platform, keep)
      assert ("stablehlo.dot_general" in text) != kernels, (platform, keep)


def test_auto_takes_the_kernels_where_they_measured_faster():
  chip = lambda kind, platform="tpu": types.SimpleNamespace(device_kind=kind, platform=platform)
  auto = dataclasses.replace(CFG, mlp_impl="auto")
  # On v6e: the kernels that keep the pre-activation where the remat policy keeps it (and the
  # backward then reads it), those that make it again where it does not ("auto" on v6e:
  # "dots_outputs", the kernels' outputs kept but not the pre-activation).
  for policy, impl in (("none", "pallas_kept"), ("dots_kernels", "pallas_kept"),
                       ("dots_mlp", "pallas_kept"), ("dots", "pallas"), ("full", "pallas"),
                       ("dots_outputs", "pallas"), ("auto", "pallas")):
    chosen = mlp_choice.chosen(dataclasses.replace(auto, remat_policy=policy), chip("TPU v6 lite"))
    assert chosen == impl, (policy, chosen)
  auto = dataclasses.replace(auto, remat_policy="dots")
  # v5p and v5e: their steps are bound by FLOPs, which the kernels that make the pre-activation
  # again add; both take those that keep it where the policy keeps it (XLA's FLOPs); v4 not.
  assert mlp_choice.chosen(auto, chip("TPU v5")) == "xla"
  assert mlp_choice.chosen(auto, chip("TPU v5 lite")) == "xla"
  for policy in ("none", "dots_kernels"):
    kept = dataclasses.replace(auto, remat_policy=policy)
    assert mlp_choice.chosen(kept, chip("TPU v5 lite")) == "pallas_kept", policy
    assert mlp_choice.chosen(kept, chip("TPU v5")) == "pallas_kept", policy
    assert mlp_choice.chosen(kept, chip("TPU v4")) == ("xla_remade" if policy == "none" else "xla")
  assert mlp_choice.chosen(auto, chip("cpu", "cpu")) == "xla"
  assert mlp_choice.chosen(auto, chip("TPU v6 lite"), tensor_parallel=2) == "xla"
  gated = dataclasses.replace(auto, mlp_type="gated", hidden_act="silu")
  assert mlp_choice.chosen(gated, chip("TPU v6 lite")) == "pallas"
  assert mlp_choice.chosen(dataclasses.replace(CFG, mlp_impl="pallas"), chip("TPU v5")) == "pallas"
  # Elsewhere XLA's products; on a TPU with nothing rematerialised, keeping the pre-activation
  # alone (fewer bytes); on a CPU as written (faster there).
  none = dataclasses.replace(auto, remat_policy="none")
  assert mlp_choice.chosen(none, chip("TPU v6 lite"), tensor_parallel=2) == "xla_remade"
  assert mlp_choice.chosen(dataclasses.replace(none, mlp_type="gated", hidden_act="silu"),
                           chip("TPU v6 lite"), tensor_parallel=2) == "xla_remade"
  assert mlp_choice.chosen(none, chip("cpu", "cpu")) == "xla"
  assert mlp_choice.chosen(none, chip("NVIDIA H200", "gpu")) == "xla"
  # train.build settles it for its mesh's chips: on this CPU, XLA's MLP.
  from bertjax.training import train
  from bertjax.configs import tiny
  config = tiny.get_config()
  config.model.update(vocab_size=100, mlp_impl="auto")
  assert train.from_config(config).model_config.mlp_impl == "xla"


@pytest.mark.parametrize("impl", ["pallas", "pallas_kept"])
def test_remat_dots_mlp_keeps_the_kernels_output_so_their_forward_runs_once(impl):
  # Under remat "dots" the forward kernel runs again in the backward (its output is no matmul's);
  # "dots_mlp" keeps that output (and with "pallas_kept" the pre-activation the backward reads),
  # and the backward calls the forward kernel no more. "dots_outputs" keeps the output but not
  # the pre-activation: enough for "pallas" (what "auto" pairs it with), not for "pallas_kept".
  ids = np.random.default_rng(0).integers(0, 97, (4, 16))
  config = dataclasses.replace(CFG, scan_layers=True, mlp_impl=impl)
  params = nn.unbox(BertModel(config).init(jax.random.key(0), ids)["params"])
  calls = {}
  for policy in ("none", "dots", "dots_mlp", "dots_outputs"):
    cfg = dataclasses.replace(config, remat_policy=policy)
    loss = lambda p, cfg=cfg: jnp.sum(BertModel(cfg).apply({"params": p}, ids)[0])
    text = str(jax.make_jaxpr(jax.grad(loss))(params))
    calls[policy] = (text.count("fused_mlp_fwd"), text.count("fused_mlp_bwd"))
  assert calls["dots_mlp"] == calls["none"], calls
  assert calls["dots"][0] > calls["dots_mlp"][0] and calls["dots"][1] == calls["dots_mlp"][1], calls
  assert (calls["dots_outputs"] == calls["none"]) == (impl == "pallas"), calls
