"""The recomputed MLM head's backward as one Pallas kernel (heads.decoded_scores' on a TPU): the
logits made again a block of the vocabulary at a time in VMEM, their gradient softmax - one-hot
made there, and x's, W's and the bias' gradients taken from it in the same step.

Written by XLA, the backward made the logits again and wrote their gradient in the compute dtype
([predictions, V], the largest tensor of the step), read it in two products (x's gradient, and
W's with the bias' as a column of ones), and summed W's [D + 1, V] float32 gradient over the
chips whole: 1,025 rows do not split over 4 or 8, so it was all-reduced and sliced (BERT-Large
L 128 on v5p-8: 1.7 GB of its step; docs/performance.md, "The MLM head's backward in one
kernel, and the weights' gradients reduce-scattered as written").

Here the grid is (the chip's TensorCores, a core's vocabulary blocks). A block of W's rows is
read once; the device's predictions (their states, labels, log Z and the loss's cotangents) stay
in VMEM for the whole grid and are walked a block of rows at a time inside the step. W's and the
bias' gradients for the block are whole at the step's end and written once in float32 ([V, D],
as the table is, so the chips' sum splits it as the parameter is split: devices.summed; [D, V]
where the table's shards are stored column-major, `stored_transposed`); the
last block of W, partial, is read in place (no padded copy of the table); x's gradient is summed
over the vocabulary in float32 VMEM and each core writes its own ([cores, R, D], for the caller
to add). Every prediction's x and its float32 gradient in VMEM bound the predictions a call
takes (`most`): past them, a device makes more calls, each adding its W's gradient to the last
one's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from bertjax.model.kernels import devices
from bertjax.parallel import platforms, sharding

_F32 = jnp.float32
_T = (((1,), (1,)), ((), ()))  # contract the last axes of both (W's transpose)
_ROWS = (((0,), (0,)), ((), ()))  # contract the first axes of both (the predictions)
# W's rows a block: its block and the block of W's float32 gradient are double buffered beside
# every prediction's state and gradient, so a small block leaves them the room.
VOCAB_BLOCK = 512
ROW_BLOCKS = (512, 256, 128, 64, 32, 16, 8)  # predictions a block inside a step
# What a call's predictions may hold of a core's VMEM (x in the compute dtype, its float32
# gradient and its staging block, three [R, 1] float32 figures at 128 lanes a row); the rest is
# the blocks' and Mosaic's. More predictions take more calls (`most`), each reading W once more
# and adding its W's gradient to the last call's, read and written once more (BERT-Large L 512
# on v5p-8: four calls).
SHARE = 0.5


def _row_bytes(width: int, item: int) -> int:
  return width * (item + 4) + devices.chunk(width) * item + 3 * 128 * 4


def most(width: int, item: int, vmem: int | None = None) -> int:
  """The predictions a call takes at most (a multiple of 128), states `width` wide in `item`
  bytes an entry, in a core's VMEM (`vmem`, the chip's by default)."""
  vmem = platforms.vmem_bytes() if vmem is None else vmem
  return max(128, int(SHARE * vmem) // _row_bytes(width, item) // 128 * 128)


def _need(rows_total: int, rows: int, width: int, item: int) -> int:
  """A call's VMEM in bytes: every prediction's state, gradient, label and figures; W's block
  and its float32 gradient's (the last call's too), double buffered; a block of rows' logits
  and their kin."""
  return (rows_total * _row_bytes(width, item) + 2 * VOCAB_BLOCK * width * (item + 8)
          + 4 * rows * VOCAB_BLOCK * 4 + rows * width * 4)


def _kernel(labels_ref, x_ref, log_z_ref, g_ref, w_ref, b_ref, *refs, vocab: int, rows: int,
            per_core: int, blocks: int, chunk: int, adds: bool, transposed: bool):
  (dw_in, db_in), refs = (refs[:2] if adds else (None, None)), refs[2 if adds else 0:]
  dw_ref, db_ref, dx_out, dx_acc, stage_ref, sem = refs
  core, j = pl.program_id(0), pl.program_id(1)
  block = core * per_core + j

  @pl.when(j == 0)
  def _():
    dx_acc[...] = jnp.zeros_like(dx_acc)

  @pl.when(block < blocks)  # the last core's steps past the vocabulary (an odd count) skip
  def _():
    first = block * VOCAB_BLOCK
    # The last block's rows past V are a partial block's padding, undefined: zeroed, as x's
    # gradient reads them (0 x NaN is NaN), and their columns' gradient zeroed below.
    w = w_ref[...]
    w = jnp.where(first + jax.lax.broadcasted_iota(jnp.int32, (w.shape[0], 1), 0) < vocab, w,
                  jnp.zeros_like(w))
    column = first + jax.lax.broadcasted_iota(jnp.int32, (1, VOCAB_BLOCK), 1)
    dw_ref[...] = dw_in[...] if adds else jnp.zeros_like(dw_ref)
    db_ref[...] = db_in[...] if adds else jnp.zeros_like(db_ref)

    @pl.loop(0, x_ref.shape[0] // rows)
    def _(r):
      at = pl.ds(pl.multiple_of(r * rows, rows), rows)
      x = x_ref[at, :]
      logits = jax.lax.dot_general(x, w, _T, preferred_element_type=_F32) + b_ref[...]
      p = jnp.exp(logits - log_z_ref[at, :])
      one_hot = (column == labels_ref[at, :]).astype(_F32)
      # Rounded to the compute dtype as the products' operand, as XLA's backward rounds it.
      g = jnp.where(column < vocab, (p - one_hot) * g_ref[at, :], 0.0).astype(x.dtype)
      if transposed:  # [D, block]
        dw_ref[...] += jax.lax.dot_general(x, g, _ROWS, preferred_element_type=_F32)
      else:  # [block, D]
        dw_ref[...] += jnp.dot(g.T, x, preferred_element_type=_F32)
      db_ref[...] += jnp.sum(g.astype(_F32), axis=0, keepdims=True)
      dx_acc[at, :] += jnp.dot(g, w, preferred_element_type=_F32)

  devices.write_sums((dx_out,), (dx_acc,), stage_ref, sem, chunk)


def _call(labels_Rx1, x_RxD, log_z_Rx1, g_Rx1, w_VxD, bias_1xV, last, cores: int,
          interpret: bool, transposed: bool):
  """One call's gradients (`grads`' three, the bias' [1, V]), W's and the bias' added to
  `last`'s (the previous call's, their buffers reused) where it is not None."""
  (rows_total, width), vocab = x_RxD.shape, w_VxD.shape[0]
  rows = next(r for r in ROW_BLOCKS if rows_total % r == 0)
  blocks = pl.cdiv(vocab, VOCAB_BLOCK)
  per_core = pl.cdiv(blocks, cores)
  item, chunk = x_RxD.dtype.itemsize, devices.chunk(width)
  at = lambda c, j: jnp.minimum(c * per_core + j, blocks - 1)
  w_spec = pl.BlockSpec((VOCAB_BLOCK, width), lambda c, j: (at(c, j), 0))
  b_spec = pl.BlockSpec((1, VOCAB_BLOCK), lambda c, j: (0, at(c, j)))
  figures = [devices.whole((rows_total, 1))] * 2
  dw_spec = (pl.BlockSpec((width, VOCAB_BLOCK), lambda c, j: (0, at(c, j))) if transposed
             else w_spec)
  sums = [] if last is None else list(last)
  return pl.pallas_call(
      functools.partial(_kernel, vocab=vocab, rows=rows, per_core=per_core, blocks=blocks,
                        chunk=chunk, adds=last is not None, transposed=transposed),
      out_shape=(jax.ShapeDtypeStruct((width, vocab) if transposed else (vocab, width), _F32),
                 jax.ShapeDtypeStruct((1, vocab), _F32),
                 jax.ShapeDtypeStruct((cores, rows_total, width), x_RxD.dtype)),
      grid=(cores, per_core),
      in_specs=[figures[0], devices.whole((rows_total, width)), *figures, w_spec, b_spec]
               + ([dw_spec, b_spec] if sums else []),
      out_specs=(dw_spec, b_spec, pl.BlockSpec(memory_space=pl.ANY)),
      scratch_shapes=[pltpu.VMEM((rows_total, width), _F32),
                      pltpu.VMEM((rows_total, chunk), x_RxD.dtype), pltpu.SemaphoreType.DMA],
      input_output_aliases={6: 0, 7: 1} if sums else {},
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "arbitrary"),
          vmem_limit_bytes=platforms.vmem_limit(_need(rows_total, rows, width, item))),
      cost_estimate=pl.CostEstimate(
          flops=6 * rows_total * vocab * width, transcendentals=rows_total * vocab,
          bytes_accessed=(cores * rows_total * (width * item + 12) + vocab * (width * item + 4)
                          + (1 + bool(sums)) * vocab * (width + 1) * 4
                          + cores * rows_total * width * item)),
      interpret=interpret, name="mlm_scores_bwd",
  )(labels_Rx1, x_RxD, log_z_Rx1, g_Rx1, w_VxD, bias_1xV, *sums)


def grads(x_RxD, w_VxD, bias_V, labels_R, log_z_R, g_R, interpret: bool = False,
          cores: int | None = None, vmem: int | None = None, transposed: bool = False):
  """(x's gradient [cores, R, D] in x's dtype, a core's sum each; W's [V, D] ([D, V] where
  `transposed`) and the bias' [V], float32) of the scores' loss with cotangents `g_R` on each
  prediction's negative log-likelihood, from the logits x W^T + b (x and W in the compute
  dtype, the products in float32) made again, log Z as the forward made it. R a multiple of 8.
  `cores`: the vocabulary's sequences, the chip's TensorCores by default; `vmem`: a core's
  VMEM, the chip's by default (the predictions a call takes, `most`)."""
  (rows_total, width), vocab = x_RxD.shape, w_VxD.shape[0]
  if rows_total % 8:
    raise ValueError(f"mlm_grads.grads: {rows_total} predictions are no multiple of 8; pad them")
  cores = min(platforms.tpu_cores() if cores is None else cores, pl.cdiv(vocab, VOCAB_BLOCK))
  calls = pl.cdiv(rows_total, most(width, x_RxD.dtype.itemsize, vmem))
  size = pl.cdiv(pl.cdiv(rows_total, calls), 128) * 128 if calls > 1 else rows_total
  column = lambda a, kind: a.astype(kind).reshape(-1, 1)
  table = (w_VxD, bias_V.astype(_F32)[None, :])
  last, dxs = None, []
  for at in range(0, rows_total, size):
    part = slice(at, at + size)
    dw, db, dx = last = _call(column(labels_R[part], jnp.int32), x_RxD[part],
                              column(log_z_R[part], _F32), column(g_R[part], _F32), *table,
                              None if not dxs else last[:2], cores, interpret, transposed)
    dxs.append(dx)
  return (dxs[0] if calls == 1 else jnp.concatenate(dxs, axis=1)), dw, db[0]


def sharded(x_BxMxD, w_VxD, bias_V, labels_BxM, log_z_BxM, g_BxM, interpret: bool = False,
            cores: int | None = None):
  """`grads` of [B, M] predictions, float32, on each device's rows under the mesh in scope (W
  whole on each, as the forward gathers it): x's gradient [B, M, D] (the cores' added), W's
  (every device's and core's, split as the table is) and the bias'."""
  width = x_BxMxD.shape[-1]
  transposed = stored_transposed(w_VxD.shape)

  def kernel(x_RxD, labels_Rx1, log_z_Rx1, g_Rx1, w_VxD, bias_1xV):
    dx, dw, db = grads(x_RxD, w_VxD, bias_1xV[0], labels_Rx1[:, 0], log_z_Rx1[:, 0],
                       g_Rx1[:, 0], interpret=interpret, cores=cores, transposed=transposed)
    return dx, dw[None], db[None, None]

  column = lambda a: a.reshape(-1, 1)
  dw_shape = w_VxD.shape[::-1] if transposed else w_VxD.shape
  dx, dw, db = devices.per_device(
      kernel, (x_BxMxD.reshape(-1, width), column(labels_BxM), column(log_z_BxM),
               column(g_BxM)),
      (w_VxD, bias_V[None, :]), ("thirds", devices.summed(int(not transposed), dw_shape), "sums"))
  # The cores' sums of x's gradient added in float32 (one core's is as written).
  dx = dx[0].astype(_F32) if dx.shape[0] == 1 else dx.astype(_F32).sum(0)
  # [D, V] turned to the table's [V, D]: in the order a TPU stores the table's shard, no copy
  # (`stored_transposed`).
  return dx.reshape(x_BxMxD.shape), dw.T if transposed else dw, db.sum((0, 1))


# The chips where W's gradient goes out [D, V] where that splits it in whole tiles and [V, D]
# does not (`stored_transposed`). On v5p-8 BERT-Base moved 11.16 -> 10.86 GB (L 128) and
# 34.57 -> 34.22 (L 512); on v6e-8, whose 8 chips XLA sums the [V, D] form over without an
# all-reduce, 3.55 -> 3.67 (docs/performance.md, "The embedding table's gradient in the order
# the chip stores it").
TRANSPOSED_ON = ("TPU_V5P",)


def stored_transposed(shape_VxD: tuple) -> bool:
  """Whether W's gradient is written [D, V]: on TRANSPOSED_ON's chips, where the chips' sum
  splits D (the parameter's "embed" axis) into shards that fill whole tiles as rows but not as
  lanes (devices.splits). BERT-Base's [30522, 768] on v5p-8's 4 chips leaves shards of 192
  columns, which a TPU stores column-major (layouts.py): written [D, V] and turned here, the
  gradient reaches the update in that order, and the table's all-reduced gradient is not turned
  to it first (188 MB a step). BERT-Large's 256 columns fill lanes: [V, D], as the table is."""
  return (platforms.tpu_chip() in TRANSPOSED_ON
          and not devices.splits(devices.summed(1, shape_VxD))
          and devices.splits(devices.summed(0, shape_VxD[::-1])))


def on_platform(x_BxMxD, w_VxD, bias_V, labels_BxM, log_z_BxM, g_BxM, xla):
  """(x's, W's and the bias' gradients, float32) of [B, M] predictions by the kernel on a TPU
  (also a TPU program compiled on a CPU host) where a device's predictions are a whole number
  of 8 (`sharded`); elsewhere `xla(x, w, bias, labels, log_z, g)`'s (tests run the kernel in
  Pallas' interpreter through `grads` and `sharded`)."""
  def tpu(*args):
    if labels_BxM.size // sharding.logical_shards("activation_batch") % 8:
      return xla(*args)
    return sharded(*args)

  return jax.lax.platform_dependent(x_BxMxD, w_VxD, bias_V, labels_BxM, log_z_BxM, g_BxM,
                                    tpu=tpu, default=xla)
