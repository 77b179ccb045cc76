"""Dynamic masked-LM masking of whole batches inside tf.data, reproducible without RNG state.

Every random number is a hash of (seed, epoch, example id, position, purpose), so a sequence gets a
new mask each epoch, the same mask for the same (seed, epoch) whatever the batch, host or restart
step, and the work is a handful of vectorized ops per batch (no per-example map).

Letters: B batch rows, L sequence length, M max predictions per sequence, V vocabulary.
"""

import dataclasses

import numpy as np
import tensorflow as tf

_GOLDEN = 0x9E3779B1
# Salts that make the streams of the different random decisions independent.
_ROUND, _SELECT, _ACTION, _TOKEN = 1, 2, 3, 4


@dataclasses.dataclass(frozen=True)
class MaskingSpec:
  """What masking needs from the config and tokenizer (plain values: cheap to capture in tf.data)."""
  max_predictions: int
  vocab_size: int
  masked_lm_prob: float = 0.15
  mask_token_prob: float = 0.8
  random_token_prob: float = 0.1
  whole_word_masking: bool = False
  mask_id: int = 4
  special_ids: tuple = (0, 2, 3)  # never masked: [PAD], [CLS], [SEP] (and [MASK] if present)
  real_ids: tuple = ()  # replacement pool for the "random token" case: no special token
  word_start_V: tuple = ()  # per id: True where a piece starts a word (whole-word masking)


def spec_from_tokenizer(tok, data_config) -> MaskingSpec:
  specials = set(tok.special_ids)
  real = tuple(i for i in range(tok.vocab_size) if i not in specials)
  p = data_config.mask_token_prob + data_config.random_token_prob
  if not 0.0 <= p <= 1.0:
    raise ValueError(f"mask_token_prob + random_token_prob = {p} must be within [0, 1].")
  return MaskingSpec(
      max_predictions=data_config.max_predictions_per_seq, vocab_size=tok.vocab_size,
      masked_lm_prob=data_config.masked_lm_prob, mask_token_prob=data_config.mask_token_prob,
      random_token_prob=data_config.random_token_prob,
      whole_word_masking=data_config.whole_word_masking, mask_id=tok.mask_id,
      special_ids=(tok.pad_id, tok.cls_id, tok.sep_id, tok.mask_id), real_ids=real,
      word_start_V=tuple(bool(x) for x in tok.word_start_V))


def _mix(h):
  """murmur3's 32-bit finalizer: every input bit flips about half the output bits."""
  h = tf.bitwise.bitwise_xor(h, tf.bitwise.right_shift(h, tf.constant(16, tf.uint32)))
  h = h * tf.constant(0x85EBCA6B, tf.uint32)
  h = tf.bitwise.bitwise_xor(h, tf.bitwise.right_shift(h, tf.constant(13, tf.uint32)))
  h = h * tf.constant(0xC2B2AE35, tf.uint32)
  return tf.bitwise.bitwise_xor(h, tf.bitwise.right_shift(h, tf.constant(16, tf.uint32)))


def hash_u32(*parts):
  """A uint32 hash of broadcastable integer tensors."""
  h = tf.constant(0x12345678, tf.uint32)
  for x in parts:
    x = tf.cast(x, tf.int64)
    for word in (tf.bitwise.bitwise_and(x, 0xFFFFFFFF), tf.bitwise.right_shift(x, 32)):
      h = _mix(tf.bitwise.bitwise_xor(h, tf.cast(word, tf.uint32)) * tf.constant(_GOLDEN, tf.uint32))
  return h


def _uniform(h):
  """uint32 hash -> float32 in [0, 1) with 24 random bits."""
  return tf.cast(tf.bitwise.right_shift(h, tf.constant(8, tf.uint32)), tf.float32) * (1.0 / (1 << 24))


def mask_batch(input_ids_BxL, input_mask_BxL, example_id_B, *, seed: int, epoch, spec: MaskingSpec):
  """Masks a batch; returns (masked input_ids, masked_lm_positions, masked_lm_ids, masked_lm_weights)."""
  B = tf.shape(input_ids_BxL)[0]
  L = input_ids_BxL.shape[1]
  M = spec.max_predictions
  if M > L:
    raise ValueError(f"max_predictions_per_seq {M} exceeds the sequence length {L}.")
  ids_BxL = tf.cast(input_ids_BxL, tf.int32)
  special_V = np.zeros(max(max(spec.special_ids) + 1, spec.vocab_size), bool)
  special_V[list(spec.special_ids)] = True
  is_special_BxL = tf.gather(tf.constant(special_V), ids_BxL)
  maskable_BxL = tf.logical_and(tf.cast(input_mask_BxL, tf.bool), tf.logical_not(is_special_BxL))
  key_B1 = [tf.constant(seed, tf.int64), tf.cast(epoch, tf.int64), tf.cast(example_id_B, tf.int64)[:, None]]
  pos_1xL = tf.range(L, dtype=tf.int64)[None, :]

  # How many to predict: 15% of maskable tokens, stochastically rounded so the rate is exact on
  # average for every length; at least one (as the original), at most M.
  n_B = tf.reduce_sum(tf.cast(maskable_BxL, tf.float32), axis=1)
  u_round_B = _uniform(hash_u32(*key_B1, _ROUND))[:, 0]
  k_B = tf.floor(n_B * spec.masked_lm_prob + u_round_B)
  k_B = tf.minimum(tf.maximum(k_B, tf.minimum(n_B, 1.0)), float(M))
  k_B = tf.cast(k_B, tf.int32)

  if spec.whole_word_masking:
    word_start_V = tf.constant(np.asarray(spec.word_start_V, bool))
    prev_maskable_BxL = tf.pad(maskable_BxL[:, :-1], [[0, 0], [1, 0]])
    # A piece after a special token starts a word even if the vocabulary calls it a continuation.
    starts_BxL = tf.logical_and(maskable_BxL, tf.logical_or(tf.gather(word_start_V, ids_BxL),
                                                            tf.logical_not(prev_maskable_BxL)))
    unit_BxL = tf.cumsum(tf.cast(starts_BxL, tf.int64), axis=1)  # word index; pieces share it
  else:
    unit_BxL = tf.broadcast_to(pos_1xL, tf.shape(ids_BxL, out_type=tf.int64))
  # 31-bit integer scores: pieces of one word tie, and top_k keeps ties in position order.
  score_BxL = tf.cast(tf.bitwise.right_shift(hash_u32(*key_B1, unit_BxL, _SELECT),
                                             tf.constant(1, tf.uint32)), tf.int32)
  score_BxL = tf.where(maskable_BxL, score_BxL, -1)
  _, cand_BxM = tf.math.top_k(score_BxL, k=M, sorted=True)
  j_1xM = tf.range(M)[None, :]
  cand_ok_BxM = tf.gather(maskable_BxL, cand_BxM, batch_dims=1)
  if spec.whole_word_masking:
    # Take whole words in score order while they fit in k (a word that does not fit ends the list).
    rows_BxL = tf.cast(tf.range(B)[:, None], tf.int64) * (L + 1) + unit_BxL
    flat = tf.reshape(rows_BxL, [-1])
    nseg = tf.cast(B, tf.int64) * (L + 1)
    word_len = tf.math.unsorted_segment_sum(tf.ones_like(flat, tf.int32), flat, nseg)
    word_first = tf.math.unsorted_segment_min(tf.reshape(tf.broadcast_to(
        tf.cast(pos_1xL, tf.int32), tf.shape(ids_BxL)), [-1]), flat, nseg)
    cand_unit_BxM = tf.gather(rows_BxL, cand_BxM, batch_dims=1)
    last_rank_BxM = (j_1xM - (cand_BxM - tf.gather(word_first, cand_unit_BxM))
                     + tf.gather(word_len, cand_unit_BxM) - 1)
    valid_BxM = tf.logical_and(cand_ok_BxM, last_rank_BxM < k_B[:, None])
  else:
    valid_BxM = tf.logical_and(cand_ok_BxM, j_1xM < k_B[:, None])
  # Positions in ascending order, as the original; padding slots at the end.
  positions_BxM = tf.sort(tf.where(valid_BxM, cand_BxM, L), axis=1)
  weights_BxM = positions_BxM < L
  positions_BxM = tf.where(weights_BxM, positions_BxM, 0)
  labels_BxM = tf.where(weights_BxM, tf.gather(ids_BxL, positions_BxM, batch_dims=1), 0)

  # 80% [MASK], 10% a random real token, 10% unchanged; keyed by position, not slot.
  key_pos_BxM = tf.cast(positions_BxM, tf.int64)
  u_action_BxM = _uniform(hash_u32(*key_B1, key_pos_BxM, _ACTION))
  real_ids = tf.constant(np.asarray(spec.real_ids, np.int32))
  pick_BxM = tf.cast(hash_u32(*key_B1, key_pos_BxM, _TOKEN) % tf.constant(len(spec.real_ids),
                                                                         tf.uint32), tf.int32)
  random_BxM = tf.gather(real_ids, pick_BxM)
  new_BxM = tf.where(u_action_BxM < spec.mask_token_prob, spec.mask_id,
                     tf.where(u_action_BxM < spec.mask_token_prob + spec.random_token_prob,
                              random_BxM, labels_BxM))
  rows_BxM = tf.broadcast_to(tf.range(B)[:, None], tf.shape(positions_BxM))
  idx_Nx2 = tf.boolean_mask(tf.stack([rows_BxM, positions_BxM], axis=-1), weights_BxM)
  masked_BxL = tf.tensor_scatter_nd_update(ids_BxL, idx_Nx2, tf.boolean_mask(new_BxM, weights_BxM))
  return masked_BxL, positions_BxM, labels_BxM, tf.cast(weights_BxM, tf.float32)
