"""Fused attention kernels for the encoder: Pallas splash attention (TPU) and cuDNN (NVIDIA GPUs).

`bertjax.model.SelfAttention` picks one by `BertConfig.attention_impl`:
  "xla"     jax.nn.dot_product_attention's XLA path (or attention_with_dropout while training with
            attention dropout): float32 [B, N, L, L] logits and probabilities in memory, any device;
  "cudnn"   cuDNN's fused (flash) attention through jax.nn.dot_product_attention;
  "splash"  the Pallas splash attention kernel on TPU, its interpreter on CPU (slow: tests only);
            no GPU branch (use "cudnn"). Blockwise, never materialising [L, L]; a local window's
            blocks outside it skipped. An unrolled layer the fused kernel holds block by block
            (a window within 128, or global past 1,024) takes it instead (RoPE inside it:
            kernels/attention_blocks.py).
  "fused"   bertjax.model.kernels.attention_kernel: a Pallas kernel (TPU; its interpreter on CPU,
            XLA on a GPU) that computes each head's whole [L, L] in VMEM, dropout on the
            probabilities included (L a multiple of 128, at most 1024; without dropout any
            multiple of 128, by blocks of queries);
  "auto"    the fused kernel on a TPU, and its arithmetic (the same dropout bits) by XLA on a CPU
            or a GPU; XLA's attention ("xla") for lengths the kernel does not hold.
cuDNN and splash have no dropout on attention probabilities: BertConfig requires
attention_dropout=0 with them (a departure from the original's 0.1; launch/README.md has its
measured effect and the memory saved at L=512).

Each implementation gets the padding and packing masks in the form its kernel reads
(`attention_masks`). What is computed at padding query positions differs between them, and no
real token ever reads it (keys are masked for every real query, the heads read real positions):
the outputs at real tokens, and every loss and gradient, agree (tests/test_attention.py).

Shape letters as in bertjax/model/encoder.py: B batch, L length, N heads, K head size.
"""

from __future__ import annotations

import functools
import inspect
import math
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu import splash_attention as splash
from jax.sharding import PartitionSpec

from bertjax.errors import Refusal
from bertjax.model import dropout
from bertjax.model.kernels import attention_kernel


IMPLS = ("xla", "cudnn", "splash", "fused", "auto")
# Splash's blocks of the sequence: multiples of the TPU's 128 lanes, larger ones fewer grid steps.
SPLASH_BLOCKS = (512, 256, 128)
# The segment id of padding tokens for splash: no real token carries it (sequence ids are >= 0),
# so a real query never attends to padding, even when a caller numbers a real sequence 0.
PADDING_SEGMENT = -1


def attention_mask(input_mask_BxL: jax.Array, sequence_ids_BxL: jax.Array | None = None):
  """Boolean mask [B, 1, Lq, Lk]: True where a query may attend to a key.

  Only keys are masked, as in the original: padding queries are computed and ignored. With packed
  rows (`sequence_ids`, 0 = padding, 1..n = the n-th sequence of the row) a token attends only
  inside its own sequence.
  """
  key_ok_BxL = input_mask_BxL.astype(bool)
  if sequence_ids_BxL is None:
    return key_ok_BxL[:, None, None, :]
  same_BxLxL = sequence_ids_BxL[:, :, None] == sequence_ids_BxL[:, None, :]
  return (same_BxLxL & key_ok_BxL[:, None, :])[:, None, :, :]


def local_band(length: int, window: int) -> np.ndarray:
  """[L, L] bool: True where |i - j| <= window // 2, ModernBERT's sliding window.

  Positions are row indices: a packed row holds each sequence contiguously, so within a sequence
  the row distance is the token distance, and the sequence mask removes the rest.
  """
  idx = np.arange(length)
  return np.abs(idx[:, None] - idx[None, :]) <= window // 2


def cudnn_local_arguments(masks: dict, length: int, window: int) -> dict:
  """jax.nn.dot_product_attention's keyword arguments for a local layer on cuDNN.

  cuDNN's own sliding window (`local_window_size`) is refused without a causal mask ("cuDNN
  doesn't support right window ... when causal mask is not used", jax 0.11 on an H200), and
  ModernBERT's window looks both ways. So local_band goes in with the padding or packing as one
  boolean [B, 1, L, L] mask, which cuDNN reads as a bias: `masks` is what cudnn_arguments built
  for the global layers (key lengths, or the packed mask).
  """
  if "mask" in masks:
    mask_Bx1xLxL = masks["mask"]
  elif "segments" in masks:
    mask_Bx1xLxL = segments_mask(masks["segments"], length)
  else:
    lengths_B = masks["key_value_seq_lengths"]
    mask_Bx1xLxL = (jnp.arange(length)[None, :] < lengths_B[:, None])[:, None, None, :]
  return {"mask": mask_Bx1xLxL & local_band(length, window)[None, None]}


def splash_segment_ids(input_mask_BxL: jax.Array, sequence_ids_BxL: jax.Array | None = None):
  """[B, L] int32 segment ids for splash: a token attends to the keys of its own id.

  Real tokens carry their sequence id (1 without packing), padding PADDING_SEGMENT: so real
  queries see exactly the keys attention_mask allows them, and padding queries see padding
  (every query sees at least itself, which the kernel's softmax needs).
  """
  real_BxL = input_mask_BxL.astype(bool)
  ids_BxL = (jnp.ones_like(input_mask_BxL, jnp.int32) if sequence_ids_BxL is None
             else sequence_ids_BxL.astype(jnp.int32))
  return jnp.where(real_BxL, ids_BxL, PADDING_SEGMENT)


def cudnn_arguments(input_mask_BxL: jax.Array, sequence_ids_BxL: jax.Array | None = None,
                    packing: str = "mask") -> dict:
  """Keyword arguments of jax.nn.dot_product_attention that mask like attention_mask, for cuDNN.

  Unpacked: key lengths (`key_value_seq_lengths`), cuDNN's padding mask, which skips the padded
  blocks and reads no mask tensor; it assumes the padding at the end of each row, as the data
  pipeline (and the original's) writes it. Packed, `packing="mask"`: the public API has no
  segment ids for cuDNN (jax 0.10's `query_seq_lengths` and `key_value_seq_lengths` are one
  length a row), so the boolean [B, 1, L, L] mask goes in, which cuDNN reads as an additive bias
  and whose gradient its backward pass always computes. `packing="segments"`: the rows' segments
  in cuDNN's packed layout (`cudnn_segments`), for `cudnn_packed_attention`.
  """
  if sequence_ids_BxL is None:
    lengths_B = jnp.sum(input_mask_BxL.astype(jnp.int32), axis=-1)
    return {"key_value_seq_lengths": lengths_B}
  if packing == "segments":
    return {"segments": cudnn_segments(input_mask_BxL, sequence_ids_BxL)}
  return {"mask": attention_mask(input_mask_BxL, sequence_ids_BxL)}


def cudnn_segments(input_mask_BxL: jax.Array, sequence_ids_BxL: jax.Array,
                   max_segments: int | None = None) -> dict:
  """Packed rows as cuDNN's packed ("THD") layout: each row's runs of one sequence id as segments,
  `q_seqlen`/`kv_seqlen` [B, M] their lengths and `q_offsets`/`kv_offsets` [B, M + 1] their first
  positions (-1 past a row's last segment), M = `max_segments`.

  A token attends to the tokens of its own segment (`segments_mask`): as attention_mask allows
  for real tokens, since the pipeline lays each sequence out contiguously; the padding after them
  is a segment of its own (splash's PADDING_SEGMENT does the same), so every query position has
  keys and a defined output. M defaults to L // 2 + 1: a BERT sequence has at least its [CLS] and
  [SEP], so no row has more segments.
  """
  batch, length = sequence_ids_BxL.shape
  m = max_segments or length // 2 + 1
  ids_BxL = jnp.where(input_mask_BxL.astype(bool), sequence_ids_BxL.astype(jnp.int32),
                      PADDING_SEGMENT)
  starts_BxL = jnp.concatenate([jnp.ones((batch, 1), bool), ids_BxL[:, 1:] != ids_BxL[:, :-1]],
                               axis=1)
  segment_BxL = jnp.cumsum(starts_BxL, axis=1) - 1
  rows_Bx1 = jnp.arange(batch)[:, None]
  position_BxL = jnp.broadcast_to(jnp.arange(length), (batch, length))
  lengths_BxM = jnp.zeros((batch, m), jnp.int32).at[rows_Bx1, segment_BxL].add(1, mode="drop")
  offsets_BxM1 = jnp.full((batch, m + 1), length, jnp.int32).at[rows_Bx1, segment_BxL].min(
      position_BxL, mode="drop")
  lengths_BxM = jnp.where(lengths_BxM > 0, lengths_BxM, -1)
  offsets_BxM1 = jnp.where(offsets_BxM1 < length, offsets_BxM1, -1)
  return {"q_seqlen": lengths_BxM, "kv_seqlen": lengths_BxM, "q_offsets": offsets_BxM1,
          "kv_offsets": offsets_BxM1}


def segments_mask(segments: dict, length: int) -> jax.Array:
  """[B, 1, L, L] bool: what cuDNN's packed layout lets each query see (its segment's keys)."""
  starts_BxM = segments["kv_offsets"][:, :-1]
  ends_BxM = jnp.where(starts_BxM >= 0, starts_BxM + segments["kv_seqlen"], -1)
  position_L = jnp.arange(length)
  inside_BxLxM = ((position_L[None, :, None] >= starts_BxM[:, None, :])
                  & (position_L[None, :, None] < ends_BxM[:, None, :]))
  same_BxLxL = jnp.einsum("bqm,bkm->bqk", inside_BxLxM.astype(jnp.int32),
                          inside_BxLxM.astype(jnp.int32)) > 0
  return same_BxLxL[:, None]


def _private_cudnn_attention():
  """jax's cuDNN attention with the packed layout, or None where this jax has no such function.

  Private (jax._src) on purpose: jax 0.10.2's public jax.nn.dot_product_attention takes one query
  and one key length a row (`[B]`) and no offsets, and turns a mask into a bias whose gradient
  its cuDNN backward always computes (fused_attention_stablehlo.should_export_dbias returns True);
  its packed layout exists only in jax._src.cudnn.fused_attention_stablehlo.dot_product_attention
  (q_offsets, kv_offsets: jax 0.10.2). Checked by signature; without it cudnn_packed_attention
  takes the public mask (tests/test_attention.py covers both).
  """
  try:
    from jax._src.cudnn import fused_attention_stablehlo  # pylint: disable=import-outside-toplevel
  except ImportError:
    return None
  fn = getattr(fused_attention_stablehlo, "dot_product_attention", None)
  try:
    params = inspect.signature(fn).parameters
  except (TypeError, ValueError):
    return None
  wanted = {"q_seqlen", "kv_seqlen", "q_offsets", "kv_offsets", "mask_type", "scale"}
  if not wanted <= set(params) or not hasattr(fused_attention_stablehlo, "MaskType"):
    return None
  return fn, fused_attention_stablehlo.MaskType.PADDING


def cudnn_packed_layout() -> bool:
  """Whether this jax has cuDNN's packed layout (cudnn_packed_attention uses it, not a mask)."""
  return _private_cudnn_attention() is not None


def cudnn_packed_attention(q_BxLxNxK, k_BxLxNxK, v_BxLxNxK, segments: dict):
  """Softmax attention within cuDNN's segments (`cudnn_segments`): no mask tensor, no bias
  gradient, where this jax has the packed layout; otherwise the public path's mask."""
  private = _private_cudnn_attention()
  if private is None:
    return jax.nn.dot_product_attention(
        q_BxLxNxK, k_BxLxNxK, v_BxLxNxK, mask=segments_mask(segments, q_BxLxNxK.shape[1]),
        implementation="cudnn")
  fn, padding = private
  return fn(q_BxLxNxK, k_BxLxNxK, v_BxLxNxK, **segments,
            scale=1.0 / float(np.sqrt(q_BxLxNxK.shape[-1])), mask_type=padding)


def cudnn_attention(q_BxLxNxK, k_BxLxNxK, v_BxLxNxK, masks: dict, local_window: int = 0):
  """SelfAttention's cuDNN call, `masks` from cudnn_arguments: a local layer's band goes in as a
  mask (cudnn_local_arguments), packed segments through cudnn_packed_attention."""
  if local_window:
    return jax.nn.dot_product_attention(
        q_BxLxNxK, k_BxLxNxK, v_BxLxNxK,
        **cudnn_local_arguments(masks, q_BxLxNxK.shape[1], local_window), implementation="cudnn")
  if "segments" in masks:
    return cudnn_packed_attention(q_BxLxNxK, k_BxLxNxK, v_BxLxNxK, masks["segments"])
  return jax.nn.dot_product_attention(q_BxLxNxK, k_BxLxNxK, v_BxLxNxK, **masks,
                                      implementation="cudnn")


def attention_masks(impl: str, input_mask_BxL: jax.Array,
                    sequence_ids_BxL: jax.Array | None = None, cudnn_packing: str = "mask") -> dict:
  """What SelfAttention of `impl` masks with, built once per batch and shared by every layer."""
  if impl in ("splash", "fused") or (
      impl == "auto" and attention_kernel.fits(input_mask_BxL.shape[1])):
    return {"segment_ids": splash_segment_ids(input_mask_BxL, sequence_ids_BxL)}
  if impl == "cudnn":
    return cudnn_arguments(input_mask_BxL, sequence_ids_BxL, cudnn_packing)
  return {"mask": attention_mask(input_mask_BxL, sequence_ids_BxL)}


def splash_equivalent(q_BxLxNxK, k_BxLxNxK, v_BxLxNxK, segment_ids_BxL, local_window: int = 0):
  """What splash_attention computes, by the XLA path: any length, any device."""
  same_Bx1xLxL = segment_ids_BxL[:, None, :, None] == segment_ids_BxL[:, None, None, :]
  if local_window:
    same_Bx1xLxL = same_Bx1xLxL & local_band(q_BxLxNxK.shape[1], local_window)[None, None]
  return jax.nn.dot_product_attention(q_BxLxNxK, k_BxLxNxK, v_BxLxNxK, mask=same_Bx1xLxL)


def splash_block_size(length: int, local_window: int = 0) -> int:
  """The kernel's block along the sequence (a local window's within it: 384 keys a query, not
  1,536 in blocks of 512); raises, naming the fix, when L does not fit."""
  widest = max(local_window, SPLASH_BLOCKS[-1]) if local_window else SPLASH_BLOCKS[0]
  for block in (b for b in SPLASH_BLOCKS if length % b == 0 and b <= widest):
    return block
  raise Refusal(
      f"attention_impl='splash' needs a sequence length that is a multiple of "
      f"{SPLASH_BLOCKS[-1]} (the kernel's smallest block); got {length}. Set data.max_seq_length "
      f"to a multiple of {SPLASH_BLOCKS[-1]} (e.g. {max(128, -(-length // 128) * 128)}), or use "
      f"attention_impl='xla'")


def splash_blocks(length: int, block: int, local_window: int = 0) -> int:
  """How many of the [L, L] scores' blocks (`block` a side) the splash kernel computes: all, or
  those holding a query and a key within half a local window (its block map skips the rest)."""
  n, half = length // block, local_window // 2
  near = lambda i, j: j * block <= (i + 1) * block - 1 + half and (j + 1) * block > i * block - half
  return sum(1 for i in range(n) for j in range(n) if not local_window or near(i, j))


def _splash_local(q_BxLxNxK, k_BxLxNxK, v_BxLxNxK, segment_ids_BxL, interpret: bool,
                  local_window: int = 0):
  """The kernel on the arrays one device holds: vmapped over the batch, all heads at once."""
  _, length, heads, head_size = q_BxLxNxK.shape
  block = splash_block_size(length, local_window)
  # One backward kernel for dq, dk and dv (5 matmuls, not 7), whose dq comes in L / block partials
  # (1 up to L = 512): a local window's narrow blocks would make 64 at 8,192 (7 GB a ModernBERT
  # layer), so it takes dq's kernel of its own.
  dq = {"block_q_dq": block, "block_kv_dq": block} if local_window else {}
  sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                            block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                            use_fused_bwd_kernel=not local_window, **dq)
  # The static mask: everything, or the sliding window (whose blocks beyond it the kernel
  # skips); the segment ids carry padding and packing.
  if local_window:
    half = local_window // 2
    static = splash.LocalMask((length, length), window_size=(half, half), offset=0)
  else:
    static = splash.FullMask((length, length))
  kernel = splash.make_splash_mha(splash.MultiHeadMask([static] * heads),
                                  block_sizes=sizes, head_shards=1, q_seq_shards=1,
                                  interpret=interpret)
  # The kernel does not scale: BERT's 1/sqrt(K) goes on q, in float32, before the cast back.
  scale = 1.0 / np.sqrt(head_size)
  q_BxLxNxK = (q_BxLxNxK.astype(jnp.float32) * scale).astype(q_BxLxNxK.dtype)

  def one(q_NxLxK, k_NxLxK, v_NxLxK, ids_L):
    return kernel(q_NxLxK, k_NxLxK, v_NxLxK, splash.SegmentIds(q=ids_L, kv=ids_L))

  heads_first = lambda x: jnp.swapaxes(x, 1, 2)
  # The blocks the kernel computes, named for the roofline's count (splash_flops): XLA's
  # analysis cannot see them, and the HLO holds the kernel's block map as an elided constant.
  with jax.named_scope(f"splash_blocks_{splash_blocks(length, block, local_window)}_of_"
                       f"{(length // block) ** 2}"):
    out_BxNxLxK = jax.vmap(one)(heads_first(q_BxLxNxK), heads_first(k_BxLxNxK),
                                heads_first(v_BxLxNxK), segment_ids_BxL)
  return heads_first(out_BxNxLxK)


def _splash_any_platform(q_BxLxNxK, k_BxLxNxK, v_BxLxNxK, segment_ids_BxL,
                         local_window: int = 0):
  # Chosen when the program is lowered, for the platform it is lowered for: a TPU program (also
  # one compiled ahead of time on a CPU host, bertjax.aot) gets the Mosaic kernel, a CPU one the
  # kernel's interpreter. GPUs have no branch: use attention_impl='cudnn' there.
  return jax.lax.platform_dependent(
      q_BxLxNxK, k_BxLxNxK, v_BxLxNxK, segment_ids_BxL,
      tpu=functools.partial(_splash_local, interpret=False, local_window=local_window),
      cpu=functools.partial(_splash_local, interpret=True, local_window=local_window))


def splash_attention(q_BxLxNxK, k_BxLxNxK, v_BxLxNxK, segment_ids_BxL, local_window: int = 0):
  """Softmax(q k^T / sqrt(K)) v within segments, by the splash kernel. [B, L, N, K] in and out.
  `local_window` > 0: only keys with |i - j| <= local_window // 2 (attention.local_band).

  A Pallas kernel is one device's program: under a mesh it runs in shard_map, each device on its
  rows of the batch (data x fsdp) and its heads (tensor), as the logical-axis rules in scope lay
  the activations out; the sequence stays whole.
  """
  splash_block_size(q_BxLxNxK.shape[1])  # the error, before anything is traced further
  run = functools.partial(_splash_any_platform, local_window=local_window)
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return run(q_BxLxNxK, k_BxLxNxK, v_BxLxNxK, segment_ids_BxL)
  batch, _, heads, _ = nn.logical_to_mesh_axes(
      ("activation_batch", "activation_length", "activation_heads", "activation_kv"))
  qkv_spec = PartitionSpec(batch, None, heads, None)
  mapped = jax.shard_map(
      run, mesh=mesh, in_specs=(qkv_spec,) * 3 + (PartitionSpec(batch, None),),
      out_specs=qkv_spec,
      # pallas_call's outputs carry no varying-manual-axes type for shard_map to check.
      check_vma=False)
  return mapped(q_BxLxNxK, k_BxLxNxK, v_BxLxNxK, segment_ids_BxL)


def select_local(is_local, local_value, global_value):
  """jnp.where for a traced choice; the value itself for a static one (no broadcast to both)."""
  if isinstance(is_local, (bool, np.bool_)):
    return local_value if is_local else global_value
  return jnp.where(is_local, local_value, global_value)


def choose_local(is_local, local_fn, global_fn, *args):
  """local_fn(*args) or global_fn(*args): decided now for an unrolled layer, by lax.cond for a
  scanned one (whose index is traced)."""
  if isinstance(is_local, (bool, np.bool_)):
    return (local_fn if is_local else global_fn)(*args)
  return jax.lax.cond(is_local, local_fn, global_fn, *args)


def gather_positions(x_BxLxD: jax.Array, positions_BxM: jax.Array) -> jax.Array:
  """x at the given positions of each row: [B, M, D]."""
  return jnp.take_along_axis(x_BxLxD, positions_BxM[..., None].astype(jnp.int32), axis=1)


def attention_with_dropout(q_BxLxNxK, k_BxLxNxK, v_BxLxNxK, mask_Bx1xLxL, rate: float, rng):
  """Softmax attention with dropout on the probabilities, as the original trains.

  The same arithmetic as jax.nn.dot_product_attention's XLA path (float32 logits and softmax),
  which is used whenever dropout is off; that path has no dropout.
  """
  scale = 1.0 / np.sqrt(q_BxLxNxK.shape[-1])
  logits_BxNxLxL = jnp.einsum("bqnk,bsnk->bnqs", q_BxLxNxK, k_BxLxNxK,
                              preferred_element_type=jnp.float32) * scale
  big_negative = 0.7 * float(jnp.finfo(jnp.float32).min)
  logits_BxNxLxL = jnp.where(mask_Bx1xLxL, logits_BxNxLxL, big_negative)
  probs_BxNxLxL = jax.nn.softmax(logits_BxNxLxL, axis=-1)
  probs_BxNxLxL = dropout.apply(probs_BxNxLxL, rng, rate)
  return jnp.einsum("bnqs,bsnk->bqnk", probs_BxNxLxL.astype(v_BxLxNxK.dtype), v_BxLxNxK)


def masked_attention(q_BxSxNxK, k_BxLxNxK, v_BxLxNxK, mask_Bx1xLxL, is_local, window: int,
                     query_positions_BxS, rate: float, rng):
  """XLA's attention under a boolean mask (attention_mask's), a local layer's band added.

  `query_positions_BxS` (or None): the positions q holds, whose rows of the mask apply. `rng`
  None: no dropout (jax.nn.dot_product_attention); else dropout on the probabilities at `rate`.
  """
  if query_positions_BxS is not None and mask_Bx1xLxL.shape[2] > 1:  # the queries' rows
    mask_Bx1xLxL = jnp.take_along_axis(mask_Bx1xLxL, query_positions_BxS[:, None, :, None], 2)
  if window:
    # A [B, 1, 1, L] key mask broadcasts up to [B, 1, L, L] here, for local layers only.
    band_1x1xLxL = local_band(k_BxLxNxK.shape[1], window)[None, None]
    if query_positions_BxS is not None:
      band_1x1xLxL = jnp.asarray(band_1x1xLxL[0, 0])[query_positions_BxS][:, None]
    mask_Bx1xLxL = select_local(is_local, mask_Bx1xLxL & band_1x1xLxL, mask_Bx1xLxL)
  if rng is not None:
    return attention_with_dropout(q_BxSxNxK, k_BxLxNxK, v_BxLxNxK, mask_Bx1xLxL, rate, rng)
  return jax.nn.dot_product_attention(q_BxSxNxK, k_BxLxNxK, v_BxLxNxK, mask=mask_Bx1xLxL,
                                      implementation="xla")


# Matmul FLOPs of each splash kernel per query-key pair and head dimension: the forward's
# q k^T and p v (2 + 2); the backward's dkv kernel recomputes q k^T, then dp = do v^T, dv and dk
# (2 each), and when fused with dq (three gradients out) also dq; a separate dq kernel recomputes
# q k^T and computes dp and dq.
_SPLASH_FLOPS = {"fwd": 4, "dkv": 8, "dkv_fused": 10, "dq": 6}


def splash_flops(line: str, operand_shapes: list[str], result_shape: str) -> float | None:
  """The FLOPs of a splash kernel's call in a compiled TPU program, which XLA's cost analysis
  cannot see into (bertjax/perf/hlocost.py asks): from its q and k operands ([..., L, K]), its
  kind, named in the call's name by jax, and the share of the [L, L] blocks it computes, named
  in the call's scope by `_splash_local` (`splash_blocks_K_of_N`; a local window's partial
  blocks counted whole): without the scope, every block (an upper bound). None for any other
  custom call."""
  kind = re.search(r"%?splash_mha_(fwd|dkv|dq)", line.split("=", 1)[0])
  arrays = [[int(d) for d in dims.split(",")]
            for shape in operand_shapes
            for dims in re.findall(r"(?:f32|bf16|f16)\[([\d,]+)\]", shape)
            if dims.count(",") >= 2]
  if not kind or len(arrays) < 2:
    return None
  q, k = arrays[0], arrays[1]
  # The blocks the call computes of all there are: _splash_local names them in a scope.
  walked = re.search(r"splash_blocks_(\d+)_of_(\d+)", line)
  share = int(walked.group(1)) / int(walked.group(2)) if walked else 1.0
  name = kind.group(1)
  if name == "dkv":
    grads = [dims for dims in re.findall(r"(?:f32|bf16|f16)\[([\d,]+)\]", result_shape)
             if dims.count(",") >= 2]
    name = "dkv_fused" if len(grads) >= 3 else "dkv"
  return float(_SPLASH_FLOPS[name] * math.prod(q[:-1]) * k[-2] * q[-1] * share)
