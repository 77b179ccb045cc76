"""Pre-training losses and accuracies as pure functions returning (sum, denominator).

Sums are divided only after they are summed over the global batch, because the number of real
masked tokens differs between rows and hosts. Everything is computed in float32. The label logit
is picked with a one-hot product rather than a gather, so logits sharded over the vocabulary axis
need only reductions (logsumexp, sum, max) that XLA partitions without gathering the vocabulary.
"""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp

Metric = tuple[jax.Array, jax.Array]  # (sum, denominator)


def weighted_cross_entropy(logits_BxMxV, labels_BxM, weights_BxM=None) -> Metric:
  """Sum of -log p(label) weighted by `weights`, and the sum of the weights."""
  logits_BxMxV = logits_BxMxV.astype(jnp.float32)
  weights_BxM = (jnp.ones(labels_BxM.shape, jnp.float32) if weights_BxM is None
                 else weights_BxM.astype(jnp.float32))
  log_z_BxM = jax.nn.logsumexp(logits_BxMxV, axis=-1)
  nll_BxM = log_z_BxM - _label_logit(logits_BxMxV, labels_BxM)
  return jnp.sum(nll_BxM * weights_BxM), jnp.sum(weights_BxM)


def weighted_accuracy(logits_BxMxV, labels_BxM, weights_BxM=None) -> Metric:
  """Weighted count of predictions where the label's logit is the largest, and the sum of the
  weights.

  The label's logit and the maximum are the loss's own terms (the same expressions, which XLA
  computes once); an argmax would be one more pass over the [B, M, V] logits, and its index-
  carrying reduction is several times slower on CPU. An exact tie with another piece counts as
  correct, where argmax would pick the lower index.
  """
  logits_BxMxV = logits_BxMxV.astype(jnp.float32)
  weights_BxM = (jnp.ones(labels_BxM.shape, jnp.float32) if weights_BxM is None
                 else weights_BxM.astype(jnp.float32))
  correct_BxM = (_label_logit(logits_BxMxV, labels_BxM)
                 >= jnp.max(logits_BxMxV, axis=-1)).astype(jnp.float32)
  return jnp.sum(correct_BxM * weights_BxM), jnp.sum(weights_BxM)


def _label_logit(logits_BxMxV, labels_BxM):
  one_hot_BxMxV = jax.nn.one_hot(labels_BxM, logits_BxMxV.shape[-1], dtype=jnp.float32)
  return jnp.sum(logits_BxMxV * one_hot_BxMxV, axis=-1)


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
