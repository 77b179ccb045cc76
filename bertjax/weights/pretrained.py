"""A pre-trained encoder for your own model, without TensorFlow: `load_pretrained(path)`.

`path` is any folder the one reader of weights takes (bertjax/weights/reader.py): a bertjax run's workdir
(pre-training or fine-tuning) or its `checkpoints/` folder (the newest checkpoint's encoder, its
shape from the model record saved beside it), a folder written by `python -m bertjax.convert.hf
import` or `convert.google import`, a folder of Google's release, or a Hugging Face BERT folder.

It returns `(config, params)`: the `BertConfig` and the encoder's parameters, the `bert` subtree of
bertjax's models (what `BertModel(config).init(...)["params"]` holds), to put into a model of yours
under the name of its `BertModel` submodule. The arrays are

  - plain, on one device (default);
  - `boxed=True`: in `nn.LogicallyPartitioned` boxes with the model's logical axis names, as
    `Module.init` returns them (so they pass where init's output does);
  - `mesh=...`: sharded on the mesh as `rules` (default `sharding.DEFAULT_RULES`) map those names,
    each read from the checkpoint directly into its shards.

`scan_layers` (default: as stored) restacks the layers: unrolled `encoder/layer_N` or one scanned
`encoder/layers/layer` with a leading [num_layers] axis; the config returned says which. The config
is the source's, dropout and dtypes included: `dataclasses.replace` those for your training.

A fine-tuned model's folder (a workdir, or transformers' BertFor... and ModernBertFor... classes)
gives its encoder too; a warning says which head is left out, and that a class which built no
pooler (token classification, question answering) gets a new one, as transformers starts it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from absl import logging

from bertjax.model.config import BertConfig
from bertjax.model.encoder import BertModel, Pooler
from bertjax.parallel import sharding
from bertjax.weights import reader as weights, match as weights_match

ENCODER = weights.ENCODER  # the encoder's name inside BertForPreTraining and every head


def _is_box(x) -> bool:
  return isinstance(x, nn.meta.AxisMetadata)


def abstract_encoder(config: BertConfig, rules: sharding.Rules | None = None) -> Any:
  """The encoder's parameters as boxed ShapeDtypeStructs (shapes, dtypes, logical names)."""
  model = BertModel(config)
  ids = jnp.zeros((1, 1), jnp.int32)
  init = sharding.logical_context(None, rules)(
      lambda rng: model.init({"params": rng}, ids)["params"])
  return jax.eval_shape(init, jax.random.key(0))


def _placements(config: BertConfig, mesh, rules) -> Any:
  """Where each encoder parameter goes: its logical sharding on `mesh`, or one local device."""
  boxed = abstract_encoder(config, rules)
  if mesh is not None:
    return sharding.logical_shardings(boxed, mesh, rules)
  one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  return jax.tree.map(lambda _: one, nn.unbox(boxed))


def _target(config: BertConfig, placements, rules) -> Any:
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      nn.unbox(abstract_encoder(config, rules)), placements)


def load_pretrained(path: str, *, scan_layers: bool | None = None,
                    mesh: jax.sharding.Mesh | None = None, rules: sharding.Rules | None = None,
                    boxed: bool = False) -> tuple[BertConfig, Any]:
  """(config, encoder parameters) of any folder bertjax/weights/reader.py reads.

  See the module docstring for the forms of the result.
  """
  if mesh is not None:
    sharding.check_auto_axes(mesh, "load_pretrained's mesh")
  rules = sharding.DEFAULT_RULES if rules is None else sharding.rules_from_config(rules)
  source = weights.inspect(path)
  config = source.config if scan_layers is None else dataclasses.replace(
      source.config, scan_layers=bool(scan_layers))
  target = _target(config, _placements(config, mesh, rules), rules)
  fresh = None
  if "pooler" in source.lacks and config.pooler:
    fresh = {ENCODER: {"pooler": _new_pooler(config, rules)}}
  encoder = weights.read(source, like={ENCODER: target}, fresh=fresh)[ENCODER]
  said = weights_match.unread(source, (ENCODER,))
  if said:
    logging.warning("load_pretrained(%s): the encoder; %s", path, said)
  return config, _boxed(encoder, config, rules) if boxed else encoder


def _new_pooler(config: BertConfig, rules) -> Any:
  """A pooler initialised as BertModel's, for a folder whose class built none."""
  x_1x1xD = jnp.zeros((1, 1, config.hidden_size), jnp.float32)
  init = sharding.logical_context(None, rules)(
      lambda rng: Pooler(config).init({"params": rng}, x_1x1xD)["params"])
  return nn.unbox(init(jax.random.key(0)))


def _boxed(encoder, config: BertConfig, rules) -> Any:
  """The arrays in the `nn.LogicallyPartitioned` boxes `init` would put them in."""
  return jax.tree.map(lambda box, x: box.replace_boxed(x), abstract_encoder(config, rules),
                      encoder, is_leaf=_is_box)
