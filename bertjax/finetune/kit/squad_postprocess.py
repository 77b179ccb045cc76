"""SQuAD predictions from start/end logits, in the files of the original `run_squad.py`:
`predictions.json`, `nbest_predictions.json` and, for v2.0, `null_odds.json`.

The candidates and their ranking are the original's; the answer text is not recovered its way.
The original re-tokenizes the chosen words and aligns them with `get_final_text`'s heuristic; here
the answer is the context between the tokenizer's character offsets of its first and last token,
so it is always an exact substring of the context, for any script. The two differ where that
heuristic would: runs of whitespace and NBSP inside an answer are kept as the context has them,
an [UNK] piece covers its whole word, and when no candidate survives the top n-best the best span
over every position is given instead of the original's nonce "empty".

The candidate search (top n_best starts x top n_best ends of every feature, and the filters) runs on
all features at once in numpy; only the final per-question ranking, which removes duplicate texts,
is a Python loop. Letters: F features, L sequence length, K n_best_size, C candidates.
"""

import dataclasses
import json
import os
from typing import Sequence

import numpy as np

from bertjax import files
from bertjax.inputs.questions import SquadExample

N_BEST_SIZE, MAX_ANSWER_LENGTH = 20, 30
# The original's answer when no candidate survives the filters.
NONCE = "empty"


@dataclasses.dataclass
class SquadPredictions:
  """predictions: question id -> answer ("" = no answer); nbest: id -> entries with text,
  probability, start_logit, end_logit; null_odds (v2.0 only): id -> null score - best non-null
  score, the number `null_score_diff_threshold` is compared with."""

  predictions: dict[str, str]
  nbest: dict[str, list[dict]]
  null_odds: dict[str, float] | None
  # id -> where the answer starts in the context (characters; -1 for no answer), and its n-best
  # probability: what `bertjax.predict` reports beside the text.
  answer_starts: dict[str, int] = dataclasses.field(default_factory=dict)
  scores: dict[str, float] = dataclasses.field(default_factory=dict)


def _softmax(scores: Sequence[float]) -> list[float]:
  x = np.asarray(scores, np.float64)
  e = np.exp(x - x.max())
  return list(e / e.sum())


def _candidates(features: dict, start_FxL: np.ndarray, end_FxL: np.ndarray, n_best_size: int,
                max_answer_length: int):
  """Every (feature, start, end, score) the original considers, in its order: features, then the
  rank of the start, then the rank of the end."""
  F = start_FxL.shape[0]
  # Stable sort of the negated logits: equal logits keep the lower position first, as Python's
  # sorted(..., reverse=True) in the original.
  top_start_FxK = np.argsort(-start_FxL, axis=1, kind="stable")[:, :n_best_size]
  top_end_FxK = np.argsort(-end_FxL, axis=1, kind="stable")[:, :n_best_size]
  rows_Fx1 = np.arange(F)[:, None]
  in_context_FxL = features["token_start_char"] >= 0
  s_FxKx1, e_Fx1xK = top_start_FxK[:, :, None], top_end_FxK[:, None, :]
  ok_FxKxK = (in_context_FxL[rows_Fx1, top_start_FxK][:, :, None]
              & in_context_FxL[rows_Fx1, top_end_FxK][:, None, :]
              & features["token_is_max_context"][rows_Fx1, top_start_FxK][:, :, None]
              & (e_Fx1xK >= s_FxKx1) & (e_Fx1xK - s_FxKx1 + 1 <= max_answer_length))
  f_C, i_C, j_C = np.nonzero(ok_FxKxK)
  s_C, e_C = top_start_FxK[f_C, i_C], top_end_FxK[f_C, j_C]
  return f_C, s_C, e_C


def _span_text(context: str, start: int, end: int) -> tuple[str, int]:
  """(text, its first character) of the context between a candidate's offsets, less whitespace at
  its ends: a SentencePiece word-start piece alone (a "\u2581" before a piece it does not join,
  such as an unknown one) covers only the spaces before the next word, so a candidate ending on it
  would end in them (and one made of it alone is empty)."""
  text = context[start:end]
  return text.strip(), start + len(text) - len(text.lstrip())


def _best_span(context: str, features: dict, start_FxL, end_FxL, rows: slice,
               max_answer_length: int) -> tuple[str, float, float] | None:
  """The best-scoring candidate of one example's features (`rows`) over every position: (text,
  start logit, end logit), None if no span of its context holds text."""
  start_FxL, end_FxL = start_FxL[rows], end_FxL[rows]
  mine = {k: features[k][rows] for k in ("token_start_char", "token_is_max_context")}
  f_C, s_C, e_C = _candidates(mine, start_FxL, end_FxL, start_FxL.shape[1], max_answer_length)
  for c in np.argsort(-(start_FxL[f_C, s_C] + end_FxL[f_C, e_C]), kind="stable"):
    text, _ = _span_text(context, features["token_start_char"][rows][f_C[c], s_C[c]],
                         features["token_end_char"][rows][f_C[c], e_C[c]])
    if text:
      return text, float(start_FxL[f_C[c], s_C[c]]), float(end_FxL[f_C[c], e_C[c]])
  return None


def _example_bounds(num_examples: int, features: dict, start_FxL, end_FxL) -> np.ndarray:
  """Where each example's features begin (and, last, their count), the logits and features
  checked against each other and the examples."""
  F, L = features["input_ids"].shape
  if start_FxL.shape != (F, L) or end_FxL.shape != (F, L):
    raise ValueError(f"Logits of shapes {start_FxL.shape} and {end_FxL.shape} do not match the "
                     f"{F} features of length {L}; pass the start/end logits of every feature, in "
                     f"the order of make_features (pad batches, then drop the padding rows).")
  example_F = features["example_index"]
  bounds = np.searchsorted(example_F, np.arange(num_examples + 1))
  if F and (np.any(np.diff(example_F) < 0) or np.any(np.diff(bounds[:-1]) == 0)
            or bounds[-1] != F):
    raise ValueError(f"The features do not belong to these {num_examples} examples (each needs "
                     f"at least one feature, in order); make them with make_features(examples).")
  return bounds


def _ranked_entries(context: str, candidates: range, null_at: int | None, null, char_start_C,
                    char_end_C, start_C, end_C, n_best_size: int):
  """One example's n-best entries, best first: (text, start logit, end logit, its first character
  in the context) of each candidate (`candidates`, ranked) whose text is new, with `null` (v2.0's
  empty answer, its first character -1) placed at rank `null_at`; at most `n_best_size`."""
  seen, c = set(), candidates.start
  while len(seen) < n_best_size and (c < candidates.stop or c == null_at):
    if c == null_at:
      seen.add("")
      null_at = None
      yield null + (-1,)
      continue
    text, first = _span_text(context, char_start_C[c], char_end_C[c])
    if text and text not in seen:
      seen.add(text)
      yield text, float(start_C[c]), float(end_C[c]), int(first)
    c += 1


def postprocess(examples: Sequence[SquadExample], features: dict, start_logits_FxL,
                end_logits_FxL, *, n_best_size: int = N_BEST_SIZE,
                max_answer_length: int = MAX_ANSWER_LENGTH, version_2_with_negative: bool = False,
                null_score_diff_threshold: float = 0.0) -> SquadPredictions:
  """The answer of each example from the logits of its features (from `questions.make_features`).

  A candidate starts and ends inside the window's context, starts at a token this window sees with
  maximum context, ends at or after its start and spans at most max_answer_length tokens; its text
  is the original context between its first token's first and last token's last character
  (less whitespace at its ends, which only a SentencePiece word-start piece alone spans).
  v2.0 adds the null answer, scored start_logits[0] + end_logits[0] (the lowest over the features),
  and answers "" when null - best non-null > null_score_diff_threshold.
  Where no candidate survives, the best span over every position of the context is the answer
  (the original's nonce "empty" only for a context without a token), so every answer is an exact
  substring of its context.
  """
  start_FxL = np.asarray(start_logits_FxL, np.float32)
  end_FxL = np.asarray(end_logits_FxL, np.float32)
  example_F = features["example_index"]
  bounds = _example_bounds(len(examples), features, start_FxL, end_FxL)

  f_C, s_C, e_C = _candidates(features, start_FxL, end_FxL, n_best_size, max_answer_length)
  start_C = start_FxL[f_C, s_C].astype(np.float64)
  end_C = end_FxL[f_C, e_C].astype(np.float64)
  score_C = start_C + end_C
  # Group by example, best first; ties keep the original's order (np.lexsort is stable).
  order = np.lexsort((-score_C, example_F[f_C]))
  f_C, s_C, e_C, start_C, end_C, score_C = (a[order] for a in (f_C, s_C, e_C, start_C, end_C,
                                                               score_C))
  cand_bounds = np.searchsorted(example_F[f_C], np.arange(len(examples) + 1))
  char_start_C = features["token_start_char"][f_C, s_C]
  char_end_C = features["token_end_char"][f_C, e_C]
  null_F = start_FxL[:, 0].astype(np.float64) + end_FxL[:, 0].astype(np.float64)

  predictions, nbest_all, null_odds = {}, {}, {} if version_2_with_negative else None
  answer_starts, scores = {}, {}
  for ex_i, ex in enumerate(examples):
    lo, hi = cand_bounds[ex_i], cand_bounds[ex_i + 1]
    null_at = null = None
    if version_2_with_negative:
      f_null = bounds[ex_i] + int(np.argmin(null_F[bounds[ex_i]:bounds[ex_i + 1]]))
      null = ("", float(start_FxL[f_null, 0]), float(end_FxL[f_null, 0]))
      score_null = null[1] + null[2]
      # The original appends the null candidate last and sorts stably: it ranks after every
      # candidate scoring at least as much.
      null_at = lo + int(np.sum(score_C[lo:hi] >= score_null))
    ranked = list(_ranked_entries(ex.context, range(lo, hi), null_at, null, char_start_C,
                                  char_end_C, start_C, end_C, n_best_size))
    entries = [r[:3] for r in ranked]  # (text, start_logit, end_logit)
    seen = {r[0] for r in ranked}
    starts = {r[0]: r[3] for r in ranked if r[0]}  # text -> its first character in the context
    if not any(t for t, _, _ in entries):
      # No candidate among the top n_best starts and ends (a short context, an untrained model):
      # the original answers its nonce "empty", which is no text of the context; the best span
      # over every position is.
      entries.append(_best_span(ex.context, features, start_FxL, end_FxL,
                                slice(bounds[ex_i], bounds[ex_i + 1]), max_answer_length)
                     or (NONCE, 0.0, 0.0))
    if version_2_with_negative and "" not in seen:
      entries.append(null)
    probs = _softmax([a + b for _, a, b in entries])
    nbest_all[ex.qas_id] = [{"text": t, "probability": float(p), "start_logit": a, "end_logit": b}
                            for (t, a, b), p in zip(entries, probs)]
    best_i = next(i for i, e in enumerate(entries) if e[0])
    best = entries[best_i]
    if version_2_with_negative:
      diff = score_null - best[1] - best[2]
      null_odds[ex.qas_id] = diff
      predictions[ex.qas_id] = "" if diff > null_score_diff_threshold else best[0]
    else:
      predictions[ex.qas_id] = best[0]
    answered = predictions[ex.qas_id]
    answer_starts[ex.qas_id] = starts.get(answered, -1) if answered else -1
    scores[ex.qas_id] = float(probs[best_i] if answered else
                              next(p for (t, _, _), p in zip(entries, probs) if not t))
  return SquadPredictions(predictions, nbest_all, null_odds, answer_starts, scores)


def write_predictions(result: SquadPredictions, output_dir: str) -> list[str]:
  """Writes predictions.json, nbest_predictions.json and (v2.0) null_odds.json; returns their
  paths."""
  files.makedirs(output_dir)
  written = {"predictions.json": result.predictions, "nbest_predictions.json": result.nbest}
  if result.null_odds is not None:
    written["null_odds.json"] = result.null_odds
  paths = []
  for name, value in written.items():
    path = os.path.join(output_dir, name)
    # Atomic: a kill mid-write leaves the previous file whole, never half of one.
    files.write_text(path, json.dumps(value, indent=4) + "\n")
    paths.append(path)
  return paths
