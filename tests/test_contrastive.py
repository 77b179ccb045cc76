"""The bi-encoder's losses against a hand computation; the whole global batch's negatives on 8
devices equal to one device; k chunks (GradCache) equal to one batch; dropout's keys reused."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from bertjax.configs import base
from bertjax.errors import Refusal
from bertjax.model import contrastive, dropout
from bertjax.model.config import BertConfig
from bertjax.model.contrastive import ContrastiveConfig
from bertjax.parallel import sharding
from bertjax.training import contrastive as contrastive_training, gradcache, train

TINY = BertConfig(vocab_size=96, hidden_size=32, num_layers=1, num_heads=4,
                  intermediate_size=64, max_position_embeddings=16, hidden_dropout=0.0,
                  attention_dropout=0.0)
Q, C, L = 16, 3, 8


def make_batch(seed=0, rows=Q):
  """Queries and passages of varying lengths, a missing hard negative, a padding row."""
  rng = np.random.default_rng(seed)
  query_mask = (np.arange(L)[None] < rng.integers(3, L + 1, rows)[:, None]).astype(np.int32)
  passage_mask = (np.arange(L)[None, None]
                  < rng.integers(3, L + 1, (rows, C))[..., None]).astype(np.int32)
  passage_mask[1, 2] = 0  # row 1 has one hard negative, not two
  weight = np.ones(rows, np.float32)
  weight[-1] = 0  # pads the batch
  # Each passage its own key, but row 12's positive is row 0's (on another device of the 8) and
  # row 3's second hard negative is row 5's positive: copies, left out of those queries' terms.
  key = np.arange(1, rows * C + 1, dtype=np.int32).reshape(rows, C) * (passage_mask.any(-1))
  key[rows * 3 // 4, 0], key[3, 2] = key[0, 0], key[5, 0]
  return {"query_ids": (rng.integers(1, 96, (rows, L)) * query_mask).astype(np.int32),
          "query_mask": query_mask,
          "passage_ids": (rng.integers(1, 96, (rows, C, L)) * passage_mask).astype(np.int32),
          "passage_mask": passage_mask, "passage_key": key.astype(np.int32), "weight": weight}


# The losses by hand ----------------------------------------------------------------------------

def _by_hand(q, p, present, weight, scale, bias, loss, symmetric, keys=None):
  """float64 loops over queries and passages: the formulas of the module docstring."""
  rows, c = present.shape
  flat_p, flat_present = p.reshape(rows * c, -1), present.reshape(-1) & np.repeat(weight > 0, c)
  flat_keys = np.zeros(rows * c, int) if keys is None else keys.reshape(-1)

  def copy(j, i):  # passage j is a copy of query i's positive (and not that positive itself)
    return j != i * c and flat_keys[j] != 0 and flat_keys[j] == flat_keys[i * c]

  total = top = 0.0
  for i in range(rows):
    if weight[i] == 0:
      continue
    logits = np.array([scale * q[i] @ flat_p[j] + bias for j in range(rows * c)])
    own = logits[i * c]
    counted = [j for j in range(rows * c) if flat_present[j] and not copy(j, i)]
    others = [logits[j] for j in counted]
    top += float(own >= max(others))
    if loss == "sigmoid":
      total += sum(math.log1p(math.exp(-(1 if j == i * c else -1) * logits[j])) for j in counted)
      continue
    forward = math.log(sum(math.exp(x) for x in others)) - own
    if symmetric:
      column = [scale * q[r] @ flat_p[i * c] for r in range(rows)
                if weight[r] > 0 and not copy(r * c, i)]
      forward = 0.5 * (forward + math.log(sum(math.exp(x) for x in column)) - own)
    total += forward
  return total, top, float(weight.sum())


# Passage keys of the 5 x 2 passages below: rows 0 and 3 share a positive (7), row 1's hard
# negative is row 2's positive (9), row 4 (padding) repeats row 0's; 0 is no key.
KEYS = np.array([[7, 1], [2, 9], [9, 0], [7, 4], [7, 5]], np.int32)


@pytest.mark.parametrize("loss,symmetric,bias,keys", [
    ("infonce", False, 0.0, None), ("infonce", True, 0.0, None), ("sigmoid", False, -2.0, None),
    ("infonce", False, 0.0, KEYS), ("infonce", True, 0.0, KEYS), ("sigmoid", False, -2.0, KEYS)])
def test_the_losses_equal_a_hand_computation(loss, symmetric, bias, keys):
  rng = np.random.default_rng(1)
  q = rng.normal(size=(5, 4))
  p = rng.normal(size=(5, 2, 4))
  q /= np.linalg.norm(q, axis=-1, keepdims=True)
  p /= np.linalg.norm(p, axis=-1, keepdims=True)
  mask = np.ones((5, 2, 3), np.int32)
  mask[2, 1] = 0  # row 2 has no hard negative
  weight = np.array([1, 1, 1, 1, 0], np.float32)
  settings = ContrastiveConfig(loss=loss, symmetric=symmetric, bias=bias, scale=3.0)
  out = {"query": jnp.asarray(q, jnp.float32), "passage": jnp.asarray(p, jnp.float32),
         "scale": jnp.float32(3.0), "bias": jnp.float32(bias)}
  got = jax.jit(functools.partial(contrastive.metrics, settings=settings))(out, mask, weight,
                                                                          passage_key_QxC=keys)
  want_loss, want_top, count = _by_hand(q, p, mask.any(-1), weight, 3.0, bias, loss, symmetric,
                                        keys)
  if keys is not None:  # the copies change the loss: the check sees them
    unmasked, _, _ = _by_hand(q, p, mask.any(-1), weight, 3.0, bias, loss, symmetric)
    assert abs(unmasked - want_loss) > 0.05
  np.testing.assert_allclose(float(got["contrastive_loss"][0]), want_loss, rtol=1e-5)
  assert float(got["contrastive_loss"][1]) == count == 4
  assert float(got["in_batch_accuracy"][0]) == want_top


def test_negative_groups_score_each_group_alone():
  rng = np.random.default_rng(2)
  q, p = rng.normal(size=(8, 4)), rng.normal(size=(8, 2, 4))
  mask, weight = np.ones((8, 2, 3), np.int32), np.ones(8, np.float32)
  loss = jax.jit(lambda *args, groups=1: contrastive.info_nce(
      *args, 2.0, groups=groups)["contrastive_loss"][0], static_argnames="groups")
  whole = loss(q, p, mask, weight, groups=2)
  halves = sum(loss(q[s], p[s], mask[s], weight[s]) for s in (slice(0, 4), slice(4, 8)))
  everyone = loss(q, p, mask, weight)
  np.testing.assert_allclose(float(whole), float(halves), rtol=1e-6)
  assert float(everyone) > float(whole) + 0.5  # more negatives, a larger loss


def test_pooling_and_normalisation():
  seq = jnp.asarray(np.random.default_rng(3).normal(size=(2, 4, 3)), jnp.float32)
  mask = np.array([[1, 1, 0, 0], [1, 1, 1, 1]])
  np.testing.assert_allclose(contrastive.pool(seq, mask, "mean")[0], seq[0, :2].mean(0),
                             rtol=1e-6)
  np.testing.assert_array_equal(contrastive.pool(seq, mask, "cls"), seq[:, 0])
  unit = contrastive.l2_normalize(seq[:, 0])
  np.testing.assert_allclose(np.linalg.norm(unit, axis=-1), 1.0, rtol=1e-6)
  zero = jnp.zeros((1, 3))
  assert not np.any(np.isnan(jax.grad(lambda x: contrastive.l2_normalize(x).sum())(zero)))


@pytest.mark.parametrize("fields", [{"loss": "cosine"}, {"pooling": "max"}, {"scale": 0.0},
                                    {"bias": -10.0}, {"loss": "sigmoid", "symmetric": True},
                                    {"negative_groups": 0}])
def test_settings_that_mean_nothing_are_refused(fields):
  with pytest.raises(Refusal, match=list(fields)[-1]):
    ContrastiveConfig(**fields)


# One step on a mesh ----------------------------------------------------------------------------

def random_params(abstract, seed=0):
  """numpy parameters of the shapes of `abstract` (ShapeDtypeStructs), drawn on the host: norm
  scales near 1, the rest at 0.1, a learned scale at 20. Compiling the model's own init costs
  ~14 s of CPU for a 2-layer model (every truncated normal's random bits are a program of their
  own), more than the rest of a test."""
  rng = np.random.default_rng(seed)

  def one(path, leaf):
    name = jax.tree_util.keystr(path[-1:])
    if "log_scale" in name:
      return np.full(leaf.shape, math.log(20.0), np.float32)
    base_value = 1.0 if "'scale'" in name else 0.0
    return (base_value + 0.1 * rng.normal(size=leaf.shape)).astype(np.float32)

  return jax.tree_util.tree_map_with_path(one, abstract)


def gradients(settings, sizes=None, devices=None, k=1, model=TINY, batch=None, rows=Q):
  """(loss, metrics, gradients) of train_step on `batch` over the mesh `sizes` with k chunks:
  train_step with SGD at rate 1, so the parameters move by minus the gradient."""
  cfg = train.TrainConfig(batch_size=rows, num_microbatches=k, warmup_steps=0,
                          num_train_steps=10)
  mesh = sharding.MeshConfig.from_dict({**base.get_config().mesh, **(sizes or {})})
  objective = contrastive_training.objective(settings)
  t = train.build(model, cfg, mesh, devices=devices, objective=objective)
  rng = jax.random.PRNGKey(0)
  before = random_params(t.abstract_state.params)
  tx = optax.sgd(1.0)
  params = jax.device_put(before, t.state_shardings.params)
  state = train.TrainState(step=jnp.zeros([], jnp.int32), params=params,
                           opt_state=tx.init(params))
  step = jax.jit(sharding.logical_context(t.mesh, t.rules)(functools.partial(
      train.train_step, model=t.model, tx=tx, schedule=lambda _: 1.0, num_microbatches=k,
      mesh=t.mesh, param_shardings=t.state_shardings.params, objective=objective)))
  state, metrics = step(state, t.to_global(make_batch() if batch is None else batch), rng)
  after, metrics = jax.device_get((state.params, metrics))
  return metrics, jax.tree.map(lambda b, a: b - a, before, after)


def assert_close(got, want, atol):
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=atol, err_msg=jax.tree_util.keystr(path))


# Tolerances: the sharded step adds the same float32 terms in another order (each device sums its
# rows' gradients, then the devices' sums are added), and the parameters' gradients are read as
# before - after an SGD step (an ulp of a weight near 1 is 6e-8): 1e-6 absolute, 1e-5 relative.
# InfoNCE, both directions, with a learned scale: the sigmoid loss shares its logits' layout.
SETTINGS = ContrastiveConfig(symmetric=True, learn_scale=True)


@pytest.fixture(scope="module")
def one_device():
  return gradients(SETTINGS, devices=jax.devices()[:1])


def test_global_negatives_on_8_devices_equal_one_device(one_device):
  """The batch's rows over data 2 x fsdp 4: each device's queries score every device's
  passages; the loss, the metrics and every gradient are the one device's."""
  want_metrics, want_grads = one_device
  metrics, grads = gradients(SETTINGS, {"ici_data": 2, "ici_fsdp": 4})
  assert_close(metrics, want_metrics, atol=1e-6)
  assert_close(grads, want_grads, atol=1e-6)
  assert float(np.abs(grads["log_scale"])) > 1e-4  # the learned scale has a gradient


def test_chunks_equal_one_batch(one_device):
  """4 chunks of 4 rows on a (data 2, fsdp 2) mesh, encoded twice (GradCache), equal the
  16-row batch on one device: loss, metrics and every gradient, the learned scale's included."""
  want_metrics, want_grads = one_device
  metrics, grads = gradients(SETTINGS, {"ici_data": 2, "ici_fsdp": 2}, jax.devices()[:4], k=4)
  assert_close(metrics, want_metrics, atol=1e-6)
  assert_close(grads, want_grads, atol=1e-6)


def test_chunks_with_dropout_differentiate_the_masks_they_drew():
  """With dropout, the re-encoding draws the first pass's masks (each chunk's key in both
  passes): the chunked gradient equals automatic differentiation through the chunks' encodings.
  A one-matrix encoder with bertjax's dropout at rate 0.5 stands for the model (what a chunk's
  encoder is, gradcache does not know; contrastive_training hands it the dropout key as here)."""
  rng = np.random.default_rng(4)
  params = {"w": jnp.asarray(rng.normal(size=(6, 4)), jnp.float32), "log_scale": jnp.float32(1.0)}
  x_KxNx6 = jnp.asarray(rng.normal(size=(2, 4, 6)), jnp.float32)
  chunks = {"query": x_KxNx6, "passage": x_KxNx6[..., ::-1]}
  keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.PRNGKey(5), i))(jnp.arange(2))

  def encode(p, chunk, key):
    q_key, p_key = jax.random.split(key)
    vec = lambda x, k: contrastive.l2_normalize(dropout.apply(jnp.tanh(x @ p["w"]), k, 0.5))
    return vec(chunk["query"], q_key), vec(chunk["passage"], p_key)[:, None]

  def loss(p, vectors):
    q_QxD, p_QxCxD = (v.reshape((-1,) + v.shape[2:]) for v in vectors)
    m = contrastive.info_nce(q_QxD, p_QxCxD, np.ones((8, 1, 1)), np.ones(8),
                             jnp.exp(p["log_scale"]), symmetric=True)
    return m["contrastive_loss"][0], m

  chunked = jax.jit(functools.partial(gradcache.chunked_value_and_grad, encode, loss))
  (value, _), grads = chunked(params, chunks, keys)

  def whole(p):
    vectors = [encode(p, jax.tree.map(lambda x, c=c: x[c], chunks), keys[c]) for c in range(2)]
    return loss(p, jax.tree.map(lambda *xs: jnp.stack(xs), *vectors))[0]

  want_value, want_grads = jax.jit(jax.value_and_grad(whole))(params)
  np.testing.assert_allclose(float(value), float(want_value), rtol=1e-6)
  assert_close(grads, want_grads, atol=1e-6)  # float32 sums of a few terms, in another order
  (other, _), _ = chunked(params, chunks, keys + 1)
  assert abs(float(other) - float(value)) > 1e-3  # dropout acted: other keys, another loss


def test_the_pooler_no_pooling_reads_is_kept_as_it_starts():
  """AdamW with weight decay: every weight the loss reads moves; the tanh pooler, which neither
  pooling reads, keeps its bits (decay alone would shrink it by lr x decay each step)."""
  cfg = train.TrainConfig(batch_size=Q, warmup_steps=0, num_train_steps=10, learning_rate=0.1,
                          weight_decay=0.1)
  mesh = sharding.MeshConfig.from_dict({**base.get_config().mesh, "ici_data": 1})
  t = train.build(TINY, cfg, mesh, devices=jax.devices()[:1],
                  objective=contrastive_training.objective(ContrastiveConfig()))
  before = random_params(t.abstract_state.params)
  params = jax.device_put(before, t.state_shardings.params)
  state = train.TrainState(step=jnp.zeros([], jnp.int32), params=params,
                           opt_state=t.optimizer.init(params))
  state, _ = t.train_step(state, t.to_global(make_batch()), jax.random.PRNGKey(0))
  after = jax.device_get(state.params)
  np.testing.assert_array_equal(after["bert"]["pooler"]["dense"]["kernel"],
                                before["bert"]["pooler"]["dense"]["kernel"])
  np.testing.assert_array_equal(after["bert"]["pooler"]["dense"]["bias"],
                                before["bert"]["pooler"]["dense"]["bias"])
  moved = after["bert"]["embeddings"]["word_embeddings"]["embedding"]
  assert np.abs(moved - before["bert"]["embeddings"]["word_embeddings"]["embedding"]).max() > 1e-3
