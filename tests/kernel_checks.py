"""Checks the kernels' tests share (no tests here)."""

import numpy as np


def assert_backwards_agree(kernel, two_cores, xla, count: int, atol: float = 2e-4):
  """A backward kernel's results (`count` of them) against its XLA fallback's, and run in two
  sequences (a v5p chip's two cores) against one: the [cores, ...] sums added, the rest equal."""
  assert len(kernel) == len(two_cores) == len(xla) == count
  for got, split, want in zip(kernel, two_cores, xla):
    np.testing.assert_allclose(got, want, atol=atol, rtol=1e-5)
    np.testing.assert_allclose(split.sum(0) if split.ndim == 3 else split,
                               got.sum(0) if got.ndim == 3 else got, atol=atol, rtol=1e-5)
