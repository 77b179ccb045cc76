"""Regression: one text (or a pair) and a number per example (STS-B, one's own scored rows).

  head       pooled -> dropout -> dense(1) ("classifier"); mean squared error
  metric     pearson, spearman, mse (the one where lower is better)
  predicted  {"value": ...}
  export     transformers' BertForSequenceClassification, num_labels=1, problem_type regression
"""

from __future__ import annotations

import functools
from typing import Mapping

import jax.numpy as jnp
import numpy as np

from bertjax.errors import Refusal
from bertjax.finetune.families.record import Family
from bertjax.finetune.kit import custom, metrics as ft_metrics, objectives
from bertjax.finetune.kit.config import TaskConfig
from bertjax.finetune.kit.taskdata import TaskData
from bertjax.formats import taskspec as spec_lib
from bertjax.model import heads
from bertjax.training import train


def num_outputs(spec: spec_lib.TaskSpec) -> int:
  del spec
  return 1


def objective(spec: spec_lib.TaskSpec | None = None) -> train.Objective:
  del spec  # one output, whatever the task
  def metrics(out_Bx1, batch):
    w_B = objectives.weight(batch)
    error_B = out_Bx1[:, 0] - batch["label"].astype(jnp.float32)
    return {"mse_loss": (jnp.sum(w_B * error_B ** 2), jnp.sum(w_B))}

  return train.Objective(
      "regression", functools.partial(heads.BertForSequenceClassification, num_labels=1),
      objectives.inputs, metrics, lambda batch: {"mse_loss": objectives.count(batch)},
      functools.partial(objectives.dummy, label=((), np.float32)), lambda out: {"score": out[:, 0]})


def predicted(outputs: Mapping[str, np.ndarray]) -> np.ndarray:
  return outputs["score"]


def decode(outputs: Mapping[str, np.ndarray]) -> list[dict]:
  return [{"value": round(float(v), 6)} for v in outputs["score"]]


def records(rows, spec: spec_lib.TaskSpec, tokenizer, run) -> list[dict]:
  features, truncated_N = custom.pair_inputs(rows, spec, tokenizer)
  return custom.pair_records(decode(run(features)), truncated_N)


def label_of(row, column: str) -> float:
  value = row[column]
  try:
    number = float(value)
  except (TypeError, ValueError):
    number = float("nan")
  if not np.isfinite(number):
    raise Refusal(f"{row.where}: column {column!r} holds {value!r}, not a number; a "
                  "regression task needs a number on every row.")
  return number


def label_array(rows: custom.Rows, spec: spec_lib.TaskSpec) -> np.ndarray:
  """The values of rows read by `label_of` (custom.pair_features)."""
  del spec
  return np.array(rows.labels, np.float32)


def report(predictions, labels) -> dict:
  predictions_N, labels_N = ft_metrics.check_pair(predictions, labels, "regression_report")
  error_N = predictions_N.astype(np.float64) - labels_N.astype(np.float64)
  return {"pearson": ft_metrics.pearson(predictions_N, labels_N),
          "spearman": ft_metrics.spearman(predictions_N, labels_N),
          "mse": float(np.mean(error_N ** 2))}


def load(cfg: TaskConfig, tokenizer) -> TaskData:
  """Regression from one's own CSV, TSV or JSON Lines files (bertjax/finetune/kit/custom.py)."""
  train_path, _, _ = custom.paths(cfg.data, "regression")
  main = ft_metrics.main_metric(cfg.eval.main_metric, "regression", FAMILY.main_metrics)
  spec = custom.spec_of("regression", cfg)
  train_rows = custom.Rows(train_path, spec, cfg.data.format, need_labels=True, label_of=label_of)

  def features(rows: custom.Rows) -> dict[str, np.ndarray]:
    return custom.pair_features(rows, spec, tokenizer, notes, label_array)

  def scorer(rows: custom.Rows):
    def score(outputs):
      out = report(predicted(outputs), np.array(rows.labels, np.float32))
      return {**out, "main": ft_metrics.main_value(
          "regression", FAMILY.main_metrics, FAMILY.lower_is_better, out, main)}
    return score

  notes: list[str] = []
  train = features(train_rows)
  if cfg.class_weights:
    raise Refusal("train.class_weights applies to classification, not regression.")
  evals, predicts = custom.pair_sets(cfg, spec, tokenizer, features, scorer, decode, notes,
                                     label_of=label_of)
  return TaskData("regression", objective(spec), train, evals, predicts, main, notes, spec=spec)


FAMILY = Family(
    "regression", head="classifier", hf_class="BertForSequenceClassification",
    hf_head="classifier", modernbert_class="ModernBertForSequenceClassification", min_labels=0,
    main_metrics=("pearson", "spearman", "mse"), lower_is_better=("mse",),
    batch_keys=("label",), packed=True,
    num_outputs=num_outputs, objective=objective, columns=custom.pair_columns,
    as_row=custom.pair_row, records=records, load=load, predicted=predicted)
