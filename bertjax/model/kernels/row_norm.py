"""A LayerNorm or RMSNorm of whole rows made inside a kernel that reads the rows, and its backward
(`mlp_kernel.mlp(..., norm=...)`: a pre-norm layer's MLP, ModernBERT's).

Written by XLA before an opaque kernel, the norm's output is a [tokens, D] tensor of its own,
written and read again, and its backward reads the kernel's gradient in passes of its own (a
float32 copy and two reductions): ModernBERT-base's phase 1 on v6e-8 moved 424 GB a step in its
LayerNorms with the MLP in one kernel, where XLA's products, which take the norm in, had left
194 (docs/performance.md, "The gated MLP and its pre-norm in one kernel, and the kernels on
v5e"). A block of the kernel holds whole rows of D, so each row's statistics are made where the
row is read, and the backward makes them again from the same rows.

The weights come in as one float32 [2, D] array, the scale and the bias (zeros where the norm
has none), and their gradients go out as one [2, D] sum. The arithmetic is the norm's in float32
(`primitives.layer_norm` with float32 statistics), the output rounded to the rows' dtype once;
the variance as the mean of squared deviations from the mean, where flax's LayerNorm takes
E[x^2] - E[x]^2: the same but for float32 rounding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_F32 = jnp.float32


def normalised(rows, weights_2xD, eps: float, centred: bool):
  """(the normalised rows, scaled and shifted, in the rows' dtype; (x̂, 1 / sigma) in float32
  for the backward). `centred`: LayerNorm (the mean taken out); else RMSNorm."""
  r = rows.astype(_F32)
  if centred:
    r = r - jnp.mean(r, axis=-1, keepdims=True)
  inv = jax.lax.rsqrt(jnp.mean(r * r, axis=-1, keepdims=True) + eps)
  x_hat = r * inv
  out = x_hat * weights_2xD[0:1, :] + weights_2xD[1:2, :]
  return out.astype(rows.dtype), (x_hat, inv)


def pulled_back(d_out, stats, weights_2xD, centred: bool):
  """(the rows' gradient in float32, the weights' gradient [2, D] summed over the rows) given
  d_out, the gradient of the normalised rows, float32."""
  x_hat, inv = stats
  g = d_out * weights_2xD[0:1, :]
  d_rows = g - x_hat * jnp.mean(g * x_hat, axis=-1, keepdims=True)
  if centred:
    d_rows = d_rows - jnp.mean(g, axis=-1, keepdims=True)
  weights = jnp.concatenate([jnp.sum(d_out * x_hat, axis=0, keepdims=True),
                             jnp.sum(d_out, axis=0, keepdims=True)], axis=0)
  return d_rows * inv, weights
