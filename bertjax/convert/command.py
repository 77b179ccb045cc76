"""The command line the converters share (`convert.hf`, `convert.modernbert`, `convert.google`):

  python -m bertjax.convert.KIND import --SOURCE=FOLDER --output=OUT [--scan_layers]
  python -m bertjax.convert.KIND export --params=FOLDER --output=DIR

each with a few flags of its own (convert.google's --do_lower_case, convert.hf's --checkpoint).
A converter's `__main__` block names its SOURCE flag, defines its own flags and calls `start`.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Mapping, Sequence

from absl import app, flags

from bertjax import cli

COMMANDS = ("import", "export")


def define_flags(command: str | None, source: str, kind: str) -> None:
  """The flags of `command` (of both for None: a bare --help); those it needs are required."""
  if command in ("import", None):
    flags.DEFINE_string(source, None, f"import: the {kind} folder read.")
    flags.DEFINE_bool("scan_layers", False, "import: store the layers stacked for nn.scan.")
  if command in ("export", None):
    flags.DEFINE_string("params", None, "export: any folder bertjax reads weights from (a "
                        "workdir, a converted, Google or Hugging Face folder).")
  flags.DEFINE_string("output", None, f"import: the bertjax folder written; export: the {kind} "
                      "folder written.")
  if command is not None:
    flags.mark_flags_as_required([source, "output"] if command == "import" else
                                 ["params", "output"])


Extra = Mapping[str, Callable[[Any], Any]]  # a converter's own flag -> its value as taken


def main(argv: Sequence[str], source: str, import_folder: Callable[..., str],
         export_folder: Callable[..., str], import_flags: Extra, export_flags: Extra) -> None:
  """Runs argv[1] (import or export) with the flags' values, a converter's own flags passed by
  their names as keyword arguments; prints the line it returns (a refused input: cli.explained's
  line)."""
  if len(argv) > 2:
    raise app.UsageError(f"unexpected arguments {argv[2:]}")
  values = flags.FLAGS
  if argv[1] == "import":
    line = cli.explained(import_folder, values[source].value, values.output,
                         scan_layers=values.scan_layers,
                         **{name: read(values[name].value) for name, read in import_flags.items()})
  else:
    line = cli.explained(export_folder, values.params, values.output,
                         **{name: read(values[name].value) for name, read in export_flags.items()})
  print(line)


def start(source: str, kind: str, import_folder: Callable[..., str],
          export_folder: Callable[..., str],
          own_flags: Callable[[str | None], None] = lambda command: None,
          import_flags: Extra | None = None, export_flags: Extra | None = None) -> None:
  """A converter's command: the subcommand read from sys.argv, its flags (the shared ones, then the
  converter's own from `own_flags(command)`) defined, then run."""
  command = cli.subcommand(sys.argv, COMMANDS)
  define_flags(command, source, kind)
  own_flags(command)
  cli.run(lambda argv: main(argv, source, import_folder, export_folder, import_flags or {},
                            export_flags or {}))
