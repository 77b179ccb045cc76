"""`python -m bertjax.benchmark [SUBCOMMAND] [--flag ...]`: every benchmark of bertjax under one
command (commands.py names them); without a subcommand, or with `train`, the train step's
throughput (train.py, whose docstring its --help prints)."""

import sys

from bertjax import cli
from bertjax.benchmark import commands, train
from bertjax.parallel import hostmem

__doc__ = train.__doc__  # absl's --help prints the main module's docstring

if __name__ == "__main__":
  commands.dispatch(sys.argv)  # another subcommand runs there; train goes on here
  hostmem.restart_with_huge_pages()
  train.define_flags()
  cli.run(train.main)
