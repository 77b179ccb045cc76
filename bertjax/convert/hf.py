"""Weight interop with Hugging Face `BertForPreTraining` checkpoints (`model.safetensors`).

A state dict here maps Hugging Face's PyTorch names (`bert.encoder.layer.0.attention.self.query.
weight`, Linear weights stored [out, in]) to numpy arrays; `safetensors.numpy` reads and writes it,
so no torch is needed. Parameters are the `BertForPreTraining` tree of `bertjax.heads`, unrolled
(`layer_N`) or scanned (`layers/layer` with a leading [num_layers] axis) as the config says.

Command line:
  python -m bertjax.convert.hf import --hf_dir=DIR_WITH_config.json_AND_model.safetensors --output=OUT
  python -m bertjax.convert.hf export --params=OUT --output=HF_DIR
`import` writes an orbax checkpoint of the parameters plus `bert_config.json` (see `save_params`),
and copies the folder's `vocab.txt` if it has one: the form a run's `init_from` (pre-training or
`python -m bertjax.finetune`) reads; `export` writes `config.json` and `model.safetensors` back.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
from typing import Callable

import numpy as np

from bertjax.model import BertConfig

# Hugging Face config.json key -> BertConfig field.
_HF_CONFIG_KEYS = {
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
    raise ValueError(f"position_embedding_type={hf_config['position_embedding_type']!r} is not "
                     "supported; bertjax implements the original absolute positions")
  act = hf_config.get("hidden_act", "gelu")
  if act not in _HF_ACTIVATIONS:
    raise ValueError(f"hidden_act={act!r} has no bertjax equivalent; "
                     f"supported: {sorted(_HF_ACTIVATIONS)}")
  values = {ours: hf_config[theirs] for theirs, ours in _HF_CONFIG_KEYS.items()
            if theirs in hf_config}
  values["hidden_act"] = _HF_ACTIVATIONS[act]
  return BertConfig.from_dict(values, **overrides)


def config_to_hf(config: BertConfig) -> dict:
  """The Hugging Face `config.json` dict of a BertConfig."""
  out = {theirs: getattr(config, ours) for theirs, ours in _HF_CONFIG_KEYS.items()}
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


def _expected_shapes(config: BertConfig) -> dict[str, tuple[int, ...]]:
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
  return shapes


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


def _check(state_dict: dict, config: BertConfig) -> None:
  expected = _expected_shapes(config)
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
    raise ValueError(
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


def params_from_hf(state_dict: dict, config: BertConfig) -> dict:
  """`BertForPreTraining` parameters (nested dict of numpy arrays) from a Hugging Face state dict.

  Raises ValueError listing every missing, unexpected and mis-shaped key at once.
  """
  sd = _normalise_names(state_dict)
  _check(sd, config)
  dtype = np.dtype(config.param_dtype)
  params: dict = {}
  for entry in _root_entries():
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
  """The Hugging Face state dict (float32 numpy) of `BertForPreTraining` parameters.

  The tied decoder weight is not written, as Hugging Face's own safetensors files omit it.
  """
  def get(path):
    return np.asarray(_get(params, path), dtype=np.float32)

  sd = {entry.hf_name: entry.to_hf(get(entry.path), config) for entry in _root_entries()}
  for entry in _layer_entries():
    if config.scan_layers:
      stacked = get(_layer_root(config, 0) + entry.path)
      per_layer = [stacked[i] for i in range(config.num_layers)]
    else:
      per_layer = [get(_layer_root(config, i) + entry.path) for i in range(config.num_layers)]
    for i, value in enumerate(per_layer):
      sd[f"bert.encoder.layer.{i}.{entry.hf_name}"] = entry.to_hf(value, config)
  return sd


def load_hf_dir(hf_dir: str, **config_overrides) -> tuple[BertConfig, dict]:
  """(config, params) from a Hugging Face model folder holding config.json + model.safetensors."""
  from safetensors.numpy import load_file  # pylint: disable=import-outside-toplevel
  config_path = os.path.join(hf_dir, "config.json")
  weights_path = os.path.join(hf_dir, "model.safetensors")
  for path in (config_path, weights_path):
    if not os.path.exists(path):
      raise FileNotFoundError(f"{path} not found: a Hugging Face BERT folder holds config.json and "
                              "model.safetensors (convert a pytorch_model.bin with transformers' "
                              "save_pretrained(..., safe_serialization=True) first)")
  with open(config_path) as f:
    config = config_from_hf(json.load(f), **config_overrides)
  return config, params_from_hf(load_file(weights_path), config)


def save_hf_dir(hf_dir: str, params: dict, config: BertConfig) -> None:
  """Writes config.json and model.safetensors that transformers' BertForPreTraining loads."""
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel
  os.makedirs(hf_dir, exist_ok=True)
  with open(os.path.join(hf_dir, "config.json"), "w") as f:
    json.dump(config_to_hf(config), f, indent=2)
  save_file(params_to_hf(params, config), os.path.join(hf_dir, "model.safetensors"),
            metadata={"format": "pt"})


def save_params(directory: str, params: dict, config: BertConfig) -> None:
  """An orbax checkpoint of the parameters under `directory/params` + `directory/bert_config.json`."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  directory = os.path.abspath(directory)
  os.makedirs(directory, exist_ok=True)
  with open(os.path.join(directory, "bert_config.json"), "w") as f:
    json.dump(dataclasses.asdict(config), f, indent=2)
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(os.path.join(directory, "params"), params, force=True)


def read_config(directory: str) -> BertConfig:
  """The BertConfig saved by `save_params`."""
  # epath, not tf.io.gfile: reading a JSON file should not cost a TensorFlow import (local paths
  # need nothing more; gs:// goes through TensorFlow's file system when it is installed).
  from etils import epath  # pylint: disable=import-outside-toplevel
  return BertConfig.from_dict(json.loads(epath.Path(directory, "bert_config.json").read_text()))


def load_params(directory: str, abstract_params=None) -> tuple[BertConfig, dict]:
  """(config, params) written by `save_params`; `abstract_params` (ShapeDtypeStructs with
  shardings) restores them directly onto a mesh."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  directory = os.path.abspath(directory) if "://" not in directory else directory
  config = read_config(directory)
  with ocp.StandardCheckpointer() as checkpointer:
    params = checkpointer.restore(os.path.join(directory, "params"), abstract_params)
  return config, params


def main(argv: list[str]) -> None:
  import argparse  # pylint: disable=import-outside-toplevel
  parser = argparse.ArgumentParser(prog="python -m bertjax.convert.hf", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = parser.add_subparsers(dest="command", required=True)
  imp = sub.add_parser("import", help="Hugging Face folder -> bertjax parameters")
  imp.add_argument("--hf_dir", required=True)
  imp.add_argument("--output", required=True)
  imp.add_argument("--scan_layers", action="store_true", help="store layers stacked for nn.scan")
  exp = sub.add_parser("export", help="bertjax parameters -> Hugging Face folder")
  exp.add_argument("--params", required=True, help="a folder written by `import` or save_params")
  exp.add_argument("--output", required=True)
  args = parser.parse_args(argv)
  if args.command == "import":
    config, params = load_hf_dir(args.hf_dir, scan_layers=args.scan_layers)
    save_params(args.output, params, config)
    vocab = os.path.join(args.hf_dir, "vocab.txt")
    if os.path.exists(vocab):  # the WordPiece vocabulary travels with the weights it indexes
      shutil.copyfile(vocab, os.path.join(args.output, "vocab.txt"))
    print(f"Imported {args.hf_dir} -> {args.output} ({config.num_layers} layers, "
          f"hidden {config.hidden_size}, vocab {config.vocab_size})")
  else:
    config, params = load_params(args.params)
    save_hf_dir(args.output, params, config)
    print(f"Exported {args.params} -> {args.output}/model.safetensors")


if __name__ == "__main__":
  main(sys.argv[1:])
