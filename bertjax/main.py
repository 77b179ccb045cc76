"""`python -m bertjax.main`: the old name of `python -m bertjax.pretrain`, kept so that scripts and
the command lines of jobs started before keep working: the same flags, the same run."""

from bertjax import cli, hostmem, pretrain

if __name__ == "__main__":
  hostmem.restart_with_huge_pages()
  cli.define_run_flags()
  cli.run(pretrain.main)
