"""Retrieval on the host, in numpy: exact top-k search over an encoded corpus, and the metrics of a
ranking (MRR@10, recall@1/@10/@100, nDCG@10) against each query's relevant passages.

Search is exact: every query's score against every passage, a block of `query_rows` queries by
`corpus_rows` passages at a time, each block's best k merged into the running best k. Memory
beyond the vectors themselves (corpus [M, D] and queries [N, D], float32): one block of scores,
query_rows x corpus_rows x 4 bytes (256 x 65,536: 64 MiB), and the running best, N x k ids and
scores. Time is N x M x D multiply-adds (one BLAS matmul per block). Ties go to the lower corpus
index, so a ranking does not depend on the block sizes.

The metrics follow trec_eval (the numbers BEIR and MS MARCO report), each a mean over the
queries that have at least one relevant passage:
  mrr_at_10     1 / the rank of the first relevant passage in the top 10 (0 if none is)
  recall_at_k   the share of a query's relevant passages found in its top k (with one relevant
                passage per query: whether it is there)
  ndcg_at_10    sum over the top 10 of gain / log2(rank + 1), over the same sum for the best
                order; gain is the relevance grade (1 for a listed passage; graded where given)
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import numpy as np

QUERY_ROWS = 256
CORPUS_ROWS = 65_536
CUTOFFS = {"mrr_at_10": 10, "recall_at_1": 1, "recall_at_10": 10, "recall_at_100": 100,
           "ndcg_at_10": 10}
MAIN_METRICS = tuple(CUTOFFS)  # each may pick the best epoch; higher is better for all

# Relevant passages of one query: corpus indices, or {index: grade} for graded relevance.
Relevant = Sequence[int] | Mapping[int, float]


def best_k(scores_NxM, offset: int, k: int) -> tuple[np.ndarray, np.ndarray]:
  """The k best columns of each row (all of them when there are fewer), best first, ties to the
  lower column: (ids + offset, scores)."""
  n, m = scores_NxM.shape
  if k < m:
    # argpartition picks k of the tied columns arbitrarily; take every column tied with the
    # k-th score too, then sort, so the lower index wins whatever the partition did.
    kth_N = -np.partition(-scores_NxM, k - 1, axis=1)[:, k - 1]
    width = int(np.max(np.sum(scores_NxM >= kth_N[:, None], axis=1)))
    cand_NxW = np.argpartition(-scores_NxM, width - 1, axis=1)[:, :width] if width < m else (
        np.broadcast_to(np.arange(m), (n, m)))
  else:
    cand_NxW = np.broadcast_to(np.arange(m), (n, m))
  cand_scores_NxW = np.take_along_axis(scores_NxM, cand_NxW, axis=1)
  order_NxW = np.lexsort((cand_NxW, -cand_scores_NxW), axis=1)[:, :k]
  return (np.take_along_axis(cand_NxW, order_NxW, axis=1) + offset,
          np.take_along_axis(cand_scores_NxW, order_NxW, axis=1))


def search(queries_NxD, corpus_MxD, k: int, *, query_rows: int = QUERY_ROWS,
           corpus_rows: int = CORPUS_ROWS) -> tuple[np.ndarray, np.ndarray]:
  """(ids [N, min(k, M)] int64, scores [N, min(k, M)] float32): each query's k best passages by
  dot product (the cosine for normalised vectors), best first (see the module docstring)."""
  queries_NxD = np.asarray(queries_NxD, np.float32)
  corpus_MxD = np.asarray(corpus_MxD, np.float32)
  if queries_NxD.ndim != 2 or corpus_MxD.ndim != 2 or queries_NxD.shape[1] != corpus_MxD.shape[1]:
    raise ValueError(f"search: queries {queries_NxD.shape} and corpus {corpus_MxD.shape} must "
                     "be [N, D] and [M, D] with the same D")
  n, m = len(queries_NxD), len(corpus_MxD)
  k = min(k, m)
  ids_NxK = np.zeros((n, k), np.int64)
  scores_NxK = np.zeros((n, k), np.float32)
  for start in range(0, n, query_rows):
    q_BxD = queries_NxD[start:start + query_rows]
    best_ids = np.zeros((len(q_BxD), 0), np.int64)
    best_scores = np.zeros((len(q_BxD), 0), np.float32)
    for offset in range(0, m, corpus_rows):
      ids, scores = best_k(q_BxD @ corpus_MxD[offset:offset + corpus_rows].T, offset, k)
      # Merged: the running best first, so among equal scores the lower id (seen earlier) wins.
      both_ids = np.concatenate([best_ids, ids], axis=1)
      both_scores = np.concatenate([best_scores, scores], axis=1)
      order = np.lexsort((both_ids, -both_scores), axis=1)[:, :k]
      best_ids = np.take_along_axis(both_ids, order, axis=1)
      best_scores = np.take_along_axis(both_scores, order, axis=1)
    ids_NxK[start:start + len(q_BxD)] = best_ids
    scores_NxK[start:start + len(q_BxD)] = best_scores
  return ids_NxK, scores_NxK


def _grades(relevant: Relevant) -> dict[int, float]:
  if isinstance(relevant, Mapping):
    return {int(i): float(g) for i, g in relevant.items() if g > 0}
  return {int(i): 1.0 for i in relevant}


def report(ranked_ids, relevant: Sequence[Relevant]) -> dict[str, float]:
  """The metrics of CUTOFFS, means over the queries with a relevant passage, and "queries" (how
  many were scored). ranked_ids [N, K]: corpus indices, best first (K >= 100 for recall_at_100
  to mean its name; fewer are scored as they are)."""
  ranked_ids = np.asarray(ranked_ids)
  if len(ranked_ids) != len(relevant):
    raise ValueError(f"report: {len(ranked_ids)} rankings for {len(relevant)} queries' "
                     "relevant passages")
  totals = dict.fromkeys(CUTOFFS, 0.0)
  scored = 0
  for ranking, rel in zip(ranked_ids, relevant):
    grades = _grades(rel)
    if not grades:
      continue
    scored += 1
    hits = [grades.get(int(i), 0.0) for i in ranking]
    first = next((r for r, g in enumerate(hits[:10]) if g > 0), None)
    totals["mrr_at_10"] += 0.0 if first is None else 1.0 / (first + 1)
    for name in ("recall_at_1", "recall_at_10", "recall_at_100"):
      found = sum(1 for g in hits[:CUTOFFS[name]] if g > 0)
      totals[name] += found / len(grades)
    dcg = sum(g / math.log2(r + 2) for r, g in enumerate(hits[:10]))
    ideal = sum(g / math.log2(r + 2)
                for r, g in enumerate(sorted(grades.values(), reverse=True)[:10]))
    totals["ndcg_at_10"] += dcg / ideal
  if not scored:
    raise ValueError("report: no query has a relevant passage in the corpus; nothing to score")
  return {**{name: total / scored for name, total in totals.items()}, "queries": scored}
