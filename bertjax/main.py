"""Entry point: `python -m bertjax.main --config=configs/tiny.py --workdir=/tmp/run`.

Any config key can be overridden with a dotted flag (`--config.train.batch_size=256`); the config
is locked, so a misspelled key is an error. Third-party INFO logs are off unless absl's
--verbosity (or -v), --logtostderr or --alsologtostderr is given. Several processes (a TPU pod, or `launch/local.sh`)
join one global mesh: on Cloud TPU nothing needs to be given, elsewhere --coordinator_address,
--num_processes and --process_id (or the BERTJAX_* environment variables of bertjax.distributed).
"""

import os
import sys

from absl import app, flags

from bertjax import cli, hostmem

cli.define_config_flag()
flags.DEFINE_string("workdir", None, "Checkpoints, TensorBoard logs and metrics go here "
                    "(local path or gs://). Running again with the same workdir resumes.")
flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (multi-process CPU/GPU).")
flags.DEFINE_integer("num_processes", None, "Processes in the job (multi-process CPU/GPU).")
flags.DEFINE_integer("process_id", None, "This process's index in [0, num_processes).")
flags.mark_flags_as_required(["config", "workdir"])
FLAGS = flags.FLAGS


def hide_accelerators_from_tensorflow() -> None:
  """tf.data runs on the host CPU; TensorFlow must not take GPU/TPU memory JAX needs."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  for kind in ("GPU", "TPU"):
    try:
      tf.config.set_visible_devices([], kind)
    except (RuntimeError, ValueError):
      pass


def start(argv) -> None:
  """What a run's process does before any work: quiet logs, TensorFlow off the accelerators, and
  the multi-process join (shared by `bertjax.main` and `bertjax.finetune`)."""
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  # TensorFlow only runs the integer input pipeline here, which oneDNN does not speed up; off, it
  # also drops the INFO banner TensorFlow's C++ logging prints past TF_CPP_MIN_LOG_LEVEL.
  os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
  cli.quiet_third_party_logs()
  hide_accelerators_from_tensorflow()
  from bertjax import distributed  # pylint: disable=import-outside-toplevel
  distributed.initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
  import jax  # pylint: disable=import-outside-toplevel
  if FLAGS.workdir and jax.process_index() == 0:
    # One lock per run, taken by its process 0: the processes of one run share the workdir (on one
    # machine under launch/local.sh, or on shared storage), two runs must not.
    from bertjax import files  # pylint: disable=import-outside-toplevel
    try:
      note = files.lock_workdir(FLAGS.workdir)
    except files.WorkdirBusyError as err:
      sys.exit(f"bertjax: {err}")
    if note:
      print(f"bertjax: {note}", flush=True)
  if jax.default_backend() == "cpu" and jax.process_index() == 0 and (
      hint := hostmem.hint_line()):
    print(f"bertjax: {hint}", flush=True)


def main(argv):
  start(argv)
  from bertjax import loop  # pylint: disable=import-outside-toplevel
  cli.explained(loop.train_and_evaluate, FLAGS.config, FLAGS.workdir)


if __name__ == "__main__":
  hostmem.restart_with_huge_pages()
  app.run(main, flags_parser=cli.parse_flags)
