"""The worker processes of the preparation, and SIGTERM while they run.

Workers are fresh interpreters, not multiprocessing: forking a process holding TensorFlow can
deadlock, and spawn re-imports the caller's main script (which may have no __main__ guard).
"""

import base64
import contextlib
import json
import os
import pickle
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
  reply line; the worker's code reads lines with `serve`. A worker's refusal of the input is
  raised here, as the worker raised it (`serve`). Interrupted (SIGTERM, Ctrl-C) or failed, every
  worker is stopped with it."""

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
    failed, refused = [], []
    for i, p in enumerate(busy):
      reply = p.stdout.readline()
      if reply.startswith(_REFUSED):
        refused.append(pickle.loads(base64.b64decode(reply[len(_REFUSED):])))
      elif reply != b"done\n":
        failed.append((i, p.wait()))
    if failed:  # a fault of the code first: its traceback is on the worker's stderr
      raise RuntimeError(f"{len(failed)} of {len(busy)} preparation process(es) failed (process, "
                         f"exit code): {failed}; see their errors above. Finished shards are "
                         f"kept: run again to resume.")
    if refused:
      raise refused[0]

  def __exit__(self, kind, value, tb):
    for p in self._procs:
      if p.poll() is None:
        # The end of its input: an idle worker returns (one whose fellow refused its input too,
        # at once rather than after the wait below); a busy one, once its task is done.
        p.stdin.close()
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


# A reply: "done", or this and the worker's refusal, pickled, in base64.
_REFUSED = b"refused "


def serve(work) -> None:
  """A worker's loop: `work(item)` for each JSON line on stdin, a reply line after each. Anything
  the work prints goes to stderr, so the replies alone travel on stdout. A refusal of the input
  (what `cli.one_line` says in one line) is the reply, raised again by the parent: the command
  then ends on its line alone, not on this worker's traceback and the parent's "failed". Any
  other error ends the worker with its traceback."""
  replies = os.fdopen(os.dup(1), "wb")
  os.dup2(2, 1)
  sys.stdout = sys.stderr
  for line in sys.stdin:
    try:
      work(json.loads(line))
      reply = b"done"
    except Exception as err:  # pylint: disable=broad-except
      if cli.one_line(err) is None:
        raise
      reply = _REFUSED + base64.b64encode(pickle.dumps(err))
    replies.write(reply + b"\n")
    replies.flush()
