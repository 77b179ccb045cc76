"""A pre-trained encoder for your own model, without TensorFlow: `load_pretrained(path)`.

`path` is one of
  - a bertjax run's workdir (pre-training or fine-tuning) or its `checkpoints/` folder: the newest
    checkpoint's encoder, its shape from the model record saved beside every checkpoint;
  - a folder written by `python -m bertjax.convert.hf import` (`bert_config.json` + `params/`);
  - a folder of Google's release (`bert_config.json` + `bert_model.ckpt.*`), read by
    `bertjax.convert.google` (TF's checkpoint format needs TensorFlow there, and only there).

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
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from etils import epath

from bertjax import checkpoint as checkpoint_lib, sharding
from bertjax.model import BertConfig, BertModel

ENCODER = "bert"  # the encoder's name inside BertForPreTraining and every fine-tuning head


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


def _restack(encoder: dict, num_layers: int, scan: bool) -> dict:
  """Unrolled `encoder/layer_N` <-> scanned `encoder/layers/layer` (leading layer axis)."""
  layers = dict(encoder["encoder"])
  if scan:
    per_layer = [layers[f"layer_{i}"] for i in range(num_layers)]
    stacked = {"layers": {"layer": jax.tree.map(lambda *xs: jnp.stack(xs), *per_layer)}}
  else:
    stacked = {f"layer_{i}": jax.tree.map(lambda x, i=i: x[i], layers["layers"]["layer"])
               for i in range(num_layers)}
  return {**encoder, "encoder": stacked}


def _checkpoints_folder(root: epath.Path) -> epath.Path | None:
  if (root / "checkpoints").is_dir():
    return root / "checkpoints"
  if root.name == "checkpoints" and root.is_dir():
    return root
  return None


def _google():
  """bertjax.convert.google, or None where this installation has none."""
  try:
    return importlib.import_module("bertjax.convert.google")
  except ModuleNotFoundError as err:
    if err.name != "bertjax.convert.google":
      raise
    return None


def load_pretrained(path: str, *, scan_layers: bool | None = None,
                    mesh: jax.sharding.Mesh | None = None, rules: sharding.Rules | None = None,
                    boxed: bool = False) -> tuple[BertConfig, Any]:
  """(config, encoder parameters) from a workdir, a `convert.hf` folder or a Google folder.

  See the module docstring for the three kinds of folder and the forms of the result.
  """
  if mesh is not None:
    sharding.check_auto_axes(mesh, "load_pretrained's mesh")
  rules = sharding.DEFAULT_RULES if rules is None else sharding.rules_from_config(rules)
  root = epath.Path(path)
  if not root.exists():
    raise FileNotFoundError(f"{path} does not exist")
  if (folder := _checkpoints_folder(root)) is not None:
    stored, read = _from_workdir(folder)
  elif (root / "bert_config.json").exists() and (root / "params").is_dir():
    stored, read = _from_converted(path)
  elif (google := _google()) is not None and google.is_google_folder(path):
    config, params = google.load_folder(path, scan_layers=bool(scan_layers))
    params = params.get(ENCODER, params)
    placements = _placements(config, mesh, rules)
    # Structure and shapes checked against the model (every problem listed), then placed.
    checkpoint_lib.subtree_target({ENCODER: params}, ENCODER, _target(config, placements, rules),
                                  None, path)
    encoder = jax.device_put(jax.tree.map(jnp.asarray, params), placements)
    return config, _boxed(encoder, config, rules) if boxed else encoder
  else:
    raise FileNotFoundError(
        f"{path} is not a pre-trained encoder bertjax reads: expected a bertjax workdir (with "
        "checkpoints/), a folder written by `python -m bertjax.convert.hf import` "
        "(bert_config.json and params/), or one of Google's released folders (bert_config.json "
        "and bert_model.ckpt.index)")

  # Read in the stored layout, each array straight into its place; restacked after if asked.
  elsewhere = (sharding.replicated(mesh) if mesh is not None
               else jax.sharding.SingleDeviceSharding(jax.local_devices()[0]))
  encoder = read(_target(stored, _placements(stored, mesh, rules), rules), elsewhere)
  config = stored if scan_layers is None else dataclasses.replace(
      stored, scan_layers=bool(scan_layers))
  if config.scan_layers != stored.scan_layers:
    encoder = jax.jit(lambda e: _restack(e, config.num_layers, config.scan_layers),
                      out_shardings=_placements(config, mesh, rules))(encoder)
  return config, _boxed(encoder, config, rules) if boxed else encoder


def _boxed(encoder, config: BertConfig, rules) -> Any:
  """The arrays in the `nn.LogicallyPartitioned` boxes `init` would put them in."""
  return jax.tree.map(lambda box, x: box.replace_boxed(x), abstract_encoder(config, rules),
                      encoder, is_leaf=_is_box)


def _from_workdir(folder: epath.Path):
  """(config, read) of the newest checkpoint of a run: the model record of its `meta` item."""
  # The items bertjax's loop saves (loop.ITEMS; loop imports TensorFlow): orbax warns of an item it
  # has no handler for. Only the encoder of `params` is read; the rest stays on disk.
  ckpt = checkpoint_lib.Checkpointer(os.fspath(folder), ("params", "opt_state"), save_every=1,
                                     keep=1)
  steps = ckpt.all_steps()
  if not steps:
    ckpt.close()
    raise FileNotFoundError(f"{folder} holds no checkpoint (the run saved none yet)")
  step = steps[-1]
  meta = ckpt.read_meta(step)
  if "model" not in meta:
    ckpt.close()
    raise ValueError(f"{folder} step {step} records no model shape (its meta has "
                     f"{sorted(meta)}); it was not written by bertjax's training loop")
  config = BertConfig.from_dict(meta["model"])

  def read(target, elsewhere):
    try:
      return ckpt.restore_subtree(step, "params", ENCODER, target, elsewhere)
    finally:
      ckpt.close()

  return config, read


def _from_converted(path: str):
  """(config, read) of a folder written by `convert.hf import` (hf.save_params)."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  from bertjax.convert import hf  # pylint: disable=import-outside-toplevel
  config = hf.read_config(path)

  def read(target, elsewhere):
    params_dir = os.path.join(os.path.abspath(path) if "://" not in path else path, "params")
    with ocp.StandardCheckpointer() as checkpointer:
      stored = checkpointer.metadata(params_dir).item_metadata
    abstract = checkpoint_lib.subtree_target(stored, ENCODER, target, elsewhere, path)
    return hf.load_params(path, abstract)[1][ENCODER]

  return config, read
