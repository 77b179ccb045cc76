"""Fine-tuning metrics against reference formulas (confusion-matrix definitions, scipy)."""

import math

import numpy as np
import pytest
import scipy.stats

from bertjax.finetune.kit import metrics


def _binary_confusion(pred, gold, positive=1):
  pred, gold = np.asarray(pred) == positive, np.asarray(gold) == positive
  return (np.sum(pred & gold), np.sum(~pred & ~gold), np.sum(pred & ~gold), np.sum(~pred & gold))


def _reference_mcc_binary(pred, gold):
  tp, tn, fp, fn = (float(x) for x in _binary_confusion(pred, gold))
  denominator = math.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
  return (tp * tn - fp * fn) / denominator if denominator else 0.0


def _reference_mcc_multiclass(pred, gold):
  """Gorodkin's R_K as a correlation of one-hot matrices: cov(X, Y) / sqrt(cov(X, X) cov(Y, Y))."""
  classes = sorted(set(pred) | set(gold))
  x = np.array([[p == c for c in classes] for p in pred], float)
  y = np.array([[g == c for c in classes] for g in gold], float)
  x, y = x - x.mean(0), y - y.mean(0)
  return np.sum(x * y) / math.sqrt(np.sum(x * x) * np.sum(y * y))


def _reference_f1(pred, gold, positive=1):
  tp, _, fp, fn = (float(x) for x in _binary_confusion(pred, gold, positive))
  precision = tp / (tp + fp) if tp + fp else 0.0
  recall = tp / (tp + fn) if tp + fn else 0.0
  return 2 * precision * recall / (precision + recall) if precision + recall else 0.0


RNG = np.random.default_rng(0)
BINARY_CASES = [
    ([1, 0, 1, 1, 0, 0, 1, 0], [1, 0, 0, 1, 0, 1, 1, 1]),
    ([1, 1, 1, 1], [1, 0, 1, 0]),  # a constant prediction: MCC undefined -> 0
    ([0, 0, 0], [0, 0, 0]),  # no positive at all: F1 undefined -> 0
    (list(RNG.integers(0, 2, 200)), list(RNG.integers(0, 2, 200))),
    ([0, 1, 1, 0, 1], [0, 1, 1, 0, 1]),
    ([1, 0, 1, 0], [0, 1, 0, 1]),
]


@pytest.mark.parametrize("pred,gold", BINARY_CASES)
def test_binary_metrics_equal_the_confusion_matrix_definitions(pred, gold):
  assert metrics.matthews_corrcoef(pred, gold) == pytest.approx(_reference_mcc_binary(pred, gold))
  assert metrics.f1(pred, gold) == pytest.approx(_reference_f1(pred, gold))
  assert metrics.f1(pred, gold, positive=0) == pytest.approx(_reference_f1(pred, gold, 0))
  assert metrics.accuracy(pred, gold) == pytest.approx(np.mean(np.equal(pred, gold)))


def test_hand_computed_values():
  # TP=3 TN=2 FP=1 FN=2: MCC = (6 - 2) / sqrt(4*5*3*4), F1 = 6 / 9.
  pred, gold = [1, 1, 1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 1, 1, 0, 0]
  assert metrics.matthews_corrcoef(pred, gold) == pytest.approx(4 / math.sqrt(240))
  assert metrics.f1(pred, gold) == pytest.approx(6 / 9)
  assert metrics.matthews_corrcoef([1, 0], [0, 1]) == pytest.approx(-1.0)


def test_multiclass_matthews_is_gorodkins():
  pred = list(RNG.integers(0, 3, 100))
  gold = [p if RNG.random() < 0.6 else int(RNG.integers(0, 3)) for p in pred]
  assert metrics.matthews_corrcoef(pred, gold) == pytest.approx(
      _reference_mcc_multiclass(pred, gold))


CORRELATION_CASES = [
    ([0.1, 2.3, 4.5, 1.2, 3.3], [0.0, 2.0, 5.0, 1.0, 3.8]),
    ([1, 2, 2, 3, 3, 3, 5], [2, 1, 2, 4, 3, 3, 5]),  # ties on both sides
    (list(RNG.normal(size=300)), list(RNG.normal(size=300))),
    (list(RNG.integers(0, 6, 300).astype(float)), list(RNG.uniform(0, 5, 300))),  # STS-B-like
    ([5, 4, 3, 2, 1], [1, 2, 3, 4, 5]),
]


@pytest.mark.parametrize("x,y", CORRELATION_CASES)
def test_correlations_equal_scipy(x, y):
  assert metrics.pearson(x, y) == pytest.approx(scipy.stats.pearsonr(x, y)[0], abs=1e-12)
  assert metrics.spearman(x, y) == pytest.approx(scipy.stats.spearmanr(x, y)[0], abs=1e-12)


def test_average_ranks_match_scipy_with_ties():
  x = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
  np.testing.assert_allclose(metrics.average_ranks(x), scipy.stats.rankdata(x, method="average"))


def test_constant_input_has_no_correlation():
  assert math.isnan(metrics.pearson([1.0, 1.0, 1.0], [1.0, 2.0, 3.0]))
  assert math.isnan(metrics.spearman([2.0, 2.0, 2.0], [1.0, 2.0, 3.0]))


def test_mismatched_or_empty_inputs_are_errors():
  with pytest.raises(ValueError, match="3 predictions for 2 labels"):
    metrics.accuracy([1, 0, 1], [1, 0])
  with pytest.raises(ValueError, match="no examples"):
    metrics.f1([], [])


def test_glue_task_table_and_main_metrics():
  pred, gold = [1, 1, 0, 0, 1], [1, 0, 0, 1, 1]
  mrpc = metrics.glue_metrics("MRPC", pred, gold)
  assert mrpc["accuracy"] == pytest.approx(0.6) and mrpc["f1"] == pytest.approx(4 / 6)
  assert mrpc["main"] == pytest.approx((0.6 + 4 / 6) / 2) == mrpc["accuracy_and_f1"]
  assert metrics.glue_metrics("CoLA", pred, gold)["main"] == pytest.approx(
      _reference_mcc_binary(pred, gold))
  x, y = CORRELATION_CASES[0]
  sts = metrics.glue_metrics("STS-B", x, y)
  assert sts["main"] == pytest.approx((scipy.stats.pearsonr(x, y)[0]
                                       + scipy.stats.spearmanr(x, y)[0]) / 2)
  assert set(metrics.glue_metrics("QQP", pred, gold)) == {"accuracy", "f1", "accuracy_and_f1",
                                                          "main"}
  for task in ("SST-2", "MNLI", "QNLI", "RTE", "WNLI"):
    assert metrics.glue_metrics(task, pred, gold) == {"accuracy": 0.6, "main": 0.6}
  with pytest.raises(ValueError, match="predict-only"):
    metrics.glue_metrics("AX", pred, gold)
  with pytest.raises(ValueError, match="Unknown GLUE task"):
    metrics.glue_metrics("SQuAD", pred, gold)
