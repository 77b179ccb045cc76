"""Copies a TPU VM's job log into the workdir (WORKDIR/logs/HOSTNAME.log) while the job runs.

Started by `python -m launch.tpu run` next to the job on every worker; a log on the VM goes with a
preempted or deleted slice, the copy in the bucket stays. Copies every --every seconds when the
log changed, and once more after the job (--pid) exits; `--once` copies once (`delete` runs it
before deleting the slice). tf.io.gfile writes gs:// as it writes a local folder (the tests use
one in place of the bucket). A GCS object cannot be appended to, so each copy rewrites the whole
log: fine for console logs of megabytes.

    python -m launch.logsync --src ~/bertjax-logs/train.log --dest gs://B/run/logs/HOST.log --pid 123
"""

from __future__ import annotations

import os
import sys
import time

from absl import app, flags


def alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # someone else's process: it exists
    return True
  return True


def copy(src: str, dest: str, gfile) -> bool:
  """Writes src to dest; False (and a line on stderr) when it could not, so the next try repeats."""
  try:
    with open(src, "rb") as f:
      data = f.read()
    gfile.makedirs(os.path.dirname(dest))
    with gfile.GFile(dest + ".partial", "wb") as f:
      f.write(data)
    gfile.rename(dest + ".partial", dest, overwrite=True)
    return True
  except Exception as err:  # pylint: disable=broad-except
    # A network blip or a missing log must not end the copying: the next round tries again.
    print(f"logsync: {src} -> {dest}: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
    return False


def define_flags() -> None:
  flags.DEFINE_string("src", None, "The log on this VM.", required=True)
  flags.DEFINE_string("dest", None, "E.g. gs://BUCKET/run/logs/HOSTNAME.log.", required=True)
  flags.DEFINE_integer("pid", None, "Copy until this process exits, then once more.")
  flags.DEFINE_float("every", 60.0, "Seconds between copies.")
  flags.DEFINE_bool("once", False, "Copy once and exit.")


def main(argv) -> int:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  args = flags.FLAGS
  if not args.once and args.pid is None:
    raise app.UsageError("give --pid (copy while it runs) or --once")
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  gfile = tf.io.gfile
  if args.once:
    return 0 if copy(args.src, args.dest, gfile) else 1
  last = None
  while True:
    running = alive(args.pid)
    try:
      stamp = os.stat(args.src)
      stamp = (stamp.st_size, stamp.st_mtime_ns)
    except OSError:
      stamp = None
    if stamp is not None and stamp != last and copy(args.src, args.dest, gfile):
      last = stamp
    if not running:  # the job is gone: the copy above was the last one (retried if it failed)
      for _ in range(3):
        if stamp is None or stamp == last or copy(args.src, args.dest, gfile):
          return 0
        time.sleep(min(args.every, 10))
      return 1
    time.sleep(args.every)


if __name__ == "__main__":
  from bertjax import cli
  define_flags()
  cli.run(main)
