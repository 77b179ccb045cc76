"""`python -m tests.killed_finetune FLAGS...` is `python -m bertjax.finetune FLAGS...` whose process
BERTJAX_TEST_KILL's first number SIGKILLs itself once its training loop has dispatched the step
given by the second, after a delay of up to a tenth of a second (the third number seeds it): a
kill at a drawn moment that lands whatever the machine's load (tests/test_launch_local_finetune.py).
A kill sent from the test instead raced the tiny run's end on a loaded machine."""

import os
import random
import runpy
import signal
import sys
import threading

if __name__ == "__main__":
  from bertjax.parallel import watchdog  # pylint: disable=import-outside-toplevel  (only when run)
  victim, at, seed = (int(n) for n in os.environ["BERTJAX_TEST_KILL"].split(":"))
  ids = [a.split("=", 1)[1] for a in sys.argv if a.startswith("--process_id=")]
  if (int(ids[0]) if ids else 0) == victim:
    real = watchdog.progress
    delay = random.Random(seed).uniform(0, 0.1)

    def progress(step=None):
      if step == at:
        threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
      real(step)
    watchdog.progress = progress
  sys.argv[0] = "bertjax.finetune"
  runpy.run_module("bertjax.finetune", run_name="__main__", alter_sys=True)
