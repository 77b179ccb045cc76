"""Pre-training heads (masked LM, next sentence) and fine-tuning heads over `BertModel`: BERT's,
or with task_head="modernbert" ModernBERT's (its prediction head before the classifier).

The MLM head gathers the masked positions first and only then applies its transform and the
vocabulary projection, so pre-training never builds a [B, L, V] tensor: at 15% masking that is
about 7x less head compute and memory than projecting every position. Logits are float32;
pre-training on an accelerator scores them where they are made (decoded_scores).
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from bertjax.model import dropout, losses
from bertjax.model.kernels import mlm_grads, mlm_kernel
# Picking rows' states at positions is attention's (the encoder's last layer does it too).
from bertjax.model.attention import gather_positions
from bertjax.model.config import ACTIVATIONS, BertConfig
from bertjax.model.encoder import BertModel
from bertjax.model.primitives import EMBED_TO_EMBED, dense, layer_norm, zeros
from bertjax.parallel import platforms


_LOGITS_AXES = ("activation_batch", "activation_length", "activation_vocab")
_CONTRACT_V = (((2,), (0,)), ((), ()))  # [B, M, V] x [V, D]
_CONTRACT_BM = (((0, 1), (0, 1)), ((), ()))  # [B, M, *] x [B, M, V]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def tied_decoder(x_BxMxD, w_VxD, bias_V, compute_dtype):
  """float32 logits x W^T + b against the word-embedding table W, in `compute_dtype`.

  The arithmetic of the einsum and its automatic gradient; only the backward pass is written out,
  to keep the [B*M, V] gradient of the logits in the layout it is made in. Differentiated
  automatically, W's gradient contracts the logits' gradient over its leading (B, M) axes, and XLA
  on CPU first copies that whole tensor into transposed order (a tenth of a small model's step);
  here the contraction runs with the small [B*M, D] input transposed instead, and the bias
  gradient comes from the same product, x with a column of ones (`_weight_and_bias_grads`).
  """
  return _decode(x_BxMxD, w_VxD, bias_V, compute_dtype)


def _decode(x_BxMxD, w_VxD, bias_V, compute_dtype):
  logits_BxMxV = jnp.einsum("bmd,vd->bmv", x_BxMxD.astype(compute_dtype),
                            w_VxD.astype(compute_dtype), preferred_element_type=jnp.float32)
  return logits_BxMxV + bias_V.astype(jnp.float32)


def _decode_fwd(x_BxMxD, w_VxD, bias_V, compute_dtype):
  return _decode(x_BxMxD, w_VxD, bias_V, compute_dtype), (x_BxMxD, w_VxD, bias_V)


def _decode_bwd(compute_dtype, residuals, g_BxMxV):
  x_BxMxD, w_VxD, bias_V = residuals
  # As automatic differentiation does: the float32 gradient of the logits against the operands
  # in compute dtype (bfloat16 x bfloat16 -> float32 products are not supported everywhere).
  dx_BxMxD = jax.lax.dot_general(g_BxMxV, w_VxD.astype(compute_dtype), _CONTRACT_V,
                                 preferred_element_type=jnp.float32)
  dw_VxD, dbias_V = _weight_and_bias_grads(x_BxMxD, g_BxMxV, compute_dtype)
  return (dx_BxMxD.astype(x_BxMxD.dtype), dw_VxD.astype(w_VxD.dtype),
          dbias_V.astype(bias_V.dtype))


def _weight_and_bias_grads(x_BxMxD, g_BxMxV, compute_dtype):
  """W's [V, D] and the bias' [V] gradients, float32, from the logits' gradient g: one product of
  g with x and a column of ones appended, where the bias' own sum read g again (a pass over
  ModernBERT's [predictions, V] float32 logits, from which XLA makes g in each reader: 8% of its
  phase 2 step on v6e-8, docs/performance.md)."""
  x1_BxMxD1 = jnp.concatenate([x_BxMxD.astype(compute_dtype),
                               jnp.ones(x_BxMxD.shape[:2] + (1,), compute_dtype)], axis=-1)
  dwb_D1xV = jax.lax.dot_general(x1_BxMxD1, g_BxMxV, _CONTRACT_BM,
                                 preferred_element_type=jnp.float32)
  return dwb_D1xV[:-1].T, dwb_D1xV[-1]


tied_decoder.defvjp(_decode_fwd, _decode_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def decoded_scores(x_BxMxD, w_VxD, bias_V, labels_BxM, compute_dtype) -> losses.MlmScores:
  """The MLM scores of tied_decoder's logits at `labels`, without keeping the logits.

  The forward pass writes the float32 [B, M, V] logits once and reads them once (log Z, the
  label's logit, the largest); on a TPU it never writes them (mlm_kernel: made and read in
  VMEM). The backward recomputes them by the same product and makes their
  gradient, softmax - one-hot, in compute dtype as the product's output: it is written once and
  read by the two products after it. Automatic differentiation would keep the float32 logits and
  read them again in each of the three products of the backward (the gradient's arithmetic
  fused into each): BERT-Base L 512 on v6e-8, 4.8 -> 3.7 GB of HBM a chip a step for the head,
  at a third more of its FLOPs (docs/performance.md). Values are the unfused loss's; the
  gradient differs by its rounding to compute dtype, as every gradient of the encoder's.
  """
  return _scores(x_BxMxD, w_VxD, bias_V, labels_BxM, compute_dtype)[0]


def _scores(x_BxMxD, w_VxD, bias_V, labels_BxM, compute_dtype):
  def xla(x_BxMxD, w_VxD, bias_V, labels_BxM):
    logits_BxMxV = nn.with_logical_constraint(
        _decode(x_BxMxD, w_VxD, bias_V, compute_dtype), _LOGITS_AXES)
    return losses.figures(logits_BxMxV, labels_BxM)

  # On a TPU the logits are made and read in VMEM (mlm_kernel), never written.
  figures = mlm_kernel.on_platform(x_BxMxD.astype(compute_dtype), w_VxD.astype(compute_dtype),
                                   bias_V, labels_BxM, xla)
  return losses.scores_of(*figures)


def _scores_fwd(x_BxMxD, w_VxD, bias_V, labels_BxM, compute_dtype):
  # W in the compute dtype whole on each device (as the products read it), kept for the
  # backward: made there again, fsdp's table was gathered and relaid twice a step (BERT-Base
  # on v5p-8: 152 MB). The parameter itself rides along for its gradient's dtype (no copy).
  w_whole = nn.with_logical_constraint(w_VxD.astype(compute_dtype), (None, None))
  scores, log_z_BxM = _scores(x_BxMxD, w_whole, bias_V, labels_BxM, compute_dtype)
  return scores, (x_BxMxD, w_whole, bias_V, labels_BxM, log_z_BxM, w_VxD)


def _scores_bwd(compute_dtype, residuals, g):
  # The barrier keeps XLA from taking the forward's logits for the recomputed ones (kept alive
  # until now, which is what this function avoids).
  *residuals, w_param = residuals
  x_BxMxD, w_VxD, bias_V, labels_BxM, log_z_BxM = jax.lax.optimization_barrier(residuals)

  def xla(x_BxMxD, w_VxD, bias_V, labels_BxM, log_z_BxM, g_BxM):
    logits_BxMxV = nn.with_logical_constraint(
        _decode(x_BxMxD, w_VxD, bias_V, compute_dtype), _LOGITS_AXES)
    one_hot_BxMxV = jax.nn.one_hot(labels_BxM, w_VxD.shape[0], dtype=jnp.float32)
    g_BxMxV = ((jnp.exp(logits_BxMxV - log_z_BxM[..., None]) - one_hot_BxMxV)
               * g_BxM[..., None]).astype(compute_dtype)
    # Written once: without the barrier XLA computes it again from float32 logits in each reader.
    g_BxMxV = jax.lax.optimization_barrier(g_BxMxV)
    dx_BxMxD = jax.lax.dot_general(g_BxMxV, w_VxD.astype(compute_dtype), _CONTRACT_V,
                                   preferred_element_type=jnp.float32)
    return (dx_BxMxD, *_weight_and_bias_grads(x_BxMxD, g_BxMxV, compute_dtype))

  # On a TPU the logits are made again and their gradient read in VMEM (mlm_grads), never
  # written. `correct` has no gradient.
  dx_BxMxD, dw_VxD, dbias_V = mlm_grads.on_platform(
      x_BxMxD.astype(compute_dtype), w_VxD.astype(compute_dtype), bias_V, labels_BxM,
      log_z_BxM, g.nll_BxM, xla)
  return (dx_BxMxD.astype(x_BxMxD.dtype), dw_VxD.astype(w_param.dtype),
          dbias_V.astype(bias_V.dtype), None)


decoded_scores.defvjp(_scores_fwd, _scores_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def kept_scores(x_BxMxD, w_VxD, bias_V, labels_BxM, compute_dtype) -> losses.MlmScores:
  """The MLM scores of tied_decoder's logits at `labels`, the logits kept for the backward
  (recompute_mlm_logits false, on a TPU: ModernBERT's phase 2). XLA wrote the float32 logits
  with their largest and read them all again for log Z; mlm_kernel.kept_scores makes log Z as
  it writes them. The backward is tied_decoder's and the loss's: the two products make the
  logits' gradient, softmax - one-hot, from the kept logits as they read them. The values are
  the unfused loss's but for the order log Z's sum is taken in."""
  return _kept(x_BxMxD, w_VxD, bias_V, labels_BxM, compute_dtype)[0]


def _padded(w_VxD, bias_V, compute_dtype):
  """W in the compute dtype and the bias with the kept logits' width of rows
  (mlm_kernel.kept_width): W's zeros, the bias' mlm_kernel.PAD (no padded column's exp
  counts)."""
  extra = mlm_kernel.kept_width(w_VxD.shape[0]) - w_VxD.shape[0]
  return (jnp.pad(w_VxD.astype(compute_dtype), ((0, extra), (0, 0))),
          jnp.pad(bias_V.astype(jnp.float32), (0, extra), constant_values=mlm_kernel.PAD))


def _kept(x_BxMxD, w_VxD, bias_V, labels_BxM, compute_dtype):
  def xla(x_BxMxD, w_VxD, bias_V, labels_BxM):
    logits_BxMxV = nn.with_logical_constraint(
        _decode(x_BxMxD, w_VxD, bias_V, compute_dtype), _LOGITS_AXES)
    return (logits_BxMxV, *losses.figures(logits_BxMxV, labels_BxM))

  w_padded, bias_padded = _padded(w_VxD, bias_V, compute_dtype)
  logits_BxMxV, *figures = mlm_kernel.kept_on_platform(
      x_BxMxD.astype(compute_dtype), w_padded, bias_padded, labels_BxM, xla)
  return losses.scores_of(*figures)[0], (logits_BxMxV, figures[0], w_padded)


def _kept_fwd(x_BxMxD, w_VxD, bias_V, labels_BxM, compute_dtype):
  scores, kept = _kept(x_BxMxD, w_VxD, bias_V, labels_BxM, compute_dtype)
  # W as the forward padded it kept too: not padded again in the backward.
  return scores, (x_BxMxD, w_VxD, bias_V, labels_BxM, *kept)


def _kept_bwd(compute_dtype, residuals, g):
  x_BxMxD, w_VxD, bias_V, labels_BxM, logits_BxMxV, log_z_BxM, w_padded = residuals
  # The logits' padded columns' gradient is zero (their exp is): W's padded rows meet only it.
  one_hot_BxMxV = jax.nn.one_hot(labels_BxM, w_padded.shape[0], dtype=jnp.float32)
  g_BxMxV = ((jnp.exp(logits_BxMxV - log_z_BxM[..., None]) - one_hot_BxMxV)
             * g.nll_BxM[..., None])  # `correct` has no gradient
  dx_BxMxD = jax.lax.dot_general(g_BxMxV, w_padded, _CONTRACT_V,
                                 preferred_element_type=jnp.float32)
  dw_VxD, dbias_V = _weight_and_bias_grads(x_BxMxD, g_BxMxV, compute_dtype)
  vocab = w_VxD.shape[0]
  return (dx_BxMxD.astype(x_BxMxD.dtype), dw_VxD[:vocab].astype(w_VxD.dtype),
          dbias_V[:vocab].astype(bias_V.dtype), None)


kept_scores.defvjp(_kept_fwd, _kept_bwd)


class MlmHead(nn.Module):
  """dense(D) -> activation -> LayerNorm -> logits against the tied word embeddings + bias.

  ModernBERT's options: no transform bias (head_bias), its own activation (head_act), no output
  bias (decoder_bias), an untied decoder matrix `decoder` [V, D] (tie_word_embeddings=False).
  """

  config: BertConfig

  @nn.compact
  def __call__(self, x_BxMxD, word_embeddings_VxD, labels_BxM=None):
    """Logits [B, M, V]; or with `labels_BxM`, their scores alone (decoded_scores, or
    kept_scores where the logits are kept)."""
    cfg = self.config
    h_BxMxD = dense(cfg, cfg.hidden_size, EMBED_TO_EMBED, "transform", use_bias=cfg.head_bias)(
        x_BxMxD)
    h_BxMxD = ACTIVATIONS[cfg.head_act or cfg.hidden_act](h_BxMxD)
    h_BxMxD = layer_norm(cfg, "transform_layer_norm")(h_BxMxD)
    if not cfg.tie_word_embeddings:
      word_embeddings_VxD = self.param(
          "decoder", nn.with_logical_partitioning(
              nn.initializers.truncated_normal(stddev=cfg.initializer_range), ("vocab", "embed")),
          (cfg.vocab_size, cfg.hidden_size), cfg.storage_dtype)
    if cfg.decoder_bias:
      bias_V = self.param("output_bias", zeros(("vocab",)), (cfg.vocab_size,),
                          cfg.storage_dtype)
    else:
      # A constant zero: its gradient from tied_decoder is computed and dropped.
      bias_V = jnp.zeros((cfg.vocab_size,), cfg.storage_dtype)
    if labels_BxM is not None:
      scored = decoded_scores if cfg.recompute_mlm_logits else kept_scores
      return scored(h_BxMxD, word_embeddings_VxD, bias_V, labels_BxM, cfg.compute_dtype)
    return nn.with_logical_constraint(
        tied_decoder(h_BxMxD, word_embeddings_VxD, bias_V, cfg.compute_dtype), _LOGITS_AXES)


class NspHead(nn.Module):
  """Next-sentence logits [..., 2] from pooled outputs [..., D] (0 = IsNext, 1 = NotNext)."""

  config: BertConfig

  @nn.compact
  def __call__(self, pooled_BxD):
    return dense(self.config, 2, ("embed", None), "dense", out_dtype=jnp.float32)(pooled_BxD)


class BertForPreTraining(nn.Module):
  """BERT with its two pre-training heads. Returns (mlm_logits [B, M, V], nsp_logits [B, 2]);
  with `masked_lm_ids` given and config.recompute_mlm_logits (or a TPU's step: kept_scores),
  (losses.MlmScores, nsp_logits).

  `masked_lm_positions` [B, M] selects where MLM logits are computed; None computes them at every
  position (for inference such as fill-in-the-blank), which builds the full [B, L, V] tensor.
  Packed rows (bertjax/data/packing.py) pass `sequence_ids` and `nsp_positions` [B, S], the
  [CLS] of each sequence: the pooler and the NSP head then run at each, and nsp_logits are
  [B, S, 2].
  """

  config: BertConfig

  def setup(self):
    self.bert = BertModel(self.config)
    self.mlm = MlmHead(self.config)
    self.nsp = NspHead(self.config)

  def __call__(self, input_ids, input_mask=None, segment_ids=None, masked_lm_positions=None,
               deterministic: bool = True, position_ids=None, sequence_ids=None,
               nsp_positions=None, masked_lm_ids=None):
    seq_BxLxD, pooled_BxD = self.bert(input_ids, input_mask, segment_ids, position_ids,
                                      sequence_ids, deterministic)
    x_BxMxD = (seq_BxLxD if masked_lm_positions is None
               else gather_positions(seq_BxLxD, jnp.asarray(masked_lm_positions)))
    labels_BxM = None
    if masked_lm_ids is not None and (self.config.recompute_mlm_logits
                                      or platforms.tpu_chip()):
      labels_BxM = jnp.asarray(masked_lm_ids)  # scored where made (on a TPU also when kept)
    mlm_logits_BxMxV = self.mlm(x_BxMxD, self.bert.word_embedding_table(), labels_BxM)
    if nsp_positions is None:
      return mlm_logits_BxMxV, self.nsp(pooled_BxD)
    # The same pooler at every [CLS]: each gathered state becomes a length-1 row of its own (the
    # pooler reads position 0), so packed and unpacked sequences share one code path.
    cls_BxSxD = gather_positions(seq_BxLxD, jnp.asarray(nsp_positions))
    b, s, d = cls_BxSxD.shape
    pooled_BxSxD = self.bert.pool(cls_BxSxD.reshape(b * s, 1, d)).reshape(b, s, d)
    return mlm_logits_BxMxV, self.nsp(pooled_BxSxD)


class PredictionHead(nn.Module):
  """ModernBERT's transform before a task's classifier (transformers' ModernBertPredictionHead):
  dense(D) -> activation -> norm, with the MLM transform's options (head_bias, head_act). Its
  parameters are named as MlmHead's transform: fine-tuning starts it from a pre-trained MLM
  transform, as transformers loads `head.*` of a ModernBertForMaskedLM into a task class.
  Pooled states [B, D] or every position's [B, L, D] alike."""

  config: BertConfig

  @nn.compact
  def __call__(self, x_xD):
    cfg = self.config
    h_xD = dense(cfg, cfg.hidden_size, EMBED_TO_EMBED, "transform", use_bias=cfg.head_bias)(x_xD)
    h_xD = ACTIVATIONS[cfg.head_act or cfg.hidden_act](h_xD)
    return layer_norm(cfg, "transform_layer_norm")(h_xD)


PREDICTION_HEAD = "prediction_head"  # its subtree beside "bert" and the classifier


def mean_pool(seq_BxLxD: jax.Array, input_mask_BxL) -> jax.Array:
  """The mean of each row's states over its real tokens (float32 sums). A row with none (the
  rows that pad an evaluation batch) gives zeros, not a division by zero."""
  m_BxLx1 = jnp.asarray(input_mask_BxL)[..., None].astype(jnp.float32)
  total_BxD = jnp.sum(seq_BxLxD.astype(jnp.float32) * m_BxLx1, axis=1)
  return (total_BxD / jnp.maximum(jnp.sum(m_BxLx1, axis=1), 1.0)).astype(seq_BxLxD.dtype)


def _classify(config: BertConfig, x, num_labels: int, deterministic: bool, name: str,
              *, modern: bool, dropout_first: bool = True):
  """[prediction head ->] dropout -> dense(num_labels), float32 logits."""
  if modern:
    x = PredictionHead(config, name=PREDICTION_HEAD)(x)
  if dropout_first:
    x = dropout.Dropout(config.hidden_dropout)(x, deterministic=deterministic)
  return dense(config, num_labels, ("embed", None), name, out_dtype=jnp.float32)(x)


class BertForSequenceClassification(nn.Module):
  """pooled -> dropout -> dense(num_labels): logits [B, num_labels] (GLUE-style tasks).

  task_head="modernbert": the [CLS] state (or, classifier_pooling="mean", the mean over real
  tokens) -> PredictionHead -> dropout -> dense, as ModernBertForSequenceClassification.

  Packed rows (prediction): `sequence_ids` number each row's sequences and `cls_positions` [B, S]
  are their [CLS] positions; the logits are then [B, S, num_labels], and the encoder's last layer
  computes those positions alone (BertModel's query_positions). Not with mean pooling."""

  config: BertConfig
  num_labels: int

  @nn.compact
  def __call__(self, input_ids, input_mask=None, segment_ids=None, deterministic: bool = True,
               sequence_ids=None, cls_positions=None):
    cfg = self.config
    modern = cfg.task_head == "modernbert"
    if cls_positions is not None:
      if modern and cfg.classifier_pooling == "mean":
        raise ValueError("cls_positions need classifier_pooling='cls': a mean reads every token")
      cls_BxSxD, pooled_BxSxD = BertModel(cfg, name="bert")(
          input_ids, input_mask, segment_ids, None, sequence_ids, deterministic, cls_positions)
      return _classify(cfg, cls_BxSxD if modern else pooled_BxSxD, self.num_labels,
                       deterministic, "classifier", modern=modern)
    seq_BxLxD, pooled_BxD = BertModel(cfg, name="bert")(
        input_ids, input_mask, segment_ids, deterministic=deterministic)
    if modern and cfg.classifier_pooling == "mean":
      pooled_BxD = mean_pool(seq_BxLxD, jnp.ones(seq_BxLxD.shape[:2], jnp.int32)
                             if input_mask is None else input_mask)
    elif modern:
      pooled_BxD = seq_BxLxD[:, 0]
    return _classify(cfg, pooled_BxD, self.num_labels, deterministic, "classifier", modern=modern)


class BertForTokenClassification(nn.Module):
  """sequence -> dropout -> dense(num_labels): logits [B, L, num_labels] (tagging, NER);
  task_head="modernbert": PredictionHead at every position first."""

  config: BertConfig
  num_labels: int

  @nn.compact
  def __call__(self, input_ids, input_mask=None, segment_ids=None, deterministic: bool = True):
    seq_BxLxD, _ = BertModel(self.config, name="bert")(
        input_ids, input_mask, segment_ids, deterministic=deterministic)
    return _classify(self.config, seq_BxLxD, self.num_labels, deterministic, "classifier",
                     modern=self.config.task_head == "modernbert")


class BertForSpanExtraction(nn.Module):
  """sequence -> dense(2): (start_logits [B, L], end_logits [B, L]) (SQuAD-style answers);
  task_head="modernbert": PredictionHead -> dropout first, as ModernBertForQuestionAnswering."""

  config: BertConfig

  @nn.compact
  def __call__(self, input_ids, input_mask=None, segment_ids=None, deterministic: bool = True):
    seq_BxLxD, _ = BertModel(self.config, name="bert")(
        input_ids, input_mask, segment_ids, deterministic=deterministic)
    modern = self.config.task_head == "modernbert"
    logits_BxLx2 = _classify(self.config, seq_BxLxD, 2, deterministic, "span", modern=modern,
                             dropout_first=modern)
    return logits_BxLx2[..., 0], logits_BxLx2[..., 1]
