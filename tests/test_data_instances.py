"""NSP pairs with the original's rules, and the MLM-only mode."""

import random

import numpy as np

from bertjax.data.preparation import instances

CLS, SEP = 2, 3


def _docs(n_docs=100, sents=200, seed=0):
  """Token ids unique across the corpus: doc d's text is d*100000 + 0, 1, 2, ... in order."""
  rng = random.Random(seed)
  docs = []
  for d in range(n_docs):
    base, doc = (d + 1) * 100_000, []
    for _ in range(sents):
      n = rng.randint(4, 16)
      doc.append(list(range(base, base + n)))
      base += n
    docs.append(doc)
  return docs


def _make(docs, L=128, short=0.0, dupe=2, nsp=True, seed=0):
  stats = instances.InstanceStats()
  out = instances.create_instances(docs, max_seq_length=L, nsp=nsp, short_seq_prob=short,
                                   dupe_factor=dupe, cls_id=CLS, sep_id=SEP,
                                   rng=random.Random(seed), stats=stats)
  return out, stats


def test_pairs_layout_and_semantics():
  docs = _docs()
  out, stats = _make(docs)
  assert len(out) == stats.instances > 4000
  not_next = np.mean([label for _, _, label in out])
  assert abs(not_next - 0.5) < 0.03, not_next
  adjacent = 0
  for tokens, num_a, label in out:
    assert len(tokens) <= 128 and tokens[0] == CLS and tokens[num_a - 1] == SEP and tokens[-1] == SEP
    a, b = tokens[1:num_a - 1], tokens[num_a:-1]
    assert a and b and CLS not in a + b and SEP not in a + b
    # A is contiguous text of one document.
    assert a == list(range(a[0], a[0] + len(a)))
    doc_a, doc_b = a[0] // 100_000, b[0] // 100_000
    assert all(t // 100_000 == doc_b for t in b)
    if label == 0:  # IsNext: B continues A in the same document
      assert doc_a == doc_b and b == list(range(b[0], b[0] + len(b))) and b[0] > a[-1]
      adjacent += b[0] == a[-1] + 1
    else:  # NotNext: B from another document
      assert doc_a != doc_b
  # Truncation trims either end at random, so only some IsNext pairs still meet exactly.
  assert adjacent > 0.15 * (len(out) - sum(x[2] for x in out))


def test_short_sequences_and_duplication():
  docs = _docs(40, 100)
  out, _ = _make(docs, short=0.5, dupe=1)
  lengths = np.array([len(t) for t, _, _ in out])
  assert (lengths < 60).mean() > 0.1 and lengths.max() <= 128
  again, _ = _make(docs, short=0.5, dupe=1)
  assert again == out  # deterministic from the seed
  twice, _ = _make(docs, short=0.5, dupe=2)
  assert len(twice) > 1.8 * len(out)


def test_long_sentence_is_split_and_counted():
  docs = _docs(5, 10)
  docs[0].insert(3, list(range(7_000_000, 7_000_500)))  # 500 tokens in one "line"
  out, stats = _make(docs, L=64, dupe=1)
  assert stats.long_sentences_split == 1
  seen = {t for tokens, _, _ in out for t in tokens if 7_000_000 <= t < 7_000_500}
  assert len(seen) > 400  # its text is used, not cut to one sequence
  assert max(len(t) for t, _, _ in out) <= 64


def test_mlm_only_chunks_are_contiguous_and_full():
  docs = _docs(20, 30)
  out, stats = _make(docs, nsp=False, dupe=1)
  lengths = [len(t) for t, _, _ in out]
  assert np.mean(np.array(lengths) == 128) > 0.9
  for tokens, num_a, label in out:
    assert label == 0 and num_a == len(tokens) and tokens[0] == CLS and tokens[-1] == SEP
    body = [t for t in tokens[1:-1] if t != SEP]  # [SEP] marks a document boundary
    runs = sum(1 for x, y in zip(body, body[1:]) if y != x + 1)
    assert runs <= tokens[1:-1].count(SEP)  # breaks only at document boundaries
  total = sum(len(s) for d in docs for s in d)
  assert sum(len(t) - 2 for t, _, _ in out) >= total  # all text (plus boundary [SEP]s) is used


def test_single_document_is_an_error():
  import pytest
  with pytest.raises(ValueError, match="at least 2 documents"):
    _make(_docs(1, 10))
