"""A fine-tuned transformers folder as an encoder: `load_pretrained` and `checkpoint.init_from`
(pre-training's, in a fresh interpreter that never imports fine-tuning, and fine-tuning's) take
the encoder of BertForSequenceClassification, BertForTokenClassification,
BertForQuestionAnswering and ModernBertFor* folders saved by transformers, tensor for tensor, and
say which head they leave out; where the class built no pooler, the pooler starts new.

The weights reader records what a folder says (its class, labels, problem_type) and nothing
more: which task family that is, fine-tuning resolves (a multi-label head has none, and its
encoder is still taken)."""

import json
import os
import subprocess
import sys
import textwrap

import flax.linen as nn
import jax
import numpy as np
import pytest
import torch
import transformers

from bertjax import errors
from bertjax.finetune import families
from bertjax.finetune.job import init_from, run
from bertjax.formats import taskspec
from bertjax.weights import reader as weights
from test_convert_modernbert import randomised
from test_modernbert_heads import BASE

LABELS = {"id2label": {0: "neg", 1: "pos", 2: "mixed"}}
BERT = dict(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=32, max_position_embeddings=32)
FOLDERS = {  # name: (transformers class, its config's extra keys)
    "BertForSequenceClassification": ("BertForSequenceClassification", LABELS),
    "BertForTokenClassification": ("BertForTokenClassification", LABELS),
    "BertForQuestionAnswering": ("BertForQuestionAnswering", {}),
    "ModernBertForSequenceClassification": ("ModernBertForSequenceClassification", LABELS),
    "ModernBertForTokenClassification": ("ModernBertForTokenClassification", LABELS),
    "ModernBertForQuestionAnswering": ("ModernBertForQuestionAnswering", {}),
    "multi_label": ("ModernBertForSequenceClassification",
                    {**LABELS, "problem_type": "multi_label_classification"}),
}
NO_POOLER = ("BertForTokenClassification", "BertForQuestionAnswering")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
  out = {}
  for n, (name, (cls, extra)) in enumerate(FOLDERS.items()):
    torch.manual_seed(n)
    modern = cls.startswith("ModernBert")
    config = (transformers.ModernBertConfig(**BASE, **extra) if modern
              else transformers.BertConfig(**BERT, **extra))
    folder = tmp_path_factory.mktemp(name)
    randomised(getattr(transformers, cls)(config)).save_pretrained(folder)
    out[name] = str(folder)
  return out


def _flat(tree) -> dict[str, np.ndarray]:
  return {jax.tree_util.keystr(p): np.asarray(x)
          for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def _assert_the_encoder(got, name, folder):
  """`got` (flat, as `_flat` makes it) holds the folder's encoder tensor for tensor, and a pooler
  where the class built none."""
  stored = _flat(weights.read(weights.inspect(folder))["bert"])
  new = {k for k in got if k.startswith("['pooler']")} if name in NO_POOLER else set()
  assert set(got) - new == set(stored) and len(stored) > 10, name
  assert len(new) == (2 if name in NO_POOLER else 0), name  # dense kernel and bias
  for key, value in stored.items():
    np.testing.assert_array_equal(got[key], value, err_msg=f"{name} {key}")


def test_load_pretrained_and_pretraining_init_from_in_a_fresh_interpreter(folders, tmp_path):
  # A fresh interpreter: pytest's has imported the families (a registry filled by that import
  # once made load_pretrained refuse a ModernBertFor* folder there, and take it here).
  script = textwrap.dedent(f"""
      import dataclasses, json, sys
      import jax, numpy as np
      from bertjax.weights import reader as weights
      from bertjax.parallel.sharding import MeshConfig
      from bertjax.weights.pretrained import load_pretrained
      from bertjax.pretrain import job as pretrain_job
      from bertjax.training import train
      out = {{}}
      for name, path in {folders!r}.items():
        config, encoder = load_pretrained(path)
        np.savez(f"{tmp_path}/{{name}}.load.npz", **{{jax.tree_util.keystr(p): np.asarray(x)
            for p, x in jax.tree_util.tree_leaves_with_path(encoder)}})
        source = weights.inspect(path, what="checkpoint.init_from")
        training = train.build(config, train.TrainConfig(batch_size=8, num_train_steps=1,
                                                         warmup_steps=0),
                               MeshConfig(), devices=jax.devices()[:1])
        data = type("Data", (), {{"do_lower_case": True, "vocab_path": "vocab.txt"}})()
        init = pretrain_job.init_from_source(source, training, data, "", True)
        fresh = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype),
                             training.abstract_state.params)
        got = init.load(fresh)
        np.savez(f"{tmp_path}/{{name}}.init.npz", **{{jax.tree_util.keystr(p): np.asarray(x)
            for p, x in jax.tree_util.tree_leaves_with_path(got["bert"])}})
        out[name] = init.origin
      out["imported"] = sorted(m for m in sys.modules if m.startswith("bertjax.finetune"))
      print(json.dumps(out))
  """)
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
  result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, timeout=600, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  said = json.loads(result.stdout.strip().splitlines()[-1])
  assert said.pop("imported") == []  # nothing of fine-tuning was needed
  for name, folder in folders.items():
    for kind in ("load", "init"):
      with np.load(tmp_path / f"{name}.{kind}.npz") as saved:
        _assert_the_encoder({k: saved[k] for k in saved.files}, name, folder)
    # Said on the console: the head left out (by its class), the pooler started new.
    warned = [line for line in result.stderr.splitlines() if f"load_pretrained({folder})" in line]
    assert len(warned) == 1 and "head" in warned[0] and "not read" in warned[0], name
    assert (FOLDERS[name][0] in warned[0]) and (FOLDERS[name][0] in said[name]), name
    assert ("pooler new" in said[name]) == ("pooler new" in warned[0]) == (name in NO_POOLER)


@pytest.mark.parametrize("name", list(FOLDERS))
def test_finetuning_init_from_takes_the_encoder(folders, name):
  source = weights.inspect(folders[name], what="checkpoint.init_from")
  assert source.task_class.architecture == FOLDERS[name][0]
  assert source.task_class.labels == (("neg", "pos", "mixed") if "id2label" in FOLDERS[name][1]
                                      else ())
  spec = taskspec.TaskSpec("tagging", "tagging", ("O", "B-X", "I-X"), 16)
  model = families.get("tagging").objective(spec).make_model(source.config)
  ids = np.zeros((1, 8), np.int32)
  # A run's new parameters, in the model's tree: filled with 1s (no init to run), so a value
  # taken from the folder cannot pass for one left new.
  shapes = jax.eval_shape(lambda: nn.unbox(model.init(jax.random.PRNGKey(0), ids, ids, ids)))
  fresh = jax.tree.map(lambda s: np.ones(s.shape, s.dtype), shapes["params"])
  origin, init = init_from.initialiser(source, source.config, "tagging")
  got = init.load(fresh)
  _assert_the_encoder(_flat(got["bert"]), name, folders[name])
  if name in NO_POOLER:  # the model's own new pooler, not another
    np.testing.assert_array_equal(got["bert"]["pooler"]["dense"]["kernel"],
                                  fresh["bert"]["pooler"]["dense"]["kernel"])
  assert FOLDERS[name][0] in init.origin and "not read" in init.origin, init.origin
  assert origin.startswith("the encoder")


def test_which_family_a_folder_is_fine_tunings_to_say(folders):
  found = {name: families.spec_of(weights.inspect(path)) for name, path in folders.items()
           if name != "multi_label"}
  assert {n: s and (s.family, s.labels) for n, s in found.items()} == {
      "BertForSequenceClassification": None,  # predicted only from a fine-tuning workdir
      "BertForTokenClassification": None, "BertForQuestionAnswering": None,
      "ModernBertForSequenceClassification": ("classification", ("neg", "pos", "mixed")),
      "ModernBertForTokenClassification": ("tagging", ("neg", "pos", "mixed")),
      "ModernBertForQuestionAnswering": ("span", ())}
  with pytest.raises(ValueError, match="multi_label_classification"):
    families.spec_of(weights.inspect(folders["multi_label"]))
  # predict says what it reads of a BertFor* folder (it said "no task head", which is false).
  from bertjax.predict import predictor as predict  # pylint: disable=import-outside-toplevel
  with pytest.raises(errors.Refusal, match=r"is a huggingface folder of "
                     r"BertForSequenceClassification, a head predict does not read: predict runs "
                     r"the task of a fine-tuning workdir .* or of a ModernBertFor\* folder"):
    predict.Predictor.from_workdir(folders["BertForSequenceClassification"])
