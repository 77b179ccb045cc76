"""The `--config` flag's file: found by path or by a released config's name, its folder made
importable, and what goes wrong loading it said in one line.

The released configs ship inside the package (`bertjax.configs`, kept in the repository's
`configs/`): `--config=tiny` names one wherever bertjax is installed, and `--config=configs/tiny.py`
does too where no such file is under the working directory (a wheel's user running the README's
commands). A config file of one's own imports the released ones (`from bertjax.configs import
base`) or its siblings (`from configs import mine`): for the latter, the folder holding its
`configs/` (the file's grandparent) is put on `sys.path` before absl parses the flags and loads the
file, the one place bertjax edits `sys.path`.

A file that does not load (a syntax error, an import that fails, `tiny:phase=9` where tiny's
get_config takes no argument, get_config raising) and a misspelled override key each end the command
in one line naming the config and the fix, not in ml_collections' traceback (`cli.parse_flags`).
"""

import contextlib
import importlib.util
import os
import re
import sys
import traceback
from typing import Sequence

from absl import flags

from bertjax.errors import Refusal


def _config_value(argv: Sequence[str], name: str) -> tuple[int, str, str] | None:
  """(index in argv, prefix, value) of the first `--<name>=VALUE` (prefix `--<name>=`) or
  `--<name> VALUE` (prefix ''), if any."""
  for i, arg in enumerate(argv):
    if arg.startswith(f"--{name}="):
      return i, f"--{name}=", arg.split("=", 1)[1]
    if arg == f"--{name}" and i + 1 < len(argv):
      return i + 1, "", argv[i + 1]
  return None


def config_file_from_argv(argv: Sequence[str], name: str = "config") -> str | None:
  """The file named by `--<name>=FILE[:args]` or `--<name> FILE[:args]` in argv, if any."""
  found = _config_value(argv, name)
  # `file.py:phase=2` passes an argument to get_config
  return found[2].split(":", 1)[0] if found else None


def released_configs() -> dict[str, str]:
  """The released configs by name ('tiny', 'bert_base', 'finetune', ...): their files in the
  installed package. Found, not imported: importing one would import the model."""
  spec = importlib.util.find_spec("bertjax.configs")
  folders = list(spec.submodule_search_locations or []) if spec else []
  return {f.removesuffix(".py"): os.path.join(folder, f) for folder in folders
          for f in sorted(os.listdir(folder)) if f.endswith(".py") and f != "__init__.py"}


def released_config_path(value: str) -> str:
  """`value` (`FILE[:args]`) with a released config's name, or a `configs/NAME.py` path that
  names no file here, replaced by the packaged file; anything else unchanged. A path that names
  no file and no released config is refused naming the released ones."""
  path, sep, args = value.partition(":")
  if os.path.isfile(path):
    return value
  folder, base = os.path.split(path)
  name = base.removesuffix(".py")
  # A bare name, or the repository's relative path to it (`configs/tiny.py`, as the README writes
  # it) from outside a checkout; never another folder's path, which names a file of one's own.
  looks_released = (base == name and not folder) or (
      base != name and os.path.normpath(folder or ".") in ("configs", "."))
  released = released_configs()
  if looks_released and name in released:
    return released[name] + sep + args
  raise Refusal(f"--config={value}: there is no file {path}; give the path of a config file, or "
                f"a released config by name (--config=tiny; the released ones are "
                f"{', '.join(released)})")


def resolve_config_argv(argv: list[str], name: str = "config") -> str | None:
  """Rewrites argv's `--<name>` value in place through released_config_path (absl reads it later);
  returns the value as given (None without the flag), for messages."""
  found = _config_value(argv, name)
  if found:
    i, prefix, value = found
    argv[i] = prefix + released_config_path(value)
    return value
  return None


def make_config_folder_importable(argv: Sequence[str], name: str = "config") -> str | None:
  """Puts the config file's grandparent folder first on sys.path; returns it (None if no flag)."""
  path = config_file_from_argv(argv, name)
  if path is None:
    return None
  root = os.path.dirname(os.path.dirname(os.path.abspath(path)))
  if root not in sys.path:
    sys.path.insert(0, root)
  return root


@contextlib.contextmanager
def misspelled_keys_in_one_line(argv: Sequence[str]):
  """A misspelled config key in one line naming the flag and ml_collections' suggestion:
  ml_collections raises it as an AttributeError, which absl would print as three chained
  tracebacks."""
  try:
    yield
  except (AttributeError, KeyError) as err:
    # str() of the KeyError ml_collections wraps: the quoted key, then its suggestion.
    text = str(err.args[0] if err.args else err)
    key = re.match(r"[\\'\"]*([^\\'\"]*)", text).group(1)
    flag = next((a.split("=", 1)[0] for a in argv[1:] if a.startswith("--")
                 and re.search(rf"[.]{re.escape(key)}(=|$|[.])", a.split("=", 1)[0])), None)
    if flag is None:
      raise
    hint = re.search(r'Did you mean "([^"]+)"', text)
    sys.exit(f"bertjax: {flag}: the config has no key {key!r}"
             + (f"; did you mean {hint.group(1)!r}?" if hint else "")
             + " (every key and its meaning: configs/base.py).")


def load_errors_in_one_line(name: str = "config", typed: str | None = None,
                            flag_values: flags.FlagValues = flags.FLAGS) -> None:
  """Makes the defined `--<name>` flag's parser refuse a file that does not load with a `Refusal`
  (`load_error`), which absl hands `cli.parse_flags` as the cause of its flag error. The parser is
  ml_collections' (public through absl's `Flag.parser`); its own report of such a file is a
  traceback flattened into the flag's error, or an uncaught SyntaxError. `typed`: the value as
  the user gave it, where resolve_config_argv replaced it with the released file's path."""
  parser = flag_values[name].parser
  parse = parser.parse

  def parse_in_one_line(value):
    try:
      return parse(value)
    except Exception as err:  # pylint: disable=broad-except
      raise Refusal(load_error(typed or value, value, err, name)) from None
  parser.parse = parse_in_one_line


def load_error(typed: str, value: str, err: BaseException, name: str = "config") -> str:
  """The line refusing a config file that `err` stopped loading (`value`: FILE[:ARGS] as loaded,
  `typed`: as given): what failed, where in the file, and the fix."""
  # ml_collections re-raises get_config's TypeError or ValueError as one of the same type holding
  # the formatted traceback, inside its handler: the original is the context.
  if str(err).startswith("Error whilst parsing config file") and err.__context__ is not None:
    err = err.__context__
  path, _, args = value.partition(":")
  shown = f"--{name}={typed}: "
  if isinstance(err, Refusal):
    return shown + str(err)
  where, text = "", str(err)
  if isinstance(err, SyntaxError):  # its str() names the file by its base name alone
    where, text = f" ({err.filename}:{err.lineno})", err.msg
  else:
    frames = [f for f in traceback.extract_tb(err.__traceback__)
              if os.path.exists(f.filename) and os.path.exists(path)
              and os.path.samefile(f.filename, path)]
    if frames:
      where = f" ({path}:{frames[-1].lineno})"
  said = f"{type(err).__name__}: {text}{where}"
  if isinstance(err, TypeError) and "get_config()" in str(err):
    if args:
      return (shown + f"its get_config() takes no argument {args!r} ({said}); leave out "
              f"':{args}', or give what the file's docstring says it takes.")
    return (shown + f"its get_config() needs an argument ({said}); give it after a colon, as "
            f"--{name}={typed}:VALUE (the file's docstring says which).")
  if isinstance(err, ImportError):
    return (shown + f"the file does not load: {said}; install what it imports, or import the "
            "released configs as `from bertjax.configs import base` and your own beside it as "
            "`from configs import NAME`.")
  if isinstance(err, SyntaxError):
    return shown + f"the file does not load: {said}; fix the file there."
  return shown + f"the file's get_config() failed: {said}; fix the file there."
