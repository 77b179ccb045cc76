"""The fine-tuning objectives: a task head over the encoder, its loss, and what it predicts.

Each is a `train.Objective`, so fine-tuning runs through the same jitted, sharded step as
pre-training (microbatches, clipping, the optimizer's count and all). Batches carry a `weight` per
row: 1 for a real example, 0 for the rows that pad the last evaluation batch to the global batch
size, so padding never counts in a loss or metric.

  classification  pooled -> dropout -> dense(C); softmax cross-entropy (GLUE but STS-B)
  regression      pooled -> dropout -> dense(1); mean squared error (STS-B)
  span            sequence -> dense(2): start and end logits; the mean of the two cross-entropies,
                  as the original run_squad.py (SQuAD)
  tagging         sequence -> dropout -> dense(C); cross-entropy on each word's first piece (NER)
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np

from bertjax import heads, losses, train

INPUTS = ("input_ids", "input_mask", "segment_ids")


def _inputs(batch):
  return {name: batch[name] for name in INPUTS}


def _dummy(batch_size: int, **extra) -> dict:
  seq_len = 8
  out = {name: np.zeros((batch_size, seq_len), np.int32) for name in INPUTS}
  out["weight"] = np.zeros((batch_size,), np.float32)
  for name, (shape, dtype) in extra.items():
    out[name] = np.zeros((batch_size,) + tuple(seq_len if d is None else d for d in shape), dtype)
  return out


def _weight(batch):
  return batch["weight"].astype(jnp.float32)


def _count(batch):
  return jnp.sum(_weight(batch))


def _labelled(name: str, model, term: str, label_key: str, weights, dummy, outputs,
              class_weights=None) -> train.Objective:
  """Cross-entropy of `batch[label_key]` under `weights(batch)`, and the accuracy beside it.

  class_weights [C]: each example's loss also weighs by its label's weight, and the loss is the
  weighted mean (so a weight of 2 counts an example twice); accuracy stays unweighted."""
  def loss_weights(batch):
    w = weights(batch)
    if class_weights is None:
      return w
    return w * jnp.asarray(class_weights, jnp.float32)[batch[label_key]]

  def metrics(logits, batch):
    return {term: losses.weighted_cross_entropy(logits, batch[label_key], loss_weights(batch)),
            "accuracy": losses.weighted_accuracy(logits, batch[label_key], weights(batch))}

  return train.Objective(name, model, _inputs, metrics,
                         lambda batch: {term: jnp.sum(loss_weights(batch))}, dummy, outputs)


def classification(num_labels: int, class_weights=None) -> train.Objective:
  """class_weights: None, or one weight per label id (config.train.class_weights)."""
  tag = "" if class_weights is None else "_weighted"
  return _labelled(
      f"classification_{num_labels}{tag}",
      functools.partial(heads.BertForSequenceClassification, num_labels=num_labels), "cls_loss",
      "label", _weight, functools.partial(_dummy, label=((), np.int32)),
      lambda logits: {"logits": logits},
      None if class_weights is None else tuple(float(w) for w in class_weights))


def regression() -> train.Objective:
  def metrics(out_Bx1, batch):
    w_B = _weight(batch)
    error_B = out_Bx1[:, 0] - batch["label"].astype(jnp.float32)
    return {"mse_loss": (jnp.sum(w_B * error_B ** 2), jnp.sum(w_B))}

  return train.Objective(
      "regression", functools.partial(heads.BertForSequenceClassification, num_labels=1),
      _inputs, metrics, lambda batch: {"mse_loss": _count(batch)},
      functools.partial(_dummy, label=((), np.float32)), lambda out: {"score": out[:, 0]})


def span() -> train.Objective:
  def metrics(out, batch):
    start_BxL, end_BxL = out
    w_B = _weight(batch)
    start_loss, den = losses.weighted_cross_entropy(start_BxL, batch["start_positions"], w_B)
    end_loss, _ = losses.weighted_cross_entropy(end_BxL, batch["end_positions"], w_B)
    return {"span_loss": ((start_loss + end_loss) / 2, den),
            "start_accuracy": losses.weighted_accuracy(start_BxL, batch["start_positions"], w_B),
            "end_accuracy": losses.weighted_accuracy(end_BxL, batch["end_positions"], w_B)}

  return train.Objective(
      "span", heads.BertForSpanExtraction, _inputs, metrics,
      lambda batch: {"span_loss": _count(batch)},
      functools.partial(_dummy, start_positions=((), np.int32), end_positions=((), np.int32)),
      lambda out: {"start_logits": out[0], "end_logits": out[1]})


def tagging(num_labels: int) -> train.Objective:
  return _labelled(
      f"tagging_{num_labels}",
      functools.partial(heads.BertForTokenClassification, num_labels=num_labels), "tag_loss",
      "label_ids",
      lambda batch: batch["label_weights"].astype(jnp.float32) * _weight(batch)[:, None],
      functools.partial(_dummy, label_ids=((None,), np.int32),
                        label_weights=((None,), np.float32)),
      # Label ids, not logits: the host needs only the argmax, and [B, L, C] floats are C times
      # the transfer.
      lambda logits: {"predicted": jnp.argmax(logits, axis=-1).astype(jnp.int32)})
