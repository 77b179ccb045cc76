"""A fine-tuning run SIGKILLed three times, and rerun with the same command after each kill, ends
where an uninterrupted run of that command ends (issue 29; docs/reliability.md): the final state
(parameters and optimizer state) and best/'s parameters bit for bit; evaluations.json, results.json
and the prediction file byte for byte (results.json names the prediction files by path: each
workdir's own path is neutralised; no field of these files depends on time).

Every run is the command in a subprocess. tests/interrupted_finetune.py kills it at a named moment
(during a save, during an evaluation, between best/'s save and the record of its evaluation):
aimed, not timed, so each kill lands where the test says, and the workdir is checked to be in
that state before the rerun. A small model (hidden 32, one layer, one device) on a synthetic
STS-B (1,024 pairs, 64 steps per epoch, 3 epochs): a regression, so the dev scores and the
predictions (three decimals, all different) show any difference in the weights. The runs share
one persistent compilation cache: only the first compiles.
"""

import json
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from bertjax.training import checkpoint as checkpoint_lib
import finetune_fixtures as fx
import interrupted_finetune
from test_data_fixtures import write_vocab

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N_TRAIN, BATCH, EPOCHS = 1024, 16, 3
PER_EPOCH = N_TRAIN // BATCH
LAST = PER_EPOCH * EPOCHS


def _command(tmp_path, workdir):
  vocab = write_vocab(str(tmp_path / "vocab.txt"))
  with open(vocab) as f:
    size = len(f.read().split())
  return [sys.executable, interrupted_finetune.__file__, "--config=configs/finetune.py:sts-b",
          f"--workdir={workdir}", f"--config.data.data_dir={tmp_path / 'glue'}",
          f"--config.data.vocab_path={vocab}", "--config.data.max_seq_length=16",
          f"--config.model.vocab_size={size}", "--config.model.hidden_size=32",
          "--config.model.num_layers=1", "--config.model.num_heads=1",
          "--config.model.intermediate_size=32", "--config.model.max_position_embeddings=16",
          "--config.model.type_vocab_size=2", f"--config.train.batch_size={BATCH}",
          f"--config.train.num_epochs={EPOCHS}", "--config.train.learning_rate=1e-3",
          "--config.train.log_every_steps=1000"]


def _environment(tmp_path):
  env = {k: v for k, v in os.environ.items() if k != interrupted_finetune.ENV}
  flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
  env.update(JAX_PLATFORMS="cpu", BERTJAX_HUGE_PAGES="0", PYTHONUNBUFFERED="1",
             XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count=1".strip(),
             JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax_cache"),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")
  return env


def _run(command, env, interrupt=None, status=0):
  """The command's stdout and stderr; `interrupt` names a moment of tests/interrupted_finetune.py,
  `status` the exit status expected (-9: SIGKILLed)."""
  if interrupt:
    env = {**env, interrupted_finetune.ENV: interrupt}
  done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  output = done.stdout + done.stderr
  assert done.returncode == status, f"{interrupt}: exit {done.returncode}\n{output[-5000:]}"
  assert "killing anyway" not in output, output[-5000:]
  return done.stdout, done.stderr


@pytest.fixture(scope="module", name="task")
def _task(tmp_path_factory):
  """The data, the environment and the workdir of an uninterrupted run, which every test here
  compares with (its compiled programs fill the cache the other runs load)."""
  root = tmp_path_factory.mktemp("chaos")
  fx.write_stsb(str(root / "glue"), n_train=N_TRAIN, n_dev=48, n_test=16)
  env = _environment(root)
  straight = str(root / "straight")
  _run(_command(root, straight), env)
  return root, env, straight


def _steps(folder):
  return sorted(int(n) for n in os.listdir(folder) if n.isdigit())


def _recorded(workdir):
  with open(os.path.join(workdir, "evaluations.json")) as f:
    return [r["step"] for r in json.load(f)]


def _stored(folder, step, item):
  ckpt = checkpoint_lib.Checkpointer(folder, checkpoint_lib.TRAIN_ITEMS, save_every=1, keep=1,
                                     async_save=False, read_only=True)
  try:
    tree = ckpt.restore_stored(step, item)
  finally:
    ckpt.close()
  return {jax.tree_util.keystr(path): np.asarray(leaf)
          for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def _read(path, workdir):
  """A file's bytes, the workdir's own path in them made neutral (results.json lists the
  prediction files by path)."""
  with open(path, "rb") as f:
    return f.read().replace(workdir.encode(), b"WORKDIR")


def _same_files(workdir, straight):
  for name in ("evaluations.json", "results.json", "predictions/STS-B.tsv"):
    assert _read(os.path.join(workdir, name), workdir) == _read(os.path.join(straight, name),
                                                                straight), name


def test_three_kills_and_reruns_end_where_an_uninterrupted_run_ends(task):
  root, env, straight = task
  killed = str(root / "killed")
  command = _command(root, killed)

  # 1. During the save of epoch 1's checkpoint, its evaluation (and best/) already recorded: no
  # checkpoint is committed, so the rerun starts over and must drop that record and best/.
  _run(command, env, f"save:{PER_EPOCH}", -9)
  assert _steps(os.path.join(killed, "checkpoints")) == []
  assert any(name.startswith(f"{PER_EPOCH}.") and "tmp" in name
             for name in os.listdir(os.path.join(killed, "checkpoints")))
  assert _recorded(killed) == [PER_EPOCH] and _steps(os.path.join(killed, "best")) == [PER_EPOCH]

  # 2. During epoch 2's evaluation, its checkpoint committed: the rerun owes that evaluation.
  output, _ = _run(command, env, f"evaluation:{2 * PER_EPOCH}", -9)
  assert "initialised from scratch" in output
  assert _steps(os.path.join(killed, "checkpoints")) == [PER_EPOCH, 2 * PER_EPOCH]
  assert _recorded(killed) == [PER_EPOCH]

  # 3. Between best/'s save of the final evaluation and its record (epoch 3 scores best on these
  # data: best/ holds a step evaluations.json does not know, which once blocked every rerun).
  output, _ = _run(command, env, f"record:{LAST}", -9)
  assert f"at step {2 * PER_EPOCH}" in output  # resumed there
  assert _steps(os.path.join(killed, "checkpoints")) == [2 * PER_EPOCH, LAST]
  assert _recorded(killed) == [PER_EPOCH, 2 * PER_EPOCH]
  assert _steps(os.path.join(killed, "best")) == [LAST]

  output, _ = _run(command, env)
  assert f"complete ({LAST} of {LAST} steps)" in output

  # The uninterrupted run's end; its predictions differ from example to example, so that the
  # file shows a difference in the weights.
  with open(os.path.join(straight, "predictions", "STS-B.tsv")) as f:
    scores = [line.split("\t")[1] for line in f.read().splitlines()[1:]]
  assert len(set(scores)) > len(scores) // 2, scores
  _same_files(killed, straight)
  assert _steps(os.path.join(killed, "best")) == _steps(os.path.join(straight, "best"))
  best = _steps(os.path.join(straight, "best"))[0]
  for folder, step, item in (("checkpoints", LAST, "params"), ("checkpoints", LAST, "opt_state"),
                             ("best", best, "params")):
    got = _stored(os.path.join(killed, folder), step, item)
    want = _stored(os.path.join(straight, folder), step, item)
    assert got.keys() == want.keys()
    for key in want:
      np.testing.assert_array_equal(got[key], want[key], err_msg=f"{folder}/{step} {key}")


def test_a_full_disk_ends_the_run_in_one_line_and_the_rerun_goes_on(task):
  # Issue 29: a save that found the disk full ended the run with a score of tracebacks (orbax's
  # logged ones, the failure raised again at each wait, tensorstore's late callbacks).
  root, env, straight = task
  workdir = str(root / "disk_full")
  command = _command(root, workdir)
  _, stderr = _run(command, env, f"disk_full:{2 * PER_EPOCH}", 1)
  assert "Traceback" not in stderr, stderr[-5000:]
  said = [line for line in stderr.splitlines() if re.search("space|Error|Errno", line)]
  assert len(said) == 1 and re.fullmatch(
      rf"bertjax: --workdir={workdir}: the disk is full \(no space left on device\) at "
      rf"{workdir}/checkpoints/{2 * PER_EPOCH}\S*tmp\S*; its newest complete checkpoint, step "
      rf"{PER_EPOCH} in {workdir}/checkpoints, is kept. Free space, then run the same command to "
      "go on.", said[0]), stderr[-5000:]
  assert _steps(os.path.join(workdir, "checkpoints")) == [PER_EPOCH]

  stdout, _ = _run(command, env)
  assert f"resumed from {workdir}/checkpoints at step {PER_EPOCH}" in stdout
  _same_files(workdir, straight)


def _one_line(stderr, what):
  """The run's one line about a storage fault (no traceback, nothing else saying an error)."""
  assert "Traceback" not in stderr, stderr[-5000:]
  said = [line for line in stderr.splitlines() if re.search("space|Error|Errno|failed", line)]
  assert len(said) == 1 and what in said[0], stderr[-5000:]
  return said[0]


def test_failed_writes_end_the_run_in_one_line_keeping_every_earlier_output(task):
  """Issue 38, item 10: a write that fails with EIO (a failing disk) during an evaluation's
  record, a checkpoint's save and the prediction file, one after the other in one workdir: each
  run ends in one line naming the failed file and the newest complete checkpoint, which is kept
  with every earlier output, and no part of the failed file is left; the last rerun ends where an
  uninterrupted run ends."""
  root, env, straight = task
  workdir = str(root / "eio")
  command = _command(root, workdir)
  eio = "a write failed with an input/output error (EIO"

  _, stderr = _run(command, env, "eio_write:evaluations.json", 1)
  line = _one_line(stderr, eio)
  assert f"at {workdir}/evaluations.json.tmp-" in line, line
  assert f"step {PER_EPOCH} in {workdir}/checkpoints, is kept" in line, line
  assert not os.path.exists(os.path.join(workdir, "evaluations.json"))

  # Epoch 1's evaluation is owed and run again; the commit of epoch 2's checkpoint fails in
  # orbax's background thread, and the run meets it after epoch 2's evaluation.
  _, stderr = _run(command, env, f"eio:{2 * PER_EPOCH}", 1)
  line = _one_line(stderr, eio)
  assert f"step {PER_EPOCH} in {workdir}/checkpoints, is kept" in line, line
  assert _steps(os.path.join(workdir, "checkpoints")) == [PER_EPOCH]
  assert _recorded(workdir) == [PER_EPOCH, 2 * PER_EPOCH]

  _, stderr = _run(command, env, "eio_write:STS-B.tsv", 1)  # the final predictions
  line = _one_line(stderr, eio)
  assert f"step {LAST} in {workdir}/checkpoints, is kept" in line, line
  assert _recorded(workdir) == [PER_EPOCH, 2 * PER_EPOCH, LAST]
  assert not [n for n in os.listdir(workdir) + os.listdir(os.path.join(workdir, "predictions"))
              if ".tmp-" in n]

  output, _ = _run(command, env)
  assert f"complete ({LAST} of {LAST} steps)" in output
  _same_files(workdir, straight)


@pytest.fixture(name="small_disk")
def _small_disk(tmp_path):
  """A filesystem of 4 MB (tmpfs; mounting needs root, else the test is skipped)."""
  folder = tmp_path / "small"
  folder.mkdir()
  done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(folder)],
                        capture_output=True, text=True, check=False)
  if done.returncode != 0:
    pytest.skip(f"no small filesystem: mount -t tmpfs failed ({done.stderr.strip()})")
  yield folder
  subprocess.run(["umount", "-l", str(folder)], check=False)


def _contents(folder):
  return {name: (folder / name).read_bytes() if (folder / name).is_file() else "folder"
          for name in sorted(os.listdir(folder))}


def test_a_full_small_disk_keeps_the_earlier_export_and_predictions(task, small_disk):
  """Issue 38, item 10, on a real full disk (tmpfs of 4 MB, filled up to 8 KB): an export and a
  prediction file that do not fit each end in one line naming the file, leave the earlier export
  and predictions (of epoch 2's checkpoint, so that the new ones differ) as they were and no part
  beside them; with space freed, the same commands finish."""
  root, env, straight = task
  with open(root / "glue" / "STS-B" / "test.tsv") as f:
    header, *rows = f.read().splitlines()
  texts = root / "texts.tsv"
  texts.write_text("\n".join([header] + rows * 20) + "\n")  # 320 rows: more than 8 KB out
  export = [sys.executable, "-m", "bertjax.convert.hf", "export", f"--weights={straight}",
            f"--output={small_disk / 'export'}"]
  predict = [sys.executable, "-m", "bertjax.predict", f"--workdir={straight}", f"--input={texts}",
             f"--output={small_disk / 'predictions.jsonl'}", "--text_a=sentence1",
             "--text_b=sentence2", "--overwrite"]
  for command in (export, predict):
    _run(command + [f"--checkpoint={2 * PER_EPOCH}"], env)
  before = _contents(small_disk)
  exported = _contents(small_disk / "export")
  assert "model.safetensors" in exported and "predictions.jsonl" in before

  stat = os.statvfs(small_disk)
  with open(small_disk / "filler", "wb") as f:
    f.write(b"\0" * (stat.f_bavail * stat.f_frsize - 8192))
  _, stderr = _run(export, env, status=1)
  line = _one_line(stderr, f"the disk is full (no space left on device) at {small_disk}/export")
  assert "Free space, then run the same command" in line, line
  _, stderr = _run(predict, env, status=1)
  _one_line(stderr, f"the disk is full (no space left on device) at {small_disk}/predictions")
  assert _contents(small_disk / "export") == exported
  assert {k: v for k, v in _contents(small_disk).items() if k != "filler"} == before

  os.remove(small_disk / "filler")
  for command in (export, predict):
    _run(command, env)
  assert sorted(os.listdir(small_disk)) == ["export", "predictions.jsonl",
                                            "predictions.jsonl.bertjax.json"]
  after = _contents(small_disk / "export")
  assert after.keys() == exported.keys() and after["model.safetensors"] != exported[
      "model.safetensors"]
  assert _contents(small_disk)["predictions.jsonl"] != before["predictions.jsonl"]
