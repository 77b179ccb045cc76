"""`python -m bertjax.main`: the old name of `python -m bertjax.pretrain`, kept so that scripts and
the command lines of jobs started before keep working: the same flags, the same run. It says so
at its start and in --help, and goes in the release `cli.OLD_NAMES_GO_IN` names."""

from bertjax import cli, hostmem, pretrain

if __name__ == "__main__":
  hostmem.restart_with_huge_pages()
  cli.define_run_flags()
  cli.old_name("bertjax.pretrain")
  cli.run(pretrain.main)
