"""The worker processes of the preparation, and SIGTERM while they run.

Workers are fresh interpreters, not multiprocessing: forking a process holding TensorFlow can
deadlock, and spawn re-imports the caller's main script (which may have no __main__ guard).
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading

from bertjax import cli

# The folder holding the bertjax package: on the workers' path, whatever their working directory.
_PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class PreparationStopped(cli.Stopped):
  """SIGTERM arrived while preparing; the finished shards are kept and a rerun resumes."""


@contextlib.contextmanager
def sigterm_raises():
  """SIGTERM becomes PreparationStopped: its default action would end this process alone, leaving
  the worker processes running without their parent and the user without a word."""
  if threading.current_thread() is not threading.main_thread():
    yield  # signal handlers can only be set from the main thread
    return

  def stop(signum, frame):
    raise PreparationStopped("SIGTERM")

  previous = signal.signal(signal.SIGTERM, stop)
  try:
    yield
  finally:
    signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _sigterm_deferred():
  """Holds SIGTERM back until the block ends: raised inside `Popen`, it would lose the child that
  was just started (never terminated, it would fail later on its empty input)."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  held = []
  previous = signal.signal(signal.SIGTERM, lambda signum, frame: held.append(signum))
  try:
    yield
  finally:
    signal.signal(signal.SIGTERM, previous)
    if held:
      signal.raise_signal(signal.SIGTERM)


class Workers:
  """`count` interpreters running `python -c code`, kept for several rounds of work (preparation's
  two steps: each interpreter imports the project and TensorFlow once, seconds of CPU apiece).

  A round sends each worker one JSON line (its share of the round) and waits for every worker's
  reply line; the worker's code reads lines with `serve`. Interrupted (SIGTERM, Ctrl-C) or
  failed, every worker is stopped with it."""

  def __init__(self, count: int, code: str):
    self._code, self.count, self._procs = code, count, []

  def __enter__(self):
    return self

  def _start(self):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([_PROJECT_ROOT, env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["CUDA_VISIBLE_DEVICES"] = ""
    with _sigterm_deferred():
      while len(self._procs) < self.count:
        self._procs.append(subprocess.Popen([sys.executable, "-c", self._code], env=env,
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE))

  def round(self, inputs: list) -> None:
    """Worker i gets inputs[i] (at most `count` of them); returns once each has replied."""
    if not inputs:
      return
    self._start()  # started on first use: a run with nothing left to do starts none
    busy = self._procs[:len(inputs)]
    for p, item in zip(busy, inputs):
      try:
        p.stdin.write(json.dumps(item).encode() + b"\n")
        p.stdin.flush()
      except BrokenPipeError:
        pass  # it died; its missing reply says so below
    failed = []
    for i, p in enumerate(busy):
      if p.stdout.readline() != b"done\n":
        failed.append((i, p.wait()))
    if failed:
      raise RuntimeError(f"{len(failed)} of {len(busy)} preparation process(es) failed (process, "
                         f"exit code): {failed}; see their errors above. Finished shards are "
                         f"kept: run again to resume.")

  def __exit__(self, kind, value, tb):
    for p in self._procs:
      if kind is None and p.poll() is None:
        p.stdin.close()  # the end of its input: the worker returns
    for p in self._procs:
      try:
        p.wait(timeout=None if kind is None else 10)
      except subprocess.TimeoutExpired:
        pass
      if p.poll() is None:
        p.terminate()
        try:
          p.wait(timeout=10)
        except subprocess.TimeoutExpired:
          p.kill()
          p.wait()
    return False


def serve(work) -> None:
  """A worker's loop: `work(item)` for each JSON line on stdin, a reply line after each. Anything
  the work prints goes to stderr, so the replies alone travel on stdout."""
  replies = os.fdopen(os.dup(1), "w")
  os.dup2(2, 1)
  sys.stdout = sys.stderr
  for line in sys.stdin:
    work(json.loads(line))
    replies.write("done\n")
    replies.flush()
