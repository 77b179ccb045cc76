"""Rotary position embeddings (RoPE; Su et al., 2021), by XLA and inside the fused attention kernel.

q and k of a head are turned, pair by pair, by angles that grow with the token's position: dimension
i of the first half pairs with i + K/2 (the "rotate half" layout of GPT-NeoX and Hugging Face's
ModernBERT, so imported q/k weights need no permutation), turning at frequency theta^(-2i/K).

By XLA (`rope_tables`, `apply_rope`), in float32 and back to the compute dtype, on [B, L, N, K]:
what attention_impl "xla", "splash" and "cudnn" read. The fused kernel (attention_kernel.py) turns
q and k as it reads them instead (`turned`, `turned_back`, on a block's heads side by side):
by XLA, the rotation's float32 copies, relayouts and their gradients were 55% of ModernBERT-base's
HBM bytes on v6e-8 (docs/performance.md, "ModernBERT-base, compiled"). The kernel reads each
row's positions and one frequency a lane (`lane_frequencies`), and makes the angles in VMEM.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu


def frequencies(head_size: int, theta: float) -> np.ndarray:
  """[K] float32: the turning frequency of each head dimension (both halves of a pair alike)."""
  inv_freq_H = 1.0 / theta ** (np.arange(0, head_size, 2, dtype=np.float64) / head_size)
  return np.concatenate([inv_freq_H, inv_freq_H]).astype(np.float32)


def lane_frequencies(head_size: int, heads: int, theta: float) -> np.ndarray:
  """[N * K] float32: `frequencies` for each of `heads` heads side by side."""
  return np.tile(frequencies(head_size, theta), heads)


def rope_tables(position_ids_BxL: jax.Array, head_size: int, theta: float):
  """(cos, sin) [B, L, K] float32 of the rotary angles at the given positions."""
  angle_BxLxK = (position_ids_BxL.astype(jnp.float32)[..., None]
                 * frequencies(head_size, theta))
  return jnp.cos(angle_BxLxK), jnp.sin(angle_BxLxK)


def apply_rope(x_BxLxNxK: jax.Array, cos_BxLxK: jax.Array, sin_BxLxK: jax.Array) -> jax.Array:
  """x rotated by its positions' angles, in float32 and back to x's dtype."""
  x = x_BxLxNxK.astype(jnp.float32)
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  out = x * cos_BxLxK[:, :, None, :] + rotated * sin_BxLxK[:, :, None, :]
  return out.astype(x_BxLxNxK.dtype)


def _partners(x_LxW, size: int, roll):
  """Each lane's pair partner in heads of `size` side by side: (the lane half a head above, the
  lane half a head below), by whole-width rotations of the lanes."""
  width, half = x_LxW.shape[-1], size // 2
  return roll(x_LxW, width - half), roll(x_LxW, half)


def _first_half(width: int, size: int):
  lane = jax.lax.broadcasted_iota(jnp.int32, (1, width), 1)
  return lane % size < size // 2


def _roll(in_kernel: bool):
  # Mosaic rotates lanes by its own op; jnp.roll is the same permutation by XLA.
  return ((lambda x, s: pltpu.roll(x, s, 1)) if in_kernel
          else (lambda x, s: jnp.roll(x, s, axis=-1)))


def turned(x_LxW, angle_LxW, size: int, in_kernel: bool = True):
  """x ([..., W]: heads of `size` side by side) turned by `angle` (float32, a lane each), in
  float32 and back to x's dtype: `apply_rope`'s arithmetic, element for element."""
  f = x_LxW.astype(jnp.float32)
  above, below = _partners(f, size, _roll(in_kernel))
  rotated = jnp.where(_first_half(f.shape[-1], size), -above, below)
  return (f * jnp.cos(angle_LxW) + rotated * jnp.sin(angle_LxW)).astype(x_LxW.dtype)


def turned_back(g_LxW, angle_LxW, size: int, in_kernel: bool = True):
  """The gradient of x from that of `turned(x, angle)` (float32 [..., W]): the transposed turn,
  g cos + R^T (g sin), in float32."""
  s = g_LxW * jnp.sin(angle_LxW)
  above, below = _partners(s, size, _roll(in_kernel))
  return g_LxW * jnp.cos(angle_LxW) + jnp.where(_first_half(s.shape[-1], size), above, -below)
