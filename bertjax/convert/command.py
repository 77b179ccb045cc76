"""The command line the converters share (`convert.hf`, `convert.modernbert`, `convert.google`):

  python -m bertjax.convert.KIND import --weights=FOLDER --output=OUT [--scan_layers]
  python -m bertjax.convert.KIND export --weights=FOLDER --output=DIR

each with a few flags of its own (convert.google's --do_lower_case, convert.hf's --checkpoint).
`--weights` names the folder of weights read, as everywhere in bertjax; the names it had before
(import: convert.hf's and convert.modernbert's --hf_dir, convert.google's --ckpt_dir; export:
--params) still work and say the new one. A converter's `__main__` block names its old import
flag, defines its own flags and calls `start`.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Mapping, Sequence

from absl import app, flags

from bertjax import cli

COMMANDS = ("import", "export")


def define_flags(command: str | None, kind: str) -> None:
  """The flags of `command` (of both for None: a bare --help); those it needs are required."""
  flags.DEFINE_string("weights", None, f"import: the {kind} folder read; export: any folder "
                      "bertjax reads weights from (a workdir, a converted, Google or Hugging Face "
                      "folder).")
  if command in ("import", None):
    flags.DEFINE_bool("scan_layers", False, "import: store the layers stacked for nn.scan.")
  flags.DEFINE_string("output", None, f"import: the bertjax folder written; export: the {kind} "
                      "folder written.")
  if command is not None:
    flags.mark_flags_as_required(["weights", "output"])


def define_checkpoint_flag(command: str | None) -> None:
  """export's --checkpoint, of the converters whose export takes a fine-tuning workdir
  (convert.hf, convert.modernbert)."""
  if command in ("export", None):
    flags.DEFINE_string("checkpoint", "best", "export: of a fine-tuning workdir: best (its best "
                        "epoch), latest or a step.")


Extra = Mapping[str, Callable[[Any], Any]]  # a converter's own flag -> its value as taken


def main(argv: Sequence[str], import_folder: Callable[..., str],
         export_folder: Callable[..., str], import_flags: Extra, export_flags: Extra) -> None:
  """Runs argv[1] (import or export) with the flags' values, a converter's own flags passed by
  their names as keyword arguments; prints the line it returns (a refused input: cli.explained's
  line)."""
  if len(argv) > 2:
    raise app.UsageError(f"unexpected arguments {argv[2:]}")
  values = flags.FLAGS
  if argv[1] == "import":
    line = cli.explained(import_folder, values.weights, values.output,
                         scan_layers=values.scan_layers,
                         **{name: read(values[name].value) for name, read in import_flags.items()})
  else:
    line = cli.explained(export_folder, values.weights, values.output,
                         **{name: read(values[name].value) for name, read in export_flags.items()})
  print(line)


def start(old_source: str, kind: str, import_folder: Callable[..., str],
          export_folder: Callable[..., str],
          own_flags: Callable[[str | None], None] = lambda command: None,
          import_flags: Extra | None = None, export_flags: Extra | None = None) -> None:
  """A converter's command: the subcommand read from sys.argv, its flags (the shared ones, then the
  converter's own from `own_flags(command)`) defined, then run. `old_source` is the name its
  import's --weights had before."""
  command = cli.subcommand(sys.argv, COMMANDS)
  cli.rename_flags(sys.argv, {old_source: "weights"} if command == "import" else
                   {"params": "weights"})
  define_flags(command, kind)
  own_flags(command)
  cli.run(lambda argv: main(argv, import_folder, export_folder, import_flags or {},
                            export_flags or {}))
