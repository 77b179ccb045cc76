"""A user's own linen model with BertModel inside: a pre-trained encoder loaded into its subtree,
its own head, trained (encoder frozen or not) under jax.jit on an 8-device mesh with shardings
from the logical rules, computing what one device computes (docs/using-the-modules.md, checked)."""

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

from bertjax.formats import converted
from bertjax.model.config import BertConfig
from bertjax.model.encoder import BertModel
from bertjax.model.heads import BertForPreTraining
from bertjax.parallel import sharding
from bertjax.weights.pretrained import load_pretrained

TINY = BertConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=4,
                  intermediate_size=64, max_position_embeddings=16)
rng = np.random.default_rng(0)
BATCH = {"input_ids": rng.integers(0, 64, (8, 8)).astype(np.int32),
         "input_mask": (np.arange(8)[None, :] < rng.integers(3, 9, (8, 1))).astype(np.int32),
         "labels": rng.integers(0, 3, (8,)).astype(np.int32)}


class Classifier(nn.Module):
  """The user's model: bertjax's encoder as the submodule "bert", their head on [CLS]."""

  config: BertConfig
  num_labels: int

  @nn.compact
  def __call__(self, input_ids, input_mask, deterministic=True):
    _, pooled = BertModel(self.config, name="bert")(input_ids, input_mask,
                                                    deterministic=deterministic)
    kernel_init = nn.with_logical_partitioning(nn.initializers.normal(0.02), ("embed", None))
    return nn.Dense(self.num_labels, kernel_init=kernel_init, name="head")(pooled)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  """A pre-trained encoder on disk, the mesh, and the model's parameters with it loaded."""
  folder = str(tmp_path_factory.mktemp("composition") / "pretrained")
  shapes = jax.eval_shape(lambda: nn.unbox(BertForPreTraining(TINY).init(
      jax.random.key(0), BATCH["input_ids"])["params"]))
  stored = jax.tree.map(lambda s: rng.normal(0, 0.05, s.shape).astype(s.dtype), shapes)
  converted.save_params(folder, stored, TINY)

  mesh = sharding.create_mesh(sharding.MeshConfig(ici_data=2, ici_fsdp=2, ici_tensor=2))
  config, encoder = load_pretrained(folder, mesh=mesh)
  model = Classifier(config, num_labels=3)
  init = sharding.logical_context()(
      lambda key: model.init(key, BATCH["input_ids"], BATCH["input_mask"])["params"])
  shardings = sharding.logical_shardings(jax.eval_shape(init, jax.random.key(1)), mesh,
                                         sharding.DEFAULT_RULES)
  params = jax.jit(lambda key: nn.unbox(init(key)), out_shardings=shardings)(jax.random.key(1))
  # The loaded subtree lies where the model's own parameters would: it drops in as it is.
  assert jax.tree.map(lambda x: x.sharding, encoder) == shardings["bert"]
  params["bert"] = encoder
  return mesh, model, params, stored["bert"]


def _loss(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


@pytest.mark.parametrize("freeze", [True, False], ids=["frozen", "trained"])
def test_train_with_the_encoder_frozen_or_trained(setup, freeze):
  mesh, model, params, stored = setup
  tx = optax.adamw(1e-3)
  if freeze:
    tx = optax.multi_transform({"train": tx, "frozen": optax.set_to_zero()},
                               {"bert": "frozen", "head": "train"})
  opt_state = tx.init(params)

  @jax.jit
  @sharding.logical_context(mesh)
  def step(params, opt_state, batch):
    def loss_fn(params):
      logits = model.apply({"params": params}, batch["input_ids"], batch["input_mask"])
      return _loss(logits, batch["labels"]), logits
    (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, logits

  batch = jax.device_put(BATCH, sharding.batch_sharding(mesh))
  new_params, _, logits = step(params, opt_state, batch)
  # The sharded forward pass computes what one device computes from the stored values.
  plain = {"params": {**jax.tree.map(np.asarray, params), "bert": stored}}
  np.testing.assert_allclose(logits, jax.jit(model.apply)(plain, BATCH["input_ids"],
                                                          BATCH["input_mask"]),
                             rtol=1e-5, atol=1e-6)
  changed = lambda a, b: not np.array_equal(np.asarray(a), np.asarray(b))
  assert changed(new_params["head"]["kernel"], params["head"]["kernel"])
  bert_changed = [changed(a, b) for a, b in zip(jax.tree.leaves(new_params["bert"]),
                                                jax.tree.leaves(stored))]
  if freeze:
    assert not any(bert_changed)  # bit for bit what the checkpoint holds
  else:
    assert all(bert_changed)
