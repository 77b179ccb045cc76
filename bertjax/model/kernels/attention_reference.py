"""The fused attention kernels' arithmetic by XLA (attention_kernel.py): where there is no
Mosaic (a GPU; a CPU without the interpreter), and what the tests hold the kernels to. q, k and v
come as the kernels take them: each [B, L, N * K], or one product's [3, B, L, N * K]."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from bertjax.model import dropout, residuals, rope
from bertjax.model.dropout import keep_decisions
from bertjax.model.kernels import attention_blocks as blocks

_F32, _U32 = jnp.float32, jnp.uint32


def dropped(p, keep, rate: float):
  """p kept where `keep` and scaled (dropout at `rate`), or p where there is none."""
  return p if rate <= 0.0 else dropout.kept(p, keep, rate)


def reference(rows_ids, first_head, key, seg, bias, q, k, v, *, rate, local_window, size):
  """The kernels' arithmetic by XLA ([B, L, N * K] in and out, heads of `size`; `bias` [3,
  N * K] added to q, k and v first)."""
  rows, length, width = q.shape
  q, k, v = (x + b.astype(x.dtype) for x, b in zip((q, k, v), bias))
  if seg.shape[1] > 1:  # RoPE, as the kernel turns q and k
    angle = seg[:, 1, :, None].astype(_F32) * bias[3]
    q, k = (rope.turned(x, angle, size, in_kernel=False) for x in (q, k))
  q, k, v = (x.reshape(rows, length, width // size, size) for x in (q, k, v))
  seg_k = seg[:, :1, None, :]  # [B, 1, 1, L]
  allowed = blocks.allowed(jnp.swapaxes(seg_k, -1, -2), seg_k, local_window)
  # Each row's heads (axis 1 of its [L, N, K]), then each row: p [B, N, L, L].
  p = jax.vmap(jax.vmap(functools.partial(blocks.probabilities, scale=1.0 / np.sqrt(size)),
                        in_axes=(1, 1, 0)))(
      q, k, jnp.broadcast_to(allowed, (rows, q.shape[2], length, length)))
  keep = None
  if rate > 0:
    row = rows_ids.astype(_U32)[:, None, None, None]
    heads = (first_head[0] + jnp.arange(q.shape[2])).astype(_U32)[None, :, None, None]
    keep = keep_decisions(key[0].astype(_U32), key[1].astype(_U32), row, heads, length, rate)
  out = jnp.einsum("bnqs,bsnk->bqnk", dropped(p, keep, rate).astype(v.dtype), v)
  return out.reshape(rows, length, width)


def forward(rows_ids, first_head, key, seg, bias, *qkv, floats=None, **kwargs):
  """The forward kernel's result: the output's bits. `floats`: q, k and v come as the bits of
  that float type (`attention_kernel._call`'s)."""
  return residuals.bits(reference(rows_ids, first_head, key, seg, bias,
                                  *_apart(_floated(qkv, floats)), **kwargs))


def backward(rows_ids, first_head, key, seg, bias, *qkv_do, rate, local_window, size,
             floats=None):
  """The backward kernel's results: dq, dk and dv (packed: as one) and their sums over
  positions."""
  qkv_do = _floated(qkv_do[:-1], floats) + qkv_do[-1:]
  _, pull = jax.vjp(lambda q, k, v: reference(rows_ids, first_head, key, seg, bias, q, k, v,
                                              rate=rate, local_window=local_window, size=size),
                    *_apart(qkv_do[:-1]))
  grads = pull(qkv_do[-1])
  sums = jnp.stack([g.sum(1, dtype=_F32) for g in grads], axis=1)
  return (jnp.stack(grads), sums) if len(qkv_do) == 2 else (*grads, sums)


def _floated(arrays: tuple, floats) -> tuple:
  """The arrays as they are, or (`floats` a float type) turned back from their bits."""
  if floats is None:
    return tuple(arrays)
  return tuple(jax.lax.bitcast_convert_type(a, floats) for a in arrays)


def _apart(qkv: tuple) -> tuple:
  """q, k and v from themselves or from their [3, B, L, N * K]."""
  return tuple(qkv[0]) if len(qkv) == 1 else qkv
