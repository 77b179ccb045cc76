"""The one reader of weights (bertjax/weights/reader.py): every kind of folder, holding the same weights,
read by every caller alike; a damaged folder of each kind refused with the same message by every
caller; no TensorFlow imported to read a local folder."""

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys

import flax.linen as nn
import jax
import numpy as np
import pytest

from bertjax.convert import google as convert_google, hf as convert_hf
from bertjax.data import tokenizer as tokenizer_lib, vocab_record
from bertjax.finetune.job import init_from
from bertjax.formats import google, hf
from bertjax.model.heads import BertForPreTraining
from bertjax.parallel.sharding import MeshConfig
from bertjax.pretrain import job as pretrain_job
from bertjax.training import checkpoint as checkpoint_lib, train
from bertjax.weights import reader as weights, match as weights_match
from bertjax.weights.pretrained import load_pretrained
from conftest import xla_flags
from google_fixtures import google_folder, random_variables, slots
from test_data_fixtures import write_vocab

SMALL = dict(attention_probs_dropout_prob=0.1, hidden_act="gelu", hidden_dropout_prob=0.1,
             hidden_size=32, initializer_range=0.02, intermediate_size=64,
             max_position_embeddings=64, num_attention_heads=2, num_hidden_layers=2,
             type_vocab_size=2, vocab_size=410)
CONFIG = google.config_from_google(SMALL)
KINDS = ("workdir", "converted", "google", "huggingface")


def _workdir(root, params, vocab, lower):
  """A run's workdir as bertjax's loop leaves it: checkpoints with the model and vocabulary
  recorded, and the vocabulary copied in."""
  workdir = os.path.join(root, "workdir")
  fingerprint = tokenizer_lib.load_vocabulary(vocab, "wordpiece", lower).fingerprint
  ckpt = checkpoint_lib.Checkpointer(os.path.join(workdir, "checkpoints"),
                                     checkpoint_lib.TRAIN_ITEMS, save_every=1, keep=3,
                                     async_save=False)
  expected = checkpoint_lib.Expected(model=CONFIG, tokenizer_fingerprint=fingerprint)
  ckpt.save(7, {"params": params, "opt_state": {"mu": jax.tree.map(np.zeros_like, params)}},
            {**expected.meta(), "step": 7}, force=True)
  ckpt.close()
  vocab_record.copy_to_workdir(vocab, "wordpiece", fingerprint, workdir, lower)
  return workdir


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
  """The same weights (a cased vocabulary) in each kind of folder; {kind: path}, and the params."""
  root = str(tmp_path_factory.mktemp("weights"))
  variables = random_variables(SMALL, seed=5)
  # "cased_" in the name: Google's casing from the name, recorded by the import as it converts.
  google_dir = google_folder(root, SMALL, "cased_L-2_H-32_A-2", variables, slots(variables))
  params = google.params_from_google(variables, CONFIG)
  convert_google.import_folder(google_dir, os.path.join(root, "converted"))
  hf_dir = os.path.join(root, "huggingface")
  hf.save_hf_dir(hf_dir, params, CONFIG)
  write_vocab(os.path.join(hf_dir, "vocab.txt"))
  with open(os.path.join(hf_dir, "tokenizer_config.json"), "w") as f:
    json.dump({"do_lower_case": False, "tokenizer_class": "BertTokenizer"}, f)
  paths = {"workdir": _workdir(root, params, os.path.join(google_dir, "vocab.txt"), False),
           "converted": os.path.join(root, "converted"), "google": google_dir,
           "huggingface": hf_dir}
  return paths, params


def _same(got, want):
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def _zeros(scan):
  """Fresh parameters of BertForPreTraining (zeros), in either layer layout."""
  config = dataclasses.replace(CONFIG, scan_layers=scan)
  ids = np.zeros((1, 4), np.int32)
  shapes = jax.eval_shape(lambda: nn.unbox(BertForPreTraining(config).init(
      jax.random.key(0), ids, ids, ids, np.zeros((1, 1), np.int32))["params"]))
  return config, jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes)


def _callers(tmp_path):
  """What each caller makes of a path: (its name, path -> the encoder it would start from)."""
  def pretraining(path):
    config, fresh = _zeros(scan=True)
    training = train.build(config, train.TrainConfig(batch_size=8, num_train_steps=1,
                                                     warmup_steps=0),
                           MeshConfig(), devices=jax.devices()[:1])
    source = weights.inspect(path, what="checkpoint.init_from")
    data = type("Data", (), {"do_lower_case": False, "vocab_path": source.vocab_file,
                             "tokenizer": "wordpiece", "source": ""})()
    fingerprint = weights_match.fingerprint_of(source, False)
    init = pretrain_job.init_from_source(source, training, data, fingerprint, False)
    got = init.load(fresh)
    assert sorted(got) == ["bert", "mlm", "nsp"]
    return weights.restack(jax.device_get(got["bert"]), config.num_layers, False)

  def finetuning(path):
    source = weights.inspect(path, what="checkpoint.init_from")
    _, fresh = _zeros(scan=False)
    return jax.device_get(init_from._encoder_loader(source)({"bert": fresh["bert"]})["bert"])

  def google_export(path):
    out = str(tmp_path / f"google-{len(os.listdir(tmp_path))}")
    convert_google.export_folder(path, out)
    return google.load_folder(out)[1]["bert"]

  def hf_export(path):
    out = str(tmp_path / f"hf-{len(os.listdir(tmp_path))}")
    convert_hf.export_folder(path, out)
    return hf.load_hf_dir(out)[1]["bert"]

  return {"load_pretrained": lambda path: load_pretrained(path)[1],
          "pre-training init_from": pretraining, "fine-tuning init_from": finetuning,
          "convert.google export": google_export, "convert.hf export": hf_export}


@pytest.mark.parametrize("kind", KINDS)
def test_every_caller_reads_the_same_encoder_model_and_vocabulary(folders, kind, tmp_path):
  paths, params = folders
  source = weights.inspect(paths[kind])
  assert source.kind == kind
  assert source.config.num_layers == 2 and source.config.hidden_size == 32
  assert set(source.subtrees) >= {"bert", "mlm", "nsp"}
  # The cased vocabulary, whichever way the folder says so.
  assert source.do_lower_case is False, source.casing_why
  assert open(source.vocab_file).read() == open(os.path.join(paths["google"], "vocab.txt")).read()
  for name, read in _callers(tmp_path).items():
    _same(read(paths[kind]), params["bert"])  # the encoder, bit for bit, whoever reads it


def _damage(kind, path):
  if kind == "workdir":  # the arrays of the newest step gone, its records intact
    shutil.rmtree(os.path.join(path, "checkpoints", "7", "params", "d"))
  elif kind == "converted":
    with open(os.path.join(path, "bert_config.json"), "r+") as f:
      f.truncate(20)
  elif kind == "google":
    with open(os.path.join(path, "bert_model.ckpt.index"), "r+b") as f:
      f.truncate(30)
  else:
    with open(os.path.join(path, "model.safetensors"), "r+b") as f:
      f.truncate(100)


@pytest.mark.parametrize("kind", KINDS)
def test_a_damaged_folder_is_refused_with_one_message_by_every_caller(folders, kind, tmp_path):
  paths, _ = folders
  path = str(tmp_path / kind)
  shutil.copytree(paths[kind], path)
  _damage(kind, path)
  messages = {}
  for name, read in _callers(tmp_path).items():
    with pytest.raises(ValueError) as err:
      read(path)
    # The same words, less the name of the key or flag the path came in by.
    messages[name] = re.sub(r"^(checkpoint\.init_from|--weights|path)=", "", str(err.value))
  assert len(set(messages.values())) == 1, messages
  message = next(iter(messages.values()))
  assert path in message and ("damaged" in message or "cannot be read" in message
                              or "not valid JSON" in message), message


def test_reading_a_local_folder_of_any_kind_imports_no_tensorflow(folders):
  paths, _ = folders
  code = ("import sys\nfrom bertjax.weights import match as weights_match, reader as weights\n"
          "from bertjax.weights.pretrained import load_pretrained\n"
          f"for path in {list(paths[k] for k in KINDS)!r}:\n"
          "  source = weights.inspect(path)\n"
          "  weights.read(source)\n"
          "  load_pretrained(path)\n"
          "  weights_match.fingerprint_of(source, False)\n"
          "print(sorted(m for m in sys.modules if m.split('.')[0] == 'tensorflow'))\n")
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(1)}
  done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                        check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  assert done.stdout.strip() == "[]"


def test_a_path_of_no_kind_names_every_kind(tmp_path):
  (tmp_path / "notes.txt").write_text("{}")
  with pytest.raises(weights.NotWeightsError, match="bertjax workdir .*convert.hf import.* "
                     "Google's released folders .* Hugging Face BERT folder or a ModernBERT "
                     "folder"):
    weights.inspect(str(tmp_path))
  # A Hugging Face folder without its weights names the file it lacks (was: the list of kinds).
  (tmp_path / "config.json").write_text('{"model_type": "modernbert"}')
  with pytest.raises(weights.NotWeightsError, match="holds a ModernBERT config.json but no "
                     "model.safetensors"):
    weights.inspect(str(tmp_path))
  with pytest.raises(FileNotFoundError, match="checkpoint.init_from=.*nowhere does not exist"):
    weights.inspect(str(tmp_path / "nowhere"), what="checkpoint.init_from")


def test_reading_a_workdir_says_nothing_of_what_it_skips_on_purpose(folders, caplog):
  """Only params are read, from a manager opened read-only: orbax's warnings about both (several
  per read) are dropped, so an export or a prediction prints its own lines alone."""
  import logging  # pylint: disable=import-outside-toplevel
  caplog.set_level(logging.WARNING)
  weights.read(weights.inspect(folders[0]["workdir"]))
  assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
