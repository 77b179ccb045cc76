"""bertjax's encoder inside flax.nnx code: created with or without a mesh, names kept, and an NNX
classifier around it trains on an 8-device mesh exactly as the same model written in linen."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from bertjax.model.config import BertConfig
from bertjax.model.encoder import BertModel
from bertjax.model.heads import BertForPreTraining
from bertjax.model.nnx import to_nnx
from bertjax.parallel import sharding
from bertjax.training import optimizer

TINY = BertConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=4,
                  intermediate_size=64, max_position_embeddings=16)
rng = np.random.default_rng(0)
BATCH = {"input_ids": jnp.asarray(rng.integers(0, 64, (8, 8)), jnp.int32),
         "input_mask": jnp.asarray(np.arange(8)[None, :] < rng.integers(3, 9, (8, 1)), jnp.int32),
         "labels": jnp.asarray(rng.integers(0, 3, (8,)), jnp.int32)}


def _names(tree) -> dict:
  """path -> logical names, of linen boxes or of NNX variables' `out_sharding`."""
  is_leaf = lambda x: isinstance(x, (nn.meta.AxisMetadata, nnx.Variable))
  return {jax.tree_util.keystr(path):
          tuple(leaf.names if isinstance(leaf, nn.meta.AxisMetadata)
                else leaf.get_metadata("out_sharding"))
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]}


def test_without_a_mesh_the_encoder_is_created_with_its_names():
  # The bare bridge cannot create the annotated parameters without a mesh.
  with pytest.raises(ValueError, match="An auto mesh context or metadata is required"):
    nnx.bridge.ToNNX(BertModel(TINY), rngs=nnx.Rngs(0)).lazy_init(BATCH["input_ids"])
  # (Shapes only: creating them is the same code, traced, and the README creates them for real.)
  encoder = nnx.eval_shape(lambda: to_nnx(BertModel(TINY), BATCH["input_ids"],
                                          rngs=nnx.Rngs(0)))
  boxed = jax.eval_shape(lambda: BertModel(TINY).init(jax.random.key(0), BATCH["input_ids"]))
  assert _names(nnx.state(encoder, nnx.Param)) == _names(boxed["params"])
  table = encoder.embeddings["word_embeddings"]["embedding"]
  assert table.get_metadata("sharding_rules") == sharding.DEFAULT_RULES
  specs = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(encoder, nnx.Param)))
  assert specs["encoder"]["layer_0"]["mlp"]["intermediate"]["kernel"] == (
      jax.sharding.PartitionSpec("fsdp", "tensor"))  # mesh axes, the rules being in the metadata
  # The weight-decay mask reads the NNX state's paths as it reads linen's.
  mask = optimizer.default_decay_mask(nnx.state(encoder, nnx.Param))
  assert nnx.to_pure_dict(mask) == optimizer.default_decay_mask(nn.unbox(boxed["params"]))
  # The heads too: BertForPreTraining with its MLM head tied to the embeddings.
  positions = jnp.zeros((8, 2), jnp.int32)
  pretraining = nnx.eval_shape(lambda: to_nnx(BertForPreTraining(TINY), BATCH["input_ids"],
                                               masked_lm_positions=positions, rngs=nnx.Rngs(0)))
  assert _names(nnx.state(pretraining, nnx.Param)["mlm"]) == {
      "['output_bias']": ("vocab",), "['transform']['bias']": ("embed",),
      "['transform']['kernel']": (None, "embed"), "['transform_layer_norm']['bias']": ("embed",),
      "['transform_layer_norm']['scale']": ("embed",)}


class NnxClassifier(nnx.Module):
  """A user's NNX model: bertjax's encoder, then a linear head on the pooled [CLS]."""

  def __init__(self, config: BertConfig, num_labels: int, example_ids, *, rngs: nnx.Rngs):
    self.bert = to_nnx(BertModel(config), example_ids, rngs=rngs)
    # Its own layer named with the same logical names (placed by the rules in scope).
    self.head = nnx.Linear(config.hidden_size, num_labels, rngs=rngs,
                           kernel_metadata={"out_sharding": ("embed", None)})

  def __call__(self, input_ids, input_mask):
    _, pooled = self.bert(input_ids, input_mask)
    return self.head(pooled)


class LinenClassifier(nn.Module):
  """The same model in linen, for the reference path."""

  config: BertConfig
  num_labels: int

  @nn.compact
  def __call__(self, input_ids, input_mask):
    _, pooled = BertModel(self.config, name="bert")(input_ids, input_mask)
    kernel_init = nn.with_logical_partitioning(nn.linear.default_kernel_init, ("embed", None))
    return nn.Dense(self.num_labels, kernel_init=kernel_init, name="head")(pooled)


def _loss(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def test_an_nnx_classifier_trains_on_a_mesh_like_the_linen_path():
  mesh = sharding.create_mesh(sharding.MeshConfig(ici_data=2, ici_fsdp=2, ici_tensor=2))
  tx = optimizer.adamw(1e-3)  # bertjax's AdamW: its decay mask reads the NNX paths too

  @nnx.jit
  def create():
    model = NnxClassifier(TINY, 3, BATCH["input_ids"], rngs=nnx.Rngs(0))
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

  # Where NNX code sets the mesh (jax.set_mesh), logical_context sets it and the rules: the
  # model and optimizer state are created sharded, the head by its logical names too.
  with sharding.logical_context(mesh):
    model, opt = create()
  head = model.head.kernel[...]
  assert head.sharding.is_equivalent_to(
      jax.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp", None)), head.ndim)

  # The encoder's parameters lie where linen's logical shardings put them, names attached.
  abstract = jax.eval_shape(
      lambda: BertModel(TINY).init(jax.random.key(0), BATCH["input_ids"])["params"])
  want_shardings = sharding.logical_shardings(abstract, mesh, sharding.DEFAULT_RULES)
  bert_state = nnx.state(model.bert, nnx.Param)
  placed = nnx.to_pure_dict(bert_state)
  assert jax.tree.structure(placed) == jax.tree.structure(want_shardings)
  for x, want in zip(jax.tree.leaves(placed), jax.tree.leaves(want_shardings)):
    assert x.sharding.is_equivalent_to(want, x.ndim), (x.sharding, want)
  assert _names(bert_state) == _names(abstract)
  mu = opt.opt_state.mu["bert"]["encoder"]["layer_0"]["mlp"]["intermediate"]["kernel"]
  assert mu[...].sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")  # as the kernel

  @nnx.jit
  def nnx_step(model, opt, batch):
    def loss_fn(model):
      logits = model(batch["input_ids"], batch["input_mask"])
      return _loss(logits, batch["labels"]), logits
    (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    opt.update(model, grads)
    return loss, logits, grads

  linen = LinenClassifier(TINY, 3)

  @jax.jit
  @sharding.logical_context(mesh)
  def linen_step(params, opt_state, batch):
    def loss_fn(params):
      logits = linen.apply({"params": params}, batch["input_ids"], batch["input_mask"])
      return _loss(logits, batch["labels"]), logits
    (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, logits, grads

  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))  # the same parameters, as linen's tree
  opt_state = jax.jit(tx.init)(params)  # on the mesh, as the step returns it (no recompile)
  # Both steps keep the encoder's activation constraints, batch over data x fsdp (forward and
  # backward: 2 x (the embeddings + 3 per layer)); the bridge adds its own on the parameters.
  batch_split = re.compile(r'sdy\.sharding_constraint [^<]*<@mesh, \[\{"data", "fsdp"\}')
  activations = 2 * (1 + 3 * TINY.num_layers)
  with jax.set_mesh(mesh):  # the mesh alone: the bridged encoder brings its rules
    assert len(batch_split.findall(nnx_step.lower(model, opt, BATCH).as_text())) == activations
  assert len(batch_split.findall(linen_step.lower(params, opt_state, BATCH).as_text())) == (
      activations)

  close = dict(rtol=1e-5, atol=1e-6)
  losses = []
  for i in range(3):
    with jax.set_mesh(mesh):
      nnx_loss, nnx_logits, nnx_grads = nnx_step(model, opt, BATCH)
    params, opt_state, linen_loss, linen_logits, linen_grads = linen_step(
        params, opt_state, BATCH)
    np.testing.assert_allclose(nnx_logits, linen_logits, **close)
    np.testing.assert_allclose(nnx_loss, linen_loss, **close)
    if i == 0:  # the same gradients, then (every step) the same updated parameters
      jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **close),
                   nnx.to_pure_dict(nnx_grads), linen_grads)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **close),
                 nnx.to_pure_dict(nnx.state(model, nnx.Param)), params)
    losses.append(float(nnx_loss))
  assert losses[-1] < losses[0]
