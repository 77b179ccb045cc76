"""A post-norm layer's attention end in kernels (bertjax/model/kernels/end_kernel.py): values and
every gradient against the formula written out, XLA's fallback and two cores against the kernel,
and a BERT model through them against XLA's layers. On a CPU the kernels run in Pallas'
interpreter; tests/test_aot.py compiles a model that takes them for a TPU."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from bertjax.model import dropout, mlp
from bertjax.model.config import BertConfig
from bertjax.model.encoder import BertModel
from bertjax.model.kernels import end_kernel
from bertjax.parallel import sharding

from kernel_checks import assert_backwards_agree, assert_models_agree

EPS = 1e-12


def _arrays(tokens, inner, width):
  keys = jax.random.split(jax.random.key(0), 7)
  normal = lambda k, shape, scale: jax.random.normal(k, shape) * scale
  weights = jnp.stack([1.0 + normal(keys[5], (width,), 0.1), normal(keys[6], (width,), 0.1)])
  return (normal(keys[0], (tokens, inner), 1.0), normal(keys[1], (tokens, width), 1.0),
          normal(keys[2], (inner, width), 0.1), normal(keys[3], (width,), 0.1), weights,
          normal(keys[4], (tokens, width), 1.0))


@pytest.mark.parametrize("rate", [0.0, 0.1])
def test_the_attention_end_and_its_gradients_are_the_formula_written_out(rate):
  # 1,024 tokens: two blocks of 512 a grid step, two sequences of one on two cores.
  c, r, w, b, weights, dy = _arrays(1024, 64, 32)
  words = dropout.key_words(jax.random.key(4))
  keep = dropout.token_decisions(*words.astype(jnp.uint32), jnp.uint32(0), 1024, 32, rate)
  scale = 1.0 / (1.0 - dropout.quantised_rate(rate))

  def written_out(c, r, w, b, weights):
    s = r + jnp.where(keep, (c @ w + b) * scale, 0.0)
    centred = s - s.mean(-1, keepdims=True)
    return (centred / jnp.sqrt((centred * centred).mean(-1, keepdims=True) + EPS) * weights[0]
            + weights[1])

  expected, pull_ref = jax.vjp(written_out, c, r, w, b, weights)
  got, pull = jax.vjp(lambda c, r, w, b, n: end_kernel.end(c, r, w, b, (n, EPS, True, rate,
                                                                         words)),
                      c, r, w, b, weights)
  np.testing.assert_allclose(got, expected, atol=1e-4, rtol=1e-4)
  for name, g, e in zip(("c", "r", "w", "b", "norm"), pull(dy), pull_ref(dy)):
    np.testing.assert_allclose(g, e, atol=5e-4, rtol=1e-4, err_msg=f"d/d{name}")

  post = (EPS, True, rate)
  key = jnp.concatenate([words, jnp.zeros((2,), jnp.int32)])[None]
  c = jax.lax.bitcast_convert_type(c, jnp.uint32)  # the kernels read c as its bits
  y, s = end_kernel._forward(c, r, w, b[None], weights, key, post, interpret=True)
  for got, want in zip((y, s), end_kernel.xla_forward(c, r, w, b[None], weights, key, post)):
    np.testing.assert_allclose(*(jax.lax.bitcast_convert_type(a, jnp.float32)
                                 if a.dtype == jnp.uint32 else a for a in (got, want)), atol=1e-5)
  kernel = end_kernel._backward(c, dy, s, w, weights, key, post, interpret=True)
  two = end_kernel._backward(c, dy, s, w, weights, key, post, interpret=True, cores=2)
  xla = end_kernel.xla_backward(c, dy, s, w, weights, key, post)
  assert_backwards_agree(kernel, two, xla, 5)


def test_in_bfloat16_the_weights_gradient_leaves_in_its_dtype_made_in_float32():
  # dW summed over the two blocks in float32 and rounded once: within bfloat16's rounding of
  # XLA's float32 product, and in bfloat16.
  c, r, w, b, weights, dy = _arrays(1024, 64, 256)
  bf = lambda a: a.astype(jnp.bfloat16)
  post = (EPS, True, 0.0)
  key = jnp.zeros((1, 4), jnp.int32)
  bits = jax.lax.bitcast_convert_type(bf(c), jnp.uint16)
  _, s = end_kernel._forward(bits, bf(r), bf(w), b[None], weights, key, post, interpret=True)
  got = end_kernel._backward(bits, bf(dy), s, bf(w), weights, key, post, interpret=True)[2]
  assert got.dtype == jnp.bfloat16
  # XLA's product of the same bfloat16 operands, accumulated in float32 and rounded once.
  want = end_kernel.xla_backward(bits, bf(dy), s, bf(w), weights, key, post)[2].astype(
      jnp.float32)
  np.testing.assert_allclose(got.astype(jnp.float32), want, rtol=1e-2,
                             atol=1e-2 * float(jnp.abs(want).max()))


@pytest.mark.parametrize("start", [False, True])
def test_a_bert_model_through_the_kernels_has_xla_s_values_and_gradients(start, monkeypatch):
  # The same parameters; with hidden dropout off, the same output and gradients as XLA's layers
  # (the attention kernel on both sides), the attention end's and the MLP's by the kernels, and
  # with `start` q, k and v by qkv_kernel (as on v5p; the CPU's chip named "").
  if start:
    monkeypatch.setattr(mlp, "POST_NORM_START_ON", ("",))
  config = BertConfig(vocab_size=97, hidden_size=32, num_layers=2, num_heads=4,
                      intermediate_size=128, max_position_embeddings=128, hidden_dropout=0.0,
                      attention_dropout=0.0, attention_impl="fused")
  ids = np.random.default_rng(2).integers(0, 97, (2, 128))  # the attention kernel's length
  models = {impl: BertModel(dataclasses.replace(config, mlp_impl=impl))
            for impl in ("xla", "pallas")}
  params = nn.unbox(models["xla"].init(jax.random.key(0), ids)["params"])
  # Every parameter moved off its start (the biases start at zero, the norms' scales at one).
  leaves, tree = jax.tree.flatten(params)
  params = jax.tree.unflatten(tree, [p + 0.05 * jax.random.normal(jax.random.key(i), p.shape)
                                     for i, p in enumerate(leaves)])
  assert jax.tree.structure(params) == jax.tree.structure(
      nn.unbox(models["pallas"].init(jax.random.key(0), ids)["params"]))
  probe = jax.random.normal(jax.random.key(7), (2, 128, 32))

  def loss(model, p):
    out, _ = model.apply({"params": p}, ids, deterministic=False, rngs={"dropout":
                                                                          jax.random.key(1)})
    return jnp.sum(out * probe)

  assert_models_agree(loss, models, params)
  text = str(jax.make_jaxpr(jax.grad(lambda p: loss(models["pallas"], p)))(params))
  assert ("fused_qkv_bwd" in text) == start


def test_the_end_s_dropout_is_the_same_on_a_mesh_and_another_key_gives_other_decisions():
  # Each device draws the decisions of its own tokens by their index in the global batch, so 8
  # devices (data x fsdp x tensor) give what one does.
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), sharding.MESH_AXES)
  config = BertConfig(vocab_size=97, hidden_size=32, num_layers=1, num_heads=4,
                      intermediate_size=128, max_position_embeddings=128, hidden_dropout=0.1,
                      attention_dropout=0.0, attention_impl="fused", mlp_impl="pallas")
  ids = np.random.default_rng(2).integers(0, 97, (4, 128))
  params = nn.unbox(BertModel(config).init(jax.random.key(0), ids)["params"])
  probe = jax.random.normal(jax.random.key(7), (4, 128, 32))

  def loss(p, batch, key):
    out, _ = BertModel(config).apply({"params": p}, batch, deterministic=False,
                                     rngs={"dropout": key})
    return jnp.sum(out * probe)

  expected = jax.value_and_grad(loss)(params, ids, jax.random.key(3))
  other = loss(params, ids, jax.random.key(4))
  assert abs(float(other - expected[0])) > 1e-3 * abs(float(expected[0]))
  run = jax.jit(sharding.logical_context(mesh)(jax.value_and_grad(loss)))
  rows = jax.device_put(ids, NamedSharding(mesh, PartitionSpec(sharding.BATCH_AXES)))
  value, grads = run(params, rows, jax.random.key(3))
  np.testing.assert_allclose(value, expected[0], rtol=1e-5)
  scale = max(float(jnp.abs(e).max()) for e in jax.tree.leaves(expected[1]))
  for (path, g), e in zip(jax.tree_util.tree_leaves_with_path(grads),
                          jax.tree.leaves(expected[1])):
    assert float(jnp.abs(g - e).max()) / scale < 1e-4, jax.tree_util.keystr(path)
