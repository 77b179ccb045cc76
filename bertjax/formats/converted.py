"""The folder `convert.hf import`, `convert.google import` and `convert.modernbert import` write:
`bert_config.json` (a BertConfig in bertjax's keys: num_layers, ...) and `params/` (an orbax
checkpoint of the parameters). bertjax/weights/reader.py reads it as the kind "converted".
"""

from __future__ import annotations

import dataclasses
import os

import orbax.checkpoint as ocp

from bertjax import files
from bertjax.model.config import BertConfig

CONFIG_FILE = "bert_config.json"


def params_dir(directory: str) -> str:
  """The orbax checkpoint of a converted folder (orbax takes absolute paths or URLs)."""
  return os.path.join(directory if "://" in directory else os.path.abspath(directory), "params")


def save_params(directory: str, params: dict, config: BertConfig) -> None:
  """An orbax checkpoint of the parameters under `directory/params` + `directory/bert_config.json`."""
  directory = os.path.abspath(directory)
  os.makedirs(directory, exist_ok=True)
  files.write_json(os.path.join(directory, CONFIG_FILE), dataclasses.asdict(config))
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(params_dir(directory), params, force=True)


def read_config(directory: str) -> BertConfig:
  """The BertConfig saved by `save_params`."""
  # files.read_json: local reads without TensorFlow, and a file cut short is named.
  return BertConfig.from_dict(files.read_json(os.path.join(directory, CONFIG_FILE),
                                              "bertjax's model config"))


def load_params(directory: str, abstract_params=None) -> tuple[BertConfig, dict]:
  """(config, params) written by `save_params`; `abstract_params` (ShapeDtypeStructs with
  shardings) restores them directly onto a mesh."""
  config = read_config(directory)
  with ocp.StandardCheckpointer() as checkpointer:
    params = checkpointer.restore(params_dir(directory), abstract_params)
  return config, params
