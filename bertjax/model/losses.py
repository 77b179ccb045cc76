"""Pre-training losses and accuracies as pure functions returning (sum, denominator).

Sums are divided only after they are summed over the global batch, because the number of real
masked tokens differs between rows and hosts. Everything is computed in float32. The label logit
is a gather forward and a one-hot product backward (`_picked`).
"""

from __future__ import annotations

import functools
from typing import Mapping, NamedTuple

import jax
import jax.numpy as jnp

Metric = tuple[jax.Array, jax.Array]  # (sum, denominator)


class MlmScores(NamedTuple):
  """The MLM head's scores at each prediction, made with its logits (heads.decoded_scores, which
  never keeps them): -log p(label) and whether the label's logit is the largest, each [B, M]."""
  nll_BxM: jax.Array
  correct_BxM: jax.Array


def _weighted(values_BxM, labels_BxM, weights_BxM) -> Metric:
  weights_BxM = (jnp.ones(labels_BxM.shape, jnp.float32) if weights_BxM is None
                 else weights_BxM.astype(jnp.float32))
  return jnp.sum(values_BxM * weights_BxM), jnp.sum(weights_BxM)


def scores(logits_BxMxV, labels_BxM) -> tuple[MlmScores, jax.Array]:
  """-log p(label) and whether the label's logit is the largest, each [B, M], and log Z: the
  terms of the loss and the accuracy (heads.decoded_scores makes them where it makes the logits).

  The label's logit and the maximum serve both terms (XLA computes them once where both are
  asked for); an argmax would be one more pass over the [B, M, V] logits, and its index-carrying
  reduction is several times slower on CPU. An exact tie with another piece counts as correct,
  where argmax would pick the lower index.
  """
  return scores_of(*figures(logits_BxMxV, labels_BxM))


def figures(logits_BxMxV, labels_BxM) -> tuple[jax.Array, jax.Array, jax.Array]:
  """log Z, the label's logit and the largest logit, each [B, M] float32."""
  logits_BxMxV = logits_BxMxV.astype(jnp.float32)
  return (jax.nn.logsumexp(logits_BxMxV, axis=-1), _label_logit(logits_BxMxV, labels_BxM),
          jnp.max(logits_BxMxV, axis=-1))


def scores_of(log_z_BxM, label_BxM, top_BxM) -> tuple[MlmScores, jax.Array]:
  """`scores` from the three figures it reads of the logits: log Z, the label's logit and the
  largest (a kernel that never writes the logits makes them: heads.decoded_scores on a TPU)."""
  correct_BxM = (label_BxM >= top_BxM).astype(jnp.float32)
  return MlmScores(log_z_BxM - label_BxM, correct_BxM), log_z_BxM


def _scored(logits_BxMxV, labels_BxM) -> MlmScores:
  if isinstance(logits_BxMxV, MlmScores):  # made with the logits (heads.decoded_scores)
    return logits_BxMxV
  return scores(logits_BxMxV, labels_BxM)[0]


def weighted_cross_entropy(logits_BxMxV, labels_BxM, weights_BxM=None) -> Metric:
  """Sum of -log p(label) weighted by `weights`, and the sum of the weights. `logits_BxMxV` may
  be the MlmScores made with them instead."""
  return _weighted(_scored(logits_BxMxV, labels_BxM).nll_BxM, labels_BxM, weights_BxM)


def weighted_accuracy(logits_BxMxV, labels_BxM, weights_BxM=None) -> Metric:
  """Weighted count of predictions where the label's logit is the largest (`scores`), and the
  sum of the weights. `logits_BxMxV` may be the MlmScores made with them instead."""
  return _weighted(_scored(logits_BxMxV, labels_BxM).correct_BxM, labels_BxM, weights_BxM)


def _label_logit(logits_BxMxV, labels_BxM):
  return _picked(logits_BxMxV.shape[-1], logits_BxMxV, labels_BxM)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _picked(vocab_size, logits_BxMxV, labels_BxM):
  """logits[..., label]: a gather forward, a one-hot product backward.

  As a one-hot product both ways, the forward pass is one more pass over [B, M, V]: XLA on CPU
  hands reductions to its YNNPACK library, which cannot take the product fused in, so the whole
  product is written out first and read back (a fortieth of a small model's step). The gather
  reads B*M values. Its automatic gradient would scatter into a zero [B, M, V] tensor; the
  one-hot form of the gradient instead fuses into the softmax gradient that it is added to.
  Both are exact, and a gather over a vocabulary split between devices is partitioned by XLA
  (each device picks the labels in its slice, the picks are summed).
  """
  del vocab_size
  index_BxMx1 = labels_BxM[..., None].astype(jnp.int32)
  return jnp.take_along_axis(logits_BxMxV, index_BxMx1, axis=-1)[..., 0]


def _picked_fwd(vocab_size, logits_BxMxV, labels_BxM):
  return _picked(vocab_size, logits_BxMxV, labels_BxM), labels_BxM


def _picked_bwd(vocab_size, labels_BxM, g_BxM):
  one_hot_BxMxV = jax.nn.one_hot(labels_BxM, vocab_size, dtype=g_BxM.dtype)
  return g_BxM[..., None] * one_hot_BxMxV, None


_picked.defvjp(_picked_fwd, _picked_bwd)


def mlm_loss(mlm_logits_BxMxV, masked_lm_ids_BxM, masked_lm_weights_BxM) -> Metric:
  return weighted_cross_entropy(mlm_logits_BxMxV, masked_lm_ids_BxM, masked_lm_weights_BxM)


def mlm_accuracy(mlm_logits_BxMxV, masked_lm_ids_BxM, masked_lm_weights_BxM) -> Metric:
  return weighted_accuracy(mlm_logits_BxMxV, masked_lm_ids_BxM, masked_lm_weights_BxM)


def _flat_pairs(nsp_logits_Bx2, next_sentence_labels_B, nsp_weights_B):
  weights = None if nsp_weights_B is None else jnp.reshape(nsp_weights_B, (-1,))
  return nsp_logits_Bx2.reshape(-1, 2), jnp.reshape(next_sentence_labels_B, (-1,)), weights


def nsp_loss(nsp_logits_Bx2, next_sentence_labels_B, nsp_weights_B=None) -> Metric:
  """One term per pair: labels [B] of rows, or [B, S] of packed sequences with their weights
  (0 for the empty slots of a row)."""
  return weighted_cross_entropy(*_flat_pairs(nsp_logits_Bx2, next_sentence_labels_B,
                                             nsp_weights_B))


def nsp_accuracy(nsp_logits_Bx2, next_sentence_labels_B, nsp_weights_B=None) -> Metric:
  return weighted_accuracy(*_flat_pairs(nsp_logits_Bx2, next_sentence_labels_B, nsp_weights_B))


def pretraining_metrics(mlm_logits_BxMxV, nsp_logits_Bx2,
                        batch: Mapping[str, jax.Array]) -> dict[str, Metric]:
  """All pre-training metrics of a batch (original feature names) as (sum, denominator)."""
  metrics = {
      "mlm_loss": mlm_loss(mlm_logits_BxMxV, batch["masked_lm_ids"], batch["masked_lm_weights"]),
      "mlm_accuracy": mlm_accuracy(mlm_logits_BxMxV, batch["masked_lm_ids"],
                                   batch["masked_lm_weights"]),
  }
  if nsp_logits_Bx2 is not None and "next_sentence_labels" in batch:
    weights = batch.get("nsp_weights")  # packed rows: [B, S], one per sequence
    metrics["nsp_loss"] = nsp_loss(nsp_logits_Bx2, batch["next_sentence_labels"], weights)
    metrics["nsp_accuracy"] = nsp_accuracy(nsp_logits_Bx2, batch["next_sentence_labels"], weights)
  return metrics


def total_loss(terms: Mapping[str, Metric]) -> jax.Array:
  """The objective: the sum of the means (sum / denominator) of the terms named `*loss`; other
  entries (accuracies) are ignored. For pre-training that is the mean MLM loss over real
  predictions + the mean NSP loss, as the original; a fine-tuning head has one term.

  The 1e-5 keeps a batch without a single masked token finite, as the original's denominator.
  """
  return sum(loss_sum / (loss_den + 1e-5) for name, (loss_sum, loss_den) in terms.items()
             if name.endswith("loss"))
