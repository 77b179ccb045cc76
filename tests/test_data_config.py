"""The data section typed at the boundary: `DataConfig` (pre-training) and fine-tuning's
`TaskConfig` name an unknown or a missing key, refuse a value of another type, are built from every
shipped config (and from an older run's record), and below the run's start no data module reads
the ConfigDict."""

import dataclasses
import json
import os
import pickle
import sys

import ml_collections
import numpy as np
import pytest

from bertjax.configs import base, bert_base, bert_large, finetune, modern_base, modern_tiny, tiny
from bertjax.data.config import DataConfig
from bertjax.finetune.job import run
from bertjax.finetune.kit.config import EvalConfig, FinetuneDataConfig, TaskConfig
from bertjax.pretrain import job as pretrain_job
from bertjax.training import loop
from test_data_fixtures import WORDS, data_config, data_section, write_vocab

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OLD_WORKDIR = os.path.join(ROOT, "tests", "fixtures", "workdir_b49986a", "workdir")


@pytest.mark.parametrize("module", [base, tiny, bert_base, bert_large, modern_base, modern_tiny])
def test_every_pretraining_config_builds_its_data_config(module):
  section = module.get_config().data
  data = DataConfig.from_config(section)
  assert dataclasses.asdict(data) == dict(section)  # every key, every value, nothing more


@pytest.mark.parametrize("task", ["next", "rte", "sts-b", "squad_v1.1", "squad_v2.0",
                                  "conll2003", "classification", "regression", "tagging", "span"])
def test_every_finetuning_config_builds_its_task_config(task):
  config = finetune.get_config(task)
  typed = TaskConfig.from_config(config)
  assert typed.task == task and typed.class_weights == config.train.class_weights
  assert dataclasses.asdict(typed.data) == dict(config.data)
  assert dataclasses.asdict(typed.eval) == dict(config.eval)
  assert typed.data.do_lower_case is None  # "init_from's casing", kept as None, not False
  # The two jobs' data sections differ: neither type takes the other's.
  with pytest.raises(ValueError, match=r"unknown key\(s\) \[.*'data.train_file'.*missing key"
                                       r"\(s\) \[.*'data.nsp'"):
    DataConfig.from_config(config.data)


def test_an_unknown_or_missing_key_is_named():
  section = base.get_config().data.to_dict()
  with pytest.raises(ValueError, match=r"^DataConfig: unknown key\(s\) \['data.max_seq_len'\] "
                                       r"\(known keys: \['source', "):
    DataConfig.from_config({**section, "max_seq_len": 64})
  del section["nsp"]
  with pytest.raises(ValueError, match=r"^DataConfig: missing key\(s\) \['data.nsp'\]$"):
    DataConfig.from_config(section)
  ft = finetune.get_config("squad_v1.1")
  with pytest.raises(ValueError, match=r"^EvalConfig: missing key\(s\) \['eval.main_metric'\]$"):
    EvalConfig.from_config({k: v for k, v in ft.eval.items() if k != "main_metric"})
  with pytest.raises(ValueError, match=r"FinetuneDataConfig: unknown key\(s\) \['data.doc_strid'"):
    FinetuneDataConfig.from_config({**ft.data, "doc_strid": 64})


def test_a_value_of_another_type_is_refused_and_an_int_for_a_float_converted():
  section = base.get_config().data.to_dict()
  with pytest.raises(ValueError, match=r"^Invalid data config: config.data.max_seq_length=True "
                                       r"must be int; config.data.packing='on' must be bool$"):
    DataConfig.from_config({**section, "packing": "on", "max_seq_length": True})
  data = DataConfig.from_config({**section, "eval_fraction": 0})
  assert data.eval_fraction == 0.0 and isinstance(data.eval_fraction, float)
  with pytest.raises(ValueError, match=r"config.data.do_lower_case=1 must be bool or NoneType"):
    FinetuneDataConfig.from_config({**finetune.get_config("rte").data, "do_lower_case": 1})


def test_frozen_changed_by_replace_and_pickled(tmp_path):
  data = data_config(tmp_path, n_docs=0)
  with pytest.raises(dataclasses.FrozenInstanceError):
    data.max_seq_length = 128
  longer = dataclasses.replace(data, max_seq_length=128)
  assert (longer.max_seq_length, data.max_seq_length) == (128, 64)
  with pytest.raises(ValueError, match="config.data.packing=1 must be bool"):
    dataclasses.replace(data, packing=1)  # replace checks types too
  assert pickle.loads(pickle.dumps(data)) == data  # what a worker process could be handed


def test_the_data_section_an_older_run_recorded_is_accepted():
  # tests/test_old_workdir.py resumes this workdir; its config.json is the record of that run.
  with open(os.path.join(OLD_WORKDIR, "config.json"), encoding="utf-8") as f:
    recorded = json.load(f)["data"]
  data = DataConfig.from_config(recorded)
  assert (data.tokenizer, data.max_seq_length, data.num_shards) == ("wordpiece", 64, 4)
  # Keys it lacks (added later, how preparation runs) take base.py's values.
  from bertjax.data.config import RECORDED_BEFORE_THEM  # pylint: disable=import-outside-toplevel
  assert RECORDED_BEFORE_THEM == {k: base.get_config().data[k] for k in RECORDED_BEFORE_THEM}


# Below the boundary ----------------------------------------------------------------------------

# Where a config's ConfigDict is read on purpose: the typed configs' builders and the fine-tuning
# run (its train, checkpoint and mesh sections).
# finetune/init_from.py: resolve_model turns config.model into the BertConfig.
BOUNDARY = ("bertjax/data/config.py", "bertjax/finetune/kit/config.py", "bertjax/finetune/job/run.py",
            "bertjax/finetune/job/init_from.py")


@pytest.fixture
def configdict_reads(monkeypatch):
  """Reads of any ConfigDict key from code of bertjax/data or bertjax/finetune outside BOUNDARY,
  as 'file: key'."""
  reads = []
  for name in ("__getattr__", "__getitem__", "get"):
    real = getattr(ml_collections.ConfigDict, name)

    def spy(self, key, *args, _real=real):
      where = os.path.relpath(sys._getframe(1).f_code.co_filename, ROOT)  # pylint: disable=protected-access
      if where.startswith(("bertjax/data/", "bertjax/finetune/")) and where not in BOUNDARY:
        reads.append(f"{where}: {key}")
      return _real(self, key, *args)
    monkeypatch.setattr(ml_collections.ConfigDict, name, spy)
  return reads


def _one_batch_instead_of_the_run(monkeypatch):
  """loop.execute replaced: the job's first training batch is made (and checked), nothing is
  compiled; the run returns as if stopped."""
  seen = {}

  def execute(config, workdir, job):
    del workdir
    seen["config"], seen["batch"] = config, next(iter(job.batches(0)))
    return None, {}
  monkeypatch.setattr(loop, "execute", execute)
  return seen


def test_pretraining_data_modules_never_read_the_config_dict(tmp_path, monkeypatch,
                                                             configdict_reads):
  config = tiny.get_config()
  config.data = data_section(tmp_path / "data", n_docs=30, sents_per_doc=12)
  m = config.model
  m.hidden_size, m.num_layers, m.num_heads, m.intermediate_size = 32, 1, 2, 64
  config.train.batch_size, config.train.learning_rate = 8, 1e-4  # a rate: one run, no search
  seen = _one_batch_instead_of_the_run(monkeypatch)
  assert pretrain_job.train_and_evaluate(config, str(tmp_path / "run")) == {}
  assert seen["batch"]["input_ids"].shape == (8, 64)
  assert configdict_reads == []
  # config.json records the data section the run used, key for key.
  assert dict(seen["config"].data) == dict(config.data)


def test_finetuning_task_readers_never_read_the_config_dict(tmp_path, monkeypatch,
                                                            configdict_reads):
  rng = np.random.default_rng(0)
  for split, n in (("train", 32), ("dev", 16)):
    rows = [f"{' '.join(rng.choice(WORDS[3:], 5))} {WORDS[i % 2]},{'ab'[i % 2]}" for i in range(n)]
    (tmp_path / f"{split}.csv").write_text("text,label\n" + "\n".join(rows) + "\n")
  vocab = write_vocab(str(tmp_path / "vocab.txt"))
  config = finetune.get_config("classification")
  d = config.data
  d.train_file, d.dev_file = str(tmp_path / "train.csv"), str(tmp_path / "dev.csv")
  d.vocab_path, d.max_seq_length = vocab, 16
  m = config.model
  m.vocab_size = sum(1 for _ in open(vocab, encoding="utf-8"))
  m.hidden_size, m.num_layers, m.num_heads, m.intermediate_size = 32, 1, 2, 64
  m.max_position_embeddings, m.type_vocab_size = 16, 2
  config.train.batch_size, config.train.learning_rate = 8, 1e-4  # a rate: one run, no search
  seen = _one_batch_instead_of_the_run(monkeypatch)
  assert run.finetune(config, str(tmp_path / "run")) == {}
  assert seen["batch"]["input_ids"].shape == (8, 16)
  assert configdict_reads == []
