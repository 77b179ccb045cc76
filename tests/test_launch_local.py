"""launch/local.sh: N local processes as the hosts of one pod (a global mesh over gloo)."""

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import xla_flags
from test_data_fixtures import data_section

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCHER = os.path.join(ROOT, "launch", "local.sh")
TIMEOUT = 300  # one bertjax.pretrain run, generous: the 2 cores of a test machine are shared
DATA_KEYS = ("tokenizer", "vocab_path", "source", "cache_dir", "max_seq_length",
             "max_predictions_per_seq", "num_shards", "num_eval_shards", "prepare_workers")


def _flags(tmp_path) -> list[str]:
  """bertjax.pretrain flags of a tiny run on a tiny corpus (the built-in one takes too long)."""
  data = data_section(tmp_path / "data", n_docs=30, sents_per_doc=12)
  return (["--config=configs/tiny.py", f"--workdir={tmp_path / 'run'}"]
          + [f"--config.data.{k}={data[k]}" for k in DATA_KEYS]
          + ["--config.model.hidden_size=32", "--config.model.intermediate_size=64",
             "--config.model.num_layers=1", "--config.train.batch_size=8",
             "--config.train.warmup_steps=1", "--config.train.log_every_steps=1",
             "--config.train.eval_sequences=8", "--config.checkpoint.save_every_steps=1000"])


def _saved_steps(tmp_path) -> list[int]:
  folder = tmp_path / "run" / "checkpoints"
  return sorted(int(name) for name in os.listdir(folder) if name.isdigit())


def _alive(pid: int) -> bool:
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except FileNotFoundError:
    return False


class _Run:
  """A command whose output a thread collects, so that every wait can time out."""

  def __init__(self, cmd, env):
    self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)
    self.lines = []
    self.children = {}  # process id -> pid of the bertjax.pretrain processes seen so far
    self._reader = threading.Thread(target=self._read, daemon=True)
    self._reader.start()

  def _read(self):
    for line in self.proc.stdout:
      self.lines.append(line.rstrip("\n"))

  @property
  def output(self) -> str:
    return "\n".join(self.lines)

  def wait_for(self, pattern: str, timeout: float = TIMEOUT) -> re.Match:
    deadline = time.time() + timeout
    while True:
      for line in list(self.lines):
        match = re.search(pattern, line)
        if match:
          return match
      assert self.proc.poll() is None or self._reader.is_alive(), (
          f"exited ({self.proc.returncode}) without printing {pattern!r}:\n" + self.output[-5000:])
      assert time.time() < deadline, f"no {pattern!r} in {timeout} s:\n" + self.output[-5000:]
      time.sleep(0.2)

  def finish(self, timeout: float = TIMEOUT) -> int:
    try:
      self.proc.wait(timeout)
    except subprocess.TimeoutExpired:
      pytest.fail(f"still running after {timeout} s:\n" + self.output[-5000:])
    self._reader.join(10)
    return self.proc.returncode

  def find_children(self) -> dict[int, int]:
    """The launcher's bertjax.pretrain children, by their --process_id (0 when there is one)."""
    pids = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True,
                          text=True).stdout.split()
    for pid in map(int, pids):
      try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
          args = f.read().decode().split("\0")
      except FileNotFoundError:
        continue
      if {"bertjax.pretrain", "bertjax.finetune",
          "tests.killed_finetune"} & set(args):
        ids = [a.split("=", 1)[1] for a in args if a.startswith("--process_id=")]
        self.children[int(ids[0]) if ids else 0] = pid
    return dict(self.children)

  def kill(self):
    if self.proc.poll() is None:
      self.find_children()
    for pid in self.children.values():
      if _alive(pid):
        os.kill(pid, signal.SIGKILL)
    if self.proc.poll() is None:
      self.proc.kill()
      self.proc.wait()


@pytest.fixture
def runs():
  """Starts commands; whatever a failed test leaves running is killed."""
  started = []

  class Runs:
    @staticmethod
    def launch(options, flags):
      # The interpreter running the tests (a checkout without .venv/ would get python3).
      env = {"PYTHON": sys.executable, **os.environ}
      started.append(_Run([LAUNCHER, *options, "--", *flags], env=env))
      return started[-1]

    @staticmethod
    def main(flags, devices):
      env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1",
             "XLA_FLAGS": xla_flags(devices)}
      started.append(_Run([sys.executable, "-m", "bertjax.pretrain", *flags], env=env))
      return started[-1]

  yield Runs
  for run in started:
    run.kill()


def test_pod_saves_on_sigterm_and_resumes_on_other_meshes(tmp_path, runs):
  flags = _flags(tmp_path)
  # 2 processes x 4 devices (the default): a mesh of 8. A preemption notice reaches one host only,
  # between log steps (none is due before step 1000): the hosts must still agree on one step and
  # save it at once, as inside a preemption's grace period.
  pod = runs.launch(["-n", "2"], flags + ["--config.train.num_train_steps=1000",
                                          "--config.train.log_every_steps=1000"])
  pod.wait_for(r"^\[0\] bertjax: initialised from scratch")
  children = pod.find_children()
  time.sleep(3)  # a few steps in, or still compiling the first on a loaded machine
  os.kill(children[1], signal.SIGTERM)
  # Counted in steps, not seconds: the notice may land while the first step compiles (37 s on a
  # loaded 2-core machine under XLA's single-threaded CPU flags), so a bound in seconds measures
  # the machine. A step saved before the end (below: saved < 1000) is one both hosts agreed on.
  saved = int(pod.wait_for(r"^\[0\] bertjax: a preemption notice received; saved step (\d+)",
                           180).group(1))
  assert pod.finish() == 0, pod.output[-5000:]
  assert 0 < saved < 1000 and _saved_steps(tmp_path)[-1] == saved
  # Every line is one process's (or the launcher's), whole; both processes spoke; both exited 0.
  assert all(re.match(r"\[(0|1|local\.sh)\] ", line) for line in pod.lines), pod.output
  assert any(line.startswith("[1] ") for line in pod.lines)
  assert "[local.sh] all 2 process(es) exited 0" in pod.lines
  # INFO lines are bertjax's own (absl names each one's file); orbax alone would write kilobytes.
  own = {name for _, _, names in os.walk(os.path.join(ROOT, "bertjax")) for name in names}
  info_files = {m.group(1) for m in (re.match(r"\[\d\] I\d{4} \S+ +\d+ ([\w.]+):\d+\]", line)
                                      for line in pod.lines) if m}
  assert info_files and info_files <= own, info_files - own

  # One process of 8 devices takes it over, for two more steps.
  single = runs.main(flags + [f"--config.train.num_train_steps={saved + 2}"], devices=8)
  assert single.finish() == 0, single.output[-5000:]
  single.wait_for(rf"^bertjax: resumed from \S+ at step {saved}$", 0)
  assert _saved_steps(tmp_path)[-1] == saved + 2

  # And 2 processes x 2 devices (a mesh of 4) take the one-process checkpoint to the end.
  pod = runs.launch(["-n", "2", "-d", "2"], flags + [f"--config.train.num_train_steps={saved + 4}"])
  assert pod.finish() == 0, pod.output[-5000:]
  pod.wait_for(rf"^\[0\] bertjax: resumed from \S+ at step {saved + 2}$", 0)
  pod.wait_for(rf"^\[0\] step {saved + 4}/{saved + 4} ", 0)
  pod.wait_for(r"^\[0\] Held-out MLM accuracy", 0)
  assert _saved_steps(tmp_path)[-1] == saved + 4


def test_bad_usage_is_refused_with_a_message():
  cases = [
      (["-n", "2", "--config=configs/tiny.py"], "missing '--'"),
      (["-n", "0", "--", "--config=configs/tiny.py"], "-n 0: the number of processes must be"),
      (["-n", "two", "--", "--config=configs/tiny.py"], "must be an integer >= 1"),
      (["-d", "0", "--", "--config=configs/tiny.py"], "-d 0: the devices per process"),
      (["-n", "2", "--", "--process_id=1"], "the launcher sets the coordinator"),
      (["-q", "--", "--config=configs/tiny.py"], "unknown option '-q'"),
  ]
  for args, message in cases:
    done = subprocess.run([LAUNCHER, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and message in done.stderr, (args, done.stderr)
  done = subprocess.run([LAUNCHER, "-h"], cwd=ROOT, capture_output=True, text=True, timeout=60)
  assert done.returncode == 0 and "Usage: launch/local.sh" in done.stdout

