"""bertjax/model/dropout.py: 16 random bits per keep/drop decision, four decisions per threefry call."""

import hashlib

import jax
import jax.numpy as jnp
import numpy as np

from bertjax.model import dropout


def test_keep_rate_and_expectation():
  rng = jax.random.PRNGKey(3)
  for rate in (0.1, 0.5):
    keep = np.asarray(dropout.keep_mask(rng, (64, 128, 256), rate))
    # 2M draws: the standard error of the kept fraction is below 0.00035.
    assert abs(keep.mean() - (1.0 - rate)) < 0.0015, (rate, keep.mean())
  x = jnp.full((64, 128, 256), 2.0)
  y = np.asarray(dropout.apply(x, rng, 0.1))
  values = np.unique(y)
  np.testing.assert_allclose(values, [0.0, 2.0 / (1.0 - 6554 / 65536)], rtol=1e-6)
  assert abs(y.mean() - 2.0) < 0.003
  assert dropout.quantised_rate(0.1) == 6554 / 65536


def test_the_four_decisions_of_one_threefry_call_are_independent():
  """Elements k, k + G, k + 2G, k + 3G of a row (G = a quarter of the row) share one threefry
  evaluation; each pair of them must be dropped together as often as chance says (rate**2)."""
  rate = 0.5
  keep = np.asarray(dropout.keep_mask(jax.random.PRNGKey(0), (4096, 256), rate))
  quarters = keep.reshape(4096, 4, 64)
  for a in range(4):
    for b in range(a + 1, 4):
      both_dropped = np.mean(~quarters[:, a] & ~quarters[:, b])
      assert abs(both_dropped - rate * rate) < 0.01, (a, b, both_dropped)
  # Rows and the first axis get their own counters too: no two rows repeat a mask.
  assert len({row.tobytes() for row in keep}) == keep.shape[0]


def test_the_masks_are_the_ones_every_release_drew():
  # A run resumed by a newer bertjax draws the masks its first steps drew: these bits (a key, a
  # last axis that is not a multiple of four) were the first release's, and its rewrite (the
  # decisions stacked as bytes, not the words as u32: docs/performance.md) kept them.
  keep = np.asarray(dropout.keep_mask(jax.random.PRNGKey(7), (3, 5, 37), 0.1))
  assert hashlib.sha256(np.packbits(keep).tobytes()).hexdigest()[:16] == "27598eb5bbca0919"


def test_the_mlp_kernels_decisions_are_pinned_and_split_each_evaluation_over_two_halves():
  # dropout.token_decisions (a post-norm layer's hidden dropout inside the MLP kernels): a run
  # resumed by a newer bertjax draws these bits. Tokens 7..10 of a row of 8: the evaluation at
  # (token, column c) decides columns c and c + 4 from its first word's low and high halves.
  k1, k2 = dropout.key_words(jax.random.key(11)).astype(jnp.uint32)
  keep = dropout.token_decisions(k1, k2, jnp.uint32(7), 4, 8, 0.5)
  assert keep.astype(int).tolist() == [[1, 0, 0, 1, 1, 1, 1, 1], [1, 1, 0, 0, 1, 1, 1, 1],
                                       [0, 1, 0, 0, 1, 0, 0, 1], [0, 0, 0, 0, 1, 1, 1, 0]]
  token = jnp.uint32(7) + jnp.arange(4, dtype=jnp.uint32)[:, None]
  y1, _ = jax.extend.random.threefry2x32_p.bind(
      k1, k2, jnp.broadcast_to(token, (4, 4)), jnp.broadcast_to(jnp.arange(4, dtype=jnp.uint32),
                                                                 (4, 4)))
  cut = dropout.threshold(0.5)
  np.testing.assert_array_equal(keep[:, :4], (y1 & 0xFFFF) >= cut)
  np.testing.assert_array_equal(keep[:, 4:], (y1 >> 16) >= cut)
  # Halves of whole lane tiles (BERT's D) are made as halves and joined: the same rule.
  wide = dropout.token_decisions(k1, k2, jnp.uint32(7), 4, 512, 0.5)
  y1, _ = jax.extend.random.threefry2x32_p.bind(
      k1, k2, jnp.broadcast_to(token, (4, 256)),
      jnp.broadcast_to(jnp.arange(256, dtype=jnp.uint32), (4, 256)))
  np.testing.assert_array_equal(wide, jnp.concatenate([(y1 & 0xFFFF) >= cut, (y1 >> 16) >= cut],
                                                      axis=1))


def test_masks_depend_on_the_key_alone():
  shape = (2, 3, 5, 7)  # a last axis that is not a multiple of four
  a = dropout.keep_mask(jax.random.PRNGKey(1), shape, 0.3)
  assert a.shape == shape and a.dtype == jnp.bool_
  np.testing.assert_array_equal(a, dropout.keep_mask(jax.random.PRNGKey(1), shape, 0.3))
  np.testing.assert_array_equal(a, jax.jit(dropout.keep_mask, static_argnums=(1, 2))(
      jax.random.key(1), shape, 0.3))  # a typed threefry key draws the same mask as its raw data
  assert not np.array_equal(a, dropout.keep_mask(jax.random.PRNGKey(2), shape, 0.3))


def test_other_key_implementations_fall_back_to_bernoulli():
  key = jax.random.key(0, impl="rbg")
  keep = np.asarray(dropout.keep_mask(key, (256, 256), 0.25))
  assert keep.shape == (256, 256) and abs(keep.mean() - 0.75) < 0.01


def test_module_is_identity_when_deterministic_and_draws_from_the_dropout_stream():
  x = jnp.ones((4, 8, 16), jnp.bfloat16)
  module = dropout.Dropout(0.1)
  np.testing.assert_array_equal(module.apply({}, x, deterministic=True), x)
  rngs = {"dropout": jax.random.PRNGKey(7)}
  y = module.apply({}, x, deterministic=False, rngs=rngs)
  assert y.dtype == jnp.bfloat16
  kept = np.asarray(y, np.float32)[np.asarray(y) != 0]
  # Scaled in float32 and rounded once: bfloat16(1 / 0.9), not 1 / bfloat16(0.9).
  np.testing.assert_array_equal(kept, np.float32(jnp.bfloat16(1.0 / (1.0 - 6554 / 65536))))
  assert 0 < np.mean(np.asarray(y) == 0) < 0.3
