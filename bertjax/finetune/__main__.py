"""`python -m bertjax.finetune --config=configs/finetune.py:TASK --workdir=DIR
--config.checkpoint.init_from=PATH`

Fine-tunes init_from's encoder on TASK (GLUE's names, squad_v1.1, squad_v2.0, conll2003, next)
with the same conventions as `python -m bertjax.pretrain`: dotted overrides of a locked config,
config.json in the workdir, console progress, TensorBoard + metrics.jsonl, orbax checkpoints, exact
resume (run the same command again), a save on SIGTERM, several processes, the mesh from
config.mesh. See bertjax/finetune/job/run.py for what the workdir holds.
"""

import sys

from absl import flags

from bertjax import cli
from bertjax.parallel import hostmem

FLAGS = flags.FLAGS


def main(argv):
  cli.start(argv)
  # lazy: search brings TensorFlow in (tf.data), which cli.quiet_tensorflow must precede.
  from bertjax.finetune.job import search  # pylint: disable=import-outside-toplevel
  cli.explained(search.finetune, FLAGS.config, FLAGS.workdir)


if __name__ == "__main__":
  cli.quiet_tensorflow()  # before the imports below bring TensorFlow in
  hostmem.restart_with_huge_pages()
  from bertjax.finetune.job import run as run_lib  # pylint: disable=ungrouped-imports
  cli.refuse_moved_keys(sys.argv, run_lib.MOVED_KEYS)
  cli.define_run_flags()
  cli.run(main)
