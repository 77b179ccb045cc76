"""Fine-tuning metrics in numpy, and which ones each GLUE task reports.

Host-side on purpose: these run once per evaluation over a whole dev set (predictions gathered to
numpy), and correlation and F1 do not decompose into per-batch (sum, denominator) pairs.

Conventions, chosen to agree with scipy and sklearn so published numbers compare:
- Matthews correlation and F1 are 0.0 when undefined (a zero denominator), as sklearn returns.
- Pearson and Spearman are nan when an input is constant, as scipy returns: a constant prediction
  has no correlation, and 0.0 would pretend it had been measured.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Sequence

import numpy as np


def _check_pair(predictions, labels, name: str) -> tuple[np.ndarray, np.ndarray]:
  predictions_N, labels_N = np.asarray(predictions).reshape(-1), np.asarray(labels).reshape(-1)
  if predictions_N.shape != labels_N.shape:
    raise ValueError(f"{name}: {predictions_N.size} predictions for {labels_N.size} labels; "
                     f"pass one prediction per example.")
  if predictions_N.size == 0:
    raise ValueError(f"{name}: no examples to score (empty predictions and labels).")
  return predictions_N, labels_N


def accuracy(predictions, labels) -> float:
  predictions_N, labels_N = _check_pair(predictions, labels, "accuracy")
  return float(np.mean(predictions_N == labels_N))


def f1(predictions, labels, positive=1) -> float:
  """Binary F1 of the class `positive` (MRPC: 1 = equivalent, QQP: 1 = duplicate)."""
  predictions_N, labels_N = _check_pair(predictions, labels, "f1")
  predicted, actual = predictions_N == positive, labels_N == positive
  true_pos = np.sum(predicted & actual)
  # 2TP / (2TP + FP + FN) equals 2PR / (P + R) and stays defined when P or R is 0/0.
  denominator = np.sum(predicted) + np.sum(actual)
  return float(2 * true_pos / denominator) if denominator else 0.0


def matthews_corrcoef(predictions, labels) -> float:
  """Matthews correlation from the confusion matrix; for K classes, Gorodkin's generalisation
  (which for two classes is (TP*TN - FP*FN) / sqrt((TP+FP)(TP+FN)(TN+FP)(TN+FN)))."""
  predictions_N, labels_N = _check_pair(predictions, labels, "matthews_corrcoef")
  classes, inverse = np.unique(np.concatenate([labels_N, predictions_N]), return_inverse=True)
  k, n = len(classes), labels_N.size
  confusion_KxK = np.zeros((k, k), np.float64)  # [true, predicted]
  np.add.at(confusion_KxK, (inverse[:n], inverse[n:]), 1.0)
  true_K, pred_K = confusion_KxK.sum(1), confusion_KxK.sum(0)
  correct, total = np.trace(confusion_KxK), float(n)
  numerator = correct * total - pred_K @ true_K
  denominator = np.sqrt((total**2 - pred_K @ pred_K) * (total**2 - true_K @ true_K))
  return float(numerator / denominator) if denominator else 0.0


def pearson(predictions, labels) -> float:
  x_N, y_N = _check_pair(predictions, labels, "pearson")
  x_N, y_N = x_N.astype(np.float64), y_N.astype(np.float64)
  dx_N, dy_N = x_N - x_N.mean(), y_N - y_N.mean()
  denominator = np.sqrt(np.sum(dx_N * dx_N) * np.sum(dy_N * dy_N))
  if denominator == 0:
    return float("nan")
  # Rounding can carry |r| a hair past 1; scipy clips too.
  return float(np.clip(np.sum(dx_N * dy_N) / denominator, -1.0, 1.0))


def average_ranks(x) -> np.ndarray:
  """Ranks 1..N, ties sharing the mean of the ranks they span (scipy's rankdata 'average')."""
  x_N = np.asarray(x).reshape(-1)
  order_N = np.argsort(x_N, kind="stable")
  sorted_N = x_N[order_N]
  # Start of each run of equal values in sorted order, and the run each position belongs to.
  new_run_N = np.concatenate([[True], sorted_N[1:] != sorted_N[:-1]])
  starts = np.flatnonzero(new_run_N)
  run_N = np.cumsum(new_run_N) - 1
  ends = np.append(starts[1:], x_N.size)  # exclusive
  mean_rank_R = (starts + 1 + ends) / 2.0  # mean of starts+1 .. ends
  ranks_N = np.empty(x_N.size, np.float64)
  ranks_N[order_N] = mean_rank_R[run_N]
  return ranks_N


def spearman(predictions, labels) -> float:
  x_N, y_N = _check_pair(predictions, labels, "spearman")
  return pearson(average_ranks(x_N), average_ranks(y_N))


@dataclasses.dataclass(frozen=True)
class TaskMetrics:
  """What a task reports, and the one number that picks its best checkpoint."""
  names: tuple[str, ...]
  main: str  # one of `names`, or a derived name computed by `combine`
  combine: Callable[[Mapping[str, float]], float] | None = None


def _mean_of(a: str, b: str):
  return lambda m: (m[a] + m[b]) / 2.0


# Where a task reports two numbers, the main metric is their mean: that is the task's score on
# the GLUE leaderboard, so the checkpoint picked is the one GLUE would rank highest.
# MNLI's main metric is the accuracy on dev_matched; dev_mismatched is reported beside it.
# AX (the diagnostic set) has no labels we can score: predict only.
GLUE_METRICS: dict[str, TaskMetrics] = {
    "CoLA": TaskMetrics(("mcc",), "mcc"),
    "SST-2": TaskMetrics(("accuracy",), "accuracy"),
    "MRPC": TaskMetrics(("accuracy", "f1"), "accuracy_and_f1", _mean_of("accuracy", "f1")),
    "STS-B": TaskMetrics(("pearson", "spearman"), "pearson_and_spearman",
                         _mean_of("pearson", "spearman")),
    "QQP": TaskMetrics(("accuracy", "f1"), "accuracy_and_f1", _mean_of("accuracy", "f1")),
    "MNLI": TaskMetrics(("accuracy",), "accuracy"),
    "QNLI": TaskMetrics(("accuracy",), "accuracy"),
    "RTE": TaskMetrics(("accuracy",), "accuracy"),
    "WNLI": TaskMetrics(("accuracy",), "accuracy"),
    "AX": TaskMetrics((), ""),
    "NEXT": TaskMetrics(("accuracy",), "accuracy"),  # the built-in task (finetune/builtin.py)
}

_METRIC_FNS = {"accuracy": accuracy, "f1": f1, "mcc": matthews_corrcoef, "pearson": pearson,
               "spearman": spearman}


def glue_metrics(task: str, predictions: Sequence, labels: Sequence) -> dict[str, float]:
  """Every metric `task` reports, plus "main" (the best-checkpoint number, see GLUE_METRICS).

  predictions: label ids (argmax of the logits), or scores for STS-B.
  """
  if task not in GLUE_METRICS:
    raise ValueError(f"Unknown GLUE task {task!r}; known: {sorted(GLUE_METRICS)}.")
  spec = GLUE_METRICS[task]
  if not spec.names:
    raise ValueError(f"{task} is predict-only (GLUE scores it on the server); write its "
                     f"predictions with glue.write_submission instead of scoring them.")
  result = {name: _METRIC_FNS[name](predictions, labels) for name in spec.names}
  result["main"] = spec.combine(result) if spec.combine else result[spec.main]
  if spec.combine:
    result[spec.main] = result["main"]
  return result


# Your own tasks ----------------------------------------------------------------------------------

def classification_report(predictions, labels, names: Sequence[str]) -> dict:
  """accuracy, macro_f1 (the unweighted mean over classes, so a rare class counts as much as a
  common one), micro_f1 (over all decisions: equal to accuracy for one label per example),
  per_class {name: precision, recall, f1, support} and the confusion matrix (rows: the true label,
  columns: the predicted one, both in the order of `names`). Ids index `names`.

  A class never predicted has precision 0 and one absent from the labels recall 0, as sklearn's
  zero_division=0; macro_f1 averages over every class of `names`."""
  predictions_N, labels_N = _check_pair(predictions, labels, "classification_report")
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


def regression_report(predictions, labels) -> dict:
  predictions_N, labels_N = _check_pair(predictions, labels, "regression_report")
  error_N = predictions_N.astype(np.float64) - labels_N.astype(np.float64)
  return {"pearson": pearson(predictions_N, labels_N),
          "spearman": spearman(predictions_N, labels_N),
          "mse": float(np.mean(error_N ** 2))}


# The numbers each family of one's own task may pick its best checkpoint by (config.eval.main_metric;
# the first is the default). "mse" is the one where lower is better: it is compared negated.
MAIN_METRICS = {
    "classification": ("accuracy", "macro_f1", "micro_f1"),
    "regression": ("pearson", "spearman", "mse"),
    "tagging": ("f1", "precision", "recall", "accuracy"),
    "span": ("f1", "exact"),
}


def main_value(family: str, scores: Mapping[str, float], main: str) -> float:
  """The number that picks the best checkpoint: higher is better."""
  if main not in MAIN_METRICS[family]:
    raise ValueError(f"config.eval.main_metric={main!r} is not one a {family} task reports; "
                     f"choose one of {list(MAIN_METRICS[family])}.")
  return -scores[main] if main == "mse" else scores[main]
