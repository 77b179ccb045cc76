"""The main job: exact resume, preemption, restore onto another mesh, refusals before compiling,
the non-finite guard, the fixed held-out set."""

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bertjax import errors
from bertjax.configs import tiny
from bertjax.data import pipeline
from bertjax.errors import CheckpointMismatchError
from bertjax.pretrain import job as pretrain_job
from bertjax.training import train
from bertjax.training.checkpoint import TRAIN_ITEMS, Checkpointer
from conftest import xla_flags
from test_data_fixtures import data_section, write_corpus

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_MAKE_PIPELINE = pipeline.make_pipeline


def _config(tmp_path, **train_overrides):
  config = tiny.get_config()
  config.data = data_section(tmp_path / "data", n_docs=30, sents_per_doc=12)
  m = config.model
  m.hidden_size, m.num_layers, m.num_heads, m.intermediate_size = 32, 1, 2, 64
  m.max_position_embeddings = 64
  m.hidden_dropout = 0.1  # exercise the dropout keys of exact resume
  t = config.train
  t.batch_size, t.num_train_steps, t.warmup_steps, t.learning_rate = 8, 6, 1, 1e-3
  t.log_every_steps, t.eval_every_steps, t.eval_sequences = 2, 0, 16
  config.checkpoint.save_every_steps = 3
  for k, v in train_overrides.items():
    t[k] = v
  return config


def _final_params(workdir, step):
  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), TRAIN_ITEMS, save_every=1, keep=1)
  assert ckpt.latest_step() == step
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  restored = ckpt._manager.restore(step, args=ocp.args.Composite(  # pylint: disable=protected-access
      params=ocp.args.StandardRestore()))
  ckpt.close()
  return restored["params"]


class _Recorder:
  """Wraps make_pipeline: records the training batches and can send SIGTERM at a given batch."""

  def __init__(self, monkeypatch, sigterm_at=None, sigterm_in_eval=False):
    self.train_ids, self.eval_batches = [], []

    def make(data, tok, *, split, **kw):
      batches = _MAKE_PIPELINE(data, tok, split=split, **kw)
      if split != "train":
        return self._wrap_eval(batches, sigterm_in_eval)
      return self._wrap(batches, kw.get("start_step", 0), sigterm_at)

    monkeypatch.setattr(pipeline, "make_pipeline", make)

  def _wrap(self, batches, start, sigterm_at):
    for i, batch in enumerate(batches, start):
      self.train_ids.append(batch["input_ids"].copy())
      if sigterm_at is not None and i == sigterm_at:
        os.kill(os.getpid(), signal.SIGTERM)  # a preemption notice, between two steps
      yield batch

  def _wrap_eval(self, batches, sigterm):
    for batch in batches:
      self.eval_batches.append({k: v.copy() for k, v in batch.items()})
      if sigterm:
        os.kill(os.getpid(), signal.SIGTERM)  # during an evaluation
      yield batch


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
  """`_config`'s 6-step run, straight through, once for the module: the reference of the resume
  test, and the finished run the refusals test argues with (on a copy). Returns the folder of its
  data and workdir ("run"), and the training batches it read."""
  base = tmp_path_factory.mktemp("straight")
  with pytest.MonkeyPatch.context() as mp:
    straight = _Recorder(mp)
    pretrain_job.train_and_evaluate(_config(base), str(base / "run"))
  return base, straight.train_ids


def test_interrupted_and_resumed_run_equals_straight_run(tmp_path, monkeypatch, capsys,
                                                         straight_run):
  base, straight_ids = straight_run
  config = _config(base)  # the straight run's config and data
  expected = _final_params(base / "run", 6)

  interrupted = _Recorder(monkeypatch, sigterm_at=2)  # the third batch: stops after step 3
  assert pretrain_job.train_and_evaluate(config, str(tmp_path / "resumed")) == {}
  assert "SIGTERM received; saved step 3" in capsys.readouterr().out
  shutil.copytree(tmp_path / "resumed", tmp_path / "other_mesh")
  resumed = _Recorder(monkeypatch)
  final = pretrain_job.train_and_evaluate(config, str(tmp_path / "resumed"))
  assert "resumed from" in capsys.readouterr().out
  got = _final_params(tmp_path / "resumed", 6)

  np.testing.assert_array_equal(np.stack(interrupted.train_ids[:3] + resumed.train_ids),
                                np.stack(straight_ids))
  flat_expected = np.concatenate([np.ravel(x) for x in _leaves(expected)])
  flat_got = np.concatenate([np.ravel(x) for x in _leaves(got)])
  np.testing.assert_array_equal(flat_got, flat_expected)  # bit for bit
  assert 0.0 <= final["mlm_accuracy"] <= 1.0 and final["num_sequences"] > 0 and "nsp_majority_baseline" in final
  # Running again reports that the run is complete.
  pretrain_job.train_and_evaluate(config, str(tmp_path / "resumed"))
  assert "is complete (6 of 6 steps)" in capsys.readouterr().out
  logs = (tmp_path / "resumed" / "metrics.jsonl").read_text()
  assert '"train/loss"' in logs and '"eval/mlm_accuracy"' in logs
  assert list((tmp_path / "resumed" / "tensorboard").iterdir())

  # The same interrupted run resumed on a (data 2, fsdp 2, tensor 2) mesh ends where the straight
  # run ends, up to the order of float sums; three steps from a fresh start land far from it.
  config.mesh.ici_data, config.mesh.ici_fsdp, config.mesh.ici_tensor = 2, 2, 2
  _Recorder(monkeypatch)
  pretrain_job.train_and_evaluate(config, str(tmp_path / "other_mesh"))
  assert "resumed from" in capsys.readouterr().out
  flat_mesh = np.concatenate([np.ravel(x) for x in _leaves(_final_params(tmp_path / "other_mesh",
                                                                          6))])
  np.testing.assert_allclose(flat_mesh, flat_expected, rtol=1e-4, atol=2e-6)


def test_packed_run_resumes_exactly_and_counts_sequences(tmp_path, monkeypatch, capsys):
  config = _config(tmp_path, num_train_steps=4, log_every_steps=1)
  config.data.packing = True
  config.data.short_seq_prob = 0.5  # short pairs, which rows can take two or three of
  config.checkpoint.save_every_steps = 2
  straight = _Recorder(monkeypatch)
  pretrain_job.train_and_evaluate(config, str(tmp_path / "straight"))
  interrupted = _Recorder(monkeypatch, sigterm_at=1)  # stops after step 2
  assert pretrain_job.train_and_evaluate(config, str(tmp_path / "resumed")) == {}
  resumed = _Recorder(monkeypatch)
  pretrain_job.train_and_evaluate(config, str(tmp_path / "resumed"))
  np.testing.assert_array_equal(np.stack(interrupted.train_ids[:2] + resumed.train_ids),
                                np.stack(straight.train_ids))
  flat = lambda step, d: np.concatenate([np.ravel(x) for x in _leaves(_final_params(d, step))])
  np.testing.assert_array_equal(flat(4, tmp_path / "resumed"), flat(4, tmp_path / "straight"))
  # Throughput counts the sequences the rows hold, not the rows; evaluation stays unpacked.
  logs = [json.loads(line) for line in (tmp_path / "straight" / "metrics.jsonl").open()]
  train_logs = [x for x in logs if "train/sequences_per_step" in x]
  assert len(train_logs) == 4
  assert sum(x["train/sequences_per_step"] for x in train_logs) > 1.2 * 4 * 8  # 8 rows a step
  for x in train_logs:
    assert x["train/seqs_per_sec"] == pytest.approx(
        x["train/sequences_per_step"] * x["train/steps_per_sec"])
    assert x["train/tokens_per_step"] > x["train/sequences_per_step"] * 5
  assert {b["input_ids"].shape for b in straight.eval_batches} == {(8, 64)}
  assert "sequence_ids" not in straight.eval_batches[0]


def _leaves(tree):
  import jax  # pylint: disable=import-outside-toplevel
  return jax.tree_util.tree_leaves(tree)


def test_refusals_name_the_difference_and_keep_the_workdir(tmp_path, capsys, straight_run):
  # A finished 6-step run (a copy of the module's straight run), extended to 8 steps with changes.
  base, _ = straight_run
  shutil.copytree(base / "run", tmp_path / "run")
  config = _config(base)
  workdir = str(tmp_path / "run")
  recorded = (tmp_path / "run" / "config.json").read_text()
  steps = sorted(os.listdir(tmp_path / "run" / "checkpoints"))
  assert steps

  bigger = _config(base, num_train_steps=8)
  bigger.model.hidden_size = 64
  with pytest.raises(CheckpointMismatchError, match="hidden_size: checkpoint 32 vs config 64"):
    pretrain_job.train_and_evaluate(bigger, workdir)
  lamb = _config(base, num_train_steps=8, optimizer="lamb", max_grad_norm=0.5)
  with pytest.raises(CheckpointMismatchError, match="train.optimizer: checkpoint 'adamw' vs "
                     "config 'lamb'; train.max_grad_norm: checkpoint 1.0 vs config 0.5"):
    pretrain_job.train_and_evaluate(lamb, workdir)
  # Another vocabulary of the same size: the embedding rows would index other pieces.
  other_vocab = _config(tmp_path, num_train_steps=8)
  words = open(config.data.vocab_path).read().split("\n")
  shuffled = tmp_path / "other_vocab.txt"
  shuffled.write_text("\n".join(words[:7] + words[7:-1][::-1] + [""]))
  other_vocab.data.vocab_path = str(shuffled)
  with pytest.raises(CheckpointMismatchError, match="tokenizer: checkpoint wordpiece-"):
    pretrain_job.train_and_evaluate(other_vocab, workdir)
  # ... nor as init_from for a new run, unless asked for.
  other_vocab.checkpoint.init_from = workdir
  with pytest.raises(CheckpointMismatchError, match="init_from_other_vocab=True"):
    pretrain_job.train_and_evaluate(other_vocab, str(tmp_path / "new"))
  assert not (tmp_path / "new" / "config.json").exists()
  other_vocab.checkpoint.init_from_other_vocab = True
  other_vocab.train.num_train_steps = 1
  pretrain_job.train_and_evaluate(other_vocab, str(tmp_path / "new"))
  assert "parameters from checkpoint.init_from" in capsys.readouterr().out

  # The refused commands left the run as it was: its record of what it was asked, its steps.
  assert (tmp_path / "run" / "config.json").read_text() == recorded
  assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == steps


def _inject_nonfinite_at(monkeypatch, bad_step):
  """The step that produces `bad_step` returns NaN parameters and an infinite gradient norm while
  its loss stays finite (as a bf16 overflow in the backward pass would)."""
  real = train.from_config

  def from_config(*args, **kwargs):
    training = real(*args, **kwargs)

    def step(state, batch, rng):
      state, metrics = training.train_step(state, batch, rng)
      if int(state.step) == bad_step:
        state = state.replace(params=jax.tree.map(lambda x: x * jnp.nan, state.params))
        metrics = {**metrics, "grad_norm": (jnp.float32(jnp.inf), metrics["grad_norm"][1])}
      return state, metrics

    return dataclasses.replace(training, train_step=step)

  monkeypatch.setattr(train, "from_config", from_config)


def test_a_nonfinite_gradient_stops_the_run_before_its_state_is_saved(tmp_path, monkeypatch):
  config = _config(tmp_path, num_train_steps=6)
  config.checkpoint.save_every_steps = 2
  _inject_nonfinite_at(monkeypatch, 4)  # a save step, with a finite loss
  with pytest.raises(errors.NonFiniteError, match="Non-finite grad_norm at step 4"):
    pretrain_job.train_and_evaluate(config, str(tmp_path / "run"))
  ckpt = Checkpointer(str(tmp_path / "run" / "checkpoints"), TRAIN_ITEMS, save_every=1, keep=1)
  assert ckpt.all_steps() == [2]
  ckpt.close()
  assert all(np.all(np.isfinite(x)) for x in _leaves(_final_params(tmp_path / "run", 2)))


def test_a_stop_during_evaluation_saves_that_step_and_the_rerun_goes_on(tmp_path, monkeypatch,
                                                                         capsys):
  config = _config(tmp_path, num_train_steps=4, eval_every_steps=2)
  # 3 held-out documents: 2 pairings each give 15 sequences since prepared-data format 3 (their
  # order, and so the draws, changed), one short of the 16 evaluated.
  config.data.eval_dupe_factor = 3
  _Recorder(monkeypatch, sigterm_in_eval=True)
  assert pretrain_job.train_and_evaluate(config, str(tmp_path / "run")) == {}
  assert "SIGTERM received; saved step 2" in capsys.readouterr().out  # not a save step (3)
  _Recorder(monkeypatch)
  final = pretrain_job.train_and_evaluate(config, str(tmp_path / "run"))
  assert "resumed from" in capsys.readouterr().out and final["num_sequences"] == 16


def test_the_heldout_set_is_fixed_and_bounded(tmp_path, monkeypatch):
  seen = []
  for seed in (0, 1):
    config = _config(tmp_path, num_train_steps=1, seed=seed, eval_sequences=16)
    config.data.eval_dupe_factor = 3  # more than 16 held-out sequences (2 pairings give 15)
    recorder = _Recorder(monkeypatch)
    final = pretrain_job.train_and_evaluate(config, str(tmp_path / f"run{seed}"))
    assert final["num_sequences"] == 16 and len(recorder.eval_batches) == 2
    seen.append(recorder.eval_batches)
  # Another training seed draws other training masks, but is scored on the same predictions.
  for a, b in zip(*seen):
    for key in ("input_ids", "masked_lm_positions", "masked_lm_ids"):
      np.testing.assert_array_equal(a[key], b[key])


def test_an_empty_heldout_split_is_found_before_the_first_step(tmp_path, monkeypatch):
  steps = []
  real = train.from_config
  monkeypatch.setattr(train, "from_config", lambda *a, **k: dataclasses.replace(
      real(*a, **k), train_step=lambda *args: steps.append(1)))
  config = _config(tmp_path)
  config.data.eval_fraction = 0.0
  with pytest.raises(ValueError, match="The eval split holds 0 sequence"):
    pretrain_job.train_and_evaluate(config, str(tmp_path / "run"))
  checkpoints = tmp_path / "run" / "checkpoints"
  assert not steps and not (checkpoints.exists() and os.listdir(checkpoints))


def test_bad_input_is_refused_before_compiling(tmp_path, monkeypatch):
  compiled = []
  monkeypatch.setattr(train, "build", lambda *a, **k: compiled.append(1))
  for section, key in (("train", "log_every_steps"), ("checkpoint", "save_every_steps")):
    config = _config(tmp_path)
    config[section][key] = 0
    with pytest.raises(ValueError, match=f"{section}.{key}=0 must be >= 1"):
      pretrain_job.train_and_evaluate(config, str(tmp_path / "zero"))
    assert not (tmp_path / "zero").exists()  # refused before anything ran
  config = _config(tmp_path)
  (tmp_path / "a_file").write_text("")
  with pytest.raises(PermissionError, match="Cannot write to --workdir"):
    pretrain_job.train_and_evaluate(config, str(tmp_path / "a_file" / "run"))
  config.checkpoint.init_from = str(tmp_path / "no_such_run")
  with pytest.raises(FileNotFoundError, match="init_from=.*no_such_run does not exist"):
    pretrain_job.train_and_evaluate(config, str(tmp_path / "run"))
  config.checkpoint.init_from = ""
  config.data.source = write_corpus(str(tmp_path / "empty.txt"), [])
  with pytest.raises(ValueError, match="empty|no training instance|no document"):
    pretrain_job.train_and_evaluate(config, str(tmp_path / "run"))
  assert not compiled


def test_command_line_refuses_unknown_key_and_survives_sigterm(tmp_path):
  # One device, compiled as the suite compiles (conftest.py), from the run's shared cache.
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(1), "PYTHONUNBUFFERED": "1"}
  base_cmd = [sys.executable, "-m", "bertjax.pretrain", "--config=configs/tiny.py",
              f"--workdir={tmp_path / 'run'}"]
  bad = subprocess.run(base_cmd + ["--config.train.batch_sise=3"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
  assert bad.returncode != 0 and "batch_sise" in bad.stderr

  data = data_section(tmp_path / "data", n_docs=30, sents_per_doc=12)
  flags = [f"--config.data.{k}={data[k]}" for k in (
      "tokenizer", "vocab_path", "source", "cache_dir", "max_seq_length",
      "max_predictions_per_seq", "num_shards", "num_eval_shards", "prepare_workers",
      "dupe_factor")]
  flags += ["--config.model.hidden_size=32", "--config.model.intermediate_size=64",
            "--config.model.num_layers=1",
            "--config.train.batch_size=8", "--config.train.num_train_steps=100000",
            "--config.train.log_every_steps=1", "--config.train.warmup_steps=10",
            "--config.checkpoint.save_every_steps=100000"]
  proc = subprocess.Popen(base_cmd + flags, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
  lines, deadline = [], time.time() + 240
  for line in proc.stdout:
    lines.append(line)
    if line.startswith("step 3/"):
      proc.send_signal(signal.SIGTERM)
      break
    assert time.time() < deadline, "".join(lines[-20:])
  out = proc.communicate(timeout=120)[0]
  assert proc.returncode == 0, "".join(lines) + out
  assert "SIGTERM received; saved step" in out
  # A save happened, yet the INFO lines of the output are bertjax's own (orbax alone would have
  # written kilobytes): absl prints the file of each, e.g. "I1123 ... loop.py:238] Run ...".
  own = {name for _, _, names in os.walk(os.path.join(ROOT, "bertjax")) for name in names}
  info_files = re.findall(r"^I\d{4} \S+ +\d+ ([\w.]+):\d+\]", "".join(lines) + out, re.M)
  assert info_files and set(info_files) <= own, set(info_files) - own
  saved = Checkpointer(str(tmp_path / "run" / "checkpoints"), TRAIN_ITEMS, save_every=1, keep=1)
  assert saved.latest_step() >= 3
  saved.close()
