"""A scanned layer's saved residuals kept as raw bits, so every backend writes them in place.

Under `nn.scan`, autodiff saves each layer's residuals (the bfloat16 inputs of its matmuls, its
GELU's input, ...) by writing them into stacked [num_layers, ...] buffers, one slice per layer
(a dynamic-update-slice inside the loop). XLA's CPU backend has no bfloat16 dynamic-update-slice:
its float normalisation rewrites each one as "convert the whole stacked buffer to float32, update
the slice, convert it all back", at every layer, so the step's traffic grows with the square of
the layer count (docs/performance.md#throughput: scanned bfloat16 was the slowest BERT-Base row
on a CPU). Integers it updates in place on every backend.

`saving_bits(f)` is `f` with the same values and gradients, bit for bit, whose residuals of a
16-bit (or 8-bit) float type are stored as unsigned integers of the same width
(`lax.bitcast_convert_type`: no arithmetic, the same bytes) and turned back before the backward
pass reads them. `scanned_call` applies it to the layer inside nn.scan's body.

`named(x, name)` keeps a named residual as bits the same way, for the remat policies. (On a TPU a
bitcast of a Pallas kernel's result still runs as an op, unless the kernel writes the bits.)
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

_NARROW = (1, 2)  # the bytes of the float types whose residuals are kept as their bits


@jax.tree_util.register_pytree_node_class
class Bits:
  """A float residual's bits, marked so `decode` knows which integers to turn back; the float
  type is static (the tree's structure), the bits its one leaf."""

  def __init__(self, bits: jax.Array, dtype: Any):
    self.bits, self.dtype = bits, dtype

  def tree_flatten(self):
    return (self.bits,), self.dtype

  @classmethod
  def tree_unflatten(cls, dtype, children):
    return cls(children[0], dtype)


def _narrow_float(x) -> bool:
  dtype = getattr(x, "dtype", None)
  return (dtype is not None and jnp.issubdtype(dtype, jnp.floating)
          and jnp.dtype(dtype).itemsize in _NARROW)


def bits_type(dtype) -> jnp.dtype:
  """The unsigned integer type as wide as `dtype`."""
  return jnp.dtype(f"uint{8 * jnp.dtype(dtype).itemsize}")


def bits(x) -> jax.Array:
  """A float array's bits, as the unsigned integers of its width (32-bit floats' too)."""
  return jax.lax.bitcast_convert_type(x, bits_type(x.dtype))


def encode(tree):
  """Each float leaf narrower than 32 bits as its Bits; the rest as they are."""
  return jax.tree.map(
      lambda x: (Bits(bits(x), x.dtype)
                 if _narrow_float(x) else x), tree)


def decode(tree):
  """`encode` undone."""
  return jax.tree.map(lambda x: jax.lax.bitcast_convert_type(x.bits, x.dtype)
                      if isinstance(x, Bits) else x, tree, is_leaf=lambda x: isinstance(x, Bits))


def _through_bits(x, name: str):
  if not _narrow_float(x):
    return jax.ad_checkpoint.checkpoint_name(x, name)
  return jax.lax.bitcast_convert_type(jax.ad_checkpoint.checkpoint_name(bits(x), name), x.dtype)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def named(x, name: str):
  """`jax.ad_checkpoint.checkpoint_name(x, name)`, the value a remat policy keeps stored as the
  unsigned integers of its bits when x is a 16-bit (or 8-bit) float; the same value and gradient.

  jax's remat rounds every float residual it keeps through a `reduce_precision` placed on the
  residual's producer (so the backward reads what the forward used). After a matmul XLA fuses it
  into the product; after a Pallas kernel it cannot, and the rounding runs as an operation of its
  own that reads the kernel's output and writes a second copy, a pass over [tokens, D] at each
  kernel a layer. The bits need no rounding. The bitcast to bits may itself run as an op after a
  kernel; a kernel that writes its result's bits (the fused attention's forward, turned back
  after it) leaves XLA a pair of bitcasts to fold, and its own output is what is kept
  (docs/performance.md has the step's figures).
  """
  return _through_bits(x, name)


@named.defjvp
def _named_jvp(name, primals, tangents):
  return _through_bits(primals[0], name), tangents[0]


def saving_bits(f: Callable) -> Callable:
  """f(params, x, *rest) differentiated in params and x (not `rest`: masks, keys, indices), its
  residuals saved as `encode` keeps them.

  Everything f reads is an argument: a value it closed over from the enclosing trace (a dropout
  key drawn in the scan's body) would be captured by jax.vjp's linearised program, outside the
  residuals, and leak out of the scan when the backward pass is traced.
  """
  wrapped = jax.custom_vjp(f)

  def forward(params, x, *rest):
    y, pullback = jax.vjp(lambda p, h: f(p, h, *rest), params, x)
    return y, (encode(pullback), len(rest))  # its leaves are the residuals

  def backward(saved, dy):
    pullback, n_rest = saved
    return (*decode(pullback)(dy), *(None,) * n_rest)

  wrapped.defvjp(forward, backward)
  return wrapped


def pullback_is_a_pytree() -> bool:
  """Whether jax.vjp's pullback is a pytree whose leaves are its residuals (jax 0.10.2's
  jax._src.api.VJP is one, registered as such), which `saving_bits` stores. A jax whose pullback
  is a plain function gets the layer called directly (`scanned_call`): its residuals stored as
  they are, as before this module."""
  _, pullback = jax.vjp(jnp.sin, jnp.ones((), jnp.float32))
  leaves = jax.tree.leaves(pullback)
  return bool(leaves) and all(hasattr(leaf, "dtype") for leaf in leaves)


def scanned_call(parent: nn.Module, layer_cls, layer_args: tuple, name: str, inputs: tuple,
                 draws_dropout: bool):
  """`layer_cls(*layer_args, name=name)(*inputs)` called from `parent`'s compact body (nn.scan's),
  through `saving_bits`.

  The layer runs as a pure function of its parameters (parent's `name` subtree), so the custom
  gradient sees all it reads. Its dropout key is drawn here, one per layer (nn.scan splits the
  "dropout" stream), and the layer draws its masks from it by flax's usual names: the same
  masks on every run of the same step, other masks than a layer called directly would draw.
  Initialisation calls the layer directly, which creates the parameters.
  """
  if parent.is_initializing() or not pullback_is_a_pytree():
    return layer_cls(*layer_args, name=name)(*inputs)
  params = parent.variables["params"][name]
  key = parent.make_rng("dropout") if draws_dropout else None
  layer = layer_cls(*layer_args)

  def apply(p, x, key, *rest):
    return layer.apply({"params": p}, x, *rest,
                       rngs=None if key is None else {"dropout": key})

  return saving_bits(apply)(params, inputs[0], key, *inputs[1:])
