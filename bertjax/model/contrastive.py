"""Sentence embeddings trained contrastively: one encoder for queries and passages, its pooled
vectors, and the two losses that score every query against every passage of the global batch.

  pooling      "mean" over the real tokens (Sentence-BERT's default, Reimers & Gurevych 2019) or
               "cls", the last layer's [CLS] state itself (not the tanh pooler: sentence-
               transformers' "cls" mode reads token 0, and its export must give these vectors)
  normalize    vectors divided by their L2 norm, so the similarity is the cosine
  infonce      softmax cross-entropy over the passages of the batch at scale s = 1 / temperature,
               the query's own positive the label: in-batch negatives (van den Oord et al. 2018's
               InfoNCE; "MultipleNegativesRankingLoss", Henderson et al. 2017, whose scale is 20);
               `symmetric` adds the passage -> query direction (as CLIP) and halves the sum
  sigmoid      an independent binary term per (query, passage) pair, log sigmoid(z (s x + b)) with
               z = +1 for the positive, -1 otherwise (SigLIP, Zhai et al. 2023; it starts s at 10,
               b at -10, both learned, and divides the sum by the batch size, as here)

The scale (and the sigmoid's bias) are fixed numbers or learned: `learn_scale` holds log s as a
parameter "log_scale" beside the encoder (CLIP's parametrisation; the scale is capped at
`max_scale`, 100 as CLIP's clip), `learn_bias` the bias "bias". A softmax ignores a constant
shift, so InfoNCE takes no bias.

Each query brings C passages: its positive first, then C - 1 hard negatives (a passage whose
input_mask is all zero is absent: fewer negatives on a row). A row of weight 0 (the rows that pad
an evaluation batch) is neither a query nor anybody's negative. Every other passage of the global
batch is a negative of every query, but a copy of its own positive: where the batch carries
`passage_key` [Q, C] (an id per distinct passage text, 0 for none), a passage whose key is the
query's positive's (the same passage as another row's positive, or among the hard negatives) is
left out of that query's terms, in both directions: two rows sharing a positive would otherwise
each be pushed away from its own answer (the loss's "false negatives").

The whole global batch on any mesh: the losses are written over the global arrays, and the logits
are constrained to rows split like the batch and columns whole, so XLA gathers the [Q x C, D]
passage vectors to every device (a few KB per row, not the encoder's activations) and each device
scores its own queries against all of them. The gradient of a gathered passage comes back
reduce-scattered to the device that encoded it. `negative_groups` G > 1 scores each query against
the passages of its own 1/G of the batch only (G = the batch's devices: per-device negatives,
no communication).

Shape letters beyond bertjax/model/encoder.py's: Q queries (rows of the batch), C passages per query,
G negative groups, R queries per group (Q / G). Vectors, logits and losses are float32.
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from bertjax.errors import Refusal
from bertjax.model.config import BertConfig
from bertjax.model.encoder import BertModel
from bertjax.model.heads import mean_pool
from bertjax.model.losses import Metric

POOLINGS = ("mean", "cls")
LOSSES = ("infonce", "sigmoid")
# The logit of an absent passage (or of a padding row's): far below any s x + b (|x| <= 1 when
# normalized), finite so that no inf - inf turns a padding row's terms into NaN.
_ABSENT = -1e9


@dataclasses.dataclass(frozen=True)
class ContrastiveConfig:
  """How vectors are made and scored (see the module docstring)."""

  loss: str = "infonce"
  pooling: str = "mean"
  normalize: bool = True
  scale: float = 20.0  # s = 1 / temperature; the start of log_scale where it is learned
  learn_scale: bool = False
  max_scale: float = 100.0
  bias: float = 0.0  # sigmoid only
  learn_bias: bool = False
  symmetric: bool = False  # infonce only
  negative_groups: int = 1

  def __post_init__(self):
    problems = []
    if self.loss not in LOSSES:
      problems.append(f"loss={self.loss!r}; choose one of {LOSSES}")
    if self.pooling not in POOLINGS:
      problems.append(f"pooling={self.pooling!r}; choose one of {POOLINGS}")
    if not 0 < self.scale <= self.max_scale:
      problems.append(f"scale={self.scale} must be in (0, max_scale={self.max_scale}]")
    if self.loss == "infonce" and (self.bias or self.learn_bias):
      problems.append("a bias with loss='infonce' (a softmax ignores a constant shift): set it "
                      "with loss='sigmoid' only")
    if self.symmetric and self.loss != "infonce":
      problems.append("symmetric=True is InfoNCE's (the sigmoid loss scores every pair already)")
    if self.negative_groups < 1:
      problems.append(f"negative_groups={self.negative_groups} must be >= 1")
    if problems:
      raise Refusal("Invalid contrastive settings: " + "; ".join(problems))


def pool(seq_BxLxD, input_mask_BxL, pooling: str) -> jax.Array:
  """float32 [B, D]: the mean over real tokens, or the [CLS] (first) state."""
  if pooling == "cls":
    return seq_BxLxD[:, 0].astype(jnp.float32)
  return mean_pool(seq_BxLxD.astype(jnp.float32), input_mask_BxL)


def l2_normalize(x_BxD, eps: float = 1e-12) -> jax.Array:
  """x / max(|x|, eps): torch.nn.functional.normalize's rule (sentence-transformers' Normalize),
  so a zero vector (an absent passage's mean) stays zero. The maximum is taken before the square
  root: the root's derivative at 0 is infinite, and times 0 it made the gradient NaN."""
  squared_Bx1 = jnp.sum(jnp.square(x_BxD), axis=-1, keepdims=True)
  return x_BxD * jax.lax.rsqrt(jnp.maximum(squared_Bx1, eps * eps))


class BiEncoder(nn.Module):
  """One encoder ("bert") for queries and passages, and the learned scale and bias if any.

  __call__ -> {"query": [Q, D], "passage": [Q, C, D], "scale": [], "bias": []}, or without
  passages {"query": [Q, D]}: a batch of texts alone (queries and passages are encoded alike,
  what prediction and evaluation ask); `encode` the vectors alone (what a chunked gradient
  re-runs), `embed` one batch of texts."""

  config: BertConfig
  settings: ContrastiveConfig

  def setup(self):
    self.bert = BertModel(self.config)
    s = self.settings
    if s.learn_scale:
      self.log_scale = self.param("log_scale", nn.initializers.constant(math.log(s.scale)), (),
                                  jnp.float32)
    if s.learn_bias:
      self.bias = self.param("bias", nn.initializers.constant(s.bias), (), jnp.float32)

  def embed(self, input_ids_BxL, input_mask_BxL, deterministic: bool = True) -> jax.Array:
    seq_BxLxD, _ = self.bert(input_ids_BxL, input_mask_BxL, None, deterministic=deterministic)
    v_BxD = pool(seq_BxLxD, input_mask_BxL, self.settings.pooling)
    return l2_normalize(v_BxD) if self.settings.normalize else v_BxD

  def encode(self, query_ids, query_mask, passage_ids, passage_mask, deterministic: bool = True):
    """(query vectors [Q, D], passage vectors [Q, C, D]); passages [Q, C, L'] are encoded as
    Q x C rows, with the encoder's own weights (one encoder, shared)."""
    q, c, length = passage_ids.shape
    p_QCxD = self.embed(passage_ids.reshape(q * c, length), passage_mask.reshape(q * c, length),
                        deterministic)
    return self.embed(query_ids, query_mask, deterministic), p_QCxD.reshape(q, c, -1)

  def logit_terms(self) -> tuple[jax.Array, jax.Array]:
    s = self.settings
    scale = (jnp.minimum(jnp.exp(self.log_scale), s.max_scale) if s.learn_scale
             else jnp.asarray(s.scale, jnp.float32))
    return scale, self.bias if s.learn_bias else jnp.asarray(s.bias, jnp.float32)

  def __call__(self, query_ids, query_mask, passage_ids=None, passage_mask=None,
               deterministic: bool = True):
    if passage_ids is None:
      return {"query": self.embed(query_ids, query_mask, deterministic)}
    q_QxD, p_QxCxD = self.encode(query_ids, query_mask, passage_ids, passage_mask, deterministic)
    scale, bias = self.logit_terms()
    return {"query": q_QxD, "passage": p_QxCxD, "scale": scale, "bias": bias}


def _grouped_logits(q_QxD, p_QxCxD, valid_QxC, keys_QxC, scale, bias, groups: int):
  """([G, R, R x C] logits of each query against every passage of its group (all of the batch
  when G = 1), [G, R, R x C] which of them count (present, and no copy of the query's own
  positive: module docstring), R, C). Query r's positive is column r x C of its group; the
  logits of what does not count are _ABSENT."""
  q, c, d = p_QxCxD.shape
  if q % groups:
    raise Refusal(f"{q} queries do not split into negative_groups={groups}; use a divisor of "
                  "the global batch size (the batch's devices: per-device negatives)")
  r = q // groups
  q_GxRxD = q_QxD.astype(jnp.float32).reshape(groups, r, d)
  p_GxRCxD = p_QxCxD.astype(jnp.float32).reshape(groups, r * c, d)
  logits_GxRxRC = jnp.einsum("grd,gpd->grp", q_GxRxD, p_GxRCxD) * scale + bias
  if groups == 1:
    # Rows split like the batch, the columns (every passage) whole on each device: what is
    # gathered is then the passages' vectors. Several groups stay where their rows are (XLA
    # follows the queries' layout through the reshape; no group need match a device).
    logits_GxRxRC = nn.with_logical_constraint(logits_GxRxRC,
                                               (None, "activation_batch", None))
  counts_GxRxRC = jnp.broadcast_to(valid_QxC.reshape(groups, 1, r * c), logits_GxRxRC.shape)
  if keys_QxC is not None:
    keys_GxRC = keys_QxC.reshape(groups, r * c)
    own_GxRx1 = keys_GxRC[:, ::c, None]  # each query's positive's key
    own_column_RxRC = jnp.arange(r * c)[None, :] == (jnp.arange(r) * c)[:, None]
    copy_GxRxRC = (keys_GxRC[:, None, :] == own_GxRx1) & (own_GxRx1 != 0) & ~own_column_RxRC
    counts_GxRxRC = counts_GxRxRC & ~copy_GxRxRC
  return jnp.where(counts_GxRxRC, logits_GxRxRC, _ABSENT), counts_GxRxRC, r, c


def _validity(passage_mask_QxCxL, weight_Q):
  weight_Q = weight_Q.astype(jnp.float32)
  valid_QxC = jnp.any(passage_mask_QxCxL > 0, axis=-1) & (weight_Q > 0)[:, None]
  return weight_Q, valid_QxC


def info_nce(q_QxD, p_QxCxD, passage_mask_QxCxL, weight_Q, scale, *, symmetric: bool = False,
             groups: int = 1, passage_key_QxC=None) -> dict[str, Metric]:
  """{"contrastive_loss", "in_batch_accuracy"}: sum of -log softmax(logits)[positive] over the
  real queries (half of it and half of the passage -> query term's when symmetric), and how many
  queries rank their positive first among the batch's passages (ties count as correct), each
  over the real queries' count."""
  weight_Q, valid_QxC = _validity(passage_mask_QxCxL, weight_Q)
  logits_GxRxRC, _, r, c = _grouped_logits(q_QxD, p_QxCxD, valid_QxC, passage_key_QxC, scale,
                                           0.0, groups)
  rows_R = jnp.arange(r)
  positive_GxR = logits_GxRxRC[:, rows_R, rows_R * c]
  w_GxR = weight_Q.reshape(-1, r)
  nll_GxR = jax.nn.logsumexp(logits_GxRxRC, axis=-1) - positive_GxR
  loss = jnp.sum(nll_GxR * w_GxR)
  if symmetric:
    # Each positive passage against the group's real queries, its own query the label (a query
    # whose positive is a copy of it is no negative: its logit is _ABSENT already).
    by_passage_GxRxR = jnp.swapaxes(logits_GxRxRC[:, :, ::c], 1, 2)
    by_passage_GxRxR = jnp.where(w_GxR[:, None, :] > 0, by_passage_GxRxR, _ABSENT)
    back_GxR = jax.nn.logsumexp(by_passage_GxRxR, axis=-1) - positive_GxR
    loss = 0.5 * (loss + jnp.sum(back_GxR * w_GxR))
  top_GxR = (positive_GxR >= jnp.max(logits_GxRxRC, axis=-1)).astype(jnp.float32)
  count = jnp.sum(weight_Q)
  return {"contrastive_loss": (loss, count), "in_batch_accuracy": (jnp.sum(top_GxR * w_GxR), count)}


def sigmoid_loss(q_QxD, p_QxCxD, passage_mask_QxCxL, weight_Q, scale, bias, *,
                 groups: int = 1, passage_key_QxC=None) -> dict[str, Metric]:
  """{"contrastive_loss", "in_batch_accuracy"}: sum over the real queries of -log sigmoid(z x
  logit) over every present passage of the group (z = +1 for its positive, -1 for the rest), and
  the positive ranked first, each over the real queries' count."""
  weight_Q, valid_QxC = _validity(passage_mask_QxCxL, weight_Q)
  logits_GxRxRC, counts_GxRxRC, r, c = _grouped_logits(q_QxD, p_QxCxD, valid_QxC,
                                                       passage_key_QxC, scale, bias, groups)
  rows_R = jnp.arange(r)
  is_positive_RxRC = jnp.arange(r * c)[None, :] == (rows_R * c)[:, None]
  sign_RxRC = jnp.where(is_positive_RxRC, 1.0, -1.0)
  terms_GxRxRC = jax.nn.softplus(-sign_RxRC * logits_GxRxRC)  # -log sigmoid(z x logit)
  w_GxR = weight_Q.reshape(-1, r)
  loss = jnp.sum(jnp.sum(jnp.where(counts_GxRxRC, terms_GxRxRC, 0.0), axis=-1) * w_GxR)
  positive_GxR = logits_GxRxRC[:, rows_R, rows_R * c]
  top_GxR = (positive_GxR >= jnp.max(logits_GxRxRC, axis=-1)).astype(jnp.float32)
  count = jnp.sum(weight_Q)
  return {"contrastive_loss": (loss, count), "in_batch_accuracy": (jnp.sum(top_GxR * w_GxR), count)}


def metrics(out, passage_mask_QxCxL, weight_Q, settings: ContrastiveConfig,
            passage_key_QxC=None) -> dict[str, Metric]:
  """The loss `settings` name, of BiEncoder's output."""
  if settings.loss == "sigmoid":
    return sigmoid_loss(out["query"], out["passage"], passage_mask_QxCxL, weight_Q, out["scale"],
                        out["bias"], groups=settings.negative_groups,
                        passage_key_QxC=passage_key_QxC)
  return info_nce(out["query"], out["passage"], passage_mask_QxCxL, weight_Q, out["scale"],
                  symmetric=settings.symmetric, groups=settings.negative_groups,
                  passage_key_QxC=passage_key_QxC)
