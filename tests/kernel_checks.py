"""Checks the kernels' tests share (no tests here)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np


def assert_backwards_agree(kernel, two_cores, xla, count: int, atol: float = 2e-4):
  """A backward kernel's results (`count` of them) against its XLA fallback's, and run in two
  sequences (a v5p chip's two cores) against one: the [cores, ...] sums added, the rest equal."""
  assert len(kernel) == len(two_cores) == len(xla) == count
  for got, split, want in zip(kernel, two_cores, xla):
    np.testing.assert_allclose(got, want, atol=atol, rtol=1e-5)
    np.testing.assert_allclose(split.sum(0) if split.ndim == 3 else split,
                               got.sum(0) if got.ndim == 3 else got, atol=atol, rtol=1e-5)


def assert_models_agree(loss, models: dict, params):
  """loss(model, params)'s value and every parameter's gradient by models["pallas"] (the
  kernels) against models["xla"]'s: the value to 1e-5, each gradient to 1e-4 of its largest."""
  got, want = (jax.value_and_grad(functools.partial(loss, models[impl]))(params)
               for impl in ("pallas", "xla"))
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
  for (path, g), e in zip(jax.tree_util.tree_leaves_with_path(got[1]), jax.tree.leaves(want[1])):
    np.testing.assert_allclose(g, e, atol=1e-4 * float(jnp.abs(e).max()) + 1e-6,
                               err_msg=jax.tree_util.keystr(path))
