"""Attention with dropout on its probabilities, in one Pallas kernel (`attention_impl="fused"`).

BERT trains with dropout on the attention probabilities (0.1). XLA's attention writes the float32
[B, N, L, L] scores, the probabilities and the dropout's keep decisions to HBM and reads them
back in the backward: at length 128 half of BERT-Base's step bytes on v6e (docs/performance.md).
Splash never writes them, but has no dropout. Here, for rows short enough that a head's [L, L]
fits VMEM (L a multiple of 128, up to MAX_LENGTH), each (row, head) is computed whole:

  forward   s = q k^T / sqrt(K), masked to the row's segments; p = softmax(s); p' = p kept
            by the dropout and scaled by 1 / (1 - rate); out = p' v;
  backward  s, p and the keep decisions made again from q, k and the key, then dv = p'^T do,
            dp = do v^T (kept and scaled), ds = p (dp - rowsum(p dp)) / sqrt(K), dq = ds k,
            dk = ds^T q.

Nothing [L, L] leaves VMEM and nothing but the inputs is kept for the backward.

The layout. q, k, v and the output are [B, L, N * K], the heads side by side as the projections
write them (model.encoder asks for them so): lane-dense, with no transpose between a product and
the kernel, where heads first ([B, N, L, K]) took one each way and padded K = 64 to 128 lanes in
HBM. A grid step reads a few rows' lanes of a few heads (two of BERT's 64: one 128-lane tile),
and each head's products run over the block's lanes with the others' zeroed in q (the scores)
or in do (dp), each result keeping its own head's lanes: a 64-deep product fills the MXU no
better than a 128-deep one, so this costs no pass of it (the cost estimate counts K). The
projections' biases come in apart (`biases`) and are added as the kernel reads q, k and v: the
products' outputs, which remat "dots" keeps, go in as they are, and no biased copy of each is
written (and, under remat, made again). The backward sums dq, dk and dv over positions as it
writes them (the biases' gradients), and the forward writes its output's bits (what remat keeps).
With RoPE (`turn`), q and k are turned after their biases, in VMEM (rope.py). Without dropout,
a local window, and a global layer past MAX_LENGTH, run by blocks of queries instead
(attention_blocks.py: `_call` picks).

The dropout's bits: each kernel draws its keep decisions itself (dropout.keep_decisions; the same
on every device kind and mesh). On a GPU, where there is no Mosaic, `reference` computes the same
arithmetic with XLA.

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
from jax.sharding import PartitionSpec

from bertjax.errors import Refusal
from bertjax.model import dropout, residuals, rope
from bertjax.model.dropout import keep_decisions, key_words
from bertjax.model.kernels import attention_blocks as blocks, attention_reference, devices
from bertjax.model.kernels.attention_reference import dropped as _dropped
from bertjax.model.kernels.attention_blocks import BIG_NEGATIVE, T as _T, per_head as _per_head

MULTIPLE = 128  # keys lie along the TPU's 128 lanes
MAX_LENGTH = 1024  # a head's [L, L] float32 scores and their kin in VMEM: 4 MB each at 1024
# A grid step's blocks (double buffered): a few heads' lanes (`_heads_a_block`) of as many rows as
# fit ROW_BYTES.
ROW_BYTES = 8 << 20
_F32, _U32 = jnp.float32, jnp.uint32



def fits(length: int) -> bool:
  """Whether the kernel holds rows of `length`."""
  return length % MULTIPLE == 0 and length <= MAX_LENGTH


def check_length(length: int, local_window: int = 0, rate: float = 0.0) -> None:
  if not (fits(length) or blocks.holds_window(length, local_window, rate)
          or blocks.by_flash(length, local_window, rate, MAX_LENGTH)):
    nearest = min(MAX_LENGTH, max(MULTIPLE, -(-length // MULTIPLE) * MULTIPLE))
    raise Refusal(
        f"attention_impl='fused' with attention dropout computes a head's whole [L, L] in VMEM: "
        f"it needs a sequence length that is a multiple of {MULTIPLE} and at most {MAX_LENGTH} "
        f"(without dropout, any multiple of {MULTIPLE}); got {length}. Set "
        f"data.max_seq_length to one (e.g. {nearest}), or model.attention_dropout=0, or use "
        f"attention_impl='xla'")


def _row_loop(local_window: int, seg_ref, rows_ref, first_head_ref, heads: int, body,
              unrolled: bool = False):
  """body(i, global row, the block's first global head, allowed [L, L], positions [L, 1]
  float32 or None) for each row of the block; the segments' mask made once a row, and with RoPE
  (`seg_ref` [rows, 2, L]: segments, positions) the positions' column. `unrolled`: i a constant
  in each copy of the body, which an operand XLA computes inside the kernel's reads needs
  (`_call`'s `fused`)."""
  block = seg_ref.shape[0]
  # Read outside the loop: the interpreter wants it so.
  first_row = pl.program_id(0) * block
  first_head = (first_head_ref[0] + pl.program_id(1) * heads).astype(_U32)

  def per_row(i, carry):
    ids = seg_ref[i]
    seg_k = ids[0:1]
    pos = blocks.column(ids[1:2]).astype(_F32) if ids.shape[0] > 1 else None
    body(i, rows_ref[first_row + i].astype(_U32), first_head,
         blocks.allowed(blocks.column(seg_k), seg_k, local_window), pos)
    return carry
  jax.lax.fori_loop(0, block, per_row, 0, unroll=unrolled)


def _probabilities_kept(q, k, allowed, row, head, key_ref, rate: float, scale: float):
  """A (row, head)'s probabilities and, at a rate, its keep decisions (None without)."""
  p = blocks.probabilities(q, k, allowed, scale)
  if rate <= 0:
    return p, None
  return p, keep_decisions(key_ref[0].astype(_U32), key_ref[1].astype(_U32), row, head,
                           p.shape[-1], rate)


def _forward_kernel(rows_ref, first_head_ref, key_ref, seg_ref, bias_ref, q_ref, k_ref, v_ref,
                    o_ref, *, rate, local_window, scale, size, unrolled):
  def body(i, row, first_head, allowed, pos):
    q, k, v, _ = blocks.biased(bias_ref, pos, size, q_ref[i], k_ref[i], v_ref[i])
    zero = jnp.zeros((), q.dtype)

    def head(n, mine):
      # Other heads' lanes zero in q: q k^T over the block's lanes is head n's scores.
      p, keep = _probabilities_kept(jnp.where(mine, q, zero), k, allowed, row, first_head + n,
                                    key_ref, rate, scale)
      return (jnp.dot(_dropped(p, keep, rate).astype(v.dtype), v, preferred_element_type=_F32),)
    o_ref[i] = jax.lax.bitcast_convert_type(_per_head(
        q_ref.shape[2] // size, size, q.shape[-1], head)[0].astype(q.dtype), o_ref.dtype)
  _row_loop(local_window, seg_ref, rows_ref, first_head_ref, q_ref.shape[2] // size, body,
            unrolled)


def _backward_kernel(rows_ref, first_head_ref, key_ref, seg_ref, bias_ref, q_ref, k_ref, v_ref,
                     do_ref, dq_ref, dk_ref, dv_ref, sums_ref, *, rate, local_window, scale,
                     size, unrolled):
  # `sums_ref`: each row's dq, dk and dv summed over its positions (the biases' gradients), here
  # where they are in VMEM: XLA read each from HBM again to sum it.
  def body(i, row, first_head, allowed, pos):
    q, k, v, angle = blocks.biased(bias_ref, pos, size, q_ref[i], k_ref[i], v_ref[i])
    do = do_ref[i]
    zero = jnp.zeros((), q.dtype)

    def head(n, mine):
      p, keep = _probabilities_kept(jnp.where(mine, q, zero), k, allowed, row, first_head + n,
                                    key_ref, rate, scale)
      dv = jnp.dot(_dropped(p, keep, rate).astype(do.dtype).T, do, preferred_element_type=_F32)
      dp = _dropped(jax.lax.dot_general(jnp.where(mine, do, zero), v, _T,
                                        preferred_element_type=_F32), keep, rate)
      ds = (p * (dp - jnp.sum(p * dp, axis=-1, keepdims=True)) * scale).astype(q.dtype)
      return (jnp.dot(ds, k, preferred_element_type=_F32),
              jnp.dot(ds.T, q, preferred_element_type=_F32), dv)
    heads = q_ref.shape[2] // size
    grads = _per_head(heads, size, q.shape[-1], head)
    if angle is not None:  # turned q's and k's gradients, rounded as XLA's would be, turned back
      grads = (*(rope.turned_back(g.astype(q.dtype).astype(_F32), angle, size)
                 for g in grads[:2]), grads[2])
    for j, (ref, value) in enumerate(zip((dq_ref, dk_ref, dv_ref), grads)):
      ref[i] = value.astype(ref.dtype)
      sums_ref[i, j:j + 1, :] = jnp.sum(ref[i].astype(_F32), axis=0, keepdims=True)
  _row_loop(local_window, seg_ref, rows_ref, first_head_ref, q_ref.shape[2] // size, body,
            unrolled)


def _heads_a_block(heads: int, size: int) -> int:
  """Heads side by side in a block: the fewest, dividing `heads`, whose lanes make whole
  128-lane tiles (2 of BERT's 64), else all of them (the array's whole width)."""
  return next((h for h in range(1, heads + 1) if heads % h == 0 and h * size % MULTIPLE == 0),
              heads)


def _block(rows: int, length: int, width: int, tensors: int) -> int:
  """Rows a grid step, dividing `rows`: the most whose `tensors` [rows, L, width] blocks (double
  buffered; `width` bytes a position) fit ROW_BYTES; one at least."""
  per_row = 2 * tensors * length * width
  return max(d for d in range(1, rows + 1)
             if rows % d == 0 and (d == 1 or d * per_row <= ROW_BYTES))


def _call(kernels, name, inputs, outputs, rows_ids, first_head, key, seg, bias, *, rate,
          local_window, size, flops, interpret, floats=None):
  """`kernels`: by `blocks.way` ("whole", "slabs", "flash"): a local window by slabs, a global
  layer past MAX_LENGTH block by block, else whole rows. `seg` int32 [B, 1, L]
  (segments; [B, 2, L] with positions: RoPE), `bias` float32 [3, N * K] (values of the inputs'
  dtype; [4, ...] with the lanes' RoPE frequencies). `outputs`: 1, the bits of the inputs'
  dtype (unsigned integers: `_attention` turns them back); or 3 and a fourth, float32
  [B, 3, N * K], the three summed over positions. Whole rows: XLA may compute each of `inputs`
  inside the kernel's reads of it (Pallas' allow_input_fusion). q, k and v may be slices: of the
  scanned loop's stacks of saved residuals in the backward, of one product's output
  (qkv_product "one"). Fused, the kernel reads them where they lie, where each was first
  copied out whole (a custom call's operand is a buffer of its own); whole arrays moved the same
  bytes either way. The kernel then reads its rows at constant offsets (`_row_loop`'s
  `unrolled`): with a traced row index libtpu 0.0.42 fails a RET_CHECK on such an operand, and
  blocks' offsets are traced."""
  # [B, L, N * K], as the projections write it: lane-dense. Heads first ([B, N, L, K]) took a
  # transpose each way and padded K = 64 to 128 lanes in HBM. Packed (one product's [3, B, L,
  # N * K]): q, k and v each read from it where they lie, and dq, dk and dv written into one.
  packed = inputs[0].ndim == 4
  views = [(inputs[0], j) for j in range(3)] * packed + [(a, None) for a in inputs[packed:]]
  rows, length, heads = inputs[-1].shape[-3:-1] + (inputs[-1].shape[-1] // size,)
  # `floats`: q, k and v as the bits of that type, read as it (qkv_kernel wrote them: `_Floats`).
  dtype = inputs[0].dtype if floats is None else jnp.dtype(floats)
  item = dtype.itemsize
  group = _heads_a_block(heads, size)
  width = group * size
  block = _block(rows, length, width * item, len(views) + outputs)
  tile = pl.BlockSpec((block, length, width), lambda b, h, *_: (b, 0, h))
  third = lambda j: pl.BlockSpec((pl.squeezed, block, length, width),
                                 lambda b, h, *_: (j, b, 0, h))
  way = blocks.way(length, local_window, rate, MAX_LENGTH)
  by_blocks = way != "whole"  # of queries: slabs or flash
  fused = (not by_blocks,) * len(views)
  span = 3 * blocks.BLOCK if way == "slabs" else length  # the keys a query's scores take
  flops += 4 * (way == "flash" and outputs > 1)  # the statistics made again: q k^T, do v^T
  # By blocks: the segments a block to a sublane; q, k, v (and dk, dv in float32) rows in VMEM.
  seg = seg.reshape(seg.shape[:2]
                    + ((length // blocks.BLOCK, blocks.BLOCK) if by_blocks else (-1,)))
  scratch = [pltpu.VMEM((length, width), t) for t in (dtype,) * 3 + (_F32,) * (2 * (outputs > 1))
             ] if by_blocks else []
  fn = functools.partial(kernels[way], rate=rate, local_window=local_window,
                         scale=1.0 / np.sqrt(size), size=size, unrolled=any(fused))
  sums = outputs > 1
  shape = jax.ShapeDtypeStruct(inputs[-1].shape[-3:],
                               dtype if sums else residuals.bits_type(dtype))
  out_shapes, out_specs = (shape,) * outputs, (tile,) * outputs
  if packed and sums:  # one [3, B, L, N * K] block of dq, dk and dv, each written as its own
    out_shapes = (jax.ShapeDtypeStruct((3,) + shape.shape, dtype),)
    out_specs = (pl.BlockSpec((3, block, length, width), lambda b, h, *_: (0, b, 0, h)),)
    fn = functools.partial(_thirds, fn)
  if floats is not None:
    fn = functools.partial(_Floats.reading, fn, dtype)
  # A head's [L, span] float32 temporaries (scores, probabilities, decisions, gradients).
  need = (2 * (len(views) + outputs) * block * length * width * item
          + 10 * min(span, blocks.BLOCK if by_blocks else length) * span * 4
          + sum(length * width * jnp.dtype(v.dtype).itemsize for v in scratch))
  sums_shape, sums_spec = ((jax.ShapeDtypeStruct((rows, 3, heads * size), _F32),),
                           (pl.BlockSpec((block, 3, width), lambda b, h, *_: (b, 0, h)),))
  result = pl.pallas_call(
      fn,
      out_shape=out_shapes + sums_shape * sums,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=3, grid=(rows // block, heads // group), scratch_shapes=scratch,
          in_specs=[pl.BlockSpec((block,) + seg.shape[1:], lambda b, h, *_: (b,) + (0,) * (
              seg.ndim - 1)),
                    pl.BlockSpec((bias.shape[0], width), lambda b, h, *_: (0, h))]
          + [tile if j is None else third(j) for _, j in views],
          out_specs=out_specs + sums_spec * sums),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel"),
                                           allow_input_fusion=(False,) * 5 + fused,
                                           vmem_limit_bytes=need + (16 << 20)),
      cost_estimate=pl.CostEstimate(
          flops=flops * rows * heads * length * span * size,
          # exp of the scores, and with RoPE the angles' cos and sin
          transcendentals=rows * heads * length * (span + 2 * size * (seg.shape[1] - 1)),
          bytes_accessed=(len(views) + outputs) * rows * heads * length * size * item
          + seg.size * 4 + sums * rows * 3 * heads * size * 4),
      interpret=interpret, name=name,
  )(rows_ids, first_head, key, seg, bias, *(a for a, _ in views))
  return result if len(result) > 1 else result[0]


class _Third:
  """q's, k's or v's gradient in a [3, rows, L, width] block, read and written as a ref of its
  own."""

  def __init__(self, ref, j: int):
    self.ref, self.j, self.dtype = ref, j, ref.dtype

  def __getitem__(self, i):
    return self.ref[self.j, i]

  def __setitem__(self, i, value):
    self.ref[self.j, i] = value


class _Floats:
  """q's, k's or v's ref of bits, read as the float type they are the bits of."""

  def __init__(self, ref, dtype):
    self.ref, self.dtype, self.shape = ref, dtype, ref.shape

  def __getitem__(self, i):
    return jax.lax.bitcast_convert_type(self.ref[i], self.dtype)

  @staticmethod
  def reading(kernel, dtype, *refs, **kwargs):
    """`kernel` with its q, k and v refs (after 3 scalars, segments, biases) read as `dtype`."""
    refs = list(refs)
    refs[5:8] = [_Floats(ref, dtype) for ref in refs[5:8]]
    return kernel(*refs, **kwargs)


def _thirds(kernel, *refs, **kwargs):
  """`kernel` (the backward's) with its dq, dk and dv refs the thirds of one output."""
  *ins, dqkv_ref, sums_ref = refs
  return kernel(*ins, *(_Third(dqkv_ref, j) for j in range(3)), sums_ref, **kwargs)


def _forward(rows_ids, first_head, key, seg, bias, *qkv, rate, local_window, size,
             interpret, floats=None):
  # 4 matmul FLOPs per query, key and head dimension: q k^T and p v. `qkv`: q, k and v, or
  # their [3, B, L, N * K] (`_call`'s packed).
  return _call(dict(whole=_forward_kernel, slabs=blocks.slab_forward_kernel,
                    flash=blocks.flash_forward_kernel),
               "fused_attention_fwd", qkv, 1, rows_ids, first_head, key, seg, bias,
               rate=rate, local_window=local_window, size=size, flops=4, interpret=interpret,
               floats=floats)


def _backward(rows_ids, first_head, key, seg, bias, *qkv_do, rate, local_window, size,
              interpret, floats=None):
  # 10: q k^T again, do v^T, dv, dq and dk. Returns dq, dk, dv (packed: as one) and their sums.
  return _call(dict(whole=_backward_kernel, slabs=blocks.slab_backward_kernel,
                    flash=blocks.flash_backward_kernel),
               "fused_attention_bwd", qkv_do, 3, rows_ids, first_head, key, seg, bias,
               rate=rate, local_window=local_window, size=size, flops=10, interpret=interpret,
               floats=floats)


def _on_platform(fn, *args, interpret_on_cpu: bool, **kwargs):
  """`fn` with the Mosaic kernel on a TPU (also a TPU program compiled on a CPU host), and
  elsewhere attention_reference's XLA arithmetic; on a CPU Pallas' interpreter instead where
  `interpret_on_cpu` (tests: slow)."""
  fallback = {_forward: attention_reference.forward, _backward: attention_reference.backward}[fn]
  return devices.on_platform(fn, fallback, *args, cpu_interprets=interpret_on_cpu, **kwargs)


def _per_device(fn, arrays: tuple, ids: tuple, outputs: int):
  """fn on each device's rows and heads under the mesh in scope (shard_map over the
  activations' batch and heads axes), or once without one. `arrays`: [B, L, N * K] (q, k and
  v packed: [3, B, L, N * K]); `ids`: (global row ids [B], global head ids [N], key [2],
  segments [B, L], biases [3, N * K]). More than one output: the [B, L, N * K] ones (packed:
  one [3, ...]), then fn's [B, 3, N * K] sums (`_call`'s)."""

  def run(*args):
    rows_ids, heads_ids, key, seg, bias = args[len(arrays):]
    return fn(rows_ids, heads_ids[:1], key, seg, bias, *args[:len(arrays)])

  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return run(*arrays, *ids)
  batch, _, heads = nn.logical_to_mesh_axes(
      ("activation_batch", "activation_length", "activation_heads"))
  qkv = PartitionSpec(batch, None, heads)  # whole heads a device: N divides over `heads`' axis
  specs = (PartitionSpec(batch), PartitionSpec(heads), PartitionSpec(None),
           PartitionSpec(batch, None, None), PartitionSpec(None, heads))
  spec = lambda a: PartitionSpec(None, *qkv) if a.ndim == 4 else qkv
  grads = (spec(arrays[0]),) if arrays[0].ndim == 4 else (qkv,) * outputs
  return jax.shard_map(
      run, mesh=mesh, in_specs=tuple(map(spec, arrays)) + specs,
      out_specs=(*grads, PartitionSpec(batch, None, heads)) if outputs > 1 else qkv,
      # pallas_call's outputs carry no varying-manual-axes type for shard_map to check.
      check_vma=False)(*arrays, *ids)


def _ids(q_BxLxNK, segment_ids_BxL, key, bias, turn, size: int):
  """`_per_device`'s ids: the segments [B, 1, L] and the biases float32 [3, N * K], with RoPE's
  positions [B, 2, L] and the lanes' frequencies [4, N * K] (`_call`'s `seg` and `bias`)."""
  rows, _, width = q_BxLxNK.shape[-3:]
  seg = segment_ids_BxL.astype(jnp.int32)[:, None, :]
  table = bias.astype(q_BxLxNK.dtype).astype(_F32)
  if turn is not None:
    seg = jnp.concatenate([seg, turn[0].astype(jnp.int32)[:, None, :]], axis=1)
    table = jnp.concatenate([table, jnp.reshape(turn[1], (1, width)).astype(_F32)])
  return (jnp.arange(rows, dtype=jnp.int32), jnp.arange(width // size, dtype=jnp.int32),
          key, seg, table)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10, 11))
def _attention(q, k, v, bias, segment_ids, key, turn, rate, local_window, interpret_on_cpu,
               size, bits):
  # q, k and v; or packed, q their [3, B, L, N * K] and k, v None. `bits`: the kernels read
  # their bits (fused_attention's).
  fwd = functools.partial(_on_platform, _forward, rate=rate, local_window=local_window,
                          size=size, interpret_on_cpu=interpret_on_cpu,
                          floats=q.dtype if bits else None)
  # The kernel writes its output's bits: residuals.named keeps bits through remat, XLA folds the
  # two bitcasts, and the kernel's own output is kept (a float's was copied, by an op).
  return jax.lax.bitcast_convert_type(
      _per_device(fwd, _given(q, k, v, bits), _ids(q, segment_ids, key, bias, turn, size), 1),
      q.dtype)


def _given(q, k, v, bits: bool = False) -> tuple:
  return tuple(map(residuals.bits if bits else (lambda a: a), (q,) if k is None else (q, k, v)))


def _attention_fwd(q, k, v, bias, segment_ids, key, turn, rate, local_window, interpret_on_cpu,
                   size, bits):
  # Only the inputs are kept: the backward makes the scores and the decisions again.
  out = _attention(q, k, v, bias, segment_ids, key, turn, rate, local_window, interpret_on_cpu,
                   size, bits)
  return out, (q, k, v, bias, segment_ids, key, turn)


def _attention_bwd(rate, local_window, interpret_on_cpu, size, bits, saved, do):
  q, k, v, bias, segment_ids, key, turn = saved
  bwd = functools.partial(_on_platform, _backward, rate=rate, local_window=local_window,
                          size=size, interpret_on_cpu=interpret_on_cpu,
                          floats=q.dtype if bits else None)
  *grads, sums = _per_device(bwd, _given(q, k, v, bits) + (do,),
                             _ids(q, segment_ids, key, bias, turn, size), 3)
  # A bias's gradient is its sum's: the biased q's gradient (the kernel's) summed over positions
  # (by the kernel, a row at a time) and rows.
  dbias = sums.sum(0).astype(bias.dtype)
  return (*grads, *(None, None) * (k is None), dbias, None, None, None)


_attention.defvjp(_attention_fwd, _attention_bwd)


def fused_attention(q_BxLxNxK, k_BxLxNxK, v_BxLxNxK, segment_ids_BxL, rng=None,
                    rate: float = 0.0, local_window: int = 0, interpret_on_cpu: bool = True,
                    head_size: int | None = None, biases=None, turn=None, bits: bool = False):
  """Softmax(q k^T / sqrt(K)) v within segments (splash's segment ids: attention.
  splash_segment_ids), the probabilities dropped at `rate` by `rng` (a jax key; none at rate 0).
  [B, L, N, K] in and out, or with `head_size` K, [B, L, N * K] (the heads side by side, as a
  projection writes them: what the kernel reads, so no copy comes between); differentiable in
  q, k and v. `biases` ([3, N * K], or one [N * K] each): added to q, k and v inside the kernel,
  so the products' outputs (what remat "dots" keeps) go in as they are and no biased copy is
  written; differentiable. `turn`: (positions [B, L], `rope.lane_frequencies` [N * K]), q and k
  turned by RoPE after their biases, in the kernel. `local_window` > 0: only keys with
  |i - j| <= local_window // 2. k and v None: q is one product's q, k and v, [3, B, L, N * K]
  with `head_size` (read where each lies, its gradient one array: no slice of them copied). The
  kernel on a TPU; on a CPU its interpreter, or with `interpret_on_cpu=False` the same arithmetic
  and bits by XLA (as on a GPU). `bits`: the kernels read q, k and v as their bits (where a
  kernel wrote them as bits, qkv_kernel: XLA folds the bitcasts between, which otherwise run as
  ops of their own); the values the same."""
  shape = q_BxLxNxK.shape[k_BxLxNxK is None:]
  check_length(shape[1], local_window, rate)
  if rate > 0 and rng is None:
    raise ValueError("fused_attention: a dropout rate needs an rng")
  key = key_words(rng) if rate > 0 else jnp.zeros((2,), jnp.int32)
  if len(shape) == 3 and head_size is None:
    raise ValueError("fused_attention: [B, L, N * K] inputs need head_size")
  size = shape[-1] if len(shape) == 4 else int(head_size)
  flat = lambda x: None if x is None else x.reshape(x.shape[:x.ndim - len(shape) + 2] + (-1,))
  width = int(np.prod(shape[2:]))
  bias = (jnp.zeros((3, width), q_BxLxNxK.dtype) if biases is None
          else jnp.stack([jnp.reshape(b, (width,)) for b in biases]))
  out = _attention(flat(q_BxLxNxK), flat(k_BxLxNxK), flat(v_BxLxNxK), bias, segment_ids_BxL,
                   key, turn, float(rate), int(local_window), bool(interpret_on_cpu), size,
                   bool(bits))
  return out.reshape(shape)
