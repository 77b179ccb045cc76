"""`python tests/interrupted_finetune.py FLAGS...` is `python -m bertjax.finetune FLAGS...`,
interrupted at the moment the environment variable BERTJAX_TEST_INTERRUPT names (for
tests/test_finetune_chaos.py): SIGKILLed, or stopped by a full disk. Unset, nothing is patched: it
is the command itself.

A kill sent from outside lands wherever the process happens to be, so a test of "killed during a
save" would pass or fail by luck; this one lands at the named moment every run. The moments, STEP
being the step of an epoch's end:

- `save:STEP`: SIGKILL during the save of checkpoints/STEP: every file written into orbax's
  temporary folder, before the rename that commits it, and held there until evaluations.json
  records the evaluation of STEP (a save slower than the evaluation, as to a bucket);
- `evaluation:STEP`: SIGKILL during the evaluation of STEP, after its first batch, once
  checkpoints/STEP is committed;
- `record:STEP`: SIGKILL after the evaluation of STEP (and best/'s save of it, if it scored best),
  before evaluations.json records it;
- `disk_full:STEP`: the commit of checkpoints/STEP fails with OSError ENOSPC, as a full disk fails
  it (in orbax's background thread; the run meets it at its next save);
- `eio:STEP`: the same commit fails with OSError EIO, as a failing disk fails it;
- `eio_write:NAME`: the first file named NAME that bertjax.files writes (evaluations.json, a
  prediction file such as STS-B.tsv, results.json) fails with EIO at its fsync, its text written.
"""

import asyncio
import errno
import os
import runpy
import signal
import sys
import time

ENV = "BERTJAX_TEST_INTERRUPT"


def _kill():
  sys.stdout.flush()
  os.kill(os.getpid(), signal.SIGKILL)


def _wait_for(condition, what: str, timeout: float = 120.0) -> None:
  """Returns once `condition()` holds; after `timeout` it says so and returns (the test then sees
  the workdir in another state than the one it asked for, and fails saying it)."""
  deadline = time.time() + timeout
  while not condition():
    if time.time() > deadline:
      print(f"killed_finetune: no {what} after {timeout:g} s; killing anyway", flush=True)
      return
    time.sleep(0.01)


def _recorded(workdir: str, step: int) -> bool:
  from bertjax import files  # pylint: disable=import-outside-toplevel
  path = os.path.join(workdir, "evaluations.json")
  try:
    return any(r["step"] == step for r in files.read_json(path))
  except (FileNotFoundError, ValueError):
    return False


def _arm(moment: str, workdir: str) -> None:
  what, step = moment.split(":")
  if what == "eio_write":
    real_fsync, name = os.fsync, step

    def fsync(fd):
      target = os.readlink(f"/proc/self/fd/{fd}")
      if os.path.basename(target).split(".tmp-")[0] == name and not failed:
        failed.append(target)
        raise OSError(errno.EIO, os.strerror(errno.EIO), target)
      real_fsync(fd)
    failed = []
    os.fsync = fsync
    return
  step = int(step)
  if what in ("save", "disk_full", "eio"):
    from orbax.checkpoint._src.path import atomicity  # pylint: disable=import-outside-toplevel
    real_finalize = atomicity.AtomicRenameTemporaryPath.finalize
    target = os.path.join(workdir, "checkpoints", str(step))

    async def finalize(self):
      if str(self.get_final()) == target:
        if what in ("disk_full", "eio"):
          code = errno.ENOSPC if what == "disk_full" else errno.EIO
          raise OSError(code, os.strerror(code), str(self.get()))
        await asyncio.to_thread(_wait_for, lambda: _recorded(workdir, step),
                                f"record of step {step} in evaluations.json")
        _kill()
      await real_finalize(self)
    atomicity.AtomicRenameTemporaryPath.finalize = finalize
  elif what == "evaluation":
    import jax  # pylint: disable=import-outside-toplevel
    from bertjax.finetune.job import run  # pylint: disable=import-outside-toplevel
    real_predict, real_batches = run.predict, run.eval_batches
    committed = os.path.join(workdir, "checkpoints", str(step))

    def killed_after_one(*args, **kwargs):
      for k, batch in enumerate(real_batches(*args, **kwargs)):
        if k == 1:
          _wait_for(lambda: os.path.isdir(committed), f"{committed}")
          _kill()
        yield batch

    def predict(training, state, features, batch_size, stop=None):
      # An evaluation (not the final predictions, which pass no stop signal) of `step`.
      evaluating = stop is not None and int(jax.device_get(state.step)) == step
      run.eval_batches = killed_after_one if evaluating else real_batches
      return real_predict(training, state, features, batch_size, stop)
    run.predict = predict
  elif what == "record":
    from bertjax import files  # pylint: disable=import-outside-toplevel
    real_write = files.write_json

    def write_json(path, value):
      if os.path.basename(path) == "evaluations.json" and any(r["step"] == step for r in value):
        _kill()
      real_write(path, value)
    files.write_json = write_json
  else:
    raise ValueError(f"{ENV}={moment}: the moments are save:STEP, evaluation:STEP, record:STEP, "
                     "disk_full:STEP, eio:STEP, eio_write:NAME")


if __name__ == "__main__":
  # As `python -m` from the repository's root would: its bertjax and configs first.
  sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  if os.environ.get(ENV):
    workdirs = [a.split("=", 1)[1] for a in sys.argv if a.startswith("--workdir=")]
    _arm(os.environ[ENV], os.path.abspath(workdirs[0]))
  runpy.run_module("bertjax.finetune", run_name="__main__", alter_sys=True)
