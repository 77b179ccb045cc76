"""A pre-norm layer's q, k and v in kernels (bertjax/model/kernels/qkv_kernel.py): values and
every gradient against the formula written out, XLA's fallback and two cores against the kernel,
and a pre-norm model through them against XLA's layers, under remat and on a mesh. On a CPU the
kernels run in Pallas' interpreter; tests/test_aot.py compiles a model that takes them for a
TPU."""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from bertjax.model.config import BertConfig
from bertjax.model.encoder import BertModel
from bertjax.model.kernels import qkv_kernel
from bertjax.parallel import sharding

from kernel_checks import assert_backwards_agree, assert_models_agree

EPS = 1e-5


def _arrays(tokens, width, inner):
  keys = jax.random.split(jax.random.key(0), 6)
  normal = lambda k, shape, scale: jax.random.normal(k, shape) * scale
  weights = jnp.stack([1.0 + normal(keys[2], (width,), 0.1), normal(keys[3], (width,), 0.1)])
  return (normal(keys[0], (tokens, width), 1.0) + 0.5, normal(keys[1], (3, width, inner), 0.1),
          weights, normal(keys[4], (3, tokens, inner), 1.0), normal(keys[5], (tokens, width), 1.0))


def _written_out(x, w, weights, centred):
  if weights is None:
    return tuple(x @ w[j] for j in range(3)), x
  r = x - x.mean(-1, keepdims=True) if centred else x
  xn = r / jnp.sqrt((r * r).mean(-1, keepdims=True) + EPS) * weights[0] + weights[1]
  return tuple(xn @ w[j] for j in range(3)), x


@pytest.mark.parametrize("norm,packed", [("layer", True), ("rms", False), (None, False)])
def test_q_k_and_v_and_their_gradients_are_the_formula_written_out(norm, packed):
  # 1,024 tokens: two blocks of 512 a grid step, two sequences of one on two cores. A LayerNorm
  # (its bias shifted), an RMSNorm, none (a layer that skips it); q, k and v as one [3, N, C]
  # array and as three; the rows' gradient from the residual's added in.
  x, w, weights, dqkv, dres = _arrays(1024, 256, 128)
  centred = norm == "layer"
  if norm == "rms":
    weights = weights.at[1].set(0.0)
  given = None if norm is None else weights
  expected, pull_ref = jax.vjp(lambda x, w, n: _written_out(x, w, n, centred), x, w, given)
  pack = lambda qkv: qkv[0] if packed else jnp.stack(qkv)
  cotangent = ((dqkv,) if packed else tuple(dqkv), dres)
  got, pull = jax.vjp(lambda x, w, n: qkv_kernel.projections(
      x, w, None if n is None else (n, EPS, centred), packed), x, w, given)
  np.testing.assert_allclose(pack(got[0]), jnp.stack(expected[0]), atol=1e-4, rtol=1e-4)
  np.testing.assert_array_equal(got[1], x)
  # A model's init takes the same arithmetic by XLA (`xla`), the same floats.
  xla = qkv_kernel.projections(x, w, None if given is None else (given, EPS, centred), packed,
                               xla=True)
  np.testing.assert_allclose(pack(xla[0]), pack(got[0]), atol=1e-5)
  grads, want = pull(cotangent), pull_ref((tuple(dqkv), dres))
  for name, g, e in zip(("x", "w", "norm"), grads, want):
    if e is not None:
      np.testing.assert_allclose(g, e, atol=5e-4 * float(jnp.abs(e).max()), rtol=1e-4,
                                 err_msg=f"d/d{name}")

  form = None if norm is None else (EPS, centred)
  weights = jnp.zeros_like(weights) if norm is None else weights
  grads = (dqkv,) if packed else tuple(dqkv)
  kernel = qkv_kernel._backward(x, grads, dres, w, weights, form, packed, interpret=True)
  two = qkv_kernel._backward(x, grads, dres, w, weights, form, packed, interpret=True, cores=2)
  xla = qkv_kernel.xla_backward(x, grads, dres, w, weights, form, packed)
  assert_backwards_agree(kernel, two, xla, 3)


def test_in_bfloat16_the_weights_gradient_leaves_in_its_dtype_made_in_float32():
  # dW summed over the two blocks in float32 and rounded once: within bfloat16's rounding of
  # XLA's float32 product, and in bfloat16; the products' outputs XLA's, written as their bits.
  x, w, weights, dqkv, dres = _arrays(1024, 256, 128)
  x, w, dqkv, dres = (a.astype(jnp.bfloat16) for a in (x, w, dqkv, dres))
  form = (EPS, True)
  out = qkv_kernel._forward(x, w, weights, form, False, interpret=True)
  as_float = lambda a: jax.lax.bitcast_convert_type(a, jnp.bfloat16).astype(jnp.float32)
  for got, want in zip(out, qkv_kernel.xla_forward(x, w, weights, form, False)):
    assert got.dtype == want.dtype == jnp.uint16
    np.testing.assert_allclose(as_float(got), as_float(want), atol=2e-2)
  got = qkv_kernel._backward(x, tuple(dqkv), dres, w, weights, form, False, interpret=True)[1]
  assert got.dtype == jnp.bfloat16
  want = qkv_kernel.xla_backward(x, tuple(dqkv), dres, w, weights, form, False)[1].astype(
      jnp.float32)
  np.testing.assert_allclose(got.astype(jnp.float32), want, rtol=1e-2,
                             atol=1e-2 * float(jnp.abs(want).max()))


_MODERN = BertConfig(
    vocab_size=97, hidden_size=64, num_layers=3, num_heads=2, intermediate_size=64,
    max_position_embeddings=256, hidden_dropout=0.0, attention_dropout=0.0, norm_position="pre",
    norm_bias=False, mlp_type="gated", mlp_bias=False, position_embedding="rope",
    type_vocab_size=0, global_every=3, local_window=32, attention_impl="fused",
    layer_norm_eps=EPS)


def _perturbed(params):
  # Every parameter moved off its start (the norms' scales start at one).
  leaves, tree = jax.tree.flatten(params)
  return jax.tree.unflatten(tree, [p + 0.05 * jax.random.normal(jax.random.key(i), p.shape)
                                   for i, p in enumerate(leaves)])


@pytest.mark.parametrize("layers", [
    {"attention_impl": "auto"},
    {"remat_policy": "dots_kernels", "attention_bias": True, "norm_bias": True},
    {"scan_layers": True, "embedding_norm": False, "norm_type": "rmsnorm"}])
def test_a_pre_norm_model_through_the_kernel_has_xla_s_values_and_gradients(layers):
  # ModernBERT's shape: layer 0 reads the embeddings' norm as it is (no norm of its own), a
  # local layer and a global one, RoPE and the gated MLP; with biases (added in the attention
  # kernel) under remat; scanned layers with a norm in each (a skipped norm in a scan is a
  # traced choice, left to XLA). The same parameters, values and gradients as XLA's layers.
  config = dataclasses.replace(_MODERN, **layers)
  ids = np.random.default_rng(2).integers(0, 97, (2, 256))
  models = {impl: BertModel(dataclasses.replace(config, mlp_impl=impl))
            for impl in ("xla", "pallas")}
  params = nn.unbox(models["xla"].init(jax.random.key(0), ids)["params"])
  assert jax.tree.structure(params) == jax.tree.structure(
      nn.unbox(models["pallas"].init(jax.random.key(0), ids)["params"]))
  params = _perturbed(params)
  probe = jax.random.normal(jax.random.key(7), (2, 256, 64))
  loss = lambda model, p: jnp.sum(model.apply({"params": p}, ids)[0] * probe)
  text = str(jax.make_jaxpr(jax.grad(functools.partial(loss, models["pallas"])))(params))
  assert "fused_qkv_bwd" in text
  assert_models_agree(loss, models, params)


def test_remat_keeps_q_k_and_v_so_the_kernel_s_forward_runs_once():
  # Under remat "dots" the forward kernel runs again in the backward (its outputs are no
  # matmul's); the policies that keep the kernels' outputs keep q, k and v ("qkv") too.
  ids = np.random.default_rng(0).integers(1, 97, (2, 256))
  config = dataclasses.replace(_MODERN, mlp_impl="pallas", num_layers=2, embedding_norm=False)
  params = nn.unbox(BertModel(config).init(jax.random.key(0), ids)["params"])
  calls = {}
  for policy in ("none", "dots", "dots_mlp", "dots_kernels", "dots_outputs"):
    cfg = dataclasses.replace(config, remat_policy=policy)
    loss = lambda p, cfg=cfg: jnp.sum(BertModel(cfg).apply({"params": p}, ids)[0])
    text = str(jax.make_jaxpr(jax.grad(loss))(params))
    calls[policy] = (text.count("fused_qkv_fwd"), text.count("fused_qkv_bwd"))
  assert calls["none"][1] > 0, calls
  assert calls["dots_mlp"] == calls["dots_kernels"] == calls["dots_outputs"] == calls["none"], (
      calls)
  assert calls["dots"][0] > calls["none"][0] and calls["dots"][1] == calls["none"][1], calls


def test_on_a_mesh_each_device_runs_its_rows_and_gives_what_one_device_does():
  # data x fsdp x tensor = 2 x 2 x 2: the kernels run on each device's rows, the weights whole,
  # q, k and v as one [3, N, C] array split by its rows; the gradients summed outside.
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), sharding.MESH_AXES)
  x, w, weights, dqkv, dres = _arrays(512, 128, 128)
  norm = lambda n: (n, EPS, True)
  read = lambda out: jnp.sum(out[0][0] * dqkv) + jnp.sum(out[1] * dres)
  loss = lambda x, w, n: read(qkv_kernel.projections(x, w, norm(n), True))
  expected = jax.value_and_grad(loss, argnums=(0, 1, 2))(x, w, weights)
  run = jax.jit(sharding.logical_context(mesh)(jax.value_and_grad(loss, argnums=(0, 1, 2))))
  rows = jax.device_put(x, NamedSharding(mesh, PartitionSpec(sharding.BATCH_AXES)))
  value, grads = run(rows, w, weights)
  np.testing.assert_allclose(value, expected[0], rtol=1e-5)
  for g, e in zip(grads, expected[1]):
    np.testing.assert_allclose(g, e, atol=1e-4 * float(jnp.abs(e).max()))
