"""Google's released BERT checkpoints (the TF1 variable layout of google-research/bert): names,
configs and arrays.

A Google folder holds `bert_config.json` (the original's keys: num_hidden_layers, ...),
`bert_model.ckpt.index` + `bert_model.ckpt.data-00000-of-00001` (variables named
`bert/encoder/layer_N/attention/self/query/kernel`, ...; dense kernels [in, out] as Flax, the NSP
weights `cls/seq_relationship/output_weights` stored [2, H]) and `vocab.txt`. Its checkpoint is read
without TensorFlow (`tf_bundle`); the names are mapped onto Hugging Face's, whose mapping onto the
bertjax tree (formats/hf.py) is then shared, unrolled (`layer_N`) or scanned (`layers/layer`).

The commands that import and export folders are `bertjax.convert.google`'s; bertjax/weights/reader.py
reads a Google folder through this module.
"""

from __future__ import annotations

import dataclasses
import os
import re

import numpy as np
from absl import logging

from bertjax import files
from bertjax.errors import Refusal
from bertjax.formats import hf, tf_bundle
from bertjax.model.config import ACTIVATIONS, BertConfig

# The TensorFlow-free reader, public here too.
CheckpointReader = tf_bundle.CheckpointReader
read_checkpoint = tf_bundle.read_checkpoint

CONFIG_FILE = "bert_config.json"
VOCAB_FILE = "vocab.txt"
CHECKPOINT_NAME = "bert_model.ckpt"

# bert_config.json keys are Hugging Face's (its config was copied from this one), less
# layer_norm_eps: the original hard-codes 1e-12.
_CONFIG_KEYS = {k: v for k, v in hf.HF_CONFIG_KEYS.items()
                if k != "layer_norm_eps"}
# The original BertConfig's defaults for keys a config leaves out (type_vocab_size is 16 in its
# code, 2 in every released file).
_CONFIG_DEFAULTS = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
                    "intermediate_size": 3072, "hidden_act": "gelu", "hidden_dropout_prob": 0.1,
                    "attention_probs_dropout_prob": 0.1, "max_position_embeddings": 512,
                    "type_vocab_size": 16, "initializer_range": 0.02}
# Keys of the multilingual and Chinese releases that the original code does not read.
_UNREAD_KEYS = ("directionality", "pooler_fc_size", "pooler_num_attention_heads",
                "pooler_num_fc_layers", "pooler_size_per_head", "pooler_type")
# Optimizer state and step counter of training checkpoints: not part of the model.
_SLOT_SUFFIXES = ("adam_m", "adam_v")
_STEP = "global_step"


# Config ----------------------------------------------------------------------------------------

def config_from_google(google_config: dict, **overrides) -> BertConfig:
  """A BertConfig from the dict of a Google `bert_config.json`."""
  if "vocab_size" not in google_config:
    raise Refusal(f"bert_config.json has no vocab_size (keys: {sorted(google_config)}); it is "
                  "not a BERT config of Google's release")
  values = {**_CONFIG_DEFAULTS, **google_config}
  unknown = sorted(set(values) - set(_CONFIG_KEYS) - {"hidden_act"} - set(_UNREAD_KEYS))
  if unknown:
    logging.warning("bert_config.json keys %s are not BERT's; ignored.", unknown)
  # The original lower-cases the name; its "gelu" is the erf form the 2018 checkpoints were
  # trained with (the later code computes the tanh approximation under the same name).
  act = str(values["hidden_act"]).lower()
  # Hugging Face's names of the tanh approximation (a config copied from there): bertjax's
  # gelu_tanh computes the same function.
  act = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}.get(act, act)
  if act not in ("gelu", "gelu_tanh"):
    raise Refusal(f"hidden_act={values['hidden_act']!r} has no bertjax equivalent (bertjax "
                  f"offers {sorted(ACTIVATIONS)}; Google's 'gelu' is bertjax's 'gelu', "
                  "'gelu_new' and 'gelu_pytorch_tanh' its 'gelu_tanh')")
  ours = {mine: values[theirs] for theirs, mine in _CONFIG_KEYS.items()}
  return BertConfig.from_dict({**ours, "hidden_act": act}, **overrides)


def config_to_google(config: BertConfig) -> dict:
  """The `bert_config.json` dict of a BertConfig, in Google's keys."""
  if config.modern_options():
    raise Refusal(f"Google's BERT format has no form for {', '.join(config.modern_options())}"
                  " (the paper's model has none of them); a ModernBERT-shaped model exports "
                  "with `python -m bertjax.convert.modernbert export`")
  if config.hidden_act != "gelu":
    logging.warning("hidden_act=%r is written as 'gelu', the only GELU name of Google's format "
                    "(which its later code computes as the tanh form); imported back, it reads "
                    "as the erf form.", config.hidden_act)
  if config.layer_norm_eps != 1e-12:
    logging.warning("layer_norm_eps=%g cannot be written: Google's code uses 1e-12.",
                    config.layer_norm_eps)
  out = {theirs: getattr(config, mine) for theirs, mine in _CONFIG_KEYS.items()}
  out["hidden_act"] = "gelu"
  return dict(sorted(out.items()))


def read_google_config(folder: str, **overrides) -> BertConfig:
  """The BertConfig of a Google folder's bert_config.json."""
  path = os.path.join(folder, CONFIG_FILE)
  if not files.exists(path):
    raise FileNotFoundError(f"{path} not found: a Google BERT folder holds bert_config.json, "
                            "bert_model.ckpt.* and vocab.txt (unzip the release into one folder)")
  return config_from_google(files.read_json(path, "Google's model config"), **overrides)


# Names -----------------------------------------------------------------------------------------

_RENAMED = {"cls.predictions.bias": "cls.predictions.output_bias",
            "cls.seq_relationship.weight": "cls.seq_relationship.output_weights",
            "cls.seq_relationship.bias": "cls.seq_relationship.output_bias"}


def _google_name(hf_name: str) -> tuple[str, bool]:
  """Google's name of a Hugging Face tensor and whether it is stored transposed (Linear weights
  are [out, in] in PyTorch; the NSP weights are [2, H] in both)."""
  if hf_name in _RENAMED:
    return _RENAMED[hf_name].replace(".", "/"), False
  name = re.sub(r"\.layer\.(\d+)\.", r".layer_\1.", hf_name)
  transposed = False
  if name.endswith("_embeddings.weight"):
    name = name[:-len(".weight")]
  elif ".LayerNorm." in name:
    name = name.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias",
                                                                       "LayerNorm.beta")
  elif name.endswith(".weight"):
    name, transposed = name[:-len("weight")] + "kernel", True
  return name.replace(".", "/"), transposed


# Google's prefixes of the pre-training heads' variables.
_HEAD_PREFIXES = {"mlm": "cls/predictions/", "nsp": "cls/seq_relationship/"}


def heads_in(names) -> tuple[str, ...]:
  """The pre-training heads whose variables appear among `names` (Google names)."""
  return tuple(head for head, prefix in _HEAD_PREFIXES.items()
               if any(str(n).startswith(prefix) for n in names))


def _table(config: BertConfig, heads=tuple(_HEAD_PREFIXES)
           ) -> dict[str, tuple[str, bool, tuple[int, ...]]]:
  """Google name -> (Hugging Face name, transposed, Google shape) of every variable of the
  encoder and of `heads`."""
  out = {}
  for hf_name, shape in hf.expected_shapes(config, heads).items():
    name, transposed = _google_name(hf_name)
    out[name] = (hf_name, transposed, tuple(reversed(shape)) if transposed else tuple(shape))
  return out


def ignored_variables(names) -> dict[str, int]:
  """How many of `names` are optimizer slots (by kind), the step counter, or variables of a task
  head ("task head": run_classifier.py's output_weights, run_squad.py's cls/squad/*)."""
  counts = {}
  for name in names:
    kind = name.rsplit("/", 1)[-1]
    if kind in _SLOT_SUFFIXES or name == _STEP:
      counts[kind] = counts.get(kind, 0) + 1
    elif _is_task_head(name):
      counts["task head"] = counts.get("task head", 0) + 1
  return counts


def _is_task_head(name: str) -> bool:
  """A variable of a fine-tuning head of the original's scripts: neither the encoder's nor a
  pre-training head's (run_classifier.py writes output_weights/output_bias at the top level)."""
  return not name.startswith("bert/") and not name.startswith(tuple(_HEAD_PREFIXES.values()))


def _is_ignored(name: str) -> bool:
  return (name == _STEP or name.rsplit("/", 1)[-1] in _SLOT_SUFFIXES) or _is_task_head(name)


def _access(source):
  """(shapes by name, name -> array) of a dict, a CheckpointReader or TensorFlow's reader."""
  if isinstance(source, CheckpointReader):
    return source.shapes(), source.read
  if hasattr(source, "get_variable_to_shape_map"):
    return ({k: tuple(v) for k, v in source.get_variable_to_shape_map().items()},
            source.get_tensor)
  return {k: tuple(np.shape(v)) for k, v in source.items()}, lambda k: np.asarray(source[k])


def params_from_google(source, config: BertConfig, *, scan_layers: bool | None = None,
                       heads=None) -> dict:
  """`BertForPreTraining` parameters (nested dict of numpy arrays) from Google's variables: the
  encoder (`bert`) and the pre-training `heads` ("mlm", "nsp"; None: those the checkpoint holds).

  `source`: {name: array}, a `CheckpointReader` (only the model's variables are read) or
  `tf.train.load_checkpoint(...)`. `scan_layers` (default: the config's) stacks the layers.
  Optimizer slots, global_step and a fine-tuning script's task head are ignored (see
  `ignored_variables`); every missing, unexpected or mis-shaped variable is listed in one
  ValueError.
  """
  if scan_layers is not None:
    config = dataclasses.replace(config, scan_layers=scan_layers)
  shapes, get = _access(source)
  heads = heads_in(shapes) if heads is None else tuple(heads)
  stored_heads = heads_in(shapes)
  absent = [head for head in heads if head in _HEAD_PREFIXES and head not in stored_heads]
  if absent:
    # A fine-tuned model of the original's scripts (run_classifier.py keeps bert/* and its own
    # output_weights), not a model of another shape: the config is not what to fix.
    raise Refusal(
        f"The checkpoint holds no {' and no '.join(_HEAD_PREFIXES[h] + '*' for h in absent)} (the "
        f"pre-training head(s) {absent}): it is a fine-tuned or encoder-only checkpoint, from "
        "which only the encoder (bert/*) can be taken (heads=() here; as checkpoint.init_from of "
        "a run, its encoder is taken and the heads start fresh).")
  table = _table(config, heads)
  unread = tuple(prefix for head, prefix in _HEAD_PREFIXES.items() if head not in heads)
  present = {name: shape for name, shape in shapes.items()
             if not _is_ignored(name) and not (unread and name.startswith(unread))}
  missing = sorted(set(table) - set(present))
  unexpected = sorted(set(present) - set(table))
  misshaped = sorted(f"{name}: {present[name]} (expected {table[name][2]})"
                     for name in set(table) & set(present) if present[name] != table[name][2])
  problems = [f"{what} variables ({len(names)}): {names}" for what, names in (
      ("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped)) if names]
  if any("/.ATTRIBUTES/" in name for name in unexpected):
    problems.append("the names are those of a TF2 object-based checkpoint (tf.train.Checkpoint), "
                    "not the TF1 names of Google's releases")
  if problems:
    raise Refusal(
        f"The checkpoint does not fit BertConfig(vocab_size={config.vocab_size}, hidden_size="
        f"{config.hidden_size}, num_layers={config.num_layers}, intermediate_size="
        f"{config.intermediate_size}, max_position_embeddings={config.max_position_embeddings}, "
        f"type_vocab_size={config.type_vocab_size}): " + "; ".join(problems)
        + ". Use the bert_config.json released with this checkpoint.")
  state_dict = {}
  for name, (hf_name, transposed, _) in table.items():
    value = np.asarray(get(name))
    state_dict[hf_name] = value.T if transposed else value
  return hf.params_from_hf(state_dict, config, heads)


def params_to_google(params: dict, config: BertConfig) -> dict[str, np.ndarray]:
  """Google's variables (float32 numpy, original names and shapes) of `BertForPreTraining`
  parameters."""
  state_dict = hf.params_to_hf(params, config)
  return {name: np.ascontiguousarray(state_dict[hf_name].T if transposed else state_dict[hf_name])
          for name, (hf_name, transposed, _) in _table(config).items() if hf_name in state_dict}


# Folders and casing ----------------------------------------------------------------------------

def load_folder(path: str, *, scan_layers: bool = False) -> tuple[BertConfig, dict]:
  """(config, `BertForPreTraining` params as numpy) of a Google folder, without TensorFlow."""
  config = read_google_config(path, scan_layers=scan_layers)
  return config, params_from_google(CheckpointReader(path), config)
