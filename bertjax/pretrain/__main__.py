"""Pre-training: `python -m bertjax.pretrain --config=configs/tiny.py --workdir=/tmp/run`.

Any config key can be overridden with a dotted flag (`--config.train.batch_size=256`); the config
is locked, so a misspelled key is an error. Third-party INFO logs are off unless absl's
--verbosity (or -v), --logtostderr or --alsologtostderr is given. Several processes (a TPU pod, or `launch/local.sh`)
join one global mesh: on Cloud TPU nothing needs to be given, elsewhere --coordinator_address,
--num_processes and --process_id (or the BERTJAX_* environment variables of bertjax.parallel.distributed).
"""

from absl import flags

from bertjax import cli
from bertjax.parallel import hostmem

FLAGS = flags.FLAGS


def main(argv):
  cli.start(argv)
  # lazy: pretrain_job imports TensorFlow (tf.data); cli.start sets its log level and oneDNN
  # switch first.
  from bertjax.pretrain import job as pretrain_job  # pylint: disable=import-outside-toplevel
  cli.explained(pretrain_job.train_and_evaluate, FLAGS.config, FLAGS.workdir)


if __name__ == "__main__":
  hostmem.restart_with_huge_pages()
  cli.define_run_flags()
  cli.run(main)
