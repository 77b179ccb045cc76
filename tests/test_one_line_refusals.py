"""Refusals of the newer surfaces in one line, first on stderr, with no error that is not one:
a workdir that cannot be made, a folder given as the corpus (to pre-training and to the prepare
command), a misspelled fine-tuning key (before TensorFlow's banner), and libtpu's TPU discovery
errors on a host with no accelerator."""

import os
import subprocess
import sys

import pytest

from bertjax.parallel import platforms

from conftest import xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _command(*args, env=None):
  env = {**os.environ, "XLA_FLAGS": xla_flags(1), **(env or {})}
  env = {k: v for k, v in env.items() if v is not None}
  return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=300)


@pytest.mark.skipif(platforms.tpu_attached() or platforms.gpu_attached(),
                    reason="the CPU-only host's case: an accelerator's backend would start here")
def test_a_workdir_under_a_file_is_one_line_and_a_cpu_host_sees_no_tpu_errors(tmp_path):
  """Without JAX_PLATFORMS (a user's shell), with libtpu installed (the `tpu` extra), jax starts
  its backends: stderr holds the refusal alone (was NotADirectoryError's traceback, after libtpu's
  `E0000 ... unexpected worker hostname` lines)."""
  (tmp_path / "afile").write_text("x")
  done = _command("bertjax.pretrain", "--config=configs/tiny.py",
                  f"--workdir={tmp_path / 'afile' / 'run'}", env={"JAX_PLATFORMS": None})
  assert done.returncode == 1
  lines = done.stderr.strip().splitlines()
  assert lines == [f"bertjax: --workdir={tmp_path / 'afile' / 'run'} cannot be made: "
                   f"{tmp_path / 'afile' / 'run'}: Not a directory (a part of it is a file, not a "
                   "folder; name a path under a folder)."], done.stderr[-3000:]


def test_a_folder_as_the_corpus_and_a_misspelled_fine_tuning_key_are_one_line(tmp_path):
  done = _command("bertjax.pretrain", "--config=configs/tiny.py", f"--workdir={tmp_path / 'w'}",
                  f"--config.data.source={tmp_path}", "--config.data.cache_dir=" + str(tmp_path),
                  env={"JAX_PLATFORMS": "cpu"})
  assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
  assert done.stderr.strip().splitlines()[-1].startswith(
      f"bertjax: IsADirectoryError: {tmp_path} (from source '{tmp_path}') is a directory")
  done = _command("bertjax.finetune", "--config=configs/finetune.py:next",
                  f"--workdir={tmp_path / 'f'}", "--config.train.learning_rat=1",
                  env={"JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": None,
                       "TF_ENABLE_ONEDNN_OPTS": None})
  assert done.returncode == 1
  assert (done.stdout + done.stderr).strip().splitlines() == [
      "bertjax: --config.train.learning_rat: the config has no key 'learning_rat'; did you mean "
      "'learning_rate'? (every key and its meaning: configs/base.py)."]


def test_the_prepare_command_refuses_in_one_line(tmp_path):
  """`python -m bertjax.data.prepare` ended every refusal in a traceback (its main ran outside
  cli.explained): every command's main now runs under it (cli.run). A refusal raised in a worker
  process reaches the command as the worker raised it: tests/test_data_prepare.py (local
  processes), tests/test_data_prepare_scale.py (Beam)."""
  from test_data_fixtures import write_vocab  # pylint: disable=import-outside-toplevel
  vocab = write_vocab(str(tmp_path / "vocab.txt"))
  (tmp_path / "texts").mkdir()
  done = _command("bertjax.data.prepare", "--config=configs/base.py",
                  "--config.data.tokenizer=wordpiece", f"--config.data.vocab_path={vocab}",
                  f"--config.data.source={tmp_path / 'texts'}",
                  f"--config.data.cache_dir={tmp_path / 'cache'}", env={"JAX_PLATFORMS": "cpu"})
  assert done.returncode == 1
  assert done.stderr.strip().splitlines() == [
      f"bertjax: IsADirectoryError: {tmp_path / 'texts'} (from source '{tmp_path / 'texts'}') is "
      f"a directory; config.data.source takes files: use e.g. '{tmp_path / 'texts'}/*.txt' (or "
      f"'{tmp_path / 'texts'}/*.txt.gz')."], done.stderr[-3000:]


def test_the_unawaited_reads_of_a_failed_restore_are_not_printed():
  """Exporting a workdir whose newest step's data is cut short printed the refusal and then
  hundreds of lines: orbax reads each array in a coroutine, and the reads dropped unawaited when
  one failed report themselves as they are collected. Every command's hook drops those (orbax's
  coroutines), and only those."""
  from bertjax import cli  # pylint: disable=import-outside-toplevel
  import types  # pylint: disable=import-outside-toplevel
  passed = []
  hook = cli.late_write_callbacks_dropped(passed.append)

  def coroutine(filename):
    scope = {}
    exec(compile("async def read():\n  pass\n", filename, "exec"), scope)  # pylint: disable=exec-used
    return scope["read"]()

  ours, theirs = (coroutine(os.path.join(os.sep, "site-packages", "orbax", "checkpoint", "s.py")),
                  coroutine(os.path.join(os.sep, "site-packages", "other", "s.py")))
  for coro in (ours, theirs):
    hook(types.SimpleNamespace(exc_value=RuntimeError("read failed"), object=coro,
                               exc_type=RuntimeError, exc_traceback=None, err_msg=None))
    coro.close()
  assert [u.object for u in passed] == [theirs]
