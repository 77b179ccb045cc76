"""Runs `python -m MODULE [SUBCOMMAND] --help` for each command given (a JSON list of argument
lists) and prints a JSON object of those that failed: {command: [exit status, output's tail]}.

The libraries every command imports (jax, flax, TensorFlow...) are imported once here and each
command runs in a fork of this process, as `python -m` would run it: its own flags, its own
bertjax imports, its own exit. A fresh interpreter for each paid those imports ~35 times (two
and a half minutes of the suite on a loaded 2-core machine).
"""

import json
import os
import runpy
import sys
import tempfile
import traceback

# As `python -m` from the working directory: it, not this script's folder, on the path.
sys.path[0] = os.getcwd()

# Third-party only: a bertjax import here would hide a command that fails to import it.
import absl.app  # noqa: F401  pylint: disable=unused-import
import flax.linen  # noqa: F401  pylint: disable=unused-import
import jax  # noqa: F401  pylint: disable=unused-import
import ml_collections  # noqa: F401  pylint: disable=unused-import
import numpy  # noqa: F401  pylint: disable=unused-import
import optax  # noqa: F401  pylint: disable=unused-import
import orbax.checkpoint  # noqa: F401  pylint: disable=unused-import
import tensorflow  # noqa: F401  pylint: disable=unused-import


def _run(args: list[str], out_path: str) -> None:
  """In the fork: the command's output to `out_path`, its exit status as the process's."""
  fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
  os.dup2(fd, 1)
  os.dup2(fd, 2)
  status = 0
  try:
    sys.argv = [args[0], *args[1:], "--help"]
    runpy.run_module(args[0], run_name="__main__", alter_sys=True)
  except SystemExit as e:
    status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
  except BaseException:  # pylint: disable=broad-except
    traceback.print_exc()
    status = 2
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(status)  # pylint: disable=protected-access


def main() -> None:
  failed = {}
  with tempfile.TemporaryDirectory() as tmp:
    for i, args in enumerate(json.loads(sys.argv[1])):
      out_path = os.path.join(tmp, f"{i}.txt")
      sys.stdout.flush()
      sys.stderr.flush()
      pid = os.fork()
      if pid == 0:
        _run(args, out_path)
      _, wait_status = os.waitpid(pid, 0)
      code = os.waitstatus_to_exitcode(wait_status)
      with open(out_path, encoding="utf-8", errors="replace") as f:
        out = f.read()
      # absl's --help exits 1 after listing the flags.
      if code not in (0, 1) or "Traceback" in out or "--help" not in out:
        failed[" ".join(args)] = [code, out[-500:]]
  print(json.dumps(failed))


if __name__ == "__main__":
  main()
