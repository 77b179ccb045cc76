"""Retrieval metrics against a ranking scored by hand; exact search in blocks equal to sorting every
score; BM25 against its formula worked by hand."""

import numpy as np
import pytest

from bertjax.finetune.kit import retrieval
from bertjax.finetune.tasks import bm25


def test_the_metrics_of_a_ranking_scored_by_hand():
  rest = list(range(20, 30))
  ranked = [
      [3, 1, 0, 2] + rest,   # relevant 1 at rank 2: RR 1/2, nDCG 1/log2(3) = 0.6309298
      [0, 4, 2, 1] + rest,   # relevant 0 and 2 at ranks 1 and 3: RR 1, recall@1 1/2,
                             # nDCG (1 + 1/log2(4)) / (1 + 1/log2(3)) = 0.9197208
      rest + [7, 8, 9, 11],  # relevant 11 at rank 14: only recall@100 finds it
      [0, 1, 2, 3] + rest,   # no relevant passage: not scored
      [5, 6, 1, 2] + rest,   # grades 5: 1, 6: 2 at ranks 1 and 2: RR 1, recall@1 1/2,
                             # nDCG (1 + 2/log2(3)) / (2 + 1/log2(3)) = 0.8597187
  ]
  relevant = [[1], [0, 2], [11], [], {5: 1, 6: 2}]
  got = retrieval.report(ranked, relevant)
  assert got["queries"] == 4
  assert got["mrr_at_10"] == pytest.approx((0.5 + 1 + 0 + 1) / 4)
  assert got["recall_at_1"] == pytest.approx((0 + 0.5 + 0 + 0.5) / 4)
  assert got["recall_at_10"] == pytest.approx((1 + 1 + 0 + 1) / 4)
  assert got["recall_at_100"] == pytest.approx(1.0)
  assert got["ndcg_at_10"] == pytest.approx((0.6309298 + 0.9197208 + 0 + 0.8597187) / 4,
                                            abs=1e-7)
  with pytest.raises(ValueError, match="no query has a relevant"):
    retrieval.report([[0, 1]], [[]])


def test_search_in_blocks_equals_sorting_every_score():
  rng = np.random.default_rng(0)
  corpus = rng.normal(size=(23, 5)).astype(np.float32)
  corpus[[4, 9, 17]] = corpus[2]  # ties: the lower index first
  queries = np.concatenate([rng.normal(size=(6, 5)), corpus[2:3]]).astype(np.float32)
  scores = queries @ corpus.T
  want = np.lexsort((np.broadcast_to(np.arange(23), scores.shape), -scores), axis=1)
  for k, query_rows, corpus_rows in ((6, 3, 4), (23, 2, 5), (40, 7, 23), (1, 1, 1)):
    ids, top = retrieval.search(queries, corpus, k, query_rows=query_rows,
                                corpus_rows=corpus_rows)
    np.testing.assert_array_equal(ids, want[:, :min(k, 23)])
    np.testing.assert_allclose(top, np.take_along_axis(scores, ids, 1), rtol=1e-6)
  ids, _ = retrieval.search(queries[-1:], corpus, 4, corpus_rows=3)
  assert list(ids[0]) == [2, 4, 9, 17]


def test_bm25_scores_its_formula_worked_by_hand():
  index = bm25.BM25(["a b", "A c c", "d"])  # lengths 2, 3, 1: avgdl 2; k1 0.9, b 0.4
  # "c": df 1, idf ln(1 + 2.5 / 1.5) = 0.9808293; in doc 1 tf 2, |d| 3:
  #   0.9808293 x 2 x 1.9 / (2 + 0.9 (0.6 + 0.4 x 1.5)) = 1.2101140
  np.testing.assert_allclose(index.scores("c"), [0, 1.2101140, 0], rtol=1e-6)
  # "a": df 2, idf ln(1.6) = 0.4700036; doc 0 (|d| 2): 0.4700036; doc 1 (|d| 3): 0.4293302
  np.testing.assert_allclose(index.scores("a c"), [0.4700036, 1.6394443, 0], rtol=1e-6)
  ids, scores = index.search(["a c", "d", "zzz"], 2)
  np.testing.assert_array_equal(ids, [[1, 0], [2, 0], [0, 1]])  # no match: ties, lower first
  assert scores[2].tolist() == [0, 0]


def test_the_largest_batch_search_doubles_then_halves_the_gap():
  from bertjax.benchmark import retrieval as benchmark_retrieval
  tried = []

  def fits(n):
    tried.append(n)
    return n <= 700, n
  lo, hi, probes = benchmark_retrieval.largest_batch(fits, 256, 2)
  # 256 and 512 fit, 1024 does not; then 768 does not, 640 does: the answer to 1/4 of the gap.
  assert (lo, hi, tried) == (640, 768, [256, 512, 1024, 768, 640])
  assert [ok for _, ok, _ in probes] == [True, True, False, False, True]
  assert benchmark_retrieval.largest_batch(lambda n: (False, n), 256, 2)[:2] == (0, 256)


def test_the_summary_task_pairs_a_docstrings_first_sentence_with_the_rest():
  from bertjax.benchmark import retrieval as benchmark_retrieval
  pairs = list(benchmark_retrieval._summaries([["Open a file.", "It returns a stream.", "Or fails."],
                                              ["One sentence alone."]]))
  assert pairs == [("Open a file.", "It returns a stream. Or fails.")]
