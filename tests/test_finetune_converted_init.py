"""Fine-tuning from a folder of `python -m bertjax.convert.hf import`: its weights and vocabulary."""

import os

import jax
import numpy as np
import pytest

from bertjax import errors
from bertjax.data import tokenizer as tokenizer_lib, vocab_record
from bertjax.finetune.job import run
from bertjax.formats import converted
from bertjax.model.config import BertConfig
from bertjax.model.heads import BertForPreTraining
from bertjax.training import loop, train
from test_data_fixtures import write_vocab
from finetune_fixtures import Builds, tiny_next_config, write_tiny_next


def _converted(tmp_path) -> tuple[str, dict, BertConfig]:
  """A folder as `convert.hf import` writes it: bert_config.json, params/, vocab.txt."""
  folder = tmp_path / "converted"
  os.makedirs(folder)
  vocab = write_vocab(str(folder / "vocab.txt"))
  size = tokenizer_lib.load_tokenizer(vocab).vocab_size
  cfg = BertConfig(vocab_size=size, hidden_size=32, num_layers=1, num_heads=2,
                   intermediate_size=64, max_position_embeddings=64, hidden_dropout=0.0,
                   attention_dropout=0.0)
  params = jax.device_get(train.init_state(
      BertForPreTraining(cfg), train.optimizer_lib.create_optimizer(
          train.TrainConfig(num_train_steps=1, warmup_steps=0))[0],
      jax.random.PRNGKey(3)).params)
  params = jax.tree.map(np.asarray, __import__("flax").linen.unbox(params))
  converted.save_params(str(folder), params, cfg)
  return str(folder), params, cfg


def test_encoder_and_vocabulary_come_from_a_converted_folder(tmp_path, monkeypatch):
  folder, params, cfg = _converted(tmp_path)
  write_tiny_next(tmp_path / "task")
  config = tiny_next_config(folder, str(tmp_path / "task"))
  builds = Builds(monkeypatch, devices=jax.devices()[:1])
  results = run.finetune(config, str(tmp_path / "ft"))
  assert results["evaluations"]
  # The encoder the first step starts from is the converted one, leaf for leaf.
  want = jax.tree_util.tree_leaves_with_path(params["bert"])
  got = dict(jax.tree_util.tree_leaves_with_path(builds.first_params["bert"]))
  assert len(want) == len(got) > 10
  for path, value in want:
    np.testing.assert_array_equal(np.asarray(got[path]), value, err_msg=str(path))
  # The folder's vocab.txt became the run's (copied into the workdir with its fingerprint).
  record = (tmp_path / "ft" / vocab_record.WORKDIR_RECORD).read_text()
  assert tokenizer_lib.load_tokenizer(os.path.join(folder, "vocab.txt")).fingerprint in record

  # Another vocabulary than the folder's is refused, naming both fingerprints.
  pieces = (tmp_path / "converted" / "vocab.txt").read_text().split("\n")
  other = tmp_path / "other_vocab.txt"  # the same pieces, two of them swapped
  other.write_text("\n".join(pieces[:5] + [pieces[6], pieces[5]] + pieces[7:]))
  config = tiny_next_config(folder, str(tmp_path / "task"))
  config.data.vocab_path = str(other)
  with pytest.raises(errors.CheckpointMismatchError, match="fingerprint") as err:
    run.finetune(config, str(tmp_path / "ft2"))
  assert str(err.value).count("wordpiece-") == 2
