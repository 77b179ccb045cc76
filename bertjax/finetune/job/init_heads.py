"""Where a fine-tuned model's ModernBERT prediction head starts (bertjax/model/heads.py, task_head
"modernbert"): as transformers starts it when a task class is loaded from a checkpoint.

transformers' ModernBertForMaskedLM and its task classes name their prediction head alike
(`head.dense`, `head.norm`), so `ModernBertForSequenceClassification.from_pretrained` of a
masked LM takes the MLM transform as the task's prediction head, and only the classifier is new.
bertjax does the same from any `checkpoint.init_from`: a task's own prediction head where it has
one (a fine-tuned folder or workdir), else the MLM transform (a ModernBERT folder, a modern
pre-training run), else the fresh one. The classifier is always new.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax

from bertjax.model import heads
from bertjax.training import checkpoint as checkpoint_lib
from bertjax.weights import reader as weights

HEAD = heads.PREDICTION_HEAD
MLM = "mlm"


def start_from(source: weights.Weights) -> str:
  """What the prediction head starts from, for the console: "" where it starts fresh."""
  if HEAD in source.subtrees:
    return "its prediction head"
  return "its MLM transform" if MLM in source.subtrees else ""


def prediction_head(source: weights.Weights, fresh: Mapping[str, Any]) -> dict:
  """The prediction head's parameters, placed as `fresh` (the model's new ones) are."""
  like = checkpoint_lib.abstract_like(dict(fresh))
  if HEAD in source.subtrees:
    return weights.read(source, like={HEAD: like})[HEAD]
  if MLM not in source.subtrees:
    return dict(fresh)
  # The MLM head is read whole (orbax restores subtrees whole): its output bias and an untied
  # decoder come along onto one device, and are dropped.
  c = source.config
  mlm_like = dict(like)
  if c.decoder_bias:
    mlm_like["output_bias"] = jax.ShapeDtypeStruct((c.vocab_size,), c.storage_dtype)
  if not c.tie_word_embeddings:
    mlm_like["decoder"] = jax.ShapeDtypeStruct((c.vocab_size, c.hidden_size), c.storage_dtype)
  mlm = weights.read(source, like={MLM: mlm_like})[MLM]
  return {k: mlm[k] for k in like}
