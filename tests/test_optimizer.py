"""AdamW and LAMB against their formulas written out in numpy; the mask; the schedule; clipping."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from bertjax.training import optimizer
from bertjax.training.train import TrainConfig

B1, B2, EPS, WD, LR = 0.9, 0.999, 1e-6, 0.01, 0.1


def small_tree(seed=0):
  """Names as bertjax's model makes them, plus a scanned (stacked) kernel and an HF LayerNorm."""
  rng = np.random.default_rng(seed)
  shapes = {
      "embeddings": {"word_embeddings": {"embedding": (5, 4)},
                     "layer_norm": {"scale": (4,), "bias": (4,)}},
      "dense": {"kernel": (4, 3), "bias": (3,)},
      "encoder": {"layers": {"layer": {"mlp": {"kernel": (2, 4, 3), "bias": (2, 3)}}}},
      "mlm": {"output_bias": (5,)},
      "LayerNorm": {"scale": (4,)},
  }
  return jax.tree.map(lambda s: rng.normal(size=s).astype(np.float32), shapes,
                      is_leaf=lambda x: isinstance(x, tuple))


# The expected decay mask of small_tree: kernels and embeddings decay, norms and biases do not.
EXPECTED_DECAY = {
    "embeddings": {"word_embeddings": {"embedding": True},
                   "layer_norm": {"scale": False, "bias": False}},
    "dense": {"kernel": True, "bias": False},
    "encoder": {"layers": {"layer": {"mlp": {"kernel": True, "bias": False}}}},
    "mlm": {"output_bias": False},
    "LayerNorm": {"scale": False},
}


def test_default_masks():
  params = small_tree()
  assert optimizer.default_decay_mask(params) == EXPECTED_DECAY
  stacked = optimizer.default_stacked_mask(params)
  assert stacked["encoder"]["layers"]["layer"]["mlp"]["kernel"] is True
  assert stacked["dense"]["kernel"] is False


def _reference(params, grads_seq, lamb: bool, bias_correction=False):
  """The update rules of the module docstring, leaf by leaf in float64 numpy."""
  flat_p, treedef = jax.tree.flatten(params)
  flat_decay = jax.tree.leaves(EXPECTED_DECAY)
  flat_stacked = jax.tree.leaves(optimizer.default_stacked_mask(params))
  w = [np.asarray(p, np.float64) for p in flat_p]
  m = [np.zeros_like(x) for x in w]
  v = [np.zeros_like(x) for x in w]
  for t, grads in enumerate(grads_seq, start=1):
    for i, g in enumerate(jax.tree.leaves(grads)):
      g = np.asarray(g, np.float64)
      m[i] = B1 * m[i] + (1 - B1) * g
      v[i] = B2 * v[i] + (1 - B2) * g * g
      mh, vh = (m[i] / (1 - B1**t), v[i] / (1 - B2**t)) if bias_correction else (m[i], v[i])
      u = mh / (np.sqrt(vh) + EPS)
      if flat_decay[i]:
        u = u + WD * w[i]
      if lamb and flat_decay[i]:
        slices = [(j,) for j in range(w[i].shape[0])] if flat_stacked[i] else [()]
        for s in slices:
          wn, un = np.linalg.norm(w[i][s]), np.linalg.norm(u[s])
          u[s] = u[s] * (wn / un if wn > 0 and un > 0 else 1.0)
      w[i] = w[i] - LR * u
  return jax.tree.unflatten(treedef, w)


def _run(tx, params, grads_seq):
  state = tx.init(params)
  for grads in grads_seq:
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
  return params


@pytest.mark.parametrize("kind,bias_correction", [("adamw", False), ("lamb", False),
                                                  ("adamw", True)])
def test_matches_formula(kind, bias_correction):
  params = small_tree(0)
  grads_seq = [small_tree(s) for s in (1, 2, 3)]
  make = {"adamw": optimizer.adamw, "lamb": optimizer.lamb}[kind]
  tx = make(LR, b1=B1, b2=B2, eps=EPS, weight_decay=WD, bias_correction=bias_correction)
  got = jax.jit(lambda p: _run(tx, p, grads_seq))(params)
  want = _reference(params, grads_seq, lamb=kind == "lamb", bias_correction=bias_correction)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


@functools.lru_cache(maxsize=None)
def _model_params_and_grads():
  """A tiny BertForPreTraining's parameters and the gradients of its loss on a random batch
  (built once, for the two tests that read them; the gradient is one compiled program, not
  hundreds of operations dispatched one by one)."""
  import flax.linen as nn
  from bertjax.model import losses
  from bertjax.model.config import BertConfig
  from bertjax.model.heads import BertForPreTraining
  from bertjax.training import train
  cfg = BertConfig(vocab_size=48, hidden_size=16, num_layers=2, num_heads=2,
                   intermediate_size=32, max_position_embeddings=16)
  model = BertForPreTraining(cfg)
  rng = np.random.default_rng(0)
  batch = train.dummy_batch(4, 12, 3)
  batch.update(input_ids=rng.integers(1, 48, (4, 12)).astype(np.int32),
               input_mask=np.ones((4, 12), np.int32),
               masked_lm_positions=rng.integers(1, 12, (4, 3)).astype(np.int32),
               masked_lm_ids=rng.integers(1, 48, (4, 3)).astype(np.int32),
               masked_lm_weights=np.ones((4, 3), np.float32),
               next_sentence_labels=rng.integers(0, 2, 4).astype(np.int32))
  boxed = jax.jit(model.init)(jax.random.key(0), **train.model_inputs(batch))["params"]
  params = nn.unbox(boxed)

  def loss(p):
    mlm, nsp = model.apply({"params": p}, **train.model_inputs(batch), deterministic=False,
                           rngs={"dropout": jax.random.key(1)})
    return losses.total_loss(losses.pretraining_metrics(mlm, nsp, batch))

  return boxed, params, jax.jit(jax.grad(loss))(params)


def test_one_adamw_step_on_real_gradients_is_the_originals():
  # google-research/bert AdamWeightDecayOptimizer, written out independently in float64: no bias
  # correction, eps 1e-6 added to sqrt(v), decay 0.01 on every parameter whose name does not
  # match the original's exclusion regex.
  import re
  _, params, grads = _model_params_and_grads()
  lr = 1e-3
  tx = optimizer.adamw(lr)  # the defaults are the original's
  updates, _ = jax.jit(lambda g, p: tx.update(g, tx.init(p), p))(grads, params)
  got = optax.apply_updates(params, updates)
  small = 0
  for (path, w), g, new in zip(jax.tree_util.tree_leaves_with_path(params),
                               jax.tree.leaves(grads), jax.tree.leaves(got)):
    name = "/".join(k.key for k in path)
    w, g = np.asarray(w, np.float64), np.asarray(g, np.float64)
    m = (1 - 0.9) * g
    v = (1 - 0.999) * g * g
    update = m / (np.sqrt(v) + 1e-6)
    if not re.search(r"layer_?norm|bias", name, re.IGNORECASE):
      update = update + 0.01 * w
    np.testing.assert_allclose(new, w - lr * update, rtol=1e-6, atol=1e-9, err_msg=name)
    small += int(np.sum((np.sqrt(v) < 1e-5) & (g != 0)))
  # Real gradients include some small enough for eps to matter (a sign-only check misses eps).
  assert small > 0


def test_the_decay_mask_sees_through_boxed_parameters():
  # Module.init returns nn.Partitioned boxes, whose paths end in `.value`: a bias must still be
  # recognised as a bias.
  boxed, params, _ = _model_params_and_grads()
  import flax.linen as nn
  assert any(isinstance(x, nn.Partitioned) for x in jax.tree.leaves(
      boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned)))
  want = optimizer.default_decay_mask(params)
  assert not want["mlm"]["output_bias"] and want["mlm"]["transform"]["kernel"]
  assert nn.unbox(optimizer.default_decay_mask(boxed)) == want
  assert (nn.unbox(optimizer.default_stacked_mask(boxed))
          == optimizer.default_stacked_mask(params))
  # AdamW on the boxed tree (as `init` returns it) updates like on the plain one.
  tx = optimizer.adamw(1e-3)
  grads = jax.tree.map(jnp.ones_like, params)
  update = jax.jit(lambda g, p: tx.update(g, tx.init(p), p))  # one program per tree structure
  plain, _ = update(grads, params)
  boxed_grads = jax.tree.map(lambda b, g: b.replace_boxed(g), boxed, grads,
                             is_leaf=lambda x: isinstance(x, nn.Partitioned))
  on_boxes, _ = update(boxed_grads, boxed)
  for a, b in zip(jax.tree.leaves(nn.unbox(on_boxes)), jax.tree.leaves(plain)):
    np.testing.assert_array_equal(a, b)


def test_schedule_is_the_originals():
  s = optimizer.learning_rate_schedule(1e-4, warmup_steps=10, total_steps=100)
  np.testing.assert_allclose(
      [float(s(i)) for i in (0, 5, 9, 10, 50, 100, 150)],
      [0.0, 5e-5, 9e-5, 1e-4 * 0.9, 5e-5, 0.0, 0.0], rtol=1e-6, atol=1e-12)
  no_warmup = optimizer.learning_rate_schedule(1.0, 0, 4)
  assert [float(no_warmup(i)) for i in range(5)] == [1.0, 0.75, 0.5, 0.25, 0.0]
  with pytest.raises(ValueError, match="warmup_steps"):
    optimizer.learning_rate_schedule(1.0, 10, 5)


def test_schedule_gives_the_same_bits_from_python_and_traced_numbers():
  """A run alone has its rate, warmup and length as Python numbers; a search's trials have them
  traced, sliced per trial inside one program (bertjax/finetune/job/trials.py), where XLA folds what
  every trial shares (here the warmup and length) and not what differs (the rate). The rates must
  be the same bits at every step: 1 ulp at one warmup step of 1e-3 grew into other dev scores
  after 4 epochs of the routing example (docs/finetuning.md#settings-chosen-on-dev)."""
  rates, warmup, total = (1e-3, 3e-4, 1e-4, 3e-5), 15, 150
  steps = np.arange(total + 2, dtype=np.int32)
  alone = np.stack([jax.jit(jax.vmap(optimizer.learning_rate_schedule(r, warmup, total)))(steps)
                    for r in rates], axis=1)
  hp = (np.array(rates, np.float32), np.full(len(rates), warmup, np.float32),
        np.full(len(rates), total, np.int32))
  trials = jax.jit(jax.vmap(lambda c: jax.lax.map(
      lambda h: optimizer.learning_rate_schedule(*h)(c), hp)))(steps)
  np.testing.assert_array_equal(np.asarray(trials).view(np.int32), alone.view(np.int32))
  assert alone[3, 0] == pytest.approx(2e-4, rel=1e-6) and alone[total - 1, 0] > 0
  assert not np.any(alone[total:])  # 0 from the end on (150 x 1/150 rounds above 1)


def test_chain_clips_global_norm_before_the_optimizer():
  cfg = TrainConfig(learning_rate=LR, warmup_steps=0, num_train_steps=10, max_grad_norm=1.0,
                    weight_decay=WD)
  tx, _ = optimizer.create_optimizer(cfg)
  params = small_tree(0)
  grads = jax.tree.map(lambda g: 10.0 * g, small_tree(1))
  norm = float(optax.tree.norm(grads))
  assert norm > 1.0
  got = jax.jit(lambda p, g: _run(tx, p, [g]))(params, grads)
  clipped = jax.tree.map(lambda g: g / norm, grads)
  adamw = optimizer.adamw(LR, weight_decay=WD)
  want = jax.jit(lambda p, g: _run(adamw, p, [g]))(params, clipped)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_unknown_optimizer_is_named():
  with pytest.raises(ValueError, match="'sgd'"):
    TrainConfig(optimizer="sgd")


def test_masks_on_the_real_scanned_model():
  # LAMB's per-layer trust ratio must see the scanned encoder's leading [num_layers] axis.
  import flax.linen as nn
  from bertjax.model.config import BertConfig
  from bertjax.model.heads import BertForPreTraining
  from bertjax.training import train
  cfg = BertConfig(vocab_size=32, hidden_size=16, num_layers=3, num_heads=2,
                   intermediate_size=32, scan_layers=True)
  model = BertForPreTraining(cfg)
  params = nn.unbox(jax.eval_shape(
      lambda: model.init(jax.random.PRNGKey(0), **train.model_inputs(train.dummy_batch(1)))))
  params = params["params"]
  stacked = optimizer.default_stacked_mask(params)
  decay = optimizer.default_decay_mask(params)
  layer = params["bert"]["encoder"]["layers"]["layer"]
  assert layer["mlp"]["output"]["kernel"].shape[0] == 3
  assert all(jax.tree.leaves(stacked["bert"]["encoder"]))
  assert not any(jax.tree.leaves(stacked["bert"]["embeddings"]) + jax.tree.leaves(stacked["mlm"]))
  enc = decay["bert"]["encoder"]["layers"]["layer"]
  assert enc["mlp"]["output"]["kernel"] and not enc["mlp"]["output"]["bias"]
  assert not any(jax.tree.leaves(enc["attention_layer_norm"]))
  assert decay["bert"]["embeddings"]["word_embeddings"]["embedding"]
  assert not decay["mlm"]["output_bias"]


def test_warmup_stable_decay_schedule_shape():
  """Linear warmup, the peak held, then peak * (1 - sqrt(progress)) to 0 over decay_steps."""
  lr = optimizer.wsd_schedule(2.0, warmup_steps=10, decay_steps=40, total_steps=100)
  at = lambda step: float(lr(step))
  assert at(0) == 0.0 and at(5) == pytest.approx(1.0) and at(10) == pytest.approx(2.0)
  assert all(at(s) == pytest.approx(2.0) for s in (11, 35, 60))  # stable until the decay
  assert at(70) == pytest.approx(2.0 * (1 - np.sqrt(0.25)))  # 1-sqrt, not linear (1.5)
  assert at(100) == 0.0 and at(150) == 0.0
  values = [at(s) for s in range(10, 101)]
  assert all(a >= b for a, b in zip(values, values[1:]))
  with pytest.raises(ValueError, match="decay_steps"):
    TrainConfig(num_train_steps=100, warmup_steps=10, schedule="wsd", decay_steps=95)
  _, schedule = optimizer.create_optimizer(
      TrainConfig(num_train_steps=100, warmup_steps=10, schedule="wsd", decay_steps=40,
                        learning_rate=2.0))
  assert float(schedule(70)) == pytest.approx(1.0)
