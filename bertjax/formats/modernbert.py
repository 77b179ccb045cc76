"""Hugging Face ModernBERT folders (`config.json` + `model.safetensors`): names, configs, arrays.

ModernBERT (Warner et al., 2024) is bertjax's encoder with the modern options of BertConfig on:
pre-LN with a final norm and no attention norm in layer 0 (the embedding norm precedes it), RoPE
with one base for global and one for local layers, a GeGLU MLP, sliding-window attention in all
layers but every `global_attn_every_n_layers`-th, no position or segment table, no pooler, and an
MLM head (dense, activation, norm, decoder tied to the word embeddings). `config_from_modernbert`
sets those options; a folder using something bertjax lacks (RoPE scaling, an activation without
an equivalent) is refused naming the key.

Hugging Face's tensors and ours:
  Wqkv [3D, D] (rows q | k | v, each head-major)  -> attention/{query,key,value}/kernel [D, N, K]
  attn.Wo [D, D]                                  -> attention/output/kernel [N, K, D]
  mlp.Wi [2F, D] (rows: activated half | gate)    -> mlp/intermediate, mlp/gate [D, F]
  mlp.Wo [D, F]                                   -> mlp/output/kernel [F, D]
  attn_norm, mlp_norm, final_norm, embeddings.norm, head.norm -> the *layer_norm modules
  head.dense -> mlm/transform; decoder.bias -> mlm/output_bias; decoder.weight (untied) ->
  mlm/decoder

The commands that import and export folders are `bertjax.convert.modernbert`'s;
bertjax/weights/reader.py reads a ModernBERT folder through this module; which ModernBertFor* task class
a folder holds, and an export's entries for one, are formats/modernbert_tasks.py's.
"""

from __future__ import annotations

import json
import os

import numpy as np

from bertjax.errors import Refusal
from bertjax.formats import hf, outfolder
from bertjax.formats.modernbert_tasks import (CLASSIFIERS, PREDICTION_HEAD, QA_HEAD, TASK_SUBTREES,
                                              heads_in)
from bertjax.model.config import BertConfig

MODEL_TYPE = "modernbert"
# Their activations with the same function as ours (ACT2FN["gelu"] is the exact erf form).
_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
                "silu": "silu", "swish": "silu"}
_ACTIVATIONS_BACK = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "silu": "silu"}
_HEAD_PREFIXES = ("head.", "decoder.", "classifier.")


def config_from_modernbert(c: dict, **overrides) -> BertConfig:
  """A BertConfig from the dict of a Hugging Face ModernBERT `config.json`."""
  problems = []
  scaling = c.get("rope_scaling")
  if scaling and (scaling.get("rope_type", scaling.get("type")) or "default") != "default":
    problems.append(f"rope_scaling={scaling} (bertjax's RoPE has no scaling; remove the key if "
                    "the checkpoint was trained without it)")
  acts = {}
  for key in ("hidden_activation", "classifier_activation"):
    value = c.get(key, "gelu")
    if value not in _ACTIVATIONS:
      problems.append(f"{key}={value!r} (supported: {sorted(_ACTIVATIONS)})")
    acts[key] = _ACTIVATIONS.get(value)
  if c.get("classifier_pooling", "cls") not in ("cls", "mean"):
    problems.append(f"classifier_pooling={c['classifier_pooling']!r} (ModernBERT's are 'cls' "
                    "and 'mean')")
  if problems:
    raise Refusal("This ModernBERT config.json uses what bertjax does not implement: "
                  + "; ".join(problems))
  every = int(c.get("global_attn_every_n_layers", 3))
  local_theta = c.get("local_rope_theta")
  values = dict(
      vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
      num_layers=c["num_hidden_layers"], num_heads=c["num_attention_heads"],
      intermediate_size=c["intermediate_size"],
      max_position_embeddings=c.get("max_position_embeddings", 8192), type_vocab_size=0,
      hidden_dropout=float(c.get("mlp_dropout", 0.0)),
      attention_dropout=float(c.get("attention_dropout", 0.0)),
      initializer_range=c.get("initializer_range", 0.02), layer_norm_eps=c.get("norm_eps", 1e-5),
      hidden_act=acts["hidden_activation"], head_act=acts["classifier_activation"],
      norm_position="pre", norm_bias=bool(c.get("norm_bias", False)),
      attention_bias=bool(c.get("attention_bias", False)),
      mlp_bias=bool(c.get("mlp_bias", False)), mlp_type="gated", position_embedding="rope",
      rope_theta=float(c.get("global_rope_theta", 160000.0)),
      local_rope_theta=float(local_theta) if local_theta is not None else 0.0,
      global_every=every, local_window=int(c.get("local_attention", 128)) if every > 1 else 0,
      embedding_norm=True, pooler=False, head_bias=bool(c.get("classifier_bias", False)),
      decoder_bias=bool(c.get("decoder_bias", True)),
      tie_word_embeddings=bool(c.get("tie_word_embeddings", True)), task_head="modernbert",
      classifier_pooling=c.get("classifier_pooling", "cls"))
  return BertConfig.from_dict(values, **overrides)


# BertConfig fields ModernBERT fixes, with the value it needs: a model otherwise has no export.
_FIXED = dict(norm_position="pre", norm_type="layernorm", mlp_type="gated",
              position_embedding="rope", type_vocab_size=0, pooler=False, embedding_norm=True)


TOKEN_ID_KEYS = ("pad_token_id", "bos_token_id", "eos_token_id", "cls_token_id", "sep_token_id")
# ModernBERT's own special tokens (its tokenizer's ids), where the vocabulary holds them.
_DEFAULT_TOKEN_IDS = dict(pad_token_id=50283, bos_token_id=50281, eos_token_id=50282,
                          cls_token_id=50281, sep_token_id=50282)


def config_to_modernbert(config: BertConfig, token_ids: dict | None = None) -> dict:
  """The ModernBERT `config.json` dict of a BertConfig; refuses one ModernBERT cannot express.

  `token_ids`: the special tokens' ids (TOKEN_ID_KEYS) of the model's tokenizer. Without them,
  ModernBERT's where they fit the vocabulary, else BERT's order ([PAD] 0, [CLS] 1, [SEP] 2);
  transformers refuses a pad id beyond the vocabulary, and reads the ids for nothing else a
  forward pass computes (padding_idx only keeps the [PAD] row's gradient at zero in training).
  """
  wrong = [f"{k}={getattr(config, k)!r} (ModernBERT needs {v!r})" for k, v in _FIXED.items()
           if getattr(config, k) != v]
  for key in ("hidden_act", "head_act"):
    act = getattr(config, key) or config.hidden_act
    if act not in _ACTIVATIONS_BACK:
      wrong.append(f"{key}={act!r} (ModernBERT takes {sorted(_ACTIVATIONS_BACK)})")
  if wrong:
    raise Refusal("This model has no ModernBERT form: " + "; ".join(wrong)
                  + ". Export it with `python -m bertjax.convert.hf export` if it is BERT's")
  every = config.global_every
  if token_ids is None:
    token_ids = (_DEFAULT_TOKEN_IDS if config.vocab_size > max(_DEFAULT_TOKEN_IDS.values())
                 else dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1,
                           sep_token_id=2))
  return dict(
      **{k: token_ids[k] for k in TOKEN_ID_KEYS if k in token_ids},
      model_type=MODEL_TYPE, architectures=["ModernBertForMaskedLM"],
      vocab_size=config.vocab_size, hidden_size=config.hidden_size,
      num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
      intermediate_size=config.intermediate_size,
      max_position_embeddings=config.max_position_embeddings,
      initializer_range=config.initializer_range, norm_eps=config.layer_norm_eps,
      norm_bias=config.norm_bias, attention_bias=config.attention_bias,
      mlp_bias=config.mlp_bias, hidden_activation=_ACTIVATIONS_BACK[config.hidden_act],
      classifier_activation=_ACTIVATIONS_BACK[config.head_act or config.hidden_act],
      classifier_bias=config.head_bias, decoder_bias=config.decoder_bias,
      tie_word_embeddings=config.tie_word_embeddings,
      global_rope_theta=config.rope_theta,
      local_rope_theta=config.local_rope_theta or config.rope_theta,
      global_attn_every_n_layers=every,
      # ModernBERT has no "no local layers" switch: with every layer global the window is unread.
      local_attention=config.local_window if every > 1 else 128,
      attention_dropout=config.attention_dropout, mlp_dropout=config.hidden_dropout,
      embedding_dropout=config.hidden_dropout)


def _normalise_names(state_dict: dict) -> dict:
  """A bare ModernBertModel's tensors lack the `model.` prefix ForMaskedLM gives them."""
  if any(k.startswith("model.") for k in state_dict):
    return {k: np.asarray(v) for k, v in state_dict.items()}
  return {(k if k.startswith(_HEAD_PREFIXES) else "model." + k): np.asarray(v)
          for k, v in state_dict.items()}


def _norm_names(prefix: str, config: BertConfig) -> list[str]:
  return [f"{prefix}.weight"] + ([f"{prefix}.bias"] if config.norm_bias else [])


def _expected_shapes(config: BertConfig, heads, num_labels: int = 0
                     ) -> dict[str, tuple[int, ...]]:
  c = config
  d, f, v = c.hidden_size, c.intermediate_size, c.vocab_size
  shapes = {"model.embeddings.tok_embeddings.weight": (v, d)}
  norms = ["model.embeddings.norm", "model.final_norm"]
  for i in range(c.num_layers):
    p = f"model.layers.{i}."
    shapes.update({p + "attn.Wqkv.weight": (3 * d, d), p + "attn.Wo.weight": (d, d),
                   p + "mlp.Wi.weight": (2 * f, d), p + "mlp.Wo.weight": (d, f)})
    if c.attention_bias:
      shapes.update({p + "attn.Wqkv.bias": (3 * d,), p + "attn.Wo.bias": (d,)})
    if c.mlp_bias:
      shapes.update({p + "mlp.Wi.bias": (2 * f,), p + "mlp.Wo.bias": (d,)})
    norms += ([p + "attn_norm"] if i else []) + [p + "mlp_norm"]
  if "mlm" in heads:
    shapes["head.dense.weight"] = (d, d)
    if c.head_bias:
      shapes["head.dense.bias"] = (d,)
    norms.append("head.norm")
    if c.decoder_bias:
      shapes["decoder.bias"] = (v,)
    if not c.tie_word_embeddings:
      shapes["decoder.weight"] = (v, d)
  if PREDICTION_HEAD in heads:
    shapes["head.dense.weight"] = (d, d)
    if c.head_bias:
      shapes["head.dense.bias"] = (d,)
    norms.append("head.norm")
    # The labels are config.json's; their count is the stored one, but the span head's (2).
    labels = 2 if QA_HEAD in heads else int(num_labels)
    shapes.update({"classifier.weight": (labels, d), "classifier.bias": (labels,)})
  for prefix in norms:
    for name in _norm_names(prefix, c):
      shapes[name] = (d,)
  return shapes


def _check(sd: dict, config: BertConfig, heads) -> None:
  stored = sd.get("classifier.weight")
  expected = _expected_shapes(config, heads, stored.shape[0] if stored is not None else 0)
  task = PREDICTION_HEAD in heads
  present = {k: v for k, v in sd.items()
             if "mlm" in heads or task or not k.startswith(_HEAD_PREFIXES)}
  tied = {"decoder.weight"} if config.tie_word_embeddings else set()
  missing = sorted(set(expected) - set(present))
  unexpected = sorted(set(present) - set(expected) - tied)
  misshaped = sorted(f"{k}: {tuple(present[k].shape)} (expected {expected[k]})"
                     for k in set(expected) & set(present)
                     if tuple(present[k].shape) != expected[k])
  untied = [k for k in tied if k in present and not np.array_equal(
      present[k], present["model.embeddings.tok_embeddings.weight"])]
  problems = [f"{what} ({len(keys)}): {keys}" for what, keys in
              (("missing keys", missing), ("unexpected keys", unexpected),
               ("mis-shaped keys", misshaped)) if keys]
  if untied:
    problems.append("decoder.weight differs from the word embeddings although config.json ties "
                    "them (tie_word_embeddings); set tie_word_embeddings=false in config.json")
  if problems:
    raise Refusal(
        f"The ModernBERT state dict does not fit its config (hidden_size={config.hidden_size}, "
        f"num_layers={config.num_layers}, intermediate_size={config.intermediate_size}, "
        f"attention_bias={config.attention_bias}, mlp_bias={config.mlp_bias}, norm_bias="
        f"{config.norm_bias}): " + "; ".join(problems))


def _layer_root(config: BertConfig, i: int) -> tuple[str, ...]:
  return ("bert", "encoder", "layers", "layer") if config.scan_layers else (
      "bert", "encoder", f"layer_{i}")


def _layer_from(sd: dict, config: BertConfig, i: int) -> dict:
  """One layer's bertjax parameters from the Hugging Face tensors of layer i."""
  c, p = config, f"model.layers.{i}."
  d, n, k, f = c.hidden_size, c.num_heads, c.head_size, c.intermediate_size
  qkv_Dx3xNxK = sd[p + "attn.Wqkv.weight"].T.reshape(d, 3, n, k)
  out: dict = {"attention": {}, "mlp": {}}
  for j, proj in enumerate(("query", "key", "value")):
    out["attention"][proj] = {"kernel": qkv_Dx3xNxK[:, j]}
    if c.attention_bias:
      out["attention"][proj]["bias"] = sd[p + "attn.Wqkv.bias"].reshape(3, n, k)[j]
  out["attention"]["output"] = {"kernel": sd[p + "attn.Wo.weight"].T.reshape(n, k, d)}
  wi_Dx2F = sd[p + "mlp.Wi.weight"].T
  out["mlp"]["intermediate"] = {"kernel": wi_Dx2F[:, :f]}
  out["mlp"]["gate"] = {"kernel": wi_Dx2F[:, f:]}
  out["mlp"]["output"] = {"kernel": sd[p + "mlp.Wo.weight"].T}
  if c.attention_bias:
    out["attention"]["output"]["bias"] = sd[p + "attn.Wo.bias"]
  if c.mlp_bias:
    out["mlp"]["intermediate"]["bias"] = sd[p + "mlp.Wi.bias"][:f]
    out["mlp"]["gate"]["bias"] = sd[p + "mlp.Wi.bias"][f:]
    out["mlp"]["output"]["bias"] = sd[p + "mlp.Wo.bias"]
  if i:
    out["attention_layer_norm"] = _norm_from(sd, p + "attn_norm", c)
  elif c.scan_layers:
    # Scanned layers share one structure: layer 0 carries a norm it bypasses (model/encoder.py).
    out["attention_layer_norm"] = _identity_norm(c)
  out["output_layer_norm"] = _norm_from(sd, p + "mlp_norm", c)
  return out


def _norm_from(sd: dict, prefix: str, config: BertConfig) -> dict:
  out = {"scale": sd[f"{prefix}.weight"]}
  if config.norm_bias:
    out["bias"] = sd[f"{prefix}.bias"]
  return out


def _identity_norm(config: BertConfig) -> dict:
  out = {"scale": np.ones(config.hidden_size, np.float32)}
  if config.norm_bias:
    out["bias"] = np.zeros(config.hidden_size, np.float32)
  return out


def params_from_modernbert(state_dict: dict, config: BertConfig, heads=None,
                           hf_config: dict | None = None) -> dict:
  """bertjax parameters (numpy) from a ModernBERT state dict: the encoder (`bert`), and the MLM
  head (`mlm`) or a task class's heads (PREDICTION_HEAD and "classifier" or "span", as
  bertjax/model/heads.py names them) when asked for or, with heads None, when present (`hf_config`,
  the folder's config.json, names the task class). Raises ValueError naming every missing,
  unexpected and mis-shaped tensor at once."""
  import jax  # pylint: disable=import-outside-toplevel
  sd = _normalise_names(state_dict)
  heads = heads_in(sd, hf_config) if heads is None else tuple(heads)
  unknown = set(heads) - {"mlm", *TASK_SUBTREES}
  if unknown:
    raise Refusal(f"A ModernBERT folder holds no {sorted(unknown)} head; it has the MLM head "
                  "or a task class's (no next-sentence prediction)")
  _check(sd, config, heads)
  layers = [_layer_from(sd, config, i) for i in range(config.num_layers)]
  if config.scan_layers:
    encoder = {"layers": {"layer": jax.tree.map(lambda *xs: np.stack(xs), *layers)}}
  else:
    encoder = {f"layer_{i}": layer for i, layer in enumerate(layers)}
  params = {"bert": {
      "embeddings": {"word_embeddings": {"embedding": sd["model.embeddings.tok_embeddings.weight"]},
                     "layer_norm": _norm_from(sd, "model.embeddings.norm", config)},
      "encoder": encoder,
      "final_layer_norm": _norm_from(sd, "model.final_norm", config)}}
  if "mlm" in heads:
    transform = {"kernel": sd["head.dense.weight"].T}
    if config.head_bias:
      transform["bias"] = sd["head.dense.bias"]
    mlm = {"transform": transform, "transform_layer_norm": _norm_from(sd, "head.norm", config)}
    if config.decoder_bias:
      mlm["output_bias"] = sd["decoder.bias"]
    if not config.tie_word_embeddings:
      mlm["decoder"] = sd["decoder.weight"]
    params["mlm"] = mlm
  if PREDICTION_HEAD in heads:
    transform = {"kernel": sd["head.dense.weight"].T}
    if config.head_bias:
      transform["bias"] = sd["head.dense.bias"]
    params[PREDICTION_HEAD] = {"transform": transform,
                               "transform_layer_norm": _norm_from(sd, "head.norm", config)}
    classifier = next((h for h in heads if h in CLASSIFIERS), None)
    if classifier is not None:  # not asked for where a new task starts from the class's head
      params[classifier] = {"kernel": sd["classifier.weight"].T, "bias": sd["classifier.bias"]}
  dtype = np.dtype(config.param_dtype)
  return jax.tree.map(lambda x: np.ascontiguousarray(x, dtype=dtype), params)


def params_to_modernbert(params: dict, config: BertConfig) -> dict[str, np.ndarray]:
  """The ModernBertForMaskedLM state dict (float32 numpy) of bertjax parameters; the head's
  tensors only when `params` holds "mlm". A tied decoder is not written (transformers ties it).
  Parameters with PREDICTION_HEAD give a task class's state dict (`head.*`, `classifier.*`)."""
  import jax  # pylint: disable=import-outside-toplevel
  config_to_modernbert(config)  # refuses a model without a ModernBERT form
  c = config
  p32 = jax.tree.map(lambda x: np.asarray(x, np.float32), params)
  bert = p32["bert"]
  d = c.hidden_size
  table_VxD = bert["embeddings"]["word_embeddings"]["embedding"]
  sd = {"model.embeddings.tok_embeddings.weight": table_VxD}

  def norm(prefix, tree):
    sd[f"{prefix}.weight"] = tree["scale"]
    if c.norm_bias:
      sd[f"{prefix}.bias"] = tree["bias"]

  norm("model.embeddings.norm", bert["embeddings"]["layer_norm"])
  norm("model.final_norm", bert["final_layer_norm"])
  for i in range(c.num_layers):
    layer = (jax.tree.map(lambda x, i=i: x[i], bert["encoder"]["layers"]["layer"])
             if "layers" in bert["encoder"] else bert["encoder"][f"layer_{i}"])
    a, m, p = layer["attention"], layer["mlp"], f"model.layers.{i}."
    sd[p + "attn.Wqkv.weight"] = np.concatenate(
        [a[proj]["kernel"].reshape(d, d) for proj in ("query", "key", "value")], axis=1).T
    sd[p + "attn.Wo.weight"] = a["output"]["kernel"].reshape(d, d).T
    sd[p + "mlp.Wi.weight"] = np.concatenate(
        [m["intermediate"]["kernel"], m["gate"]["kernel"]], axis=1).T
    sd[p + "mlp.Wo.weight"] = m["output"]["kernel"].T
    if c.attention_bias:
      sd[p + "attn.Wqkv.bias"] = np.concatenate(
          [a[proj]["bias"].reshape(d) for proj in ("query", "key", "value")])
      sd[p + "attn.Wo.bias"] = a["output"]["bias"]
    if c.mlp_bias:
      sd[p + "mlp.Wi.bias"] = np.concatenate([m["intermediate"]["bias"], m["gate"]["bias"]])
      sd[p + "mlp.Wo.bias"] = m["output"]["bias"]
    if i:
      norm(p + "attn_norm", layer["attention_layer_norm"])
    norm(p + "mlp_norm", layer["output_layer_norm"])
  if "mlm" in p32:
    mlm = p32["mlm"]
    sd["head.dense.weight"] = mlm["transform"]["kernel"].T
    if c.head_bias:
      sd["head.dense.bias"] = mlm["transform"]["bias"]
    norm("head.norm", mlm["transform_layer_norm"])
    if c.decoder_bias:
      sd["decoder.bias"] = mlm["output_bias"]
    if not c.tie_word_embeddings:
      sd["decoder.weight"] = mlm["decoder"]
  if PREDICTION_HEAD in p32:
    head = p32[PREDICTION_HEAD]
    sd["head.dense.weight"] = head["transform"]["kernel"].T
    if c.head_bias:
      sd["head.dense.bias"] = head["transform"]["bias"]
    norm("head.norm", head["transform_layer_norm"])
    classifier = p32[next(h for h in CLASSIFIERS if h in p32)]
    sd["classifier.weight"] = classifier["kernel"].T
    sd["classifier.bias"] = classifier["bias"]
  return {k: np.ascontiguousarray(v) for k, v in sd.items()}


def load_dir(hf_dir: str, **config_overrides) -> tuple[BertConfig, dict]:
  """(config, params) of a ModernBERT folder (config.json + model.safetensors)."""
  for name in ("config.json", "model.safetensors"):
    if not os.path.exists(os.path.join(hf_dir, name)):
      raise FileNotFoundError(f"{os.path.join(hf_dir, name)} not found: a ModernBERT folder holds "
                              "config.json and model.safetensors (save_pretrained writes both)")
  with open(os.path.join(hf_dir, "config.json")) as f:
    hf_config = json.load(f)
  config = config_from_modernbert(hf_config, **config_overrides)
  return config, params_from_modernbert(
      hf.read_safetensors(os.path.join(hf_dir, "model.safetensors")), config,
      hf_config=hf_config)


def save_dir(hf_dir: str, params: dict, config: BertConfig,
             token_ids: dict | None = None, write_more=None) -> str:
  """Writes config.json and model.safetensors that transformers' ModernBertForMaskedLM loads
  (bertjax/formats/outfolder.py: nothing else left in the folder), and what `write_more(folder)`
  writes (the tokenizer's files); returns what was written besides, and removed."""
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel
  state_dict = params_to_modernbert(params, config)
  with outfolder.ExportFolder(hf_dir) as folder:
    with open(folder.path("config.json"), "w") as f:
      json.dump(config_to_modernbert(config, token_ids), f, indent=2)
    save_file(state_dict, folder.path("model.safetensors"), metadata={"format": "pt"})
    more = write_more(folder) if write_more is not None else ""
  return more + folder.said()
