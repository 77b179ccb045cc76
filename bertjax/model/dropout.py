"""Dropout that spends a quarter of the random bits `jax.random.bernoulli` does.

`flax.linen.Dropout` draws a float32 uniform per element through `jax.random.bernoulli`. With
jax's partitionable threefry (the default, needed so a sharded mask is drawn shard by shard) every
element is one whole threefry-2x32 evaluation: 20 rounds of 32-bit adds, rotations and xors that
produce 64 bits, of which one 32-bit word survives, and a keep/drop decision needs far fewer. On a
CPU these bits were a tenth of a small model's training step (docs/performance.md#throughput).

`keep_mask` takes 16 bits per decision, so one evaluation serves four elements: the rate is
quantised to a multiple of 1/65536 (0.1 becomes 6554/65536 = 0.1000061), and the kept values are
scaled by the exact inverse of the keep probability, so every element's expectation is unchanged.
The counters are laid out like the array (one per group of four elements along the last axis),
as jax's own partitionable counters are, so under a mesh each device hashes its own shard.

What a mask depends on: the key (the run's dropout stream folded with the step and the module's
name) and each element's index in the global array — its row in the global batch, its position,
its feature. Not the mesh, the device count, the process count or the sharding: a step gives the
same masks on one device, on 8, and on 2 processes x 2 devices (tests/test_train_step.py,
tests/test_launch_local_finetune.py), as long as every example lands on the same row of the global
batch. The inputs guarantee that: fine-tuning orders each global batch before hosts take their
rows; pre-training's hosts read shards of their own, so its batches (not its masks) change with
the number of processes.

The fused attention kernel's bits (attention_kernel.py; `keep_decisions`). A kernel cannot read a
mask it did not write, so it draws its keep decisions itself, and the backward draws them again:
threefry-2x32 (jax.random's default generator, its `threefry2x32_p` primitive, which Mosaic lowers
inside a kernel) keyed by the layer's dropout key (`key_words`), on counters made of the element's
global row, head, query and key. Each evaluation's two 32-bit words give four 16-bit pieces, four
decisions (the rate quantised as above): piece p of the evaluation at (query group g, key j)
decides (query p * L/4 + g, key j), so the four [L/4, L] pieces stack along the queries (whole
(8, 128) tiles, no lane shuffles). Not the bits of attention_impl="xla" (whose pieces run along
the keys), but the same on every device kind and mesh: the decisions depend on the key and each
element's global (row, head, query, key) alone.

The MLP kernels' bits (post-norm layers, `token_decisions`): the same threefry keyed by the
layer's dropout key, on counters made of each token's global index (its row in the global batch
times L, plus its position) and a column of the row's first half; each evaluation decides two
elements. The same on every device kind and mesh; not the bits of mlp_impl="xla".

Keys that are not threefry (an `rbg` or `unsafe_rbg` default implementation) fall back to
`jax.random.bernoulli`.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.extend import random as jex_random

BITS = 16  # per keep/drop decision
_LEVELS = 1 << BITS
_PER_WORD = 32 // BITS
_PER_EVALUATION = 2 * _PER_WORD  # threefry-2x32 returns two 32-bit words per evaluation


def threshold(rate: float) -> int:
  """16-bit values below it are dropped."""
  return round(rate * _LEVELS)


def quantised_rate(rate: float) -> float:
  """The drop probability `keep_mask` realises for `rate`: the nearest multiple of 1/65536."""
  return threshold(rate) / _LEVELS


def _threefry_key_words(rng):
  """(k1, k2) uint32 scalars of a threefry key, typed or raw; None for another implementation."""
  if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
    if str(jax.random.key_impl(rng)) != jex_random.threefry_prng_impl.name:
      return None
    rng = jax.random.key_data(rng)
  if rng.shape != (2,) or rng.dtype != jnp.uint32:
    return None
  return rng[0], rng[1]


def keep_mask(rng, shape, rate: float) -> jax.Array:
  """Boolean mask of `shape`, each element True with probability 1 - quantised_rate(rate)."""
  shape = tuple(int(d) for d in shape)
  words = _threefry_key_words(rng)
  if words is None or not shape:
    return jax.random.bernoulli(rng, 1.0 - quantised_rate(rate), shape)
  groups = -(-shape[-1] // _PER_EVALUATION)
  counter_shape = shape[:-1] + (groups,)
  # A distinct (x1, x2) counter pair per group of four: x1 the index along the first axis, x2 the
  # flat index over the others (so no axis but the first may exceed 2**32 groups in all).
  inner = counter_shape[1:]
  if math.prod(inner) >= 2 ** 32:
    raise ValueError(f"dropout over shape {shape}: more than 2**32 elements past the first axis")
  x1 = jax.lax.broadcasted_iota(jnp.uint32, counter_shape, 0)
  x2 = jnp.broadcast_to(jnp.arange(math.prod(inner), dtype=jnp.uint32).reshape(inner),
                        counter_shape)
  y1, y2 = jex_random.threefry2x32_p.bind(words[0], words[1], x1, x2)
  # Element (..., p * groups + g) takes the p-th 16-bit piece of group g's two words: pieces 0
  # and 1 from y1, 2 and 3 from y2, low half first. Each piece is compared with the threshold
  # where it is cut from its word, and the four [..., groups] decisions stacked (one byte an
  # element): stacking the 32-bit words or pieces first made XLA's TPU compiler write a u32
  # [..., 4, groups] buffer, four bytes an element, at every attention dropout.
  keep = jnp.stack(decisions(y1, y2, rate), axis=-2)
  return keep.reshape(shape[:-1] + (_PER_EVALUATION * groups,))[..., :shape[-1]]


def decisions(y1, y2, rate: float) -> list:
  """The four keep decisions a threefry evaluation's two words (y1, y2) give at `rate`: their
  16-bit pieces, y1's then y2's, low half first, each compared with the threshold where it is
  cut from its word."""
  return _word_decisions(y1, rate) + _word_decisions(y2, rate)


def _word_decisions(y, rate: float) -> list:
  """The two keep decisions of a 32-bit word: its low and its high 16 bits against the
  threshold."""
  cut = jnp.uint32(threshold(rate))
  return [(y & jnp.uint32(_LEVELS - 1)) >= cut, (y >> BITS) >= cut]


def kept(x, keep, rate: float):
  """x where `keep`, scaled to keep the expectation at `rate`; 0 elsewhere."""
  scale = 1.0 / (1.0 - quantised_rate(rate))
  # Scaled in float32 whatever x's dtype: 1/0.9 in bfloat16 would be 0.16% off.
  return jnp.where(keep, (x.astype(jnp.float32) * scale).astype(x.dtype), jnp.zeros((), x.dtype))


def apply(x, rng, rate: float):
  """x with elements dropped at `rate` and the rest scaled to keep the expectation."""
  if rate <= 0.0:
    return x
  return kept(x, keep_mask(rng, x.shape, rate), rate)


class Dropout(nn.Module):
  """`flax.linen.Dropout`'s interface (rate; deterministic at construction or call) over
  `keep_mask`. Draws from the "dropout" rng stream."""

  rate: float
  deterministic: bool | None = None

  @nn.compact
  def __call__(self, x, deterministic: bool | None = None):
    deterministic = nn.merge_param("deterministic", self.deterministic, deterministic)
    if deterministic or self.rate <= 0.0:  # no key drawn: a rate of 0 needs no "dropout" rng
      return x
    return apply(x, self.make_rng("dropout"), self.rate)

  def draw(self):
    """The key __call__ would mask its next input with (a kernel that drops inside takes it)."""
    return self.make_rng("dropout")


_PIECES = 4  # keep decisions a threefry evaluation gives (`decisions`)
_U32 = jnp.uint32


def keep_decisions(k1, k2, row, head, length: int, rate: float):
  """Boolean [..., L, L]: which attention probabilities of (row, head) survive dropout at
  `rate`. `row` and `head` are uint32 arrays broadcasting together (scalars in the kernel,
  [B, 1, 1, 1] and [1, N, 1, 1] for a whole batch)."""
  group = length // _PIECES
  shape = jnp.broadcast_shapes(jnp.shape(row), jnp.shape(head))[:-2] + (group, length)
  g = jax.lax.broadcasted_iota(_U32, shape, len(shape) - 2)
  j = jax.lax.broadcasted_iota(_U32, shape, len(shape) - 1)
  # One counter per (row, head, query group, key): x2 < N * L^2 / 4, far below 2**32.
  x2 = (head * _U32(group) + g) * _U32(length) + j
  # jax's own threefry primitive: XLA computes it, and Mosaic has a lowering of its own for it.
  y1, y2 = jex_random.threefry2x32_p.bind(k1, k2, jnp.broadcast_to(row, shape), x2)
  return jnp.concatenate(decisions(y1, y2, rate), axis=-2)


def token_decisions(k1, k2, first, tokens: int, width: int, rate: float):
  """Boolean [tokens, width]: which of a post-norm layer's MLP outputs survive dropout at `rate`
  in the MLP kernels (mlp_kernel's `post`), the tokens' global indices first, first + 1, ... (a
  uint32 scalar). One threefry evaluation a token and column c of the first half gives the
  decisions of columns c and c + width / 2, its first word's low and high 16 bits: whole halves
  of a row (lane tiles where D / 2 is a multiple of 128), no lane shuffles."""
  half = width // 2
  if half % 128:
    # Halves that are not whole lane tiles (D = 128: Mosaic cannot join two 64-lane boolean
    # halves): every column evaluates its own word, the same decisions for twice the work.
    token = jax.lax.broadcasted_iota(_U32, (tokens, width), 0) + first
    column = jax.lax.broadcasted_iota(_U32, (tokens, width), 1)
    low = column < half
    y1, _ = jex_random.threefry2x32_p.bind(k1, k2, token, jnp.where(low, column, column - half))
    # The 16-bit piece picked before the comparison (Mosaic selects no booleans).
    piece = jnp.where(low, y1 & jnp.uint32(_LEVELS - 1), y1 >> BITS)
    return piece >= jnp.uint32(threshold(rate))
  token = jax.lax.broadcasted_iota(_U32, (tokens, half), 0) + first
  column = jax.lax.broadcasted_iota(_U32, (tokens, half), 1)
  y1, _ = jex_random.threefry2x32_p.bind(k1, k2, token, column)
  return jnp.concatenate(_word_decisions(y1, rate), axis=-1)


def key_words(rng) -> jax.Array:
  """The uint32 pair the kernels' threefry is keyed with, from a jax key (typed or raw; another
  implementation's key data gives its first two words)."""
  if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
    rng = jax.random.key_data(rng)
  return jax.lax.bitcast_convert_type(rng.reshape(-1)[:2].astype(_U32), jnp.int32)
