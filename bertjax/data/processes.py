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


def run_workers(inputs: list, code: str):
  """Runs `python -c code` once per item of `inputs`, each reading its item as JSON on stdin, and
  waits for all; stops them all if this process is interrupted (SIGTERM, Ctrl-C)."""
  env = dict(os.environ)
  root = _PROJECT_ROOT
  env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
  env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  env["CUDA_VISIBLE_DEVICES"] = ""
  procs = []
  try:
    with _sigterm_deferred():
      for item in inputs:
        p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, env=env)
        procs.append(p)
        p.stdin.write(json.dumps(item).encode())
        p.stdin.close()
    codes = [p.wait() for p in procs]
  except BaseException:  # the workers stop with us
    for p in procs:
      if p.poll() is None:
        p.terminate()
    for p in procs:
      try:
        p.wait(timeout=10)
      except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
    raise
  failed = [(i, rc) for i, rc in enumerate(codes) if rc != 0]
  if failed:
    raise RuntimeError(f"{len(failed)} of {len(procs)} preparation process(es) failed (process, "
                       f"exit code): {failed}; see their errors above. Finished shards are kept: "
                       f"run again to resume.")
