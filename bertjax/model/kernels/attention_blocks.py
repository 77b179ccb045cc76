"""A head's attention in VMEM: the pieces of attention_kernel.py's kernels, and its kernels by
blocks of queries: a local window at any length, a global layer past whole rows.

attention_kernel.py computes a head's whole [L, L] in VMEM, up to L 1,024. A local window
(ModernBERT's 128 in two layers of three) needs only the keys within half a window of a query:
for a block of BLOCK queries, the keys of that block and of its two neighbours, a slab of
3 x BLOCK (clamped at the row's ends), which holds every key the block's queries may see. Each
block's softmax is then whole in VMEM at any length, with no running maximum, and a query
computes 3 x BLOCK scores, not L: ModernBERT's phase 2 at 8,192, where the whole-row kernel does
not fit, and fewer FLOPs at 1,024. A grid step takes a row's few heads, as the whole-row kernels:
q, k and v are biased and turned (RoPE) once into VMEM, then each block of queries is computed
against its slab. The backward adds each block's dk and dv into float32 rows in VMEM and writes
them when the row is done. No dropout (`holds_window`: the whole-row kernel draws it).

A global layer past the whole-row kernel's length (phase 2's 8,192) runs the same way, each block
of queries against every block of keys with a running maximum (`by_flash`); its backward makes a
block's statistics again, rowsum(do o) among them, in a pass of q k^T and do v^T: the forward's
output as a residual of its own was not what remat kept by name, and the forward ran again.

The segments (and RoPE's positions) come in as [rows, 1 or 2, L / BLOCK, BLOCK], a block of them
a sublane, which the kernels index by block.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from bertjax.model import rope
from bertjax.parallel import platforms

BLOCK = 128  # queries a slab serves (its keys: 3 x BLOCK)
_F32 = jnp.float32
T = (((1,), (1,)), ((), ()))  # dot_general: contract the last axes of both (b's transpose)
BIG_NEGATIVE = 0.7 * float(np.finfo(np.float32).min)  # a masked score, as the XLA path


def holds_window(length: int, local_window: int, rate: float) -> bool:
  """Whether a local window at `length` runs by slabs: no dropout, half the window within a
  block, whole blocks and at least a slab's worth of them."""
  return (rate <= 0 and 0 < local_window // 2 <= BLOCK and length % BLOCK == 0
          and length >= 3 * BLOCK)


# At lengths the whole-row kernel holds, a local window runs whole rows on these chips, bound by
# HBM there: slabs read q, k and v as arrays of their own (a traced block offset into an operand
# XLA computes inside the kernel's reads fails libtpu's RET_CHECK), so a layer by slabs takes
# three products, not one, and on v6e that cost more than the scores the slabs skip
# (ModernBERT-base L 1,024 on v6e-8: 0.607 by the roofline whole, 0.541 by slabs; on v5p-8,
# bound by FLOPs, slabs 0.881 against 0.810: docs/performance.md, "ModernBERT-base: RoPE inside
# the attention kernel").
WHOLE_ROWS_ON = ("TPU_V6E",)


def by_slabs(length: int, local_window: int, rate: float, longest: int) -> bool:
  """Whether the kernels run a local window by slabs: where they hold it, past `longest` (the
  whole-row kernel's) always, below it off the chips of WHOLE_ROWS_ON."""
  return holds_window(length, local_window, rate) and (
      length > longest or platforms.tpu_chip() not in WHOLE_ROWS_ON)


def by_flash(length: int, local_window: int, rate: float, longest: int) -> bool:
  """Whether the kernels run a global layer block by block (online softmax over every block of
  keys): past `longest`, the whole-row kernel's, without dropout, in whole blocks."""
  return not local_window and rate <= 0 and length > longest and length % BLOCK == 0


def way(length: int, local_window: int, rate: float, longest: int) -> str:
  """How the kernels run a layer: "slabs" (`by_slabs`), "flash" (`by_flash`) or "whole" rows.
  One answer for the kernels and for the encoder, which gives blocks of queries q, k and v as
  arrays of their own."""
  if by_slabs(length, local_window, rate, longest):
    return "slabs"
  return "flash" if by_flash(length, local_window, rate, longest) else "whole"


def allowed(seg_q_Sx1, seg_k_1xT, local_window: int, q_start=0, k_start=0):
  """[.., S, T] bool: same segment, and within half the window (queries from `q_start`, keys
  from `k_start` in the row)."""
  same = seg_q_Sx1 == seg_k_1xT
  if local_window:
    shape = (seg_q_Sx1.shape[-2], seg_k_1xT.shape[-1])
    i = jax.lax.broadcasted_iota(jnp.int32, shape, 0) + q_start
    j = jax.lax.broadcasted_iota(jnp.int32, shape, 1) + k_start
    same = same & (jnp.abs(i - j) <= local_window // 2)
  return same


def probabilities(q_SxK, k_TxK, allowed_SxT, scale: float):
  s = jax.lax.dot_general(q_SxK, k_TxK, T, preferred_element_type=_F32) * scale
  s = jnp.where(allowed_SxT, s, BIG_NEGATIVE)
  e = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
  return e / jnp.sum(e, axis=-1, keepdims=True)


def column(seg_1xL):
  """[1, L] -> [L, 1] by a masked sum over the lanes (Mosaic transposes no [1, L] vector)."""
  length = seg_1xL.shape[-1]
  i = jax.lax.broadcasted_iota(jnp.int32, (length, length), 0)
  j = jax.lax.broadcasted_iota(jnp.int32, (length, length), 1)
  return jnp.sum(jnp.where(i == j, jnp.broadcast_to(seg_1xL, (length, length)), 0), axis=1,
                 keepdims=True)


def per_head(heads: int, size: int, width: int, fn):
  """fn(n, lanes of head n) for each of a block's heads, in turn (few: attention_kernel's
  `_heads_a_block`); the results' arrays [.., width] combined lane by lane, each head's lanes
  from its own call."""
  out = None
  lane = jax.lax.broadcasted_iota(jnp.int32, (1, width), 1)
  for n in range(heads):
    mine = (lane >= n * size) & (lane < (n + 1) * size)
    got = fn(n, mine)
    out = got if out is None else tuple(jnp.where(mine, g, o) for g, o in zip(got, out))
  return out


def biased(bias_ref, pos, size: int, *blocks):
  """q, k and v blocks each with its bias added (float32 [3, width] in `bias_ref`, its values
  those of the compute dtype, so the sum rounds as XLA's `product + bias` does), then with `pos`
  ([.., 1] float32) q and k turned (RoPE: row 3 of `bias_ref` the lanes' frequencies); and the
  angles."""
  q, k, v = ((x.astype(_F32) + bias_ref[j:j + 1, :]).astype(x.dtype)
             for j, x in enumerate(blocks))
  if pos is None:
    return q, k, v, None
  angle = pos * bias_ref[3:4, :]
  return rope.turned(q, angle, size), rope.turned(k, angle, size), v, angle


def _at(b):
  return pl.ds(pl.multiple_of(b * BLOCK, BLOCK), BLOCK)


def _positions(seg_ref, i, b):
  """Block b's positions [BLOCK, 1] float32 (RoPE), or None without."""
  if seg_ref.shape[1] < 2:
    return None
  return column(seg_ref[i, 1, pl.ds(b, 1), :]).astype(_F32)


def _prepare(i, seg_ref, bias_ref, ins, kept, size: int):
  """Row i's q, k and v, biased and (q and k) turned, into the VMEM rows `kept`, block by block."""
  def one(b, carry):
    got = biased(bias_ref, _positions(seg_ref, i, b), size, *(x[i, _at(b), :] for x in ins))
    for ref, value in zip(kept, got[:3]):
      ref[_at(b), :] = value
    return carry
  jax.lax.fori_loop(0, ins[0].shape[1] // BLOCK, one, 0)


def _slab(i, b, seg_ref, local_window: int):
  """Block b's queries, its slab of keys (both as ref slices) and which of them it may see."""
  blocks = seg_ref.shape[2]
  first = jnp.clip(b - 1, 0, blocks - 3)
  seg_k = jnp.concatenate([seg_ref[i, 0, pl.ds(first + j, 1), :] for j in range(3)], axis=1)
  sees = allowed(column(seg_ref[i, 0, pl.ds(b, 1), :]), seg_k, local_window, b * BLOCK,
                 first * BLOCK)
  return _at(b), pl.ds(pl.multiple_of(first * BLOCK, BLOCK), 3 * BLOCK), sees


def _total(x):
  return jnp.sum(x.astype(_F32), axis=0, keepdims=True)


def _turned_back(g, i, b, seg_ref, bias_ref, size: int, dtype):
  """Block b's gradient of turned q or k turned back (RoPE), rounded first as XLA's would be;
  as it is without RoPE."""
  if seg_ref.shape[1] < 2:
    return g
  return rope.turned_back(g.astype(dtype).astype(_F32),
                          _positions(seg_ref, i, b) * bias_ref[3:4, :], size)


def _begin(i, seg_ref, bias_ref, ins, kept, rows, size: int):
  """A backward's row: q, k, v into VMEM (`_prepare`), the float32 rows `rows` zeroed."""
  _prepare(i, seg_ref, bias_ref, ins, kept, size)
  for ref in rows:
    ref[...] = jnp.zeros(ref.shape, _F32)


def _written(i, seg_ref, back, kept, refs, sums_ref, dq_sum):
  """Row i's dk (turned back) and dv from the float32 VMEM rows `kept` into `refs`, and the
  three gradients' sums over its positions."""
  def one(b, sums):
    dk = back(kept[0][_at(b), :], i, b).astype(refs[0].dtype)
    dv = kept[1][_at(b), :].astype(refs[1].dtype)
    refs[0][i, _at(b), :], refs[1][i, _at(b), :] = dk, dv
    return sums[0] + _total(dk), sums[1] + _total(dv)
  zeros = jnp.zeros((1, dq_sum.shape[1]), _F32)
  dk_sum, dv_sum = jax.lax.fori_loop(0, seg_ref.shape[2], one, (zeros, zeros))
  for j, value in enumerate((dq_sum, dk_sum, dv_sum)):
    sums_ref[i, j:j + 1, :] = value


def _forward_rows(seg_ref, bias_ref, ins, o_ref, kept, size: int, per_block):
  """Each row's q, k and v into VMEM (`kept`), then each block of its queries' output, as bits:
  `per_block(i, b)` gives block b's attention of one head's q (the others' lanes zero)."""
  heads, width = ins[0].shape[2] // size, ins[0].shape[2]

  def row(i, carry):
    _prepare(i, seg_ref, bias_ref, ins, kept, size)

    def block(b, carry):
      q, attend = kept[0][_at(b), :], per_block(i, b)
      zero = jnp.zeros((), q.dtype)
      out = per_head(heads, size, width, lambda n, mine: (attend(jnp.where(mine, q, zero)),))[0]
      o_ref[i, _at(b), :] = jax.lax.bitcast_convert_type(out.astype(q.dtype), o_ref.dtype)
      return carry
    return jax.lax.fori_loop(0, seg_ref.shape[2], block, carry)
  jax.lax.fori_loop(0, ins[0].shape[0], row, 0)


def slab_forward_kernel(rows_ref, first_head_ref, key_ref, seg_ref, bias_ref, q_ref, k_ref,
                        v_ref, o_ref, qs, ks, vs, *, rate, local_window, scale, size, unrolled):
  """attention_kernel's forward (its output's bits) by slabs; `qs`, `ks`, `vs` VMEM [L, width]."""
  del rows_ref, first_head_ref, key_ref, rate, unrolled

  def per_block(i, b):
    _, slab, sees = _slab(i, b, seg_ref, local_window)
    k, v = ks[slab, :], vs[slab, :]
    return lambda q: jnp.dot(probabilities(q, k, sees, scale).astype(v.dtype), v,
                             preferred_element_type=_F32)
  _forward_rows(seg_ref, bias_ref, (q_ref, k_ref, v_ref), o_ref, (qs, ks, vs), size, per_block)


def slab_backward_kernel(rows_ref, first_head_ref, key_ref, seg_ref, bias_ref, q_ref, k_ref,
                         v_ref, do_ref, dq_ref, dk_ref, dv_ref, sums_ref, qs, ks, vs, dk_rows,
                         dv_rows, *, rate, local_window, scale, size, unrolled):
  """attention_kernel's backward by slabs: dq a block at a time, dk and dv added up in the
  float32 VMEM rows `dk_rows`, `dv_rows` and written when the row is done; q's and k's
  gradients turned back (RoPE) after rounding as XLA's would be; each gradient's sum."""
  del rows_ref, first_head_ref, key_ref, rate, unrolled
  heads, width, dtype = q_ref.shape[2] // size, q_ref.shape[2], q_ref.dtype
  back = lambda g, i, b: _turned_back(g, i, b, seg_ref, bias_ref, size, dtype)

  def row(i, carry):
    _begin(i, seg_ref, bias_ref, (q_ref, k_ref, v_ref), (qs, ks, vs), (dk_rows, dv_rows), size)

    def block(b, dq_sum):
      at, slab, sees = _slab(i, b, seg_ref, local_window)
      q, k, v, do = qs[at, :], ks[slab, :], vs[slab, :], do_ref[i, at, :]
      zero = jnp.zeros((), q.dtype)

      def head(n, mine):
        p = probabilities(jnp.where(mine, q, zero), k, sees, scale)
        dv = jnp.dot(p.astype(do.dtype).T, do, preferred_element_type=_F32)
        dp = jax.lax.dot_general(jnp.where(mine, do, zero), v, T, preferred_element_type=_F32)
        ds = (p * (dp - jnp.sum(p * dp, axis=-1, keepdims=True)) * scale).astype(q.dtype)
        return (jnp.dot(ds, k, preferred_element_type=_F32),
                jnp.dot(ds.T, q, preferred_element_type=_F32), dv)
      dq, dk, dv = per_head(heads, size, width, head)
      dq = back(dq, i, b).astype(dq_ref.dtype)
      dq_ref[i, at, :] = dq
      dk_rows[slab, :] = dk_rows[slab, :] + dk
      dv_rows[slab, :] = dv_rows[slab, :] + dv
      return dq_sum + _total(dq)

    dq_sum = jax.lax.fori_loop(0, seg_ref.shape[2], block, jnp.zeros((1, width), _F32))
    _written(i, seg_ref, back, (dk_rows, dv_rows), (dk_ref, dv_ref), sums_ref, dq_sum)
    return carry
  jax.lax.fori_loop(0, q_ref.shape[0], row, 0)


def _scores(q_SxW, k_SxW, seg_q_Sx1, seg_k_1xS, scale: float):
  s = jax.lax.dot_general(q_SxW, k_SxW, T, preferred_element_type=_F32) * scale
  return jnp.where(seg_q_Sx1 == seg_k_1xS, s, BIG_NEGATIVE)


def _online(q, i, seg_ref, ks, vs, seg_q, scale: float, do=None):
  """Over every block of row i's keys with a running maximum: softmax(q k^T) v (float32 [S, W]);
  or with `do`, the backward's statistics: (the log-sum-exp [S, 1], rowsum(p (do v^T)) [S, 1],
  which is rowsum(do o), without the output)."""
  def step(j, carry):
    m, l, acc = carry
    s = _scores(q, ks[_at(j), :], seg_q, seg_ref[i, 0, pl.ds(j, 1), :], scale)
    top = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True))
    p, fade = jnp.exp(s - top), jnp.exp(m - top)
    v = vs[_at(j), :]
    got = (jnp.dot(p.astype(v.dtype), v, preferred_element_type=_F32) if do is None else
           jnp.sum(p * jax.lax.dot_general(do, v, T, preferred_element_type=_F32), axis=-1,
                   keepdims=True))
    return top, fade * l + jnp.sum(p, axis=-1, keepdims=True), fade * acc + got
  rows = q.shape[0]
  start = (jnp.full((rows, 1), BIG_NEGATIVE, _F32), jnp.zeros((rows, 1), _F32),
           jnp.zeros((rows, q.shape[1] if do is None else 1), _F32))
  m, l, acc = jax.lax.fori_loop(0, seg_ref.shape[2], step, start)
  return acc / l if do is None else (m + jnp.log(l), acc / l)


def flash_forward_kernel(rows_ref, first_head_ref, key_ref, seg_ref, bias_ref, q_ref, k_ref,
                         v_ref, o_ref, qs, ks, vs, *, rate, local_window, scale, size, unrolled):
  """attention_kernel's forward for a global layer past its whole rows: each block of queries
  against every block of keys, online (`_online`)."""
  del rows_ref, first_head_ref, key_ref, rate, local_window, unrolled

  def per_block(i, b):
    seg_q = column(seg_ref[i, 0, pl.ds(b, 1), :])
    return lambda q: _online(q, i, seg_ref, ks, vs, seg_q, scale)
  _forward_rows(seg_ref, bias_ref, (q_ref, k_ref, v_ref), o_ref, (qs, ks, vs), size, per_block)


def flash_backward_kernel(rows_ref, first_head_ref, key_ref, seg_ref, bias_ref, q_ref, k_ref,
                          v_ref, do_ref, dq_ref, dk_ref, dv_ref, sums_ref, qs, ks, vs, dk_rows,
                          dv_rows, *, rate, local_window, scale, size, unrolled):
  """The backward of `flash_forward_kernel`: a block of queries' statistics made again (a pass of
  q k^T and do v^T: no residual but the inputs, which remat keeps by name), then each block of
  keys' share of dq, and dk, dv added up in the float32 VMEM rows as `slab_backward_kernel`."""
  del rows_ref, first_head_ref, key_ref, rate, local_window, unrolled
  heads, width, dtype = q_ref.shape[2] // size, q_ref.shape[2], q_ref.dtype
  back = lambda g, i, b: _turned_back(g, i, b, seg_ref, bias_ref, size, dtype)

  def row(i, carry):
    _begin(i, seg_ref, bias_ref, (q_ref, k_ref, v_ref), (qs, ks, vs), (dk_rows, dv_rows), size)

    def block(b, dq_sum):
      q, do, seg_q = qs[_at(b), :], do_ref[i, _at(b), :], column(seg_ref[i, 0, pl.ds(b, 1), :])
      zero = jnp.zeros((), q.dtype)

      def head(n, mine):
        q_n, do_n = jnp.where(mine, q, zero), jnp.where(mine, do, zero)
        lse, d = _online(q_n, i, seg_ref, ks, vs, seg_q, scale, do=do_n)

        def step(j, dq):
          k, v = ks[_at(j), :], vs[_at(j), :]
          p = jnp.exp(_scores(q_n, k, seg_q, seg_ref[i, 0, pl.ds(j, 1), :], scale) - lse)
          dp = jax.lax.dot_general(do_n, v, T, preferred_element_type=_F32)
          ds = (p * (dp - d) * scale).astype(dtype)
          keep = lambda x: jnp.where(mine, x, 0.0)
          dv_rows[_at(j), :] += keep(jnp.dot(p.astype(dtype).T, do, preferred_element_type=_F32))
          dk_rows[_at(j), :] += keep(jnp.dot(ds.T, q, preferred_element_type=_F32))
          return dq + jnp.dot(ds, k, preferred_element_type=_F32)
        return (jax.lax.fori_loop(0, seg_ref.shape[2], step, jnp.zeros((q.shape[0], width),
                                                                         _F32)),)
      dq = back(per_head(heads, size, width, head)[0], i, b).astype(dq_ref.dtype)
      dq_ref[i, _at(b), :] = dq
      return dq_sum + _total(dq)

    dq_sum = jax.lax.fori_loop(0, seg_ref.shape[2], block, jnp.zeros((1, width), _F32))
    _written(i, seg_ref, back, (dk_rows, dv_rows), (dk_ref, dv_ref), sums_ref, dq_sum)
    return carry
  jax.lax.fori_loop(0, q_ref.shape[0], row, 0)
