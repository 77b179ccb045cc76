"""SQuAD EM and F1 exactly as the official `evaluate-v1.1.py` and `evaluate-v2.0.py` compute them.

Gold answers are given as question id -> list of answer texts (an empty list: no answer, v2.0);
`gold_answers` makes that mapping from `questions.SquadExample`s.
"""

import collections
import logging
import re
import string
from typing import Mapping, Sequence

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)


def normalize_answer(s: str) -> str:
  """Lower-case, remove ASCII punctuation, remove the articles a/an/the, collapse whitespace."""
  s = "".join(ch for ch in s.lower() if ch not in _PUNCTUATION)
  return " ".join(_ARTICLES.sub(" ", s).split())


def exact_match(prediction: str, gold: str) -> int:
  return int(normalize_answer(prediction) == normalize_answer(gold))


def f1_score(prediction: str, gold: str, *, version_2: bool = False) -> float:
  """Token-overlap F1 of the normalized texts. v1.1 scores an empty side 0; v2.0 scores it 1 when
  both sides are empty (a correct "no answer") and 0 otherwise."""
  pred_toks, gold_toks = normalize_answer(prediction).split(), normalize_answer(gold).split()
  if version_2 and (not pred_toks or not gold_toks):
    return float(pred_toks == gold_toks)
  same = sum((collections.Counter(pred_toks) & collections.Counter(gold_toks)).values())
  if same == 0:
    return 0.0
  precision, recall = same / len(pred_toks), same / len(gold_toks)
  return 2 * precision * recall / (precision + recall)


def gold_answers(examples) -> dict[str, list[str]]:
  return {ex.qas_id: list(ex.answers) for ex in examples}


def evaluate_v1(gold: Mapping[str, Sequence[str]], predictions: Mapping[str, str]) -> dict:
  """{"exact_match", "f1"} in percent over every gold question; an unanswered one counts 0 (the
  official script prints a message and does the same)."""
  if not gold:
    raise ValueError("No gold questions to evaluate.")
  em = f1 = 0.0
  missing = [q for q in gold if q not in predictions]
  if missing:
    logging.warning("SQuAD v1.1 evaluation: %d of %d questions have no prediction and count 0, "
                    "e.g. %s", len(missing), len(gold), missing[:3])
  for qid, answers in gold.items():
    if qid in predictions:
      em += max(exact_match(predictions[qid], a) for a in answers)
      f1 += max(f1_score(predictions[qid], a) for a in answers)
  return {"exact_match": 100.0 * em / len(gold), "f1": 100.0 * f1 / len(gold)}


def _summary(exact: Mapping[str, float], f1: Mapping[str, float], qids: Sequence[str]) -> dict:
  return {"exact": 100.0 * sum(exact[q] for q in qids) / len(qids),
          "f1": 100.0 * sum(f1[q] for q in qids) / len(qids), "total": len(qids)}


def _best_threshold(predictions, scores, na_probs, has_answer) -> tuple[float, float]:
  """The official search: start from answering nothing, then answer questions in increasing
  na_prob order, keeping the best running score and the na_prob where it was reached."""
  current = best = sum(1 for q in has_answer if not has_answer[q])
  best_thresh = 0.0
  for qid in sorted(na_probs, key=lambda q: na_probs[q]):
    if qid not in scores:
      continue
    if has_answer[qid]:
      current += scores[qid]
    else:
      current += -1 if predictions[qid] else 0
    if current > best:
      best, best_thresh = current, na_probs[qid]
  return 100.0 * best / len(scores), best_thresh


def evaluate_v2(gold: Mapping[str, Sequence[str]], predictions: Mapping[str, str],
                na_probs: Mapping[str, float] | None = None, na_prob_thresh: float = 1.0) -> dict:
  """The official v2.0 report: exact, f1, total; HasAns_* and NoAns_* (when there are such
  questions); with na_probs (e.g. null_odds.json) also best_exact, best_exact_thresh, best_f1,
  best_f1_thresh. As the official script, a question whose na_prob exceeds na_prob_thresh counts as
  answered "no answer" in exact/f1 (1.0 by default, also when na_probs are null odds)."""
  if not gold:
    raise ValueError("No gold questions to evaluate.")
  missing = [q for q in gold if q not in predictions]
  if missing:
    raise ValueError(f"SQuAD v2.0 evaluation: {len(missing)} of {len(gold)} questions have no "
                     f"prediction (e.g. {missing[:3]}); predict every question ('' = no answer).")
  has_answer = {q: bool(answers) for q, answers in gold.items()}
  exact_raw, f1_raw = {}, {}
  for qid, answers in gold.items():
    # Gold texts that normalize to nothing do not count; with none left, "" is the answer.
    texts = [a for a in answers if normalize_answer(a)] or [""]
    exact_raw[qid] = max(exact_match(predictions[qid], a) for a in texts)
    f1_raw[qid] = max(f1_score(predictions[qid], a, version_2=True) for a in texts)
  probs = na_probs if na_probs is not None else {q: 0.0 for q in predictions}
  lacking = [q for q in gold if q not in probs]
  if lacking:
    raise ValueError(f"na_probs lack {len(lacking)} question(s) (e.g. {lacking[:3]}); pass the "
                     f"null_odds of the same predictions.")

  def thresholded(scores):
    return {q: float(not has_answer[q]) if probs[q] > na_prob_thresh else s
            for q, s in scores.items()}

  exact, f1 = thresholded(exact_raw), thresholded(f1_raw)
  out = _summary(exact, f1, list(gold))
  for name, want in (("HasAns", True), ("NoAns", False)):
    qids = [q for q in gold if has_answer[q] == want]
    if qids:
      out.update({f"{name}_{k}": v for k, v in _summary(exact, f1, qids).items()})
  if na_probs is not None:
    out["best_exact"], out["best_exact_thresh"] = _best_threshold(predictions, exact_raw, probs,
                                                                  has_answer)
    out["best_f1"], out["best_f1_thresh"] = _best_threshold(predictions, f1_raw, probs, has_answer)
  return out
