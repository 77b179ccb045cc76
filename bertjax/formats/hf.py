"""Hugging Face BERT folders (`config.json` + `model.safetensors`): names, configs and arrays.

A state dict here maps Hugging Face's PyTorch names (`bert.encoder.layer.0.attention.self.query.
weight`, Linear weights stored [out, in]) to numpy arrays; `safetensors.numpy` reads and writes it,
so no torch is needed. Parameters are the `BertForPreTraining` tree of `bertjax.heads`, unrolled
(`layer_N`) or scanned (`layers/layer` with a leading [num_layers] axis) as the config says. A
fine-tuned model goes out as its transformers task class (`task_to_hf`).

The commands that import and export folders are `bertjax.convert.hf`'s; bertjax/weights/reader.py reads a
Hugging Face folder through this module.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable

import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from bertjax import files
from bertjax.errors import Refusal
from bertjax.formats import outfolder
from bertjax.model.config import BertConfig

# Hugging Face config.json key -> BertConfig field.
HF_CONFIG_KEYS = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads",
    "intermediate_size": "intermediate_size",
    "max_position_embeddings": "max_position_embeddings",
    "type_vocab_size": "type_vocab_size",
    "hidden_dropout_prob": "hidden_dropout",
    "attention_probs_dropout_prob": "attention_dropout",
    "initializer_range": "initializer_range",
    "layer_norm_eps": "layer_norm_eps",
}
# Hugging Face `hidden_act` values with the same function as ours.
_HF_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}

# Keys that may be present and carry nothing of their own: the decoder tied to the word
# embeddings, its bias tied to `cls.predictions.bias`, and an old non-persistent buffer.
_TIED_KEYS = {
    "cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
    "cls.predictions.decoder.bias": "cls.predictions.bias",
}
_IGNORED_KEYS = ("bert.embeddings.position_ids",)


def config_from_hf(hf_config: dict, **overrides) -> BertConfig:
  """A BertConfig from the dict of a Hugging Face BERT `config.json`."""
  if hf_config.get("position_embedding_type", "absolute") != "absolute":
    raise Refusal(f"position_embedding_type={hf_config['position_embedding_type']!r} is not "
                  "supported; bertjax implements the original absolute positions")
  act = hf_config.get("hidden_act", "gelu")
  if act not in _HF_ACTIVATIONS:
    raise Refusal(f"hidden_act={act!r} has no bertjax equivalent; "
                  f"supported: {sorted(_HF_ACTIVATIONS)}")
  values = {ours: hf_config[theirs] for theirs, ours in HF_CONFIG_KEYS.items()
            if theirs in hf_config}
  values["hidden_act"] = _HF_ACTIVATIONS[act]
  return BertConfig.from_dict(values, **overrides)


def config_to_hf(config: BertConfig) -> dict:
  """The Hugging Face `config.json` dict of a BertConfig; refuses a model with modern options,
  which Hugging Face's BERT cannot express."""
  modern = config.modern_options()
  if modern:
    raise Refusal(f"Hugging Face's BERT has no form for {', '.join(modern)} (the paper's "
                  "model has none of them); a ModernBERT-shaped model exports with "
                  "`python -m bertjax.convert.modernbert export`")
  out = {theirs: getattr(config, ours) for theirs, ours in HF_CONFIG_KEYS.items()}
  out.update(model_type="bert", architectures=["BertForPreTraining"],
             hidden_act={"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}[config.hidden_act],
             position_embedding_type="absolute", pad_token_id=0)
  return out


@dataclasses.dataclass(frozen=True)
class _Entry:
  """One tensor: its Hugging Face name, its path below a layer (or the root), and the reshapes."""
  hf_name: str
  path: tuple[str, ...]
  to_ours: Callable[[np.ndarray, BertConfig], np.ndarray]
  to_hf: Callable[[np.ndarray, BertConfig], np.ndarray]


def _same(x, _):
  return x


def _transpose(x, _):
  return np.ascontiguousarray(x.T)


def _qkv_kernel(w, c):  # [D_out, D_in] -> [D_in, N, K]
  return np.ascontiguousarray(w.T).reshape(c.hidden_size, c.num_heads, c.head_size)


def _square_kernel_back(k, c):  # [D, N, K] or [N, K, D] -> the [D_out, D_in] Linear weight
  return np.ascontiguousarray(k.reshape(c.hidden_size, c.hidden_size).T)


def _qkv_bias(b, c):
  return b.reshape(c.num_heads, c.head_size)


def _qkv_bias_back(b, c):
  return b.reshape(c.hidden_size)


def _attn_out_kernel(w, c):  # [D_out, D_in] -> [N, K, D_out]
  return np.ascontiguousarray(w.T).reshape(c.num_heads, c.head_size, c.hidden_size)


def _linear(hf_prefix, path):
  return [_Entry(f"{hf_prefix}.weight", path + ("kernel",), _transpose, _transpose),
          _Entry(f"{hf_prefix}.bias", path + ("bias",), _same, _same)]


def _norm(hf_prefix, path):
  return [_Entry(f"{hf_prefix}.weight", path + ("scale",), _same, _same),
          _Entry(f"{hf_prefix}.bias", path + ("bias",), _same, _same)]


def _layer_entries() -> list[_Entry]:
  """Entries of one encoder layer; names relative to `bert.encoder.layer.N.` and the layer."""
  entries = []
  for proj in ("query", "key", "value"):
    entries += [
        _Entry(f"attention.self.{proj}.weight", ("attention", proj, "kernel"),
               _qkv_kernel, _square_kernel_back),
        _Entry(f"attention.self.{proj}.bias", ("attention", proj, "bias"),
               _qkv_bias, _qkv_bias_back)]
  entries += [
      _Entry("attention.output.dense.weight", ("attention", "output", "kernel"),
             _attn_out_kernel, _square_kernel_back),
      _Entry("attention.output.dense.bias", ("attention", "output", "bias"), _same, _same)]
  entries += _norm("attention.output.LayerNorm", ("attention_layer_norm",))
  entries += _linear("intermediate.dense", ("mlp", "intermediate"))
  entries += _linear("output.dense", ("mlp", "output"))
  entries += _norm("output.LayerNorm", ("output_layer_norm",))
  return entries


def _root_entries() -> list[_Entry]:
  emb = ("bert", "embeddings")
  entries = [
      _Entry("bert.embeddings.word_embeddings.weight", emb + ("word_embeddings", "embedding"),
             _same, _same),
      _Entry("bert.embeddings.position_embeddings.weight",
             emb + ("position_embeddings", "embedding"), _same, _same),
      _Entry("bert.embeddings.token_type_embeddings.weight",
             emb + ("token_type_embeddings", "embedding"), _same, _same),
  ]
  entries += _norm("bert.embeddings.LayerNorm", emb + ("layer_norm",))
  entries += _linear("bert.pooler.dense", ("bert", "pooler", "dense"))
  entries += _linear("cls.predictions.transform.dense", ("mlm", "transform"))
  entries += _norm("cls.predictions.transform.LayerNorm", ("mlm", "transform_layer_norm"))
  entries.append(_Entry("cls.predictions.bias", ("mlm", "output_bias"), _same, _same))
  entries += _linear("cls.seq_relationship", ("nsp", "dense"))
  return entries


# Heads a state dict may hold beside the encoder ("bert"), by the prefix of their tensors.
HEAD_PREFIXES = {"mlm": "cls.predictions.", "nsp": "cls.seq_relationship."}


def heads_in(names) -> tuple[str, ...]:
  """The pre-training heads whose tensors appear among `names` (Hugging Face names)."""
  return tuple(head for head, prefix in HEAD_PREFIXES.items()
               if any(str(n).startswith(prefix) for n in names))


def expected_shapes(config: BertConfig, heads=tuple(HEAD_PREFIXES)) -> dict[str, tuple[int, ...]]:
  """Every tensor of the encoder and of `heads`, with its Hugging Face shape."""
  c = config
  d, f = c.hidden_size, c.intermediate_size
  shapes = {
      "bert.embeddings.word_embeddings.weight": (c.vocab_size, d),
      "bert.embeddings.position_embeddings.weight": (c.max_position_embeddings, d),
      "bert.embeddings.token_type_embeddings.weight": (c.type_vocab_size, d),
      "bert.pooler.dense.weight": (d, d),
      "cls.predictions.transform.dense.weight": (d, d),
      "cls.predictions.bias": (c.vocab_size,),
      "cls.seq_relationship.weight": (2, d),
      "cls.seq_relationship.bias": (2,),
  }
  for name in ("bert.embeddings.LayerNorm", "cls.predictions.transform.LayerNorm"):
    shapes[f"{name}.weight"] = shapes[f"{name}.bias"] = (d,)
  shapes["bert.pooler.dense.bias"] = shapes["cls.predictions.transform.dense.bias"] = (d,)
  layer = {"intermediate.dense.weight": (f, d), "intermediate.dense.bias": (f,),
           "output.dense.weight": (d, f)}
  for entry in _layer_entries():
    if entry.hf_name not in layer:
      square = entry.hf_name.endswith("weight") and "LayerNorm" not in entry.hf_name
      layer[entry.hf_name] = (d, d) if square else (d,)
  for i in range(c.num_layers):
    for name, shape in layer.items():
      shapes[f"bert.encoder.layer.{i}.{name}"] = shape
  dropped = tuple(HEAD_PREFIXES[h] for h in HEAD_PREFIXES if h not in heads)
  return {k: v for k, v in shapes.items() if not (dropped and k.startswith(dropped))}


def _normalise_names(state_dict: dict) -> dict:
  """Accept the older `gamma`/`beta` LayerNorm names and checkpoints without the `bert.` prefix."""
  out = {}
  for name, value in state_dict.items():
    name = name.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta",
                                                                       "LayerNorm.bias")
    if name.startswith(("embeddings.", "encoder.", "pooler.")):
      name = "bert." + name
    out[name] = np.asarray(value)
  return out


# Heads of transformers' task classes (fine-tuned exports): not pre-training heads, so read past.
TASK_HEAD_PREFIXES = ("classifier.", "qa_outputs.")
_POOLER = "bert.pooler."


def without_pooler(state_dict) -> bool:
  """Whether the state dict (or its names) is one of a task class built without a pooler (token
  classification, question answering): a task head, and no pooler tensor at all."""
  return (any(k.startswith(TASK_HEAD_PREFIXES) for k in state_dict)
          and not any(k.startswith(_POOLER) for k in state_dict))


def _check(state_dict: dict, config: BertConfig, heads) -> None:
  expected = expected_shapes(config, heads)
  if without_pooler(state_dict):
    expected = {k: v for k, v in expected.items() if not k.startswith(_POOLER)}
  state_dict = {k: v for k, v in state_dict.items() if not k.startswith(TASK_HEAD_PREFIXES)}
  unread = tuple(HEAD_PREFIXES[h] for h in HEAD_PREFIXES if h not in heads)
  if unread:  # the heads not asked for are not read, so not checked either
    state_dict = {k: v for k, v in state_dict.items() if not k.startswith(unread)}
  missing = sorted(set(expected) - set(state_dict))
  unexpected = sorted(set(state_dict) - set(expected) - set(_TIED_KEYS) - set(_IGNORED_KEYS))
  misshaped = sorted(f"{k}: {tuple(state_dict[k].shape)} (expected {expected[k]})"
                     for k in set(expected) & set(state_dict)
                     if tuple(state_dict[k].shape) != expected[k])
  untied = sorted(k for k, source in _TIED_KEYS.items()
                  if k in state_dict and source in state_dict
                  and not np.array_equal(state_dict[k], state_dict[source]))
  problems = []
  if missing:
    problems.append(f"missing keys ({len(missing)}): {missing}")
  if unexpected:
    problems.append(f"unexpected keys ({len(unexpected)}): {unexpected}")
  if misshaped:
    problems.append(f"mis-shaped keys ({len(misshaped)}): {misshaped}")
  if untied:
    problems.append(f"keys that should equal their tied source but differ: {untied} "
                    "(bertjax ties the MLM decoder to the word embeddings)")
  if problems:
    raise Refusal(
        f"The Hugging Face state dict does not fit BertConfig(vocab_size={config.vocab_size}, "
        f"hidden_size={config.hidden_size}, num_layers={config.num_layers}, "
        f"intermediate_size={config.intermediate_size}, max_position_embeddings="
        f"{config.max_position_embeddings}, type_vocab_size={config.type_vocab_size}): "
        + "; ".join(problems))


def _set(tree: dict, path: tuple[str, ...], value) -> None:
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def _get(tree: dict, path: tuple[str, ...]):
  for key in path:
    tree = tree[key]
  return tree


def _layer_root(config: BertConfig, i: int) -> tuple[str, ...]:
  return ("bert", "encoder", "layers", "layer") if config.scan_layers else (
      "bert", "encoder", f"layer_{i}")


def params_from_hf(state_dict: dict, config: BertConfig, heads=None) -> dict:
  """`BertForPreTraining` parameters (nested dict of numpy arrays) from a Hugging Face state dict:
  the encoder (`bert`) and the pre-training `heads` ("mlm", "nsp"; None: those it holds). The
  head of a transformers task class (classifier, qa_outputs: what `export` writes for a
  fine-tuned model) is read past; where that class has no pooler (token classification, question
  answering), neither has the encoder returned.

  Raises ValueError listing every missing, unexpected and mis-shaped key at once.
  """
  sd = _normalise_names(state_dict)
  heads = heads_in(sd) if heads is None else tuple(heads)
  _check(sd, config, heads)
  dtype = np.dtype(config.param_dtype)
  params: dict = {}
  no_pooler = without_pooler(sd)
  for entry in _root_entries():
    if entry.path[0] != "bert" and entry.path[0] not in heads:
      continue
    if no_pooler and entry.hf_name.startswith(_POOLER):
      continue  # the encoder then has no "pooler" subtree: the exported class had none
    _set(params, entry.path, entry.to_ours(sd[entry.hf_name], config).astype(dtype))
  for entry in _layer_entries():
    per_layer = [entry.to_ours(sd[f"bert.encoder.layer.{i}.{entry.hf_name}"], config).astype(dtype)
                 for i in range(config.num_layers)]
    if config.scan_layers:
      _set(params, _layer_root(config, 0) + entry.path, np.stack(per_layer))
    else:
      for i, value in enumerate(per_layer):
        _set(params, _layer_root(config, i) + entry.path, value)
  return params


def params_to_hf(params: dict, config: BertConfig) -> dict[str, np.ndarray]:
  """The Hugging Face state dict (float32 numpy) of `BertForPreTraining` parameters: the encoder
  and whichever pre-training heads `params` holds.

  The tied decoder weight is not written, as Hugging Face's own safetensors files omit it.
  """
  def get(path):
    return np.asarray(_get(params, path), dtype=np.float32)

  sd = {entry.hf_name: entry.to_hf(get(entry.path), config) for entry in _root_entries()
        if entry.path[0] in params}
  for entry in _layer_entries():
    if config.scan_layers:
      stacked = get(_layer_root(config, 0) + entry.path)
      per_layer = [stacked[i] for i in range(config.num_layers)]
    else:
      per_layer = [get(_layer_root(config, i) + entry.path) for i in range(config.num_layers)]
    for i, value in enumerate(per_layer):
      sd[f"bert.encoder.layer.{i}.{entry.hf_name}"] = entry.to_hf(value, config)
  return sd


def safetensors_names(path: str) -> list[str]:
  """The tensor names of a safetensors file (its header only)."""
  with safe_open(path, "np") as f:
    return list(f.keys())


def read_safetensors(path: str) -> dict[str, np.ndarray]:
  return load_file(path)


def load_hf_dir(hf_dir: str, **config_overrides) -> tuple[BertConfig, dict]:
  """(config, params) from a Hugging Face model folder holding config.json + model.safetensors."""
  config_path = os.path.join(hf_dir, "config.json")
  weights_path = os.path.join(hf_dir, "model.safetensors")
  for path in (config_path, weights_path):
    if not os.path.exists(path):
      raise FileNotFoundError(f"{path} not found: a Hugging Face BERT folder holds config.json and "
                              "model.safetensors (convert a pytorch_model.bin with transformers' "
                              "save_pretrained(..., safe_serialization=True) first)")
  config = config_from_hf(files.read_json(config_path, "the Hugging Face config"),
                          **config_overrides)
  return config, params_from_hf(load_file(weights_path), config)


def save_hf_dir(hf_dir: str, params: dict, config: BertConfig) -> None:
  """Writes config.json and model.safetensors that transformers' BertForPreTraining loads."""
  hf_config = config_to_hf(config)  # refuses a model BERT cannot express before any write
  os.makedirs(hf_dir, exist_ok=True)
  files.write_json(os.path.join(hf_dir, "config.json"), hf_config)
  save_file(params_to_hf(params, config), os.path.join(hf_dir, "model.safetensors"),
            metadata={"format": "pt"})


# The transformers class of sequence classification, the one that builds the pooler: its token
# classification and QA classes build none, so the pooler's weights are left out there, or
# transformers would warn of unused weights.
_SEQUENCE_CLASS = "BertForSequenceClassification"


def task_to_hf(params: dict, config: BertConfig, *, head: str, hf_class: str, hf_head: str,
               outputs: int, labels: tuple[str, ...]) -> tuple[dict[str, np.ndarray], dict]:
  """The state dict and the config.json entries of a fine-tuned model in the transformers class
  `hf_class` (its family's, bertjax/finetune/families/): the encoder, the head (bertjax's `head`
  subtree, a "classifier" or "span" dense, [D, C] kernel, as the [C, D] Linear `hf_head`; span's
  two outputs are start then end, as transformers splits qa_outputs), its width `outputs`, and
  the labels by id where the head's outputs are the task's label names."""
  if config.task_head != "bert":
    raise Refusal(f"task_head={config.task_head!r}: transformers' Bert* task classes have "
                  "BERT's head alone; export with `python -m bertjax.convert.modernbert export`")
  sd = params_to_hf({"bert": params["bert"]}, config)
  if hf_class != _SEQUENCE_CLASS:
    sd = {k: v for k, v in sd.items() if not k.startswith("bert.pooler.")}
  dense = params[head]["dense"] if "dense" in params[head] else params[head]
  sd[f"{hf_head}.weight"] = np.ascontiguousarray(np.asarray(dense["kernel"], np.float32).T)
  sd[f"{hf_head}.bias"] = np.asarray(dense["bias"], np.float32)
  extra = {"architectures": [hf_class], "num_labels": outputs}
  if labels and len(labels) == outputs:  # the head's outputs are the label names
    extra.update(id2label={str(i): name for i, name in enumerate(labels)},
                 label2id={name: i for i, name in enumerate(labels)})
  if hf_class == _SEQUENCE_CLASS:  # transformers' own rule: one output is a regression
    extra["problem_type"] = "regression" if outputs == 1 else "single_label_classification"
  return sd, extra


@dataclasses.dataclass(frozen=True)
class TaskClass:
  """What a fine-tuned transformers folder's config.json says of its task (BERT's and
  ModernBERT's alike): the class, the labels by id and the problem_type ("" where unsaid). Which
  bertjax family that is, is fine-tuning's to say (bertjax/finetune/families/)."""

  architecture: str  # `architectures`' task class ("" where the folder names none)
  labels: tuple[str, ...]  # `id2label`, by id
  problem_type: str = ""


def task_class(hf_config: dict, architecture: str) -> TaskClass:
  """The task of a config.json whose weights hold the head of `architecture`."""
  return TaskClass(architecture, labels_of(hf_config), hf_config.get("problem_type") or "")


def task_in(hf_config: dict, names) -> TaskClass | None:
  """The task of a BERT folder whose tensors (`names`) hold a task class's head (classifier,
  qa_outputs: read past by `params_from_hf`); None for a pre-training folder."""
  if not any(str(n).startswith(TASK_HEAD_PREFIXES) for n in names):
    return None
  return task_class(hf_config, next(iter(hf_config.get("architectures") or ()), ""))


def labels_of(hf_config: dict) -> tuple[str, ...]:
  """config.json's id2label, by id."""
  id2label = hf_config.get("id2label") or {}
  try:
    by_id = {int(k): str(v) for k, v in id2label.items()}
  except ValueError:
    raise Refusal(f"config.json's id2label={id2label} has keys that are not label ids; write "
                  "them as \"0\", \"1\", ...") from None
  if sorted(by_id) != list(range(len(by_id))):
    raise Refusal(f"config.json's id2label has ids {sorted(by_id)}; a head's labels are "
                  f"0 to {len(by_id) - 1}, each named once")
  return tuple(by_id[i] for i in range(len(by_id)))


def write_hf_dir(folder: outfolder.ExportFolder, state_dict: dict, hf_config: dict) -> None:
  """Writes `config.json` and `model.safetensors` (as transformers' save_pretrained names them)
  into an export's folder."""
  files.write_json(folder.path("config.json"), hf_config)
  with files.writing(path := folder.path("model.safetensors")):  # a full disk said with the file
    save_file(state_dict, path, metadata={"format": "pt"})

