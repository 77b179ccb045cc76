"""Heads (no full-vocabulary tensor in pre-training, fine-tuning shapes) and losses."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from bertjax.model import heads, losses
from bertjax.model.config import BertConfig
from bertjax.model.heads import (BertForPreTraining, BertForSequenceClassification, tied_decoder,
                                 BertForSpanExtraction, BertForTokenClassification, decoded_scores,
                                 kept_scores)

CFG = BertConfig(vocab_size=97, hidden_size=32, num_layers=1, num_heads=4, intermediate_size=64,
                 max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0)


def _shapes_in_jaxpr(jaxpr):
  """Shapes of every value a jaxpr computes, sub-jaxprs (scan, remat, pjit) included."""
  shapes = set()
  for eqn in jaxpr.eqns:
    shapes |= {tuple(getattr(v.aval, "shape", ())) for v in eqn.outvars}
    for value in eqn.params.values():
      for inner in (value if isinstance(value, (tuple, list)) else (value,)):
        inner = getattr(inner, "jaxpr", inner)
        if hasattr(inner, "eqns"):
          shapes |= _shapes_in_jaxpr(inner)
  return shapes


def test_pretraining_never_builds_full_vocabulary_logits():
  batch, length, masked = 3, 24, 4
  ids = jnp.ones((batch, length), jnp.int32)
  positions = jnp.zeros((batch, masked), jnp.int32)
  model = BertForPreTraining(CFG)
  params = model.init(jax.random.key(0), ids, masked_lm_positions=positions)["params"]
  jaxpr = jax.make_jaxpr(lambda p: model.apply({"params": p}, ids, None, None, positions))(params)
  shapes = _shapes_in_jaxpr(jaxpr.jaxpr)
  assert (batch, masked, CFG.vocab_size) in shapes
  assert not any(len(s) >= 2 and s[-1] == CFG.vocab_size and length in s for s in shapes), shapes
  # Without positions every position is projected: the same numbers at the masked positions.
  full_logits, _ = model.apply({"params": params}, ids)
  assert full_logits.shape == (batch, length, CFG.vocab_size)


def test_masked_logits_are_the_full_logits_at_the_masked_positions():
  rng = np.random.default_rng(0)
  ids = rng.integers(0, 97, (2, 16)).astype(np.int32)
  positions = np.array([[0, 3, 15], [7, 7, 2]], np.int32)
  model = BertForPreTraining(CFG)
  params = model.init(jax.random.key(1), ids, masked_lm_positions=positions)["params"]
  masked, nsp = model.apply({"params": params}, ids, None, None, positions)
  full, nsp_full = model.apply({"params": params}, ids)
  np.testing.assert_allclose(masked, np.take_along_axis(np.asarray(full), positions[..., None], 1),
                             atol=1e-5)
  np.testing.assert_allclose(nsp, nsp_full)
  # The decoder is tied: no second [V, D] matrix among the parameters.
  sizes = [x.size for x in jax.tree_util.tree_leaves(params)]
  assert sizes.count(CFG.vocab_size * CFG.hidden_size) == 1


def test_fine_tuning_heads():
  ids = jnp.ones((2, 12), jnp.int32)
  for module, shape in ((BertForSequenceClassification(CFG, 3), [(2, 3)]),
                        (BertForTokenClassification(CFG, 5), [(2, 12, 5)]),
                        (BertForSpanExtraction(CFG), [(2, 12), (2, 12)])):
    variables = module.init(jax.random.key(0), ids)
    out = module.apply(variables, ids)
    out = out if isinstance(out, tuple) else (out,)
    assert [o.shape for o in out] == shape
    assert all(o.dtype == jnp.float32 for o in out)
    assert "bert" in variables["params"]


def _reference_ce(logits, labels, weights):
  logits = np.asarray(logits, np.float64)
  logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
      - logits.max(-1, keepdims=True)
  nll = -np.take_along_axis(logp, labels[..., None], -1)[..., 0]
  return (nll * weights).sum(), weights.sum()


def test_mlm_loss_and_accuracy_against_numpy():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(4, 5, 11)).astype(np.float32) * 3
  labels = rng.integers(0, 11, (4, 5)).astype(np.int32)
  weights = (rng.random((4, 5)) > 0.3).astype(np.float32)
  total, den = losses.mlm_loss(logits, labels, weights)
  ref_total, ref_den = _reference_ce(logits, labels, weights)
  np.testing.assert_allclose(total, ref_total, rtol=1e-5)
  assert float(den) == ref_den
  correct, den = losses.mlm_accuracy(logits, labels, weights)
  assert float(correct) == float(((logits.argmax(-1) == labels) * weights).sum())
  # Padding predictions (weight 0) never count, whatever their labels.
  labels_b = labels.copy()
  labels_b[weights == 0] = 3
  np.testing.assert_allclose(losses.mlm_loss(logits, labels_b, weights)[0], total, rtol=1e-6)


def test_the_loss_gradient_is_softmax_minus_one_hot():
  """The label logit is a gather with a written one-hot backward pass (losses._picked): the
  gradient of the weighted cross-entropy over the logits must be w * (softmax - one_hot)."""
  rng = np.random.default_rng(1)
  logits = rng.normal(size=(3, 4, 13)).astype(np.float32) * 2
  labels = rng.integers(0, 13, (3, 4)).astype(np.int32)
  weights = (rng.random((3, 4)) > 0.3).astype(np.float32)
  grad = jax.grad(lambda lg: losses.mlm_loss(lg, labels, weights)[0])(jnp.asarray(logits))
  softmax = np.exp(logits - logits.max(-1, keepdims=True))
  softmax /= softmax.sum(-1, keepdims=True)
  one_hot = np.eye(13, dtype=np.float32)[labels]
  np.testing.assert_allclose(grad, weights[..., None] * (softmax - one_hot), atol=1e-6)


def test_the_label_logit_of_logits_split_over_the_vocabulary_needs_no_gather_of_them():
  """losses._picked gathers the label's logit: over a vocabulary split between devices XLA must
  pick within each slice (no all-gather of the logits), and loss and gradient stay the same."""
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "tensor"))
  logits = jax.random.normal(jax.random.PRNGKey(0), (8, 5, 512))
  labels = jax.random.randint(jax.random.PRNGKey(1), (8, 5), 0, 512)
  weights = jnp.ones((8, 5))
  fn = jax.jit(jax.value_and_grad(lambda lg: losses.mlm_loss(lg, labels, weights)[0]))
  split = jax.device_put(logits, NamedSharding(mesh, P("data", None, "tensor")))
  assert "all-gather" not in fn.lower(split).compile().as_text()
  for got, want in zip(fn(split), fn(logits)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_nsp_metrics_and_total_loss():
  logits = np.array([[2.0, -1.0], [0.0, 1.0], [0.5, 0.5]], np.float32)
  labels = np.array([0, 0, 1], np.int32)
  total, den = losses.nsp_loss(logits, labels)
  np.testing.assert_allclose(total, _reference_ce(logits, labels, np.ones(3))[0], rtol=1e-6)
  assert float(den) == 3
  # the first row right, the second wrong, the third an exact tie (counted right)
  assert float(losses.nsp_accuracy(logits, labels)[0]) == 2.0
  batch = {"masked_lm_ids": np.zeros((3, 1), np.int32),
           "masked_lm_weights": np.ones((3, 1), np.float32), "next_sentence_labels": labels}
  metrics = losses.pretraining_metrics(np.zeros((3, 1, 4), np.float32), logits, batch)
  expected = np.log(4) + float(total) / 3
  np.testing.assert_allclose(losses.total_loss(metrics), expected, rtol=1e-4)
  # A batch without a single real prediction stays finite.
  batch["masked_lm_weights"] = np.zeros((3, 1), np.float32)
  metrics = losses.pretraining_metrics(np.zeros((3, 1, 4), np.float32), logits, batch)
  assert np.isfinite(losses.total_loss(metrics))


def test_losses_are_float32_for_bfloat16_logits():
  logits = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3, 7)), jnp.bfloat16)
  total, den = losses.mlm_loss(logits, jnp.zeros((2, 3), jnp.int32), jnp.ones((2, 3)))
  assert total.dtype == jnp.float32 and den.dtype == jnp.float32
  ref = _reference_ce(np.asarray(logits.astype(jnp.float32)), np.zeros((2, 3), np.int64),
                      np.ones((2, 3)))[0]
  np.testing.assert_allclose(total, ref, rtol=1e-5)


@pytest.mark.parametrize("spec", [P(None, None, "tensor"), P("data", None, "tensor")])
def test_losses_with_vocabulary_sharded_logits(spec):
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "tensor"))
  rng = np.random.default_rng(1)
  logits = rng.normal(size=(4, 6, 64)).astype(np.float32)
  labels = rng.integers(0, 64, (4, 6)).astype(np.int32)
  weights = (rng.random((4, 6)) > 0.2).astype(np.float32)
  sharded = jax.device_put(logits, NamedSharding(mesh, spec))
  assert sharded.addressable_shards[0].data.shape[-1] == 16
  fn = jax.jit(lambda lg, lb, w: (losses.mlm_loss(lg, lb, w), losses.mlm_accuracy(lg, lb, w)))
  got = fn(sharded, labels, weights)
  want = fn(logits, labels, weights)
  jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), got, want)
  np.testing.assert_allclose(got[0][0], _reference_ce(logits, labels, weights)[0], rtol=1e-5)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_the_tied_decoder_s_written_gradient_is_the_automatic_one(dtype, tol):
  """`tied_decoder` writes its backward pass out (for the layout of the logits' gradient): the
  input's, the table's and the bias's gradients must be those of differentiating the plain
  product, in float32 and with bfloat16 compute."""
  k = jax.random.split(jax.random.PRNGKey(3), 4)
  x, w = jax.random.normal(k[0], (3, 5, 16)), jax.random.normal(k[1], (50, 16)) * 0.3
  bias, g = jax.random.normal(k[2], (50,)), jax.random.normal(k[3], (3, 5, 50))

  def plain(x, w, b):
    return jnp.einsum("bmd,vd->bmv", x.astype(dtype), w.astype(dtype),
                      preferred_element_type=jnp.float32) + b.astype(jnp.float32)

  def cotangent(fn):
    out, vjp = jax.vjp(fn, x, w, bias)
    return (out,) + vjp(g)

  written = cotangent(lambda x, w, b: tied_decoder(x, w, b, dtype))
  automatic = cotangent(plain)
  for name, a, b in zip(("logits", "dx", "dw", "dbias"), written, automatic):
    assert a.shape == b.shape and a.dtype == b.dtype, name
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=tol,
                               atol=tol * float(jnp.max(jnp.abs(b))), err_msg=name)


@pytest.mark.parametrize("scorer", [decoded_scores, kept_scores])
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_scores_made_with_the_logits_are_the_loss_s_and_its_gradient(dtype, tol, scorer):
  """`decoded_scores` (recompute_mlm_logits) scores the logits where it makes them and remakes
  them in the backward; `kept_scores` (on a TPU where they are kept) keeps them for a backward
  of its own: the loss, the accuracy and every gradient are those of the logits path
  (tied_decoder, then the losses); bfloat16 rounds the logits' gradient once more."""
  k = jax.random.split(jax.random.PRNGKey(5), 5)
  x, w = jax.random.normal(k[0], (3, 5, 16)), jax.random.normal(k[1], (50, 16)) * 0.3
  bias = jax.random.normal(k[2], (50,))
  # Half the labels the largest logit's: an accuracy neither 0 nor 1.
  best = jnp.argmax(jnp.einsum("bmd,vd->bmv", x, w) + bias, axis=-1)
  labels = jnp.where(jnp.arange(5) % 2 == 0, best, jax.random.randint(k[3], (3, 5), 0, 50))
  weights = (jax.random.uniform(k[4], (3, 5)) > 0.3).astype(jnp.float32)

  def scored(head):
    def loss(x, w, b):
      out = head(x, w, b)
      nll, acc = losses.mlm_loss(out, labels, weights), losses.mlm_accuracy(out, labels, weights)
      return nll[0] / nll[1], acc
    (value, acc), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(x, w, bias)
    return (value, acc[0]) + grads

  fused = scored(lambda x, w, b: scorer(x, w, b, labels, dtype))
  logits = scored(lambda x, w, b: tied_decoder(x, w, b, dtype))
  for name, a, b in zip(("loss", "accuracy", "dx", "dw", "dbias"), fused, logits):
    assert a.shape == b.shape and a.dtype == b.dtype, name
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=tol,
                               atol=tol * float(jnp.max(jnp.abs(b))), err_msg=name)
  assert 0 < float(fused[1]) < float(jnp.sum(weights))  # some right, some wrong


def test_the_model_scores_in_its_head_when_its_config_says_so(monkeypatch):
  batch, length, masked = 2, 16, 3
  ids = jax.random.randint(jax.random.PRNGKey(0), (batch, length), 0, CFG.vocab_size)
  positions = jnp.tile(jnp.arange(masked), (batch, 1))
  labels = ids[:, :masked]
  model = BertForPreTraining(CFG)
  params = model.init(jax.random.key(0), ids, masked_lm_positions=positions)["params"]
  logits, _ = model.apply({"params": params}, ids, masked_lm_positions=positions,
                          masked_lm_ids=labels)  # the default keeps its logits
  assert logits.shape == (batch, masked, CFG.vocab_size)
  fused = BertForPreTraining(dataclasses.replace(CFG, recompute_mlm_logits=True))
  scores, _ = fused.apply({"params": params}, ids, masked_lm_positions=positions,
                          masked_lm_ids=labels)
  assert isinstance(scores, losses.MlmScores)
  np.testing.assert_allclose(losses.mlm_loss(scores, labels, None)[0],
                             losses.mlm_loss(logits, labels, None)[0], rtol=1e-6)
  # A TPU's step scores them where it keeps them too (kept_scores).
  monkeypatch.setattr(heads.platforms, "tpu_chip", lambda: "TPU_V6E")
  kept, _ = model.apply({"params": params}, ids, masked_lm_positions=positions,
                        masked_lm_ids=labels)
  assert isinstance(kept, losses.MlmScores)
  np.testing.assert_allclose(losses.mlm_loss(kept, labels, None)[0],
                             losses.mlm_loss(logits, labels, None)[0], rtol=1e-6)


def test_accuracy_counts_the_label_s_logit_being_the_largest():
  logits = jnp.array([[[0.1, 2.0, -1.0], [3.0, 3.0, 0.0], [0.0, -1.0, -2.0]]])
  labels = jnp.array([[1, 1, 2]])
  # right; a tie with the largest (counted right); wrong.
  correct, count = losses.weighted_accuracy(logits, labels, jnp.array([[1.0, 1.0, 0.5]]))
  assert (float(correct), float(count)) == (2.0, 2.5)
