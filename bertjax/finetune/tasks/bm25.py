"""BM25 (Robertson & Zaragoza 2009, "The Probabilistic Relevance Framework: BM25 and Beyond"): the
lexical baseline a trained retriever is measured against, in numpy over an inverted index.

  score(q, d) = sum over the query's terms t present in d of
                idf(t) x tf(t, d) (k1 + 1) / (tf(t, d) + k1 (1 - b + b |d| / avgdl))
  idf(t)      = ln(1 + (N - df(t) + 0.5) / (df(t) + 0.5))   (Lucene's form: never negative)

k1 = 0.9, b = 0.4: Anserini's defaults, its MS MARCO passage baseline. A query's repeated term
counts once per occurrence, as Lucene's. Terms: `words` (lower-cased runs of letters and digits)
unless the caller passes its own (a tokenizer's pieces).
"""

from __future__ import annotations

import math
import re
from typing import Callable, Iterable, Sequence

import numpy as np

from bertjax.finetune.kit import retrieval

_WORD = re.compile(r"\w+", re.UNICODE)


def words(text: str) -> list[str]:
  return _WORD.findall(text.lower())


class BM25:
  """An index of `documents` (texts): `scores(query)` [M] and `search(queries, k)`."""

  def __init__(self, documents: Iterable[str], *, k1: float = 0.9, b: float = 0.4,
               terms: Callable[[str], Sequence[str]] = words):
    self.k1, self.b, self.terms = k1, b, terms
    postings: dict[str, dict[int, int]] = {}
    lengths = []
    for doc_id, text in enumerate(documents):
      tokens = terms(text)
      lengths.append(len(tokens))
      for token in tokens:
        counts = postings.setdefault(token, {})
        counts[doc_id] = counts.get(doc_id, 0) + 1
    self.size = len(lengths)
    length_M = np.asarray(lengths, np.float64)
    average = float(length_M.mean()) if self.size and length_M.mean() > 0 else 1.0
    # The length norm of each document, computed once: k1 (1 - b + b |d| / avgdl).
    self._norm_M = k1 * (1.0 - b + b * length_M / average)
    self._index = {}
    for token, counts in postings.items():
      ids = np.fromiter(counts.keys(), np.int64, len(counts))
      tf = np.fromiter(counts.values(), np.float64, len(counts))
      idf = math.log(1.0 + (self.size - len(ids) + 0.5) / (len(ids) + 0.5))
      self._index[token] = (ids, idf * tf * (k1 + 1.0) / (tf + self._norm_M[ids]))

  def scores(self, query: str) -> np.ndarray:
    """[M] float64: the query's BM25 score against every document (0 where no term matches)."""
    total_M = np.zeros(self.size, np.float64)
    for token in self.terms(query):
      if token in self._index:
        ids, contribution = self._index[token]
        total_M[ids] += contribution
    return total_M

  def search(self, queries: Iterable[str], k: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids [N, k], scores [N, k]) of each query's best k documents, ties to the lower index (as
    retrieval.search, whose ordering it uses)."""
    ids, scores = [], []
    for query in queries:
      i, s = retrieval.best_k(self.scores(query)[None], 0, min(k, self.size))
      ids.append(i[0])
      scores.append(s[0])
    return np.stack(ids), np.stack(scores)
