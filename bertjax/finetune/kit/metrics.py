"""Fine-tuning metrics in numpy, and which ones each GLUE task reports (each task family's own
report is in its module, bertjax/finetune/families/).

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

from bertjax.errors import Refusal



def check_pair(predictions, labels, name: str) -> tuple[np.ndarray, np.ndarray]:
  predictions_N, labels_N = np.asarray(predictions).reshape(-1), np.asarray(labels).reshape(-1)
  if predictions_N.shape != labels_N.shape:
    raise ValueError(f"{name}: {predictions_N.size} predictions for {labels_N.size} labels; "
                     f"pass one prediction per example.")
  if predictions_N.size == 0:
    raise ValueError(f"{name}: no examples to score (empty predictions and labels).")
  return predictions_N, labels_N


def accuracy(predictions, labels) -> float:
  predictions_N, labels_N = check_pair(predictions, labels, "accuracy")
  return float(np.mean(predictions_N == labels_N))


def f1(predictions, labels, positive=1) -> float:
  """Binary F1 of the class `positive` (MRPC: 1 = equivalent, QQP: 1 = duplicate)."""
  predictions_N, labels_N = check_pair(predictions, labels, "f1")
  predicted, actual = predictions_N == positive, labels_N == positive
  true_pos = np.sum(predicted & actual)
  # 2TP / (2TP + FP + FN) equals 2PR / (P + R) and stays defined when P or R is 0/0.
  denominator = np.sum(predicted) + np.sum(actual)
  return float(2 * true_pos / denominator) if denominator else 0.0


def matthews_corrcoef(predictions, labels) -> float:
  """Matthews correlation from the confusion matrix; for K classes, Gorodkin's generalisation
  (which for two classes is (TP*TN - FP*FN) / sqrt((TP+FP)(TP+FN)(TN+FP)(TN+FN)))."""
  predictions_N, labels_N = check_pair(predictions, labels, "matthews_corrcoef")
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
  x_N, y_N = check_pair(predictions, labels, "pearson")
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
  x_N, y_N = check_pair(predictions, labels, "spearman")
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


# The number that picks the best checkpoint of one's own task --------------------------------------

def main_value(family: str, choices: Sequence[str], lower: Sequence[str],
               scores: Mapping[str, float], main: str) -> float:
  """scores[main], higher is better (negated where `lower` says lower is); main must be one of
  the family's `choices` (its main_metrics)."""
  if main not in choices:
    raise Refusal(f"config.eval.main_metric={main!r} is not one a {family} task reports; "
                  f"choose one of {list(choices)}.")
  return -scores[main] if main in lower else scores[main]


def main_metric(main: str, family: str, choices: Sequence[str]) -> str:
  """config.eval.main_metric checked against the family's choices; "" = the first."""
  main = main or choices[0]
  main_value(family, choices, (), {m: 0.0 for m in choices}, main)
  return main
