"""What the commands (pretrain, finetune, aot, benchmark, data.prepare, convert, predict, launch.tpu)
share: the `--config` flag, a run's flags and start-up, `run` (absl's app.run with usage errors in
one line), subcommands, quiet logs, refusals reported without a traceback.

A command defines its flags only when it runs as one (in its `__main__` block), never at import:
importing every module in one process (a test does) then defines no flag twice, and two commands'
`--workdir` or `--output` never meet.

The `--config` flag's file (by path, or a released config by name) and its load errors:
bertjax/config_files.py.
"""

import gc
import json
import logging
import os
import signal
import sys
from typing import Any, Callable, NoReturn, Sequence

from absl import flags, logging as absl_logging
from ml_collections import config_flags

from bertjax import config_files, errors, files
from bertjax.errors import Refusal
from bertjax.parallel import hostmem, platforms, watchdog

_PACKAGE = os.path.dirname(os.path.abspath(__file__))


def rename_flags(argv: list[str], renamed: dict[str, str]) -> None:
  """Rewrites, in place, each `--OLD[=value]` of argv whose flag was renamed to `--NEW`, saying so
  on stderr: an old name keeps working, and the user learns the new one."""
  for i, arg in enumerate(argv):
    for old, new in renamed.items():
      if arg == f"--{old}" or arg.startswith(f"--{old}="):
        argv[i] = f"--{new}" + arg[len(old) + 2:]
        print(f"bertjax: --{old} is now --{new} (the old name still works this release)",
              file=sys.stderr, flush=True)


def refuse_moved_keys(argv: Sequence[str], moved: dict[str, str], name: str = "config") -> None:
  """Ends the command naming the new path of every `--config.OLD=...` in argv whose key moved
  (absl would only say that the old key does not exist)."""
  found = []
  for arg in argv:
    if arg.startswith(f"--{name}."):
      key = arg[len(name) + 3:].split("=", 1)[0]
      if key in moved:
        found.append(f"--{name}.{key} is now --{name}.{moved[key]}")
  if found:
    sys.exit("bertjax: ValueError: config keys moved: " + "; ".join(found) + " (the paths "
             "pre-training uses for the same settings).")


def quiet_tensorflow() -> None:
  """TensorFlow's C++ start-up lines (oneDNN's banner, INFO) off unless the user set them: a
  config file loaded with the flags may import TensorFlow, and its banner would come before the
  command's own first line (a refused config key's, say)."""
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  # TensorFlow only runs the integer input pipeline here, which oneDNN does not speed up; off, it
  # also drops the INFO banner TensorFlow's C++ logging prints past TF_CPP_MIN_LOG_LEVEL.
  os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")


def define_config_flag(help_text: str = "Config file (a path, or a released config's name: tiny, "
                       "bert_base, finetune:next, ...), locked.", name: str = "config",
                       default: str | None = None):
  """Defines the locked config-file flag: an unknown or misspelled override key is an error."""
  quiet_tensorflow()
  try:
    typed = config_files.resolve_config_argv(sys.argv, name)
    if default is not None:
      default = config_files.released_config_path(default)
  except Refusal as e:
    sys.exit(f"bertjax: {e}")
  config_files.make_config_folder_importable(sys.argv, name)
  # a default file is loaded, and checked, here
  with config_files.misspelled_keys_in_one_line(sys.argv):
    holder = config_flags.DEFINE_config_file(name, default, help_text, lock_config=True)
  config_files.load_errors_in_one_line(name, typed)
  return holder


def define_run_flags() -> None:
  """The flags of a training run (`bertjax.pretrain`, `bertjax.finetune`): the locked config, the
  workdir and the multi-process join; `start` reads them."""
  define_config_flag()
  flags.DEFINE_string("workdir", None, "Checkpoints, TensorBoard logs and metrics go here "
                      "(local path or gs://). Running again with the same workdir resumes.")
  flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (multi-process "
                      "CPU/GPU).")
  flags.DEFINE_integer("num_processes", None, "Processes in the job (multi-process CPU/GPU).")
  flags.DEFINE_integer("process_id", None, "This process's index in [0, num_processes).")
  flags.mark_flags_as_required(["config", "workdir"])


def hide_accelerators_from_tensorflow() -> None:
  """tf.data runs on the host CPU; TensorFlow must not take GPU/TPU memory JAX needs. Where no
  accelerator is attached there is none to take, and TensorFlow is left to be imported where the
  data needs it (a refused flag or config key is then said seconds sooner)."""
  if not (platforms.gpu_attached() or platforms.tpu_attached()):
    return
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  for kind in ("GPU", "TPU"):
    try:
      tf.config.set_visible_devices([], kind)
    except (RuntimeError, ValueError):
      pass


def start(argv) -> None:
  """What a run's process does before any work: quiet logs, TensorFlow off the accelerators, and
  the multi-process join (`define_run_flags`' flags, parsed)."""
  from absl import app  # pylint: disable=import-outside-toplevel
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  quiet_tensorflow()
  quiet_third_party_logs()
  sys.unraisablehook = late_write_callbacks_dropped(sys.unraisablehook)
  hide_accelerators_from_tensorflow()
  # lazy: distributed imports jax, which the launcher and the data workers, importing this module
  # for its flags and refusals, need not load.
  from bertjax.parallel import distributed  # pylint: disable=import-outside-toplevel
  flag = flags.FLAGS
  train_config = getattr(flag["config"].value, "train", None) if "config" in flag else None
  seconds = train_config.get("watchdog_seconds", 0) if train_config is not None else 0
  distributed.initialize(flag.coordinator_address, flag.num_processes, flag.process_id,
                         heartbeat_seconds=watchdog.jax_heartbeat_seconds(seconds))
  import jax  # pylint: disable=import-outside-toplevel
  if flag.workdir and jax.process_index() == 0:
    # One lock per run, taken by its process 0: the processes of one run share the workdir (on one
    # machine under launch/local.sh, or on shared storage), two runs must not.
    try:
      note = files.lock_workdir(flag.workdir)
    except errors.WorkdirError as err:
      sys.exit(f"bertjax: {err}")
    if note:
      print(f"bertjax: {note}", flush=True)
  if jax.default_backend() == "cpu" and jax.process_index() == 0 and (
      hint := hostmem.hint_line()):
    print(f"bertjax: {hint}", flush=True)


def parse_flags(argv: Sequence[str]) -> list[str]:
  """absl's flag parsing (app.run's `flags_parser`), a bad flag said in one line with exit status
  2 (`usage_error`), a misspelled config key as `config_files.misspelled_keys_in_one_line` says
  it, a config file that does not load as a refusal (`config_files.load_error`'s line)."""
  with config_files.misspelled_keys_in_one_line(argv):
    try:
      return flags.FLAGS(argv)
    except flags.Error as err:
      if isinstance(err.__context__, Refusal):  # the config file's (load_errors_in_one_line)
        sys.exit(one_line(err.__context__))
      usage_error(str(err))


# The command's name where it runs under another's (`bertjax.benchmark predict` runs the module
# bertjax.benchmark.predict as its `__main__`): set by that command.
PROGRAM: str | None = None


def program() -> str:
  """The running command as its user typed it, for messages: `bertjax.convert.hf` for
  `python -m bertjax.convert.hf`, else the script's name."""
  if PROGRAM is not None:
    return PROGRAM
  spec = getattr(sys.modules.get("__main__"), "__spec__", None)
  if spec is not None and spec.name:
    return spec.name.removesuffix(".__main__")
  return os.path.basename(sys.argv[0])


def usage_error(message: str, prog: str | None = None) -> NoReturn:
  """Ends a command given a command line it cannot run: one line naming the flag or word at fault,
  exit status 2 (a usage error's status, as argparse and the shells give it)."""
  print(f"{prog or program()}: error: {' '.join(message.split())} (--help: the flags)",
        file=sys.stderr, flush=True)
  sys.exit(2)


HELP_FLAGS = ("--help", "-?", "--helpshort", "--helpfull", "--helpxml")


def subcommand(argv: Sequence[str], names: Sequence[str], prog: str | None = None) -> str | None:
  """The subcommand of `prog SUBCOMMAND [--flag ...]`: argv[1], one of `names`; None where argv[1]
  asks for help. Read before the flags are defined, so that each subcommand defines only its own:
  absl then refuses another subcommand's flag by name, and `SUBCOMMAND --help` lists its flags.
  Anything else ends the command (`usage_error`)."""
  word = argv[1] if len(argv) > 1 else None
  if word in names:
    return word
  if word in HELP_FLAGS:
    return None
  usage_error(f"{'unknown command ' + repr(word) if word else 'no command'}: the first word "
              f"says which, one of {', '.join(names)}", prog)


def run(main: Callable[[list[str]], Any]) -> None:
  """app.run(main) as every command's `__main__` block ends: flags parsed by `parse_flags`,
  third-party INFO logs off (`quiet_third_party_logs`: app.run sets absl's verbosity to INFO), an
  app.UsageError raised by main said in one line with exit status 2 (absl would print the module's
  docstring), a refused input in one line with exit status 1 (`explained`), and the flags a
  command takes from bertjax modules (this module's run flags, the converters' shared ones)
  listed by its --help as its own."""
  from absl import app  # pylint: disable=import-outside-toplevel
  quiet_tensorflow()
  platforms.skip_absent_tpu()
  platforms.add_xla_flags()
  platforms.add_libtpu_flags()
  sys.unraisablehook = late_write_callbacks_dropped(sys.unraisablehook)
  for module, defined in list(flags.FLAGS.flags_by_module_dict().items()):
    if module.startswith("bertjax."):
      for flag in defined:  # absl's --help shows the key flags of the main module (argv[0])
        flags.FLAGS.register_key_flag_for_module(sys.argv[0], flag)

  def main_with_usage_in_one_line(argv):
    quiet_third_party_logs()
    try:
      # Under `explained`, so that every command refuses its input in one line, whatever part of
      # it refuses (bertjax.data.prepare's main had ended every refusal in a traceback).
      return explained(main, argv)
    except app.UsageError as err:
      usage_error(str(err))

  try:
    app.run(main_with_usage_in_one_line, flags_parser=parse_flags)
  finally:
    # The interpreter's last collections at exit walk every object TensorFlow's and jax's imports
    # made: ~2.5 s a command, for nothing (the process is ending; every output was closed by the
    # code that wrote it, and atexit handlers still run). Frozen, they are left to the OS.
    gc.freeze()


class _OwnInfoOnly(logging.Filter):
  """Below WARNING, only bertjax's own records pass: orbax alone writes about 10 KB of INFO per
  checkpoint save, which would bury the run's lines and flood whatever reads its stderr. Nor does
  a library's report of a full disk (orbax logs the traceback of a failed save at each wait): the
  run says it in one line (`explained`)."""

  def filter(self, record: logging.LogRecord) -> bool:
    own = record.pathname.startswith(_PACKAGE)
    if not own and record.exc_info and files.storage_fault(record.exc_info[1]):
      return False
    return record.levelno >= logging.WARNING or own


def late_write_callbacks_dropped(previous):
  """An unraisable-exception hook that drops what a failed save leaves behind: orbax closes the
  event loop of a save whose write failed (a full disk) while tensorstore's other writes of it
  are under way, and each of those, finishing, reports that the loop is closed (dozens of
  tracebacks after the failure itself, which the run reports). Nor the reads of a failed
  restore: orbax reads each array in a coroutine, and when one finds its file cut short the
  others are dropped unawaited and report themselves as they are collected, after the command's
  one line naming the damage. Everything else goes to `previous`."""
  def hook(unraisable):
    error = unraisable.exc_value
    if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
      return
    code = getattr(getattr(unraisable, "object", None), "cr_code", None)
    if code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename:
      return
    previous(unraisable)
  return hook


def quiet_third_party_logs() -> bool:
  """Applies the filter unless absl's --verbosity / -v, --logtostderr or --alsologtostderr was
  given (then everything is logged as asked). Call after flags are parsed; returns whether set."""
  if any(flags.FLAGS[name].present for name in ("verbosity", "logtostderr", "alsologtostderr")
         if name in flags.FLAGS):
    return False
  handler = absl_logging.get_absl_handler()
  if not any(isinstance(f, _OwnInfoOnly) for f in handler.filters):
    handler.addFilter(_OwnInfoOnly())
  return True


class Stopped(Exception):
  """SIGTERM stopped the work (data.processes.PreparationStopped); what was finished is kept and
  a rerun resumes. `explained` says it and ends with the status a shell reports for SIGTERM."""


def one_line(err: BaseException) -> str | None:
  """The line a command ends on, alone, for `err`: a refusal of the input (a `Refusal` of
  bertjax/errors.py: a bad config value, a malformed file, a checkpoint of another run; a missing
  file or folder; a file that is not text or JSON; a non-finite loss) or a full disk. None for
  anything else, which keeps its traceback: a plain ValueError is a fault of the code, not of
  its input. The data workers ask it too, to hand a refusal back rather than print it."""
  if isinstance(err, errors.DiskFullError):  # names the workdir, the file and what is kept
    return f"bertjax: {err}"
  # A full disk or a failed write (EIO), however the library that wrote says it (safetensors'
  # own error, tensorstore's ValueError): one line naming the file.
  if (said := files.storage_fault_line(
      program(), err, "what it wrote before is kept (each file is written whole or not at "
      "all)")):
    return f"bertjax: {said}"
  if type(err) is Refusal:  # pylint: disable=unidiomatic-typecheck
    return f"bertjax: ValueError: {err}"  # as said before Refusal was its own class
  # The project's refusals; a missing file or folder; a file that is not UTF-8 or not JSON (what
  # was read is at fault, not bertjax); a non-finite loss.
  if isinstance(err, (Refusal, FileNotFoundError, IsADirectoryError, NotADirectoryError,
                      UnicodeDecodeError, json.JSONDecodeError, errors.NonFiniteError)):
    return f"bertjax: {type(err).__name__}: {err}"
  if isinstance(err, OSError):
    if (said := files.unwritable(err)) is not None:  # read-only, a file in the way, ...
      return f"bertjax: {type(err).__name__}: {said}"
    if isinstance(err, PermissionError):
      return f"bertjax: {type(err).__name__}: {err}"
  return None


def explained(run, *args, **kwargs):
  """Runs `run(*args, **kwargs)`; an error `one_line` says ends the command with that line alone
  and exit status 1, as `bertjax.aot` does: the message names the problem and the fix, and a
  traceback would only bury it. Other errors keep their traceback. `run` (below) runs every
  command's main so; a command may also wrap a part of its work."""
  try:
    return run(*args, **kwargs)
  except Stopped as err:
    # SIGTERM while preparing data: said, and the status a shell reports for SIGTERM (as
    # `bertjax.data.prepare` exits), so a script does not go on as if the run had ended.
    print(f"bertjax: {err}", file=sys.stderr, flush=True)
    sys.exit(128 + signal.SIGTERM)
  except Exception as err:  # pylint: disable=broad-except
    if (line := one_line(err)) is not None:
      sys.exit(line)
    raise
