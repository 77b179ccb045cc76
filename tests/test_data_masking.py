"""Dynamic masking: rates, specials never masked, reproducibility, whole words."""

import numpy as np
import pytest

from bertjax.data import masking

PAD, UNK, CLS, SEP, MASK = 0, 1, 2, 3, 4
V = 1000


def _batch(B=2000, L=128, seed=0):
  """[CLS] A [SEP] B [SEP] + padding, random lengths, real ids >= 5."""
  rng = np.random.default_rng(seed)
  ids = np.zeros([B, L], np.int32)
  mask = np.zeros([B, L], np.int32)
  for b in range(B):
    n = rng.integers(8, L + 1)
    a = rng.integers(1, n - 3)
    row = rng.integers(5, V, size=n)
    row[0], row[a + 1], row[n - 1] = CLS, SEP, SEP
    ids[b, :n], mask[b, :n] = row, 1
  return ids, mask


def _spec(**kw):
  word_start = np.ones(V, bool)
  word_start[900:] = False  # ids 900.. are "##" continuation pieces
  args = dict(max_predictions=20, vocab_size=V, mask_id=MASK, special_ids=(PAD, CLS, SEP, MASK),
              real_ids=tuple(range(5, V)), word_start_V=tuple(word_start))
  args.update(kw)
  return masking.MaskingSpec(**args)


def _run(ids, mask, seed=0, epoch=0, spec=None, example_ids=None):
  example_ids = np.arange(len(ids)) if example_ids is None else example_ids
  out = masking.mask_batch(ids, mask, example_ids, seed=seed, epoch=epoch, spec=spec or _spec())
  return [np.asarray(x) for x in out]


@pytest.fixture(scope="module")
def masked():
  ids, mask = _batch()
  return ids, mask, _run(ids, mask)


def test_rates(masked):
  ids, mask, (new, pos, labels, weights) = masked
  maskable = (mask == 1) & (ids != CLS) & (ids != SEP)
  picked = int(weights.sum())
  assert abs(picked / maskable.sum() - 0.15) < 0.005, picked / maskable.sum()
  rows = np.repeat(np.arange(len(ids))[:, None], pos.shape[1], 1)[weights > 0]
  p = pos[weights > 0]
  now, orig = new[rows, p], ids[rows, p]
  assert np.array_equal(labels[weights > 0], orig)
  frac_mask = np.mean(now == MASK)
  frac_keep = np.mean(now == orig)
  frac_rand = np.mean((now != MASK) & (now != orig))
  assert abs(frac_mask - 0.8) < 0.015 and abs(frac_keep - 0.1) < 0.015 and abs(frac_rand - 0.1) < 0.015
  # Random replacements are real tokens, never specials.
  assert now[(now != MASK)].min() >= 5
  # Outside the predicted positions nothing changes.
  untouched = np.ones_like(ids, bool)
  untouched[rows, p] = False
  assert np.array_equal(new[untouched], ids[untouched])


def test_specials_and_padding_never_masked(masked):
  ids, mask, (new, pos, labels, weights) = masked
  chosen = np.take_along_axis(ids, pos, axis=1)[weights > 0]
  assert not np.isin(chosen, [PAD, CLS, SEP]).any()
  assert (np.take_along_axis(mask, pos, axis=1)[weights > 0] == 1).all()
  # Positions ascending, padding slots zero at the end, at most M, at least 1 per row.
  for r in range(len(ids)):
    k = int(weights[r].sum())
    assert 1 <= k <= 20 and np.all(np.diff(pos[r, :k]) > 0) and not pos[r, k:].any()
    assert not labels[r, k:].any()


def test_reproducible_and_new_each_epoch(masked):
  ids, mask, first = masked
  again = _run(ids, mask)
  assert all(np.array_equal(a, b) for a, b in zip(first, again))
  other_epoch = _run(ids, mask, epoch=1)
  other_seed = _run(ids, mask, seed=1)
  assert np.mean(np.all(first[1] == other_epoch[1], axis=1)) < 0.01
  assert np.mean(np.all(first[1] == other_seed[1], axis=1)) < 0.01
  # A sequence's mask depends on its id, not on its batch or row.
  perm = np.random.default_rng(1).permutation(len(ids))[:300]
  sub = _run(ids[perm], mask[perm], example_ids=perm)
  assert np.array_equal(sub[1], first[1][perm]) and np.array_equal(sub[0], first[0][perm])


def test_max_predictions_cap():
  ids, mask = _batch(B=200, L=256)
  _, _, _, weights = _run(ids, mask, spec=_spec(max_predictions=8))
  assert weights.sum(1).max() == 8


def test_whole_word_masking_takes_whole_words():
  ids, mask = _batch(B=1000, L=128, seed=3)
  # Make about a third of the tokens continuation pieces (ids >= 900) of the word before them.
  rng = np.random.default_rng(0)
  cont = (rng.random(ids.shape) < 0.35) & (ids >= 5)
  ids = np.where(cont, rng.integers(900, V, ids.shape), ids).astype(np.int32)
  new, pos, labels, weights = _run(ids, mask, spec=_spec(whole_word_masking=True))
  word_start = (ids < 900) | np.isin(ids, [CLS, SEP, PAD])
  picked = np.zeros_like(ids, bool)
  for r in range(len(ids)):
    picked[r, pos[r][weights[r] > 0]] = True
  maskable = (mask == 1) & (ids != CLS) & (ids != SEP)
  for r in range(len(ids)):
    for i in range(1, ids.shape[1]):
      if maskable[r, i] and maskable[r, i - 1] and not word_start[r, i]:
        assert picked[r, i] == picked[r, i - 1], (r, i)  # a piece goes with its word
  rate = picked.sum() / maskable.sum()
  assert 0.12 < rate < 0.16, rate


def _reference_whole_words(word_lens, k, rng):
  """The original's selection: words in random order, a word that does not fit is skipped."""
  taken, total = [], 0
  for w in rng.permutation(len(word_lens)):
    if total >= k:
      break
    if total + word_lens[w] > k:
      continue
    taken.append(w)
    total += word_lens[w]
  return taken


def _word_rates_padded(word_lens, draws, L):
  """Per-word masking rate of `[CLS] words [SEP] + padding`, one sequence masked `draws` times."""
  row = [CLS]
  for w, n in enumerate(word_lens):
    row += [5 + w] + [900 + w] * (n - 1)  # a word-start piece, then continuation pieces
  row += [SEP]
  ids = np.zeros([draws, L], np.int32)
  ids[:, :len(row)] = row
  mask = (ids != PAD).astype(np.int32)
  _, pos, _, weights = _run(ids, mask, spec=_spec(whole_word_masking=True),
                            example_ids=np.arange(draws))
  word_of = np.full(L, -1)
  word_of[1:len(row) - 1] = np.repeat(np.arange(len(word_lens)), word_lens)
  hits = np.zeros(len(word_lens))
  for r in range(draws):
    words = word_of[pos[r][weights[r] > 0]]
    assert (words >= 0).all()
    for w in set(words):
      assert (words == w).sum() == word_lens[w]  # whole words only
      hits[w] += 1
  return hits / draws, weights.sum(1)


def _reference_word_rates(word_lens, draws, seed=0):
  rng = np.random.default_rng(seed)
  n = sum(word_lens)
  hits = np.zeros(len(word_lens))
  for _ in range(draws):
    k = min(20, max(1, int(np.floor(n * 0.15 + rng.random()))))  # our count: stochastic rounding
    hits[_reference_whole_words(word_lens, k, rng)] += 1
  return hits / draws


def test_whole_word_masking_reaches_every_word_of_a_padded_sequence():
  # Twelve one-piece words then [SEP] and padding: every word, the last one too, near 15%.
  rates, _ = _word_rates_padded([1] * 12, 4000, L=24)
  assert np.all(np.abs(rates - 0.15) < 0.03), rates


def test_whole_word_masking_matches_the_original_selection():
  # Words of several lengths: a word that does not fit is skipped and the next one tried, so
  # short words fill what long ones leave; the rates follow the original's rule.
  word_lens = [3, 1, 2, 1, 4, 1, 1, 2, 1, 3, 1, 1]
  rates, counts = _word_rates_padded(word_lens, 6000, L=32)
  expected = _reference_word_rates(word_lens, 20000)
  assert np.all(np.abs(rates - expected) < 0.025), (rates, expected)
  assert abs(counts.mean() - 0.15 * sum(word_lens)) < 0.1, counts.mean()


def test_docs_list_the_deviations_from_the_original_masking():
  import pathlib
  page = (pathlib.Path(__file__).parent.parent / "docs" / "data.md").read_text()
  section = page[page.index("**Deliberate deviations from the original"):]
  section = " ".join(section[:section.index("###")].split())
  for fact in ("15% of the *non-special* tokens", "A random replacement (the 10% case) is drawn "
               "from the non-special tokens", "Masks are drawn anew every epoch",
               "Whole-word masking: a continuation piece right after `[CLS]` or `[SEP]`"):
    assert fact in section, fact
