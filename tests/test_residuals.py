"""bertjax/model/residuals.py: a scanned layer's residuals kept as bits, values and gradients unchanged."""

import re

import jax
import jax.numpy as jnp
import numpy as np

from bertjax.model import dropout, residuals

LAYERS = 3


def _layer(w_DxD, x_BxD, key):
  """A bfloat16 layer whose backward needs bfloat16 residuals (the matmul's inputs, GELU's
  input) and a dropout mask."""
  h = jnp.dot(x_BxD.astype(jnp.bfloat16), w_DxD.astype(jnp.bfloat16))
  return dropout.apply(jax.nn.gelu(h), key, 0.25).astype(jnp.float32) + x_BxD


def _loss(layer):
  def loss(w_NxDxD, x_BxD, key):
    keys = jax.random.split(key, LAYERS)
    h, _ = jax.lax.scan(lambda h, wk: (layer(wk[0], h, wk[1]), None), x_BxD, (w_NxDxD, keys))
    return jnp.sum(h ** 2)
  return loss


def _args():
  rng = np.random.default_rng(0)
  return (jnp.asarray(rng.normal(size=(LAYERS, 16, 16)) * 0.3, jnp.float32),
          jnp.asarray(rng.normal(size=(4, 16)), jnp.float32), jax.random.key(3))


def _stacked_residual_dtypes(loss, args):
  """The dtypes of what the forward scan stacks for the backward pass ([LAYERS, ...] outputs)."""
  jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(*args).jaxpr
  scans = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
  return {v.aval.dtype.name for v in scans[0].outvars
          if v.aval.shape[:1] == (LAYERS,) and v.aval.ndim > 1}


def test_saving_bits_changes_no_value_and_no_gradient_bit_for_bit():
  args = _args()
  plain = jax.jit(jax.value_and_grad(_loss(_layer), argnums=(0, 1)))(*args)
  bits = jax.jit(jax.value_and_grad(_loss(residuals.saving_bits(_layer)), argnums=(0, 1)))(*args)
  for ours, reference in zip(jax.tree.leaves(bits), jax.tree.leaves(plain)):
    np.testing.assert_array_equal(ours, reference)
  assert float(jnp.abs(plain[1][0]).sum()) > 0  # gradients that could differ


def test_the_scan_stacks_bfloat16_residuals_as_unsigned_integers():
  # What the CPU backend needs to update each layer's slice in place (no whole-buffer convert).
  args = _args()
  assert "bfloat16" in _stacked_residual_dtypes(_loss(_layer), args)  # what the codec removes
  stacked = _stacked_residual_dtypes(_loss(residuals.saving_bits(_layer)), args)
  assert "uint16" in stacked and "bfloat16" not in stacked


def test_encode_round_trips_every_narrow_float_and_leaves_the_rest():
  tree = {"b": jnp.arange(4, dtype=jnp.bfloat16), "h": jnp.arange(3, dtype=jnp.float16),
          "f": jnp.arange(2, dtype=jnp.float32), "i": jnp.arange(2, dtype=jnp.int32), "n": None}
  encoded = residuals.encode(tree)
  assert {k: v.bits.dtype.name for k, v in encoded.items() if isinstance(v, residuals.Bits)} == {
      "b": "uint16", "h": "uint16"}
  assert encoded["f"] is tree["f"] and encoded["i"] is tree["i"]
  decoded = residuals.decode(encoded)
  for name in ("b", "h", "f", "i"):
    assert decoded[name].dtype == tree[name].dtype
    np.testing.assert_array_equal(decoded[name], tree[name])


def test_a_jax_whose_pullback_is_a_plain_function_calls_the_layer_directly(monkeypatch):
  # saving_bits stores jax.vjp's pullback as the pytree of its residuals (jax 0.10.2's VJP). A
  # jax where it is a plain function gets the scanned layers called as before: the same model.
  from bertjax.model.config import BertConfig  # pylint: disable=import-outside-toplevel
  from bertjax.model.encoder import BertModel  # pylint: disable=import-outside-toplevel
  assert residuals.pullback_is_a_pytree()
  cfg = BertConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                   hidden_dropout=0.0, attention_dropout=0.0, scan_layers=True, dtype="bfloat16")
  ids = jnp.asarray(np.random.default_rng(1).integers(5, 64, (2, 8)), jnp.int32)
  model = BertModel(cfg)
  params = model.init(jax.random.key(0), ids)
  loss = lambda p: jnp.sum(model.apply(p, ids)[0].astype(jnp.float32) ** 2)
  reference = jax.jit(jax.value_and_grad(loss))(params)
  real_vjp = jax.vjp

  def plain_vjp(fun, *primals):
    y, pullback = real_vjp(fun, *primals)
    return y, lambda ct: pullback(ct)

  monkeypatch.setattr(jax, "vjp", plain_vjp)
  assert not residuals.pullback_is_a_pytree()
  direct = jax.jit(jax.value_and_grad(loss))(params)
  for a, b in zip(jax.tree.leaves(direct), jax.tree.leaves(reference)):
    np.testing.assert_array_equal(a, b)
  jaxpr = str(jax.make_jaxpr(jax.grad(loss))(params))
  assert "custom_vjp" not in jaxpr and "uint16" not in jaxpr  # called directly, as before


@jax.custom_vjp
def _opaque(x):
  """A stand-in for a Pallas kernel: a result XLA cannot fuse a rounding into."""
  return jnp.sin(x)


_opaque.defvjp(lambda x: (jnp.sin(x), x), lambda x, dy: (jnp.cos(x) * dy,))


def _kept_by_name(name_it):
  def f(w_DxD, x_BxD):
    y = name_it(_opaque(x_BxD @ w_DxD).astype(jnp.bfloat16), "kernel_output")
    return jnp.sum(jnp.tanh(y.astype(jnp.float32)) * x_BxD)
  return jax.checkpoint(f, policy=jax.checkpoint_policies.save_only_these_names("kernel_output"))


def test_a_named_residual_is_kept_as_bits_with_no_rounding_and_the_same_gradients():
  w, x = jnp.asarray(np.random.default_rng(2).normal(size=(2, 8, 8)) * 0.5, jnp.float32)
  grad = lambda name_it: jax.grad(_kept_by_name(name_it), argnums=(0, 1))
  plain, bits = grad(jax.ad_checkpoint.checkpoint_name), grad(residuals.named)
  for ours, reference in zip(jax.jit(bits)(w, x), jax.jit(plain)(w, x)):
    np.testing.assert_array_equal(ours, reference)
  # jax's remat rounds a float residual through reduce_precision (a pass of its own after a
  # kernel); the bits it keeps as they are.
  assert "reduce_precision" in str(jax.make_jaxpr(plain)(w, x))
  program = str(jax.make_jaxpr(bits)(w, x))
  assert "reduce_precision" not in program
  assert re.search(r"u16\[8,8\] = name\[name=kernel_output\]", program), program


def test_the_kernels_outputs_are_kept_as_bits_by_the_remat_policies():
  # The kernels' results the kernel-keeping policies save: each a uint16 residual, so no
  # rounding pass follows the attention and MLP kernels on a TPU. The MLP kernel's kept
  # pre-activation stays a float (as bits its step moved more: mlp_kernel._mlp_fwd).
  from bertjax.model.config import BertConfig  # pylint: disable=import-outside-toplevel
  from bertjax.model.encoder import BertModel  # pylint: disable=import-outside-toplevel
  cfg = BertConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64,
                   hidden_dropout=0.0, attention_dropout=0.0, dtype="bfloat16",
                   attention_impl="fused", mlp_impl="pallas_kept", remat_policy="dots_kernels")
  ids = jnp.asarray(np.random.default_rng(1).integers(5, 64, (1, 128)), jnp.int32)
  model = BertModel(cfg)
  params = model.init(jax.random.key(0), ids)
  loss = lambda p: jnp.sum(model.apply(p, ids)[0].astype(jnp.float32) ** 2)
  program = str(jax.make_jaxpr(jax.grad(loss))(params))
  kept = re.findall(r"(\w+)\[[\d,]*\] = name\[name=(\w+)\]", program)
  assert sorted(set(kept)) == [("bf16", "mlp_hidden"), ("u16", "attention_output"),
                               ("u16", "mlp_output")], kept
