"""The MLM head's scores made in VMEM: a Pallas kernel whose float32 [predictions, V] logits never
reach HBM (the forward of heads.decoded_scores on a TPU).

XLA writes the logits x W^T + b once and reads them back for log Z, the label's logit and the
largest: two float32 passes over [predictions, V], the largest tensor of a pre-training step
(BERT-Base L 512 on v6e-8: 0.89 GB each). Here the vocabulary is walked a block at a time, the
outer loop of the grid, each block of W read once; for each block of predictions, the inner loop,
the block's logits are made and folded into the running largest logit, the running sum of
exp(logit - largest) (log Z's online form) and the label's logit, which stay in VMEM for all the
chip's predictions and are written once at the end. The predictions' states are read once per
block of the vocabulary: [predictions, D] in the compute dtype, small beside [predictions, V].

The backward is unchanged (heads._scores_bwd: the logits made again by XLA's product). On a CPU
the kernel runs in Pallas' interpreter (tests), and elsewhere XLA's arithmetic (heads._scores).

Where the logits are kept for the backward (heads.kept_scores), `kept_scores` writes them and
makes the same figures in the one pass, where XLA read them all again for log Z.
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
_T = (((1,), (1,)), ((), ()))  # dot_general: contract the last axes of both (W's transpose)
# Vocabulary columns a block (W's rows): W read once whatever the size; a block of predictions'
# states is read once per vocabulary block, so fewer, larger blocks read less.
VOCAB_BLOCK = 2048
# Predictions a block, the largest of these that divides the chip's (else they are padded): the
# logits' tile [rows, VOCAB_BLOCK] float32, 4 MB at 512. Any size reads W once.
ROW_BLOCKS = (512, 256, 128, 64, 32, 16, 8)
# Predictions a call at most. Their running figures stay in VMEM for the whole grid, and an
# [R, 1] float32 array fills a 128-lane tile a row: 1.5 KB a prediction for the three, 12 MiB
# here. More (BERT-Large L 512 at 128 rows a chip: 29,184 predictions, 43 MiB of figures beside
# W's blocks) overflowed v5p's 64 MiB of VMEM, so a device with more makes one call for each
# group of this many, each reading W once more (BERT-Large's, bf16: 62 MB; one group's float32
# logits written and read by XLA would be 2 GB).
MAX_ROWS = 8192
# The three above are the sizes where a core's VMEM holds them (v5p's 64 MiB, v5e's and v6e's
# 128); on a chip with less (v4's 16 MiB) they are halved together until a call fits (`_sizes`).
# A padded vocabulary column's bias: its exp is 0 against any real logit, and finite, so the
# running largest and sum never meet inf - inf.
PAD = -1e30


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def _need(rows_total: int, rows: int, vocab_block: int, width: int, item: int,
          tail: bool) -> int:
  """A call's VMEM in bytes: the running figures of all its predictions (an [R, 1] float32
  array fills a 128-lane tile a row), the double-buffered blocks of x and W (and the tail's),
  the logits' block and its kin in float32, the labels' block."""
  return (3 * rows_total * 128 * 4 + 2 * (rows * width + vocab_block * width) * item
          + 3 * rows * vocab_block * 4 + 2 * rows * 128 * 4 + tail * vocab_block * width * item)


def _sizes(rows_total: int, vocab: int, width: int, item: int, vmem: int):
  """(predictions a call at most, a block of them at most, vocabulary columns a block):
  MAX_ROWS, ROW_BLOCKS[0] and VOCAB_BLOCK, halved together until a call's blocks and Mosaic's
  room (`platforms.vmem_limit`'s quarter, 2 MiB more) fit a core's VMEM of `vmem` bytes, or the
  blocks are the least. v5p, v5e and v6e take them whole for every released config; v4's 16 MiB
  takes a quarter (W read in more blocks, the predictions' states read once a block)."""
  calls, rows, block = MAX_ROWS, ROW_BLOCKS[0], VOCAB_BLOCK
  while True:
    vocab_block = min(block, _round_up(vocab, 128))
    need = _need(min(calls, _round_up(rows_total, 8)), rows, vocab_block, width, item,
                 vocab % vocab_block != 0)
    if int(need * 1.25) + (2 << 20) <= vmem or rows <= ROW_BLOCKS[-1]:
      return calls, rows, vocab_block
    calls, rows, block = calls // 2, rows // 2, max(128, block // 2)


def _kernel(labels_ref, x_ref, w_ref, *refs, rows: int, vocab_block: int, full: int | None,
            whole_x: bool):
  """One block of predictions against one block of the vocabulary. `full`: the blocks read in
  place from W, the last one (the vocabulary's tail) from a padded copy of its own, the first of
  `refs`; None where every block is W's. `whole_x`: x_ref holds every prediction's state."""
  (tail_ref, b_ref, top_ref, sum_ref, label_ref) = refs if full is not None else (None, *refs)
  j, i = pl.program_id(0), pl.program_id(1)  # vocabulary block (outer), predictions' block
  at = pl.ds(pl.multiple_of(i * rows, rows), rows)

  @pl.when(j == 0)
  def _():
    top_ref[at, :] = jnp.full((rows, 1), PAD, _F32)
    sum_ref[at, :] = jnp.zeros((rows, 1), _F32)
    label_ref[at, :] = jnp.zeros((rows, 1), _F32)

  x = x_ref[at, :] if whole_x else x_ref[...]
  fold = lambda w: _fold(_logits(x, w, b_ref), j * vocab_block, labels_ref,
                         (top_ref, sum_ref, label_ref), at)
  _each_block(fold, w_ref, tail_ref, j, full)


def _logits(x, w, b_ref):
  return jax.lax.dot_general(x, w, _T, preferred_element_type=_F32) + b_ref[...]


def _each_block(fold, w_ref, tail_ref, j, full: int | None):
  """fold(W's block j), the tail's block where j is past W's whole ones (`full` of them)."""
  if full is None:
    fold(w_ref[...])
  else:
    pl.when(j < full)(lambda: fold(w_ref[...]))
    pl.when(j == full)(lambda: fold(tail_ref[...]))


def _fold(logits, first_column, labels_ref, figures, at):
  """A block of logits (its first vocabulary column `first_column`) folded into the running
  largest logit, sum of exp(logit - largest) and label's logit (`figures`' rows `at`)."""
  top_ref, sum_ref, label_ref = figures
  column = first_column + jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1)
  label_ref[at, :] += jnp.sum(jnp.where(column == labels_ref[...], logits, 0.0), axis=1,
                              keepdims=True)
  top = top_ref[at, :]
  new_top = jnp.maximum(top, jnp.max(logits, axis=1, keepdims=True))
  sum_ref[at, :] = (sum_ref[at, :] * jnp.exp(top - new_top)
                    + jnp.sum(jnp.exp(logits - new_top), axis=1, keepdims=True))
  top_ref[at, :] = new_top


def _call(x_RxD, w_VxD, tail, bias_1xV, labels_Rx1, rows: int, vocab_block: int, vmem: int,
          interpret: bool):
  """(largest logit, sum of exp(logit - largest), label's logit), each [R, 1] float32, for rows
  padded to whole blocks of `rows`; W's whole blocks read in place, its tail (if any) from
  `tail`, a block of its own; the bias padded to whole blocks."""
  rows_total, width = x_RxD.shape
  full = w_VxD.shape[0] // vocab_block
  blocks = full + (tail is not None)
  item = x_RxD.dtype.itemsize
  stats = jax.ShapeDtypeStruct((rows_total, 1), _F32)
  # Every row's running figures resident in VMEM for the whole grid (their block never moves).
  whole = devices.whole((rows_total, 1))
  need = _need(rows_total, rows, vocab_block, width, item, tail is not None)
  # Every prediction's state in VMEM where it fits beside the rest, read once: in blocks, it is
  # read once a block of the vocabulary (BERT-Base L 512 on v5p-8: 15 times 22 MB a step).
  whole_need = need + (rows_total - 2 * rows) * width * item
  whole_x = int(whole_need * 1.25) + (2 << 20) <= vmem
  need = whole_need if whole_x else need
  x_spec = (devices.whole((rows_total, width)) if whole_x
            else pl.BlockSpec((rows, width), lambda j, i: (i, 0)))
  # W's block index stays at its last whole block for the tail's step: no copy is made again.
  w_spec = pl.BlockSpec((vocab_block, width), lambda j, i: (jnp.minimum(j, full - 1), 0))
  tail_specs, tail_args = [], []
  if tail is not None:
    tail_specs = [devices.whole(tail.shape)]
    tail_args = [tail]
  vocab = blocks * vocab_block
  return pl.pallas_call(
      functools.partial(_kernel, rows=rows, vocab_block=vocab_block,
                        full=full if tail is not None else None, whole_x=whole_x),
      out_shape=(stats, stats, stats),
      grid=(blocks, rows_total // rows),
      in_specs=[pl.BlockSpec((rows, 1), lambda j, i: (i, 0)), x_spec, w_spec, *tail_specs,
                pl.BlockSpec((1, vocab_block), lambda j, i: (0, j))],
      out_specs=(whole, whole, whole),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary"),
                                           vmem_limit_bytes=platforms.vmem_limit(need, vmem)),
      cost_estimate=pl.CostEstimate(
          flops=2 * rows_total * vocab * width, transcendentals=rows_total * vocab,
          bytes_accessed=((1 if whole_x else blocks) * rows_total * width * item
                          + blocks * rows_total * 4 + vocab * (width * item + 4)
                          + 3 * rows_total * 4)),
      interpret=interpret, name="mlm_scores_fwd",
  )(labels_Rx1, x_RxD, w_VxD, *tail_args, bias_1xV)


def _pad(a, n: int):
  return jnp.pad(a, ((0, n - a.shape[0]),) + ((0, 0),) * (a.ndim - 1))


def _table(w_VxD, bias_V, vocab_block: int):
  """(W, its tail or None, the bias float32 padded to whole blocks). W is not copied whole to
  pad it (BERT-Base's: 47 MB read and written a step, more than the logits at a few rows a
  chip): its whole blocks are read in place, and only the rows past the last of them are
  copied, padded to a block. A vocabulary under one block is all tail."""
  vocab = w_VxD.shape[0]
  whole = vocab // vocab_block * vocab_block
  if whole == vocab:
    w, tail = w_VxD, None
  elif whole == 0:
    w, tail = _pad(w_VxD, vocab_block), None
  else:
    w, tail = w_VxD, _pad(w_VxD[whole:], vocab_block)
  bias = jnp.pad(bias_V.astype(_F32), (0, _round_up(vocab, vocab_block) - vocab),
                 constant_values=PAD)
  return w, tail, bias


def scores(x_RxD, w_VxD, bias_V, labels_R, interpret: bool = False, vmem: int | None = None):
  """(log Z, the label's logit, the largest logit), each [R] float32, of the logits
  x W^T + b (x and W in the compute dtype, the products in float32), without writing them; in
  as few calls of at most MAX_ROWS predictions as there can be (fewer where a core's VMEM, `vmem`
  bytes, the chip's by default, is small: `_sizes`), of one size (one kernel compiled), W
  prepared once for all."""
  rows_total, vocab = x_RxD.shape[0], w_VxD.shape[0]
  vmem = platforms.vmem_bytes() if vmem is None else vmem
  most, largest, vocab_block = _sizes(rows_total, vocab, x_RxD.shape[1], x_RxD.dtype.itemsize,
                                      vmem)
  w, tail, bias = _table(w_VxD, bias_V, vocab_block)
  labels_Rx1 = labels_R.astype(jnp.int32)[:, None]

  def group(x_GxD, labels_Gx1):
    count = x_GxD.shape[0]
    rows = next((r for r in ROW_BLOCKS if r <= largest and count % r == 0),
                min(largest, _round_up(count, 8)))
    padded_rows = _round_up(count, rows)
    figures = _call(_pad(x_GxD, padded_rows), w, tail, bias[None, :],
                    _pad(labels_Gx1, padded_rows), rows, vocab_block, vmem, interpret)
    return [a[:count, 0] for a in figures]

  calls = -(-rows_total // most)
  size = _round_up(-(-rows_total // calls), 8)
  groups = [group(x_RxD[at:at + size], labels_Rx1[at:at + size])
            for at in range(0, rows_total, size)]
  top, total, label = (parts[0] if calls == 1 else jnp.concatenate(parts)
                       for parts in zip(*groups))
  return top + jnp.log(total), label, top


# Where the logits are kept (`kept_scores`): predictions a block, the largest of these dividing
# the device's (else padded), the vocabulary's blocks the inner loop, so a block's running
# figures alone stay in VMEM and any number of predictions takes one call, W read once a block
# of predictions (ModernBERT's 77 MB table 30 times for v6e-8's 46,080 a microbatch, against
# the 9.3 GB of float32 logits the kernel spares reading again).
KEPT_ROW_BLOCKS = (2048, 1536, 1024, 512, 256, 128, 64, 32, 16, 8)
KEPT_VOCAB_BLOCK = 512


def _kept_kernel(labels_ref, x_ref, w_ref, *refs, vocab_block: int, full: int | None):
  """A block of predictions against a block of the vocabulary: its logits written, folded into
  the block's running figures (scratch), which are written at the vocabulary's last block."""
  refs = refs if full is not None else (None, *refs)
  tail_ref, b_ref, logits_ref, *outs = refs[:6]
  figures = refs[6:]
  j = pl.program_id(1)

  @pl.when(j == 0)
  def _():
    for ref, start in zip(figures, (PAD, 0.0, 0.0)):
      ref[...] = jnp.full(ref.shape, start, _F32)

  def fold(w):
    logits = _logits(x_ref[...], w, b_ref)
    logits_ref[...] = logits
    _fold(logits, j * vocab_block, labels_ref, figures, slice(None))

  _each_block(fold, w_ref, tail_ref, j, full)

  @pl.when(j == pl.num_programs(1) - 1)
  def _():
    for out, ref in zip(outs, figures):
      out[...] = ref[...]


def _kept_vocab_block(vocab: int) -> int:
  return min(KEPT_VOCAB_BLOCK, _round_up(vocab, 128))


def kept_width(vocab: int) -> int:
  """The kept logits' width for a vocabulary of `vocab`: whole blocks of the kernel's columns
  (a slice of them to `vocab` would be a copy of the largest tensor of the step)."""
  return _round_up(vocab, _kept_vocab_block(vocab))


def kept_scores(x_RxD, w_VxD, bias_V, labels_R, interpret: bool = False):
  """(the logits x W^T + b [R, kept_width(V)] float32, log Z, the label's logit, the largest
  logit, each [R]): the logits written once, their figures made as they are (XLA writes them
  with their largest and reads them all again for log Z). Columns past V are the bias'
  padding's (b's PAD: out of every figure). For a backward that reads the kept logits
  (heads.kept_scores)."""
  (rows_total, width), vocab = x_RxD.shape, w_VxD.shape[0]
  vocab_block = _kept_vocab_block(vocab)
  w, tail, bias = _table(w_VxD, bias_V, vocab_block)
  rows = next((r for r in KEPT_ROW_BLOCKS if rows_total % r == 0),
              min(KEPT_ROW_BLOCKS[0], _round_up(rows_total, 8)))
  padded = _round_up(rows_total, rows)
  full = w.shape[0] // vocab_block
  blocks, item = full + (tail is not None), x_RxD.dtype.itemsize
  padded_vocab = blocks * vocab_block
  need = (2 * (rows * width + vocab_block * width) * item + 5 * rows * vocab_block * 4
          + (tail is not None) * vocab_block * width * item + 8 * rows * 128 * 4)
  stats = pl.BlockSpec((rows, 1), lambda i, j: (i, 0))
  logits, top, total, label = pl.pallas_call(
      functools.partial(_kept_kernel, vocab_block=vocab_block,
                        full=full if tail is not None else None),
      out_shape=(jax.ShapeDtypeStruct((padded, padded_vocab), _F32),)
                + (jax.ShapeDtypeStruct((padded, 1), _F32),) * 3,
      grid=(padded // rows, blocks),
      in_specs=[stats, pl.BlockSpec((rows, width), lambda i, j: (i, 0)),
                pl.BlockSpec((vocab_block, width), lambda i, j: (jnp.minimum(j, full - 1), 0))]
               + ([devices.whole(tail.shape)] if tail is not None else [])
               + [pl.BlockSpec((1, vocab_block), lambda i, j: (0, j))],
      out_specs=(pl.BlockSpec((rows, vocab_block), lambda i, j: (i, j)), stats, stats, stats),
      scratch_shapes=[pltpu.VMEM((rows, 1), _F32)] * 3,
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                           vmem_limit_bytes=platforms.vmem_limit(need)),
      cost_estimate=pl.CostEstimate(
          flops=2 * padded * padded_vocab * width, transcendentals=padded * padded_vocab,
          bytes_accessed=(padded // rows * padded_vocab * width * item + padded * width * item
                          + padded * padded_vocab * 4 + 4 * padded * 4)),
      interpret=interpret, name="mlm_kept_fwd",
  )(_pad(labels_R.astype(jnp.int32)[:, None], padded), _pad(x_RxD, padded), w,
    *([tail] if tail is not None else []), bias[None, :])
  top, total, label = (a[:rows_total, 0] for a in (top, total, label))
  return logits[:rows_total], top + jnp.log(total), label, top


def worth_it(predictions: int, width: int) -> bool:
  """Whether the kernel moves fewer bytes than XLA's logits for a device's `predictions`: it
  spares their float32 [predictions, V] logits written and read (8 bytes a logit), and costs a
  copy of the table W in the compute dtype, which XLA's product reads where it is gathered
  (~2 x 2 bytes an entry of [V, D], measured: v5p-128 at 4 rows a chip, docs/performance.md).
  So predictions > D / 2."""
  return 2 * predictions > width


def on_platform(x_BxMxD, w_VxD, bias_V, labels_BxM, xla):
  """`scores` of [B, M] predictions by the kernel on a TPU (also a TPU program compiled on a CPU
  host) where a device holds enough predictions (`worth_it`), run on each device's rows under
  the mesh in scope (W whole on each, as XLA's product gathers it); elsewhere `xla(x, w, bias,
  labels)`, the same figures from XLA's logits (a CPU's runs keep XLA's speed; tests run the
  kernel in Pallas' interpreter through `scores`)."""
  def kernel(x_RxD, labels_Rx1, w_VxD, bias_1xV):
    figures = scores(x_RxD, w_VxD, bias_1xV[0], labels_Rx1[:, 0])
    return tuple(f[:, None] for f in figures)

  def tpu(x_BxMxD, w_VxD, bias_V, labels_BxM):
    shards = sharding.logical_shards("activation_batch")
    if not worth_it(labels_BxM.size // shards, x_BxMxD.shape[-1]):
      return xla(x_BxMxD, w_VxD, bias_V, labels_BxM)
    figures = devices.per_device(
        kernel, (x_BxMxD.reshape(-1, x_BxMxD.shape[-1]), labels_BxM.reshape(-1, 1)),
        (w_VxD, bias_V[None, :]), ("tokens", "tokens", "tokens"))
    return tuple(f.reshape(labels_BxM.shape) for f in figures)

  return jax.lax.platform_dependent(x_BxMxD, w_VxD, bias_V, labels_BxM, tpu=tpu, default=xla)


def kept_on_platform(x_BxMxD, w_VxD, bias_V, labels_BxM, xla):
  """`kept_scores` of [B, M] predictions ([B, M, V] logits, then [B, M] figures) as `on_platform`
  runs `scores`: by the kernel on a TPU where a device holds enough predictions, elsewhere
  `xla(x, w, bias, labels)`'s."""
  def kernel(x_RxD, labels_Rx1, w_VxD, bias_1xV):
    logits, *figures = kept_scores(x_RxD, w_VxD, bias_1xV[0], labels_Rx1[:, 0])
    return (logits, *(f[:, None] for f in figures))

  def tpu(x_BxMxD, w_VxD, bias_V, labels_BxM):
    shards = sharding.logical_shards("activation_batch")
    if not worth_it(labels_BxM.size // shards, x_BxMxD.shape[-1]):
      return xla(x_BxMxD, w_VxD, bias_V, labels_BxM)
    logits, *figures = devices.per_device(
        kernel, (x_BxMxD.reshape(-1, x_BxMxD.shape[-1]), labels_BxM.reshape(-1, 1)),
        (w_VxD, bias_V[None, :]), ("tokens",) * 4)
    return (logits.reshape(labels_BxM.shape + (-1,)),
            *(f.reshape(labels_BxM.shape) for f in figures))

  return jax.lax.platform_dependent(x_BxMxD, w_VxD, bias_V, labels_BxM, tpu=tpu, default=xla)
