"""Inputs shared by the parity tests against Hugging Face (no tests here)."""

import numpy as np


def parity_inputs(vocab_size: int):
  """(ids, mask, segments, masked positions) of 3 rows of 20: one full, two padded at different
  points, both segments, and masked positions unsorted or at the padding boundary."""
  rng = np.random.default_rng(5)
  ids = rng.integers(0, vocab_size, (3, 20)).astype(np.int32)
  mask = np.ones((3, 20), np.int32)
  mask[1, 14:] = 0
  mask[2, 5:] = 0
  seg = np.zeros((3, 20), np.int32)
  seg[:, 9:] = 1
  positions = np.array([[1, 4, 9, 19], [0, 2, 13, 7], [1, 2, 3, 4]], np.int32)
  return ids, mask, seg, positions
