"""What the fine-tuning objectives share. Each family (bertjax/finetune/families/) builds its own
`train.Objective` (its head over the encoder, its loss, what it predicts) from these pieces, so
fine-tuning runs through the same jitted, sharded step as pre-training (microbatches, clipping, the
optimizer's count and all). Batches carry a `weight` per row: 1 for a real example, 0 for the rows
that pad the last evaluation batch to the global batch size, so padding never counts in a loss or
metric.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from bertjax.model import losses
from bertjax.training import train

INPUTS = ("input_ids", "input_mask", "segment_ids")


def inputs(batch):
  return {name: batch[name] for name in INPUTS}


def dummy(batch_size: int, **extra) -> dict:
  seq_len = 8
  out = {name: np.zeros((batch_size, seq_len), np.int32) for name in INPUTS}
  out["weight"] = np.zeros((batch_size,), np.float32)
  for name, (shape, dtype) in extra.items():
    out[name] = np.zeros((batch_size,) + tuple(seq_len if d is None else d for d in shape), dtype)
  return out


def weight(batch):
  return batch["weight"].astype(jnp.float32)


def count(batch):
  return jnp.sum(weight(batch))


def labelled(name: str, model, term: str, label_key: str, weights, dummy, outputs,
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

  return train.Objective(name, model, inputs, metrics,
                         lambda batch: {term: jnp.sum(loss_weights(batch))}, dummy, outputs)
