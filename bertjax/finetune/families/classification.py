"""Classification: one text (or a pair) and one of C labels per example (GLUE but STS-B, NEXT, one's
own labelled rows).

  head       pooled -> dropout -> dense(C) ("classifier"); softmax cross-entropy, optionally
             weighted per class (config.train.class_weights)
  metric     accuracy, macro_f1, micro_f1; per class precision, recall, F1, support; confusion
  predicted  {"label": ..., "probabilities": {label: p, ...}}
  export     transformers' BertForSequenceClassification with id2label / label2id
"""

from __future__ import annotations

import functools
from typing import Mapping, Sequence

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
  return len(spec.labels)


def objective_of(num_labels: int, class_weights=None) -> train.Objective:
  """class_weights: None, or one weight per label id (config.train.class_weights)."""
  tag = "" if class_weights is None else "_weighted"
  return objectives.labelled(
      f"classification_{num_labels}{tag}",
      functools.partial(heads.BertForSequenceClassification, num_labels=num_labels), "cls_loss",
      "label", objectives.weight, functools.partial(objectives.dummy, label=((), np.int32)),
      lambda logits: {"logits": logits},
      None if class_weights is None else tuple(float(w) for w in class_weights))


def objective(spec: spec_lib.TaskSpec) -> train.Objective:
  return objective_of(len(spec.labels))


def predicted(outputs: Mapping[str, np.ndarray]) -> np.ndarray:
  """Label ids: the argmax of the logits."""
  return np.argmax(outputs["logits"], axis=-1)


def decode(spec: spec_lib.TaskSpec, outputs: Mapping[str, np.ndarray]) -> list[dict]:
  """One record per example: the label and each label's probability."""
  logits_NxC = np.asarray(outputs["logits"], np.float64)
  probs_NxC = np.exp(logits_NxC - logits_NxC.max(-1, keepdims=True))
  probs_NxC /= probs_NxC.sum(-1, keepdims=True)
  return [{"label": spec.labels[int(np.argmax(p))],
           "probabilities": {name: round(float(x), 6) for name, x in zip(spec.labels, p)}}
          for p in probs_NxC]


def records(rows, spec: spec_lib.TaskSpec, tokenizer, run) -> list[dict]:
  features, truncated_N = custom.pair_inputs(rows, spec, tokenizer)
  return custom.pair_records(decode(spec, run(features)), truncated_N)


# Labels -----------------------------------------------------------------------------------------

label_of = custom.text_label  # a label column holds class names


def sorted_labels(names) -> tuple[str, ...]:
  """Numeric order where every label is an integer ("2" before "10"), else text order."""
  names = set(names)
  try:
    return tuple(sorted(names, key=int))
  except ValueError:
    return tuple(sorted(names))


def label_notes(rows: custom.Rows, column: str) -> list[str]:
  """What a user should hear about the labels of a file: surrounding spaces taken off, and
  labels told apart only by case (kept apart: "Pos" and "pos" may be meant as two)."""
  notes = []
  spaced = [w for w, r in zip(rows.where, rows.raw_labels)
            if isinstance(r, str) and r != r.strip()]
  if spaced:
    notes.append(f"{len(spaced)} label(s) in column {column!r} of {rows.path} had spaces around "
                 f"them, taken off (first at {spaced[0]})")
  by_folded: dict[str, dict[str, str]] = {}
  for where, label in zip(rows.where, rows.labels):
    by_folded.setdefault(label.casefold(), {}).setdefault(label, where)
  for spellings in by_folded.values():
    if len(spellings) > 1:
      notes.append(f"labels {sorted(spellings)} in {rows.path} differ only in case and are "
                   f"separate classes (at {', '.join(spellings[k] for k in sorted(spellings))}); "
                   "write them alike if they are one")
  return notes


def label_ids(rows: custom.Rows, labels: Sequence[str]) -> np.ndarray:
  index = {name: k for k, name in enumerate(labels)}
  for where, label in zip(rows.where, rows.labels):
    if label not in index:
      raise Refusal(f"{where}: label {label!r} is not in the label map {list(labels)} (read "
                    "from the training file, or config.data.labels); add it there, or fix "
                    "the row.")
  return np.array([index[label] for label in rows.labels], np.int32)


def label_array(rows: custom.Rows, spec: spec_lib.TaskSpec) -> np.ndarray:
  """The label ids of rows read by `label_of` (custom.pair_features)."""
  return label_ids(rows, spec.labels)


def class_weights(raw: str, labels: Sequence[str], train_ids_N: np.ndarray) -> list[float] | None:
  """Of config.train.class_weights: "" (none), "balanced" (n / (C * count): each class weighs as
  much in the loss as any other, sklearn's rule) or "name=weight,..." (unnamed classes weigh 1)."""
  raw = raw.strip()
  if not raw:
    return None
  counts_C = np.bincount(train_ids_N, minlength=len(labels))
  if raw == "balanced":
    absent = [labels[k] for k in np.flatnonzero(counts_C == 0)]
    if absent:
      raise Refusal(f"train.class_weights='balanced': the label(s) {absent} have no training "
                    "example, so no weight; drop them from config.data.labels or give weights.")
    return [float(w) for w in len(train_ids_N) / (len(labels) * counts_C)]
  weights = [1.0] * len(labels)
  for item in raw.split(","):
    name, eq, value = item.partition("=")
    name = name.strip()
    if not eq or name not in labels:
      raise Refusal(f"train.class_weights={raw!r}: {item.strip()!r} is not label=weight with "
                    f"a label of {list(labels)}; or use 'balanced'.")
    try:
      weights[labels.index(name)] = float(value)
    except ValueError:
      raise Refusal(f"train.class_weights: {value!r} (for {name!r}) is not a number.") from None
  if min(weights) < 0 or max(weights) <= 0:
    raise Refusal(f"train.class_weights={raw!r}: weights must be >= 0, one at least > 0.")
  return weights


# The metric -------------------------------------------------------------------------------------

def report(predictions, labels, names: Sequence[str]) -> dict:
  """accuracy, macro_f1 (the unweighted mean over classes, so a rare class counts as much as a
  common one), micro_f1 (over all decisions: equal to accuracy for one label per example),
  per_class {name: precision, recall, f1, support} and the confusion matrix (rows: the true label,
  columns: the predicted one, both in the order of `names`). Ids index `names`.

  A class never predicted has precision 0 and one absent from the labels recall 0, as sklearn's
  zero_division=0; macro_f1 averages over every class of `names`."""
  predictions_N, labels_N = ft_metrics.check_pair(predictions, labels, "classification_report")
  k = len(names)
  confusion_KxK = np.zeros((k, k), np.int64)
  np.add.at(confusion_KxK, (labels_N.astype(np.int64), predictions_N.astype(np.int64)), 1)
  true_pos_K = np.diag(confusion_KxK).astype(np.float64)
  predicted_K, actual_K = confusion_KxK.sum(0), confusion_KxK.sum(1)
  precision_K = np.divide(true_pos_K, predicted_K, out=np.zeros(k), where=predicted_K > 0)
  recall_K = np.divide(true_pos_K, actual_K, out=np.zeros(k), where=actual_K > 0)
  denominator_K = predicted_K + actual_K
  f1_K = np.divide(2 * true_pos_K, denominator_K, out=np.zeros(k), where=denominator_K > 0)
  total = float(labels_N.size)
  return {
      "accuracy": float(true_pos_K.sum() / total),
      "macro_f1": float(f1_K.mean()),
      "micro_f1": float(2 * true_pos_K.sum() / (predicted_K.sum() + actual_K.sum())),
      "per_class": {name: {"precision": float(precision_K[i]), "recall": float(recall_K[i]),
                           "f1": float(f1_K[i]), "support": int(actual_K[i])}
                    for i, name in enumerate(names)},
      "confusion": {"labels": list(names), "matrix": confusion_KxK.tolist()},
  }


# One's own task ---------------------------------------------------------------------------------

def load(cfg: TaskConfig, tokenizer) -> TaskData:
  """Classification from one's own CSV, TSV or JSON Lines files (bertjax/finetune/kit/custom.py)."""
  train_path, _, _ = custom.paths(cfg.data, "classification")
  main = ft_metrics.main_metric(cfg.eval.main_metric, "classification", FAMILY.main_metrics)
  probe = custom.spec_of("classification", cfg, ("a", "b"))
  train_rows = custom.Rows(train_path, probe, cfg.data.format, need_labels=True)
  labels = custom.labels_given(cfg.data) or sorted_labels(train_rows.labels)
  if len(labels) < 2:
    raise Refusal(f"{train_path}: one label ({labels[0]!r}) in the whole file; "
                  "classification needs at least two.")
  spec = custom.spec_of("classification", cfg, labels)

  def features(rows: custom.Rows) -> dict[str, np.ndarray]:
    return custom.pair_features(rows, spec, tokenizer, notes, label_array)

  def scorer(rows: custom.Rows):
    def score(outputs):
      out = report(predicted(outputs), label_ids(rows, labels), labels)
      return {**out, "main": ft_metrics.main_value(
          "classification", FAMILY.main_metrics, FAMILY.lower_is_better, out, main)}
    return score

  notes = label_notes(train_rows, spec.label)
  train = features(train_rows)
  weights = class_weights(cfg.class_weights, labels, train["label"])
  if weights is not None:
    notes.append("class weights " + ", ".join(f"{n}={w:.3g}" for n, w in zip(labels, weights)))
  evals, predicts = custom.pair_sets(cfg, spec, tokenizer, features, scorer,
                                     functools.partial(decode, spec), notes,
                                     lambda rows: label_notes(rows, spec.label))
  return TaskData("classification", objective_of(len(labels), weights), train, evals, predicts,
                  main, notes, spec=spec)


FAMILY = Family(
    "classification", head="classifier", hf_class="BertForSequenceClassification",
    hf_head="classifier", modernbert_class="ModernBertForSequenceClassification", min_labels=2,
    main_metrics=("accuracy", "macro_f1", "micro_f1"), lower_is_better=(),
    batch_keys=("label",), packed=True,
    num_outputs=num_outputs, objective=objective, columns=custom.pair_columns,
    as_row=custom.pair_row, records=records, load=load, predicted=predicted)
