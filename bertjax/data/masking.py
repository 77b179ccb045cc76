"""Dynamic masked-LM masking of whole batches inside tf.data, reproducible without RNG state.

Every random number is a hash of (seed, epoch, example id, position, purpose), so a sequence gets a
new mask each epoch, the same mask for the same (seed, epoch) whatever the batch, host or restart
step, and the work is a handful of vectorized ops per batch (no per-example map).

Letters: B batch rows, L sequence length, M max predictions per sequence, V vocabulary.
"""

import dataclasses

import numpy as np
import tensorflow as tf

from bertjax.data.config import DataConfig
from bertjax.errors import Refusal

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
  # Byte-level BPE (bertjax/data/hf_tokenizer.py): a piece also starts a word where the class of
  # its first character does not continue the last one's of the piece before it:
  # not word_joins[word_last_V[previous id]][word_first_V[id]]. Empty for other tokenizers.
  word_first_V: tuple = ()
  word_last_V: tuple = ()
  word_joins: tuple = ()


def spec_from_tokenizer(tok, data: DataConfig) -> MaskingSpec:
  specials = set(tok.special_ids)
  real = tuple(i for i in range(tok.vocab_size) if i not in specials)
  p = data.mask_token_prob + data.random_token_prob
  if not 0.0 <= p <= 1.0:
    raise Refusal(f"mask_token_prob + random_token_prob = {p} must be within [0, 1].")
  return MaskingSpec(
      max_predictions=data.max_predictions_per_seq, vocab_size=tok.vocab_size,
      masked_lm_prob=data.masked_lm_prob, mask_token_prob=data.mask_token_prob,
      random_token_prob=data.random_token_prob,
      whole_word_masking=data.whole_word_masking, mask_id=tok.mask_id,
      special_ids=(tok.pad_id, tok.cls_id, tok.sep_id, tok.mask_id), real_ids=real,
      word_start_V=tuple(bool(x) for x in tok.word_start_V), **_word_classes(tok))


def _word_classes(tok) -> dict:
  tables = getattr(tok, "word_tables", None)
  if tables is None or not tables.joins_CxC.any():
    return {}
  return dict(word_first_V=tuple(int(x) for x in tables.first_V),
              word_last_V=tuple(int(x) for x in tables.last_V),
              word_joins=tuple(tuple(bool(x) for x in row) for row in tables.joins_CxC))


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


def word_starts(ids_BxL, maskable_BxL, spec: MaskingSpec):
  """[B, L] bool: the maskable pieces that start a word (the others join the word before)."""
  word_start_V = tf.constant(np.asarray(spec.word_start_V, bool))
  prev_maskable_BxL = tf.pad(maskable_BxL[:, :-1], [[0, 0], [1, 0]])
  # A piece after a special token starts a word even if the vocabulary calls it a continuation.
  starts_BxL = tf.logical_or(tf.gather(word_start_V, ids_BxL), tf.logical_not(prev_maskable_BxL))
  if spec.word_joins:
    prev_ids_BxL = tf.pad(ids_BxL[:, :-1], [[0, 0], [1, 0]])
    last_BxL = tf.gather(tf.constant(np.asarray(spec.word_last_V, np.int32)), prev_ids_BxL)
    first_BxL = tf.gather(tf.constant(np.asarray(spec.word_first_V, np.int32)), ids_BxL)
    joins_BxL = tf.gather_nd(tf.constant(np.asarray(spec.word_joins, bool)),
                             tf.stack([last_BxL, first_BxL], axis=-1))
    starts_BxL = tf.logical_or(starts_BxL, tf.logical_not(joins_BxL))
  return tf.logical_and(maskable_BxL, starts_BxL)


def _whole_word_selection(ids_BxL, maskable_BxL, k_B, key_B1, spec: MaskingSpec):
  """Positions of whole words, as the original: words in random order, each taken if it fits in
  the k still to predict, a word that does not fit skipped for the next one. Returns [B, L] bool.

  U = L + 1 word slots per row (word w has index w; 0 holds the pieces before the first word).
  """
  B, L = tf.shape(ids_BxL)[0], ids_BxL.shape[1]
  word_BxL = tf.cumsum(tf.cast(word_starts(ids_BxL, maskable_BxL, spec), tf.int32), axis=1)
  # Only maskable positions count: [SEP] and padding share the index of the word before them.
  flat_word = tf.reshape(tf.range(B)[:, None] * (L + 1) + word_BxL, [-1])
  len_BxU = tf.reshape(tf.math.unsorted_segment_sum(
      tf.reshape(tf.cast(maskable_BxL, tf.int32), [-1]), flat_word, B * (L + 1)), [B, L + 1])
  score_BxU = tf.cast(tf.bitwise.right_shift(hash_u32(*key_B1, tf.range(L + 1)[None, :], _SELECT),
                                             tf.constant(1, tf.uint32)), tf.int32)
  order_BxU = tf.argsort(tf.where(len_BxU > 0, score_BxU, -1), axis=1, direction="DESCENDING",
                         stable=True)
  len_ranked_UxB = tf.transpose(tf.gather(len_BxU, order_BxU, batch_dims=1))
  # The greedy pass is sequential; it stops once every row is full or has tried all its words.
  num_words = tf.reduce_max(tf.reduce_sum(tf.cast(len_BxU > 0, tf.int32), axis=1))

  def step(r, total_B, taken):
    n_B = len_ranked_UxB[r]
    fits_B = tf.logical_and(n_B > 0, total_B + n_B <= k_B)
    return r + 1, total_B + tf.where(fits_B, n_B, 0), taken.write(r, fits_B)

  num_ranks, _, taken = tf.while_loop(
      lambda r, total_B, taken: tf.logical_and(r < num_words, tf.reduce_any(total_B < k_B)), step,
      (0, tf.zeros_like(k_B), tf.TensorArray(tf.bool, size=L + 1, element_shape=[None])))
  taken_UxB = tf.concat([taken.gather(tf.range(num_ranks)),
                         tf.zeros([L + 1 - num_ranks, B], tf.bool)], axis=0)
  rank_Nx2 = tf.stack([tf.broadcast_to(tf.range(B)[:, None], [B, L + 1]), order_BxU], axis=-1)
  word_taken_BxU = tf.scatter_nd(rank_Nx2, tf.transpose(taken_UxB), [B, L + 1])
  return tf.logical_and(maskable_BxL, tf.gather(word_taken_BxU, word_BxL, batch_dims=1))


def mask_batch(input_ids_BxL, input_mask_BxL, example_id_B, *, seed: int, epoch, spec: MaskingSpec):
  """Masks a batch; returns (masked input_ids, masked_lm_positions, masked_lm_ids, masked_lm_weights)."""
  B = tf.shape(input_ids_BxL)[0]
  L = input_ids_BxL.shape[1]
  M = spec.max_predictions
  if M > L:
    raise Refusal(f"max_predictions_per_seq {M} exceeds the sequence length {L}.")
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
    selected_BxL = _whole_word_selection(ids_BxL, maskable_BxL, k_B, key_B1, spec)
    # The selected positions (at most k <= M) come first: top_k of a 0/1 score.
    _, cand_BxM = tf.math.top_k(tf.cast(selected_BxL, tf.int32), k=M)
    valid_BxM = tf.gather(selected_BxL, cand_BxM, batch_dims=1)
  else:
    # 31-bit integer scores: the k highest-scoring maskable positions are predicted.
    score_BxL = tf.cast(tf.bitwise.right_shift(hash_u32(*key_B1, pos_1xL, _SELECT),
                                               tf.constant(1, tf.uint32)), tf.int32)
    score_BxL = tf.where(maskable_BxL, score_BxL, -1)
    _, cand_BxM = tf.math.top_k(score_BxL, k=M, sorted=True)
    cand_ok_BxM = tf.gather(maskable_BxL, cand_BxM, batch_dims=1)
    valid_BxM = tf.logical_and(cand_ok_BxM, tf.range(M)[None, :] < k_B[:, None])
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
