"""Attention with dropout on its probabilities, in one Pallas kernel (`attention_impl="fused"`).

BERT trains with dropout on the attention probabilities (0.1). XLA's attention writes the float32
[B, N, L, L] scores, the probabilities and the dropout's keep decisions to HBM and reads them
back in the backward: at length 128 half of BERT-Base's step bytes on v6e (docs/performance.md).
The splash kernel never writes them, but has no dropout. Here, for rows short enough that a
head's whole [L, L] fits the chip's VMEM (L a multiple of 128, up to MAX_LENGTH), each (row,
head) is computed whole:

  forward   s = q k^T / sqrt(K), masked to the row's segments; p = softmax(s); p' = p kept
            by the dropout and scaled by 1 / (1 - rate); out = p' v;
  backward  s, p and the keep decisions made again from q, k and the key, then dv = p'^T do,
            dp = do v^T (kept and scaled), ds = p (dp - rowsum(p dp)) / sqrt(K), dq = ds k,
            dk = ds^T q.

Nothing [L, L] leaves VMEM and nothing but the inputs is kept for the backward.

The dropout's bits. A kernel cannot read a mask it did not write, so it draws its keep decisions
itself, and the backward draws them again: threefry-2x32 (jax.random's default generator, its
`threefry2x32_p` primitive, which Mosaic lowers inside a kernel) keyed by the
layer's dropout key, on counters made of the element's global row, head, query and key. Each
evaluation's two 32-bit words give four 16-bit pieces, four decisions (rate quantised to 1/65536
as bertjax.model.dropout): piece p of the evaluation at (query group g, key j) decides
(query p * L/4 + g, key j), so the four [L/4, L] pieces stack along the queries (whole (8, 128)
tiles, no lane shuffles). Not the bits of attention_impl="xla" (whose pieces run along the keys),
but the same on every device kind and mesh: the decisions depend on the key and each element's
global (row, head, query, key) alone. On a GPU, where there is no Mosaic, `reference` computes
the same arithmetic with XLA.

A kernel is one device's program: under a mesh it runs in shard_map over the activations' batch
and heads axes, each device on its rows and heads, with their global numbers for the counters.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.extend import random as jex_random
from jax.sharding import PartitionSpec

from bertjax.errors import Refusal
from bertjax.model import dropout

MULTIPLE = 128  # keys lie along the TPU's 128 lanes
MAX_LENGTH = 1024  # a head's [L, L] float32 scores and their kin in VMEM: 4 MB each at 1024
# A grid step's blocks (double buffered): as many rows as fit ROW_BYTES, all their heads; where
# one row's heads pass HEAD_BYTES (long rows), one row and as many heads as fit it (v5p's 64 MiB
# of VMEM holds BERT-Large's backward at 1,024 so).
ROW_BYTES, HEAD_BYTES = 8 << 20, 16 << 20
_F32, _U32 = jnp.float32, jnp.uint32
_T = (((1,), (1,)), ((), ()))  # dot_general: contract the last axes of both (b's transpose)
_PIECES = 4  # keep decisions a threefry evaluation gives (dropout.decisions)
BIG_NEGATIVE = 0.7 * float(np.finfo(np.float32).min)  # a masked score, as the XLA path


def keep_decisions(k1, k2, row, head, length: int, rate: float):
  """Boolean [..., L, L]: which attention probabilities of (row, head) survive dropout at
  `rate`. `row` and `head` are uint32 arrays broadcasting together (scalars in the kernel,
  [B, 1, 1, 1] and [1, N, 1, 1] for a whole batch)."""
  group = length // _PIECES
  shape = jnp.broadcast_shapes(jnp.shape(row), jnp.shape(head))[:-2] + (group, length)
  g = jax.lax.broadcasted_iota(_U32, shape, len(shape) - 2)
  j = jax.lax.broadcasted_iota(_U32, shape, len(shape) - 1)
  # One counter per (row, head, query group, key): x2 < N * L^2 / 4, far below 2**32.
  x2 = (head * _U32(group) + g) * _U32(length) + j
  # jax's own threefry primitive: XLA computes it, and Mosaic has a lowering of its own for it.
  y1, y2 = jex_random.threefry2x32_p.bind(k1, k2, jnp.broadcast_to(row, shape), x2)
  return jnp.concatenate(dropout.decisions(y1, y2, rate), axis=-2)


def fits(length: int) -> bool:
  """Whether the kernel holds rows of `length`."""
  return length % MULTIPLE == 0 and length <= MAX_LENGTH


def check_length(length: int) -> None:
  if not fits(length):
    nearest = min(MAX_LENGTH, max(MULTIPLE, -(-length // MULTIPLE) * MULTIPLE))
    raise Refusal(
        f"attention_impl='fused' computes a head's whole [L, L] in VMEM: it needs a sequence "
        f"length that is a multiple of {MULTIPLE} and at most {MAX_LENGTH}; got {length}. Set "
        f"data.max_seq_length to one (e.g. {nearest}), or use attention_impl='splash' (no "
        f"attention dropout) or 'xla'")


def _allowed(seg_q_Lx1, seg_k_1xL, local_window: int):
  same = seg_q_Lx1 == seg_k_1xL
  if local_window:
    length = seg_k_1xL.shape[-1]
    i = jax.lax.broadcasted_iota(jnp.int32, (length, length), 0)
    j = jax.lax.broadcasted_iota(jnp.int32, (length, length), 1)
    same = same & (jnp.abs(i - j) <= local_window // 2)
  return same


def _probabilities(q_LxK, k_LxK, allowed_LxL, scale: float):
  s = jax.lax.dot_general(q_LxK, k_LxK, _T, preferred_element_type=_F32) * scale
  s = jnp.where(allowed_LxL, s, BIG_NEGATIVE)
  e = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
  return e / jnp.sum(e, axis=-1, keepdims=True)


def _dropped(p, keep, rate: float):
  return p if rate <= 0.0 else dropout.kept(p, keep, rate)


def _column(seg_1xL):
  """[1, L] -> [L, 1] by a masked sum over the lanes (Mosaic transposes no [1, L] vector)."""
  length = seg_1xL.shape[-1]
  i = jax.lax.broadcasted_iota(jnp.int32, (length, length), 0)
  j = jax.lax.broadcasted_iota(jnp.int32, (length, length), 1)
  return jnp.sum(jnp.where(i == j, jnp.broadcast_to(seg_1xL, (length, length)), 0), axis=1,
                 keepdims=True)


def _row_head_loop(local_window: int, seg_ref, rows_ref, first_head_ref, heads: int, body):
  """body(i, n, global row, global head, allowed [L, L]) for each row of the block and each
  of its `heads`; the segments' mask made once a row."""
  block = seg_ref.shape[0]
  # Read outside the loops: the interpreter wants it so.
  first_row = pl.program_id(0) * block
  first_head = first_head_ref[0] + pl.program_id(1) * heads

  def per_row(i, carry):
    seg_k = seg_ref[i]
    allowed = _allowed(_column(seg_k), seg_k, local_window)
    row = rows_ref[first_row + i].astype(_U32)

    def per_head(n, carry):
      body(i, n, row, (first_head + n).astype(_U32), allowed)
      return carry
    return jax.lax.fori_loop(0, heads, per_head, carry)
  jax.lax.fori_loop(0, block, per_row, 0)


def _probabilities_kept(q, k, allowed, row, head, key_ref, rate: float, scale: float):
  """A (row, head)'s probabilities and, at a rate, its keep decisions (None without)."""
  p = _probabilities(q, k, allowed, scale)
  if rate <= 0:
    return p, None
  return p, keep_decisions(key_ref[0].astype(_U32), key_ref[1].astype(_U32), row, head,
                           p.shape[-1], rate)


def _forward_kernel(rows_ref, first_head_ref, key_ref, seg_ref, q_ref, k_ref, v_ref, o_ref, *,
                    rate, local_window, scale):
  def body(i, n, row, head, allowed):
    p, keep = _probabilities_kept(q_ref[i, n], k_ref[i, n], allowed, row, head, key_ref, rate,
                                  scale)
    v = v_ref[i, n]
    o_ref[i, n] = jnp.dot(_dropped(p, keep, rate).astype(v.dtype), v,
                          preferred_element_type=_F32).astype(o_ref.dtype)
  _row_head_loop(local_window, seg_ref, rows_ref, first_head_ref, q_ref.shape[1], body)


def _backward_kernel(rows_ref, first_head_ref, key_ref, seg_ref, q_ref, k_ref, v_ref, do_ref,
                     dq_ref, dk_ref, dv_ref, *, rate, local_window, scale):
  def body(i, n, row, head, allowed):
    q, k, v, do = q_ref[i, n], k_ref[i, n], v_ref[i, n], do_ref[i, n]
    p, keep = _probabilities_kept(q, k, allowed, row, head, key_ref, rate, scale)
    dv_ref[i, n] = jnp.dot(_dropped(p, keep, rate).astype(do.dtype).T, do,
                           preferred_element_type=_F32).astype(dv_ref.dtype)
    dp = _dropped(jax.lax.dot_general(do, v, _T, preferred_element_type=_F32), keep, rate)
    ds = (p * (dp - jnp.sum(p * dp, axis=-1, keepdims=True)) * scale).astype(q.dtype)
    dq_ref[i, n] = jnp.dot(ds, k, preferred_element_type=_F32).astype(dq_ref.dtype)
    dk_ref[i, n] = jnp.dot(ds.T, q, preferred_element_type=_F32).astype(dk_ref.dtype)
  _row_head_loop(local_window, seg_ref, rows_ref, first_head_ref, q_ref.shape[1], body)


def _block(rows: int, heads: int, length: int, size: int, tensors: int) -> tuple[int, int]:
  """(rows, heads) a grid step, each dividing its whole, for `tensors` [rows, heads, L, K] blocks
  (double buffered; `size` bytes a head's row of K): the most rows within ROW_BYTES with all
  heads, where one row's heads fit HEAD_BYTES; else one row and the most heads within it. One
  of each at least."""
  per_head = 2 * tensors * length * size
  most = lambda n, limit: max(d for d in range(1, n + 1) if n % d == 0 and (d == 1 or limit(d)))
  if heads * per_head <= HEAD_BYTES:
    return most(rows, lambda b: b * heads * per_head <= ROW_BYTES), heads
  return 1, most(heads, lambda h: h * per_head <= HEAD_BYTES)


def _call(kernel, name, inputs, outputs, rows_ids, first_head, key, seg, *, rate, local_window,
          flops, interpret):
  rows, heads, length, size = inputs[0].shape
  item = inputs[0].dtype.itemsize
  block, head_block = _block(rows, heads, length, size * item, len(inputs) + outputs)
  tile = pl.BlockSpec((block, head_block, length, size), lambda b, h, *_: (b, h, 0, 0))
  fn = functools.partial(kernel, rate=rate, local_window=local_window,
                         scale=1.0 / np.sqrt(size))
  shape = jax.ShapeDtypeStruct(inputs[0].shape, inputs[0].dtype)
  # A head's [L, L] float32 temporaries (scores, probabilities, decisions, gradients).
  need = (2 * (len(inputs) + outputs) * block * head_block * length * size * item
          + 10 * length * length * 4)
  result = pl.pallas_call(
      fn,
      out_shape=(shape,) * outputs,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=3, grid=(rows // block, heads // head_block),
          in_specs=[pl.BlockSpec((block, 1, length), lambda b, h, *_: (b, 0, 0))]
          + [tile] * len(inputs),
          out_specs=(tile,) * outputs),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel"),
                                           vmem_limit_bytes=need + (16 << 20)),
      cost_estimate=pl.CostEstimate(
          flops=flops * rows * heads * length * length * size,
          transcendentals=rows * heads * length * length,
          bytes_accessed=(len(inputs) + outputs) * rows * heads * length * size * item
          + rows * length * 4),
      interpret=interpret, name=name,
  )(rows_ids, first_head, key, seg, *inputs)
  return result if outputs > 1 else result[0]


def _forward(rows_ids, first_head, key, seg, q, k, v, *, rate, local_window, interpret):
  # 4 matmul FLOPs per query, key and head dimension: q k^T and p v.
  return _call(_forward_kernel, "fused_attention_fwd", (q, k, v), 1, rows_ids, first_head, key,
               seg, rate=rate, local_window=local_window, flops=4, interpret=interpret)


def _backward(rows_ids, first_head, key, seg, q, k, v, do, *, rate, local_window, interpret):
  # 10: q k^T again, do v^T, dv, dq and dk.
  return _call(_backward_kernel, "fused_attention_bwd", (q, k, v, do), 3, rows_ids, first_head,
               key, seg, rate=rate, local_window=local_window, flops=10, interpret=interpret)


def reference(rows_ids, first_head, key, seg, q, k, v, *, rate, local_window):
  """The kernels' arithmetic by XLA, heads first ([B, N, L, K]): where there is no Mosaic, and
  what the tests hold the kernels to."""
  length = q.shape[2]
  seg_k = seg[:, :, None, :]  # [B, 1, 1, L]
  allowed = _allowed(jnp.swapaxes(seg_k, -1, -2), seg_k, local_window)
  p = jax.vmap(jax.vmap(functools.partial(_probabilities, scale=1.0 / np.sqrt(q.shape[-1]))))(
      q, k, jnp.broadcast_to(allowed, q.shape[:2] + (length, length)))
  keep = None
  if rate > 0:
    rows = rows_ids.astype(_U32)[:, None, None, None]
    heads = (first_head[0] + jnp.arange(q.shape[1])).astype(_U32)[None, :, None, None]
    keep = keep_decisions(key[0].astype(_U32), key[1].astype(_U32), rows, heads, length, rate)
  return jnp.einsum("bnqs,bnsk->bnqk", _dropped(p, keep, rate).astype(v.dtype), v)


def _reference_backward(rows_ids, first_head, key, seg, q, k, v, do, *, rate, local_window):
  _, pull = jax.vjp(lambda q, k, v: reference(rows_ids, first_head, key, seg, q, k, v, rate=rate,
                                              local_window=local_window), q, k, v)
  return pull(do)


def _on_platform(fn, *args, interpret_on_cpu: bool, **kwargs):
  """`fn` with the Mosaic kernel on a TPU (also a TPU program compiled on a CPU host), and
  elsewhere `reference`'s XLA arithmetic; on a CPU Pallas' interpreter instead where
  `interpret_on_cpu` (tests: slow)."""
  fallback = functools.partial({_forward: reference, _backward: _reference_backward}[fn],
                               **kwargs)
  return jax.lax.platform_dependent(
      *args, tpu=functools.partial(fn, **kwargs, interpret=False),
      cpu=functools.partial(fn, **kwargs, interpret=True) if interpret_on_cpu else fallback,
      default=fallback)


def _per_device(fn, arrays: tuple, ids: tuple, outputs: int):
  """fn on each device's rows and heads under the mesh in scope (shard_map over the
  activations' batch and heads axes), or once without one. `arrays`: [B, L, N, K] (heads
  first inside fn); `ids`: (global row ids [B], global head ids [N], key [2], segments [B, L])."""
  heads_first = lambda x: jnp.swapaxes(x, 1, 2)

  def run(*args):
    rows_ids, heads_ids, key, seg = args[len(arrays):]
    out = fn(rows_ids, heads_ids[:1], key, seg[:, None, :], *map(heads_first, args[:len(arrays)]))
    return tuple(map(heads_first, out)) if outputs > 1 else heads_first(out)

  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return run(*arrays, *ids)
  batch, _, heads, _ = nn.logical_to_mesh_axes(
      ("activation_batch", "activation_length", "activation_heads", "activation_kv"))
  qkv = PartitionSpec(batch, None, heads, None)
  specs = (PartitionSpec(batch), PartitionSpec(heads), PartitionSpec(None),
           PartitionSpec(batch, None))
  return jax.shard_map(
      run, mesh=mesh, in_specs=(qkv,) * len(arrays) + specs,
      out_specs=(qkv,) * outputs if outputs > 1 else qkv,
      # pallas_call's outputs carry no varying-manual-axes type for shard_map to check.
      check_vma=False)(*arrays, *ids)


def _ids(q_BxLxNxK, segment_ids_BxL, key):
  rows, _, heads, _ = q_BxLxNxK.shape
  return (jnp.arange(rows, dtype=jnp.int32), jnp.arange(heads, dtype=jnp.int32),
          key, segment_ids_BxL.astype(jnp.int32))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _attention(q, k, v, segment_ids, key, rate, local_window, interpret_on_cpu):
  fwd = functools.partial(_on_platform, _forward, rate=rate, local_window=local_window,
                          interpret_on_cpu=interpret_on_cpu)
  return _per_device(fwd, (q, k, v), _ids(q, segment_ids, key), 1)


def _attention_fwd(q, k, v, segment_ids, key, rate, local_window, interpret_on_cpu):
  # Only the inputs are kept: the backward makes the scores and the decisions again.
  out = _attention(q, k, v, segment_ids, key, rate, local_window, interpret_on_cpu)
  return out, (q, k, v, segment_ids, key)


def _attention_bwd(rate, local_window, interpret_on_cpu, saved, do):
  q, k, v, segment_ids, key = saved
  bwd = functools.partial(_on_platform, _backward, rate=rate, local_window=local_window,
                          interpret_on_cpu=interpret_on_cpu)
  dq, dk, dv = _per_device(bwd, (q, k, v, do), _ids(q, segment_ids, key), 3)
  return dq, dk, dv, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def key_words(rng) -> jax.Array:
  """The uint32 pair the kernels' threefry is keyed with, from a jax key (typed or raw; another
  implementation's key data gives its first two words)."""
  if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
    rng = jax.random.key_data(rng)
  return jax.lax.bitcast_convert_type(rng.reshape(-1)[:2].astype(_U32), jnp.int32)


def fused_attention(q_BxLxNxK, k_BxLxNxK, v_BxLxNxK, segment_ids_BxL, rng=None,
                    rate: float = 0.0, local_window: int = 0, interpret_on_cpu: bool = True):
  """Softmax(q k^T / sqrt(K)) v within segments (splash's segment ids: attention.
  splash_segment_ids), the probabilities dropped at `rate` by `rng` (a jax key; none at rate 0).
  [B, L, N, K] in and out; differentiable in q, k and v. `local_window` > 0: only keys with
  |i - j| <= local_window // 2. The kernel on a TPU; on a CPU its interpreter, or with
  `interpret_on_cpu=False` the same arithmetic and bits by XLA (as on a GPU)."""
  check_length(q_BxLxNxK.shape[1])
  if rate > 0 and rng is None:
    raise ValueError("fused_attention: a dropout rate needs an rng")
  key = key_words(rng) if rate > 0 else jnp.zeros((2,), jnp.int32)
  return _attention(q_BxLxNxK, k_BxLxNxK, v_BxLxNxK, segment_ids_BxL, key, float(rate),
                    int(local_window), bool(interpret_on_cpu))
