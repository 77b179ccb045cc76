"""A Google folder as released (bert_config.json, bert_model.ckpt.*, vocab.txt) as `init_from`:
pre-training continues from it and fine-tuning starts from it, with its vocabulary and casing."""

import json
import os

import jax
import numpy as np
import pytest
import tensorflow as tf

from bertjax import errors
from bertjax.configs import tiny
from bertjax.convert import google as convert_google
from bertjax.finetune.job import run
from bertjax.formats import google
from bertjax.pretrain import job as pretrain_job
from bertjax.training import checkpoint as checkpoint_lib, train
from bertjax.weights import reader as weights, match as weights_match
from google_fixtures import google_folder, random_variables, slots
from test_data_fixtures import data_section
from finetune_fixtures import Builds, tiny_next_config, write_tiny_next

SMALL = dict(attention_probs_dropout_prob=0.1, hidden_act="gelu", hidden_dropout_prob=0.1,
             hidden_size=32, initializer_range=0.02, intermediate_size=64,
             max_position_embeddings=64, num_attention_heads=2, num_hidden_layers=1,
             type_vocab_size=2, vocab_size=410)


@pytest.fixture(name="one_device")
def _one_device(monkeypatch):
  """Runs on one device: a third faster to compile and save than on 8."""
  real = train.build

  def build(model_config, train_config, mesh_config, devices=None, objective=train.PRETRAINING):
    del devices
    return real(model_config, train_config, mesh_config, jax.devices()[:1], objective)
  monkeypatch.setattr(train, "build", build)


def _saved_variables(workdir):
  """The last checkpoint's parameters of `workdir`, under Google's names."""
  ckpt = checkpoint_lib.Checkpointer(os.path.join(workdir, "checkpoints"), checkpoint_lib.TRAIN_ITEMS,
                                     save_every=1, keep=1)
  params = ckpt.restore_stored(ckpt.all_steps()[-1], "params")
  ckpt.close()
  return params


def _pretraining_config(tmp_path):
  config = tiny.get_config()
  config.data = data_section(tmp_path / "data", n_docs=30, sents_per_doc=12)
  config.data.tokenizer, config.data.vocab_path = "sentencepiece", ""  # init_from's, then
  m = config.model
  m.vocab_size, m.hidden_size, m.num_layers, m.num_heads, m.intermediate_size = 0, 32, 1, 2, 64
  m.max_position_embeddings = 64
  t = config.train
  t.batch_size, t.num_train_steps, t.warmup_steps, t.learning_rate = 8, 2, 0, 0.0
  t.log_every_steps, t.eval_every_steps, t.eval_sequences = 2, 0, 8
  config.checkpoint.save_every_steps = 2
  return config


def test_pretraining_continues_from_a_google_folder(tmp_path, one_device, capsys):
  variables = random_variables(SMALL)
  folder = google_folder(tmp_path, SMALL, "uncased_L-1_H-32_A-2", variables, slots(variables))
  config = _pretraining_config(tmp_path)
  config.checkpoint.init_from = folder
  pretrain_job.train_and_evaluate(config, str(tmp_path / "run"))
  out = capsys.readouterr().out
  assert (f"vocabulary from checkpoint.init_from: {folder}/vocab.txt (wordpiece, "
          "do_lower_case=True: the name uncased_L-1_H-32_A-2 says uncased)") in out
  assert f"parameters from checkpoint.init_from={folder} (google): encoder + mlm + nsp," in out
  # Learning rate 0: the checkpoint holds the Google folder's weights, bit for bit.
  saved = google.params_to_google(_saved_variables(tmp_path / "run"),
                                  google.config_from_google(SMALL))
  assert saved.keys() == variables.keys()
  for name, value in variables.items():
    assert saved[name].tobytes() == value.tobytes(), name
  record = json.load(open(tmp_path / "run" / "tokenizer.json"))
  assert record["copied_from"] == os.path.join(folder, "vocab.txt") and record["do_lower_case"]
  # The run exports back to Google's layout: the same variables, config and vocabulary.
  convert_google.export_folder(str(tmp_path / "run"), str(tmp_path / "exported"))
  reader = tf.train.load_checkpoint(str(tmp_path / "exported" / "bert_model.ckpt"))
  assert sorted(reader.get_variable_to_shape_map()) == sorted(variables)
  for name, value in variables.items():
    assert reader.get_tensor(name).tobytes() == value.tobytes(), name
  exported = json.load(open(tmp_path / "exported" / "bert_config.json"))
  assert exported.keys() == SMALL.keys()  # the sizes of the folder, the run's dropout and init
  assert {k: v for k, v in exported.items() if isinstance(v, int)} == {
      k: v for k, v in SMALL.items() if isinstance(v, int)}
  assert (tmp_path / "exported" / "vocab.txt").read_text() == open(
      os.path.join(folder, "vocab.txt")).read()

  # Another model size is refused, naming the sizes; so is another vocabulary, unless asked for
  # (both checked where the run takes init_from's parameters).
  source = weights.inspect(folder)
  bigger = google.config_from_google(dict(SMALL, hidden_size=64, intermediate_size=128))
  with pytest.raises(errors.CheckpointMismatchError,
                     match="hidden_size: checkpoint 32 vs config 64; model.intermediate_size: "
                     "checkpoint 64 vs config 128"):
    weights_match.check_model(source, bigger)
  with pytest.raises(errors.CheckpointMismatchError,
                     match=r"was trained with another vocabulary \(fingerprint wordpiece-410-\w+\) "
                     r"than this run's \(fingerprint wordpiece-410-0123\).* set "
                     "checkpoint.init_from_other_vocab=True"):
    weights_match.check_vocabulary(source, "wordpiece-410-0123", True)


def test_finetuning_starts_from_a_google_folder(tmp_path, one_device, monkeypatch):
  variables = random_variables(SMALL, seed=3)
  folder = google_folder(tmp_path, SMALL, "cased_L-1_H-32_A-2", variables)
  write_tiny_next(tmp_path / "task")
  config = tiny_next_config(folder, str(tmp_path / "task"))
  config.model.scan_layers = True  # a layout of ours: any fits a Google folder
  builds = Builds(monkeypatch)
  results = run.finetune(config, str(tmp_path / "ft"))
  assert results["evaluations"]
  # The encoder the first step starts from is the folder's, leaf for leaf.
  encoder = builds.first_params["bert"]
  layer = encoder["encoder"]["layers"]["layer"]
  np.testing.assert_array_equal(layer["mlp"]["intermediate"]["kernel"][0],
                                variables["bert/encoder/layer_0/intermediate/dense/kernel"])
  np.testing.assert_array_equal(encoder["embeddings"]["word_embeddings"]["embedding"],
                                variables["bert/embeddings/word_embeddings"])
  np.testing.assert_array_equal(encoder["pooler"]["dense"]["kernel"],
                                variables["bert/pooler/dense/kernel"])
  # The folder's vocab.txt became the run's, cased as the folder's name says.
  record = json.load(open(tmp_path / "ft" / "tokenizer.json"))
  assert record["copied_from"] == os.path.join(folder, "vocab.txt")
  assert record["do_lower_case"] is False

  # Another model size is refused, naming the sizes.
  config = tiny_next_config(folder, str(tmp_path / "task"))
  config.model.hidden_size = 64
  with pytest.raises(ValueError, match=f"config.model.hidden_size=64 but checkpoint.init_from="
                     f"{folder} has 32"):
    run.finetune(config, str(tmp_path / "ft2"))
  # Another vocabulary than the folder's is refused, naming both fingerprints.
  pieces = open(os.path.join(folder, "vocab.txt")).read().split("\n")
  other = tmp_path / "other_vocab.txt"
  other.write_text("\n".join(pieces[:5] + [pieces[6], pieces[5]] + pieces[7:]))
  config = tiny_next_config(folder, str(tmp_path / "task"))
  config.data.vocab_path, config.data.do_lower_case = str(other), False
  with pytest.raises(errors.CheckpointMismatchError, match="fingerprint") as err:
    run.finetune(config, str(tmp_path / "ft3"))
  assert str(err.value).count("wordpiece-") == 2
