"""`python -m tests.slowed_finetune FLAGS...` is `python -m bertjax.finetune FLAGS...` with each
training step followed by a sleep of BERTJAX_TEST_STEP_SECONDS (0.3 by default): a kill aimed at a
logged step of a tiny run lands while the run still goes on, however late a loaded machine lets
the test see the line (tests/test_launch_local_finetune.py). The sleep changes no number."""

import os
import runpy
import sys
import time

if __name__ == "__main__":
  from bertjax import watchdog  # pylint: disable=import-outside-toplevel
  real = watchdog.progress
  seconds = float(os.environ.get("BERTJAX_TEST_STEP_SECONDS", "0.3"))

  def progress(step=None):
    if step is not None:  # a training step (evaluation batches pass none)
      time.sleep(seconds)
    real(step)
  watchdog.progress = progress
  sys.argv[0] = "bertjax.finetune"
  runpy.run_module("bertjax.finetune", run_name="__main__", alter_sys=True)
