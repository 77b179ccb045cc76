"""Shared helpers of the Google-checkpoint tests (no tests here): the original's variables written
out by hand, and Google folders written with TensorFlow's own checkpoint writer."""

import json
import os

import numpy as np
import tensorflow as tf

from test_data_fixtures import write_vocab

# A small BERT of Google's release (uncased_L-2_H-128_A-2) with a test vocabulary.
GOOGLE_CONFIG = dict(attention_probs_dropout_prob=0.1, hidden_act="gelu", hidden_dropout_prob=0.1,
                     hidden_size=128, initializer_range=0.02, intermediate_size=512,
                     max_position_embeddings=64, num_attention_heads=2, num_hidden_layers=2,
                     type_vocab_size=2, vocab_size=410)
NAME = "uncased_L-2_H-128_A-2"


def shapes(c: dict) -> dict[str, tuple[int, ...]]:
  """The original's variables and shapes, written out here rather than taken from the converter."""
  h, f, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
  out = {"bert/embeddings/word_embeddings": (v, h),
         "bert/embeddings/position_embeddings": (c["max_position_embeddings"], h),
         "bert/embeddings/token_type_embeddings": (c["type_vocab_size"], h),
         "bert/pooler/dense/kernel": (h, h), "bert/pooler/dense/bias": (h,),
         "cls/predictions/transform/dense/kernel": (h, h),
         "cls/predictions/transform/dense/bias": (h,), "cls/predictions/output_bias": (v,),
         "cls/seq_relationship/output_weights": (2, h), "cls/seq_relationship/output_bias": (2,)}
  norms = ["bert/embeddings/LayerNorm", "cls/predictions/transform/LayerNorm"]
  for i in range(c["num_hidden_layers"]):
    p = f"bert/encoder/layer_{i}/"
    for dense, shape in (("attention/self/query", (h, h)), ("attention/self/key", (h, h)),
                         ("attention/self/value", (h, h)), ("attention/output/dense", (h, h)),
                         ("intermediate/dense", (h, f)), ("output/dense", (f, h))):
      out[p + dense + "/kernel"], out[p + dense + "/bias"] = shape, shape[-1:]
    norms += [p + "attention/output/LayerNorm", p + "output/LayerNorm"]
  for norm in norms:
    out[norm + "/gamma"] = out[norm + "/beta"] = (h,)
  return out


def random_variables(c: dict, seed=0) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)  # scale 0.2 keeps activations in a useful range
  return {name: (rng.normal(size=shape) * 0.2).astype(np.float32)
          for name, shape in shapes(c).items()}


def save(prefix: str, variables: dict) -> None:
  """TensorFlow's own checkpoint writer (the op tf.compat.v1.train.Saver runs), names as given."""
  names = sorted(variables)
  tf.raw_ops.SaveV2(prefix=prefix, tensor_names=names, shape_and_slices=[""] * len(names),
                    tensors=[tf.constant(variables[n]) for n in names])


def google_folder(root, c=GOOGLE_CONFIG, name=NAME, variables=None, extra=None) -> str:
  folder = os.path.join(str(root), name)
  os.makedirs(folder, exist_ok=True)
  variables = dict(random_variables(c) if variables is None else variables)
  save(os.path.join(folder, "bert_model.ckpt"), {**variables, **(extra or {})})
  with open(os.path.join(folder, "bert_config.json"), "w") as f:
    json.dump(c, f)
  write_vocab(os.path.join(folder, "vocab.txt"))
  return folder


def slots(variables: dict) -> dict:
  """What a training checkpoint adds: Adam's two slots per variable and the step."""
  out = {"global_step": np.int64(1000)}
  for name, value in variables.items():
    out[name + "/adam_m"], out[name + "/adam_v"] = value * 0.5, value * value
  return out
