"""The commands' shared start-up (bertjax/cli.py): the --config flag (its folder importable from any
working directory), one flags library, usage errors in one line, flags defined only when run."""

import ast
import os
import pathlib
import re
import subprocess
import sys

import pytest

from bertjax import cli, config_files, errors

from conftest import xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("argv, expected", [
    (["prog", "--config=configs/tiny.py"], "configs/tiny.py"),
    (["prog", "--config", "configs/bert_base.py:phase=2"], "configs/bert_base.py"),
    (["prog", "--config=/x/configs/b.py:phase=2", "--config.train.batch_size=4"], "/x/configs/b.py"),
    (["prog", "--config.train.batch_size=4"], None),
    (["prog", "--config"], None),
    (["prog", "--configs=a.py"], None),
])
def test_config_file_from_argv(argv, expected):
  assert config_files.config_file_from_argv(argv) == expected


def test_make_config_folder_importable(tmp_path, monkeypatch):
  monkeypatch.setattr(sys, "path", list(sys.path))
  root = config_files.make_config_folder_importable(
      ["p", f"--config={tmp_path}/configs/mine.py:x=1"])
  assert root == str(tmp_path) and sys.path[0] == str(tmp_path)
  config_files.make_config_folder_importable(["p", f"--config={tmp_path}/configs/mine.py"])
  assert sys.path.count(str(tmp_path)) == 1  # not added twice
  assert config_files.make_config_folder_importable(["p"]) is None


def test_a_released_config_is_named_by_name_or_by_its_path_outside_a_checkout(tmp_path,
                                                                              monkeypatch):
  released = config_files.released_configs()
  assert {"tiny", "base", "bert_base", "bert_large", "finetune", "modern_tiny"} <= released.keys()
  assert config_files.released_config_path("tiny") == released["tiny"]
  assert config_files.released_config_path("finetune:next") == released["finetune"] + ":next"
  here = "configs/bert_base.py:phase=2"  # a checkout's file is taken as it is, path and argument
  monkeypatch.chdir(ROOT)
  assert config_files.released_config_path(here) == here
  monkeypatch.chdir(tmp_path)  # no configs/ here: the README's path names the released file
  assert config_files.released_config_path(here) == released["bert_base"] + ":phase=2"
  (tmp_path / "configs").mkdir()
  (tmp_path / "configs" / "tiny.py").write_text("")  # one's own configs/tiny.py wins
  assert config_files.released_config_path("configs/tiny.py") == "configs/tiny.py"
  for wrong in ("tiyn", "configs/tiyn.py", "/elsewhere/configs/tiny.py"):
    with pytest.raises(errors.Refusal, match=r"there is no file .*--config=tiny.*bert_base"):
      config_files.released_config_path(wrong)
  argv = ["p", "--config", "tiny:x", "--config.train.batch_size=2"]
  config_files.resolve_config_argv(argv)
  assert argv == ["p", "--config", released["tiny"] + ":x", "--config.train.batch_size=2"]


@pytest.mark.parametrize("module, extra", [
    ("bertjax.benchmark", ["--steps=1", "--warmup_steps=0", "--config.model.vocab_size=512",
                           "--config.train.batch_size=2"]),
    ("bertjax.pretrain", ["--workdir=unused", "--config.train.batch_sise=2"]),
])
def test_commands_load_configs_from_another_directory(tmp_path, module, extra):
  """A config file of one's own, run from elsewhere, imports its sibling (`from configs import
  ...`, through its folder put on sys.path) and a released config (`from bertjax.configs import
  ...`, from the installed package)."""
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(1))
  other = tmp_path / "project"
  (other / "configs").mkdir(parents=True)
  (other / "configs" / "__init__.py").write_text("")
  (other / "configs" / "shared.py").write_text(
      "from bertjax.configs import tiny\n\n\ndef get_config():\n  c = tiny.get_config()\n"
      "  c.model.hidden_size = 64\n  return c\n")
  (other / "configs" / "mine.py").write_text(
      "from configs import shared\n\n\ndef get_config():\n  return shared.get_config()\n")
  cwd = tmp_path / "elsewhere"
  cwd.mkdir()
  done = subprocess.run([sys.executable, "-m", module, f"--config={other}/configs/mine.py", *extra],
                        cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
  out = done.stdout + done.stderr
  assert "No module named" not in out, out[-2000:]
  if module == "bertjax.pretrain":  # the config loaded; the misspelled override key is named
    assert done.returncode != 0 and "batch_sise" in out, out[-2000:]
  else:
    assert done.returncode == 0, out[-2000:]
    assert "sequences_per_s" in out


def _record(path: str, level: int):
  import logging  # pylint: disable=import-outside-toplevel
  return logging.LogRecord("absl", level, path, 1, "a message", None, None)


def test_third_party_info_is_off_unless_verbosity_is_asked_for(monkeypatch):
  import logging  # pylint: disable=import-outside-toplevel
  from absl import flags, logging as absl_logging  # pylint: disable=import-outside-toplevel
  handler = absl_logging.get_absl_handler()
  monkeypatch.setattr(handler, "filters", [])
  own = os.path.join(os.path.dirname(cli.__file__), "loop.py")
  orbax = "/venv/site-packages/orbax/checkpoint/checkpoint_manager.py"
  monkeypatch.setattr(flags.FLAGS["verbosity"], "present", 1)
  assert not cli.quiet_third_party_logs()  # asked for: everything as absl would log it
  assert handler.filter(_record(orbax, logging.INFO))
  monkeypatch.setattr(flags.FLAGS["verbosity"], "present", 0)
  assert cli.quiet_third_party_logs() and len(handler.filters) == 1
  cli.quiet_third_party_logs()
  assert len(handler.filters) == 1  # applied once
  assert not handler.filter(_record(orbax, logging.INFO))
  assert handler.filter(_record(orbax, logging.WARNING))
  assert handler.filter(_record(own, logging.INFO))


def test_a_refused_input_ends_the_command_with_its_message_alone(tmp_path):
  """A bad task name (or any refused input) is one line on stderr and exit status 1."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(1)}
  done = subprocess.run([sys.executable, "-m", "bertjax.finetune",
                         f"--config={ROOT}/configs/finetune.py:nosuchtask",
                         f"--workdir={tmp_path / 'run'}"], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300)
  assert done.returncode == 1, done.stderr[-2000:]
  assert "bertjax: ValueError: Unknown fine-tuning task 'nosuchtask'" in done.stderr
  assert "Traceback" not in done.stderr, done.stderr[-2000:]


def test_subcommands_are_read_before_the_flags(capsys):
  names = ("import", "export")
  assert cli.subcommand(["prog", "export", "--params=x"], names) == "export"
  assert cli.subcommand(["prog", "--help"], names) is None  # help on every subcommand's flags
  for argv, said in ((["prog", "imprt"], "unknown command 'imprt'"),
                     (["prog"], "no command"), (["prog", "--params=x", "export"], "unknown command")):
    with pytest.raises(SystemExit) as exited:
      cli.subcommand(argv, names, prog="prog")
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"prog: error: {said}") and err.count("\n") == 1, err
    assert "one of import, export" in err


@pytest.mark.parametrize("module, args, said", [
    ("bertjax.pretrain", ["--wokdir=x"], "Unknown command line flag 'wokdir'. Did you mean: workdir ?"),
    ("bertjax.pretrain", ["--config=configs/tiny.py"],
     "flag --workdir=None: Flag --workdir must have a value"),
    ("bertjax.pretrain", ["--config=configs/tiny.py", "--workdir=w", "extra"],
     "Unexpected arguments: ['extra']"),
])
def test_a_command_line_a_command_cannot_run_is_one_line_with_exit_status_2(module, args, said):
  """absl would print two lines (FATAL ...) or the module's whole docstring, with exit status 1."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(1)}
  done = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300)
  assert done.returncode == 2, done.stderr[-2000:]
  err = done.stderr
  assert err.startswith(f"{module}: error: {said}"), done.stderr[-2000:]
  assert err.count("\n") == 1, done.stderr[-2000:]


CONFIG_FILES = {  # name: (text, the argument given, what the line says)
    "syntax": ("def get_config(:\n", "", r"the file does not load: SyntaxError: invalid syntax "
               r"\(.*syntax.py:1\); fix the file there\."),
    "import": ("import no_such_module_here\n", "", r"the file does not load: ModuleNotFoundError: "
               r"No module named 'no_such_module_here' \(.*import.py:1\); install what it imports"),
    "argument": ("def get_config():\n  return {}\n", "phase=9", r"its get_config\(\) takes no "
                 r"argument 'phase=9' .*; leave out ':phase=9'"),
    "needs": ("def get_config(task):\n  return {}\n", "", r"its get_config\(\) needs an argument "
              r".*; give it after a colon, as --config=.*needs.py:VALUE"),
    "raises": ("def get_config(arg=None):\n  return {}[arg]\n", "x", r"the file's get_config\(\) "
               r"failed: KeyError: 'x' \(.*raises.py:2\); fix the file there\."),
}


@pytest.mark.parametrize("case", CONFIG_FILES)
def test_a_config_file_that_does_not_load_is_one_line_naming_it_and_the_fix(tmp_path, case):
  """ml_collections' own report: a traceback flattened into absl's flag error, or (a syntax or an
  import error) an uncaught traceback."""
  from absl import flags  # pylint: disable=import-outside-toplevel
  from ml_collections import config_flags  # pylint: disable=import-outside-toplevel
  text, args, said = CONFIG_FILES[case]
  path = tmp_path / f"{case}.py"
  path.write_text(text)
  value = f"{path}:{args}" if args else str(path)
  own = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "", flag_values=own, lock_config=True)
  config_files.load_errors_in_one_line("config", None, own)
  with pytest.raises(flags.Error) as raised:  # what cli.parse_flags takes it from
    own(["prog", f"--config={value}"])
  refusal = raised.value.__context__
  assert isinstance(refusal, errors.Refusal), raised.value
  line = str(refusal)
  assert "\n" not in line and line.startswith(f"--config={value}: "), line
  assert re.search(said, line), line


@pytest.mark.parametrize("config, said", [
    ("tiny:phase=9", "--config=tiny:phase=9: its get_config() takes no argument 'phase=9'"),
    ("BAD", "--config=BAD: the file does not load: SyntaxError: invalid syntax (BAD:1)")])
def test_a_config_that_does_not_load_ends_the_command_as_a_refusal(tmp_path, config, said):
  """Through a command: the line is the refusal's, exit status 1 (was a traceback)."""
  bad = tmp_path / "bad.py"
  bad.write_text("def get_config(:\n")
  config, said = config.replace("BAD", str(bad)), said.replace("BAD", str(bad))
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(1)}
  done = subprocess.run([sys.executable, "-m", "bertjax.pretrain", f"--config={config}",
                         f"--workdir={tmp_path / 'run'}"], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300)
  assert done.returncode == 1, done.stderr[-2000:]
  assert done.stderr.strip().splitlines() == [done.stderr.strip()], done.stderr[-2000:]
  assert done.stderr.startswith(f"bertjax: ValueError: {said}"), done.stderr[-2000:]


def _modules():
  """(name, path) of every module of bertjax/ and launch/."""
  for folder in ("bertjax", "launch"):
    for path in sorted(pathlib.Path(ROOT, folder).rglob("*.py")):
      yield ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"), path


def test_every_command_is_on_absl_and_the_shared_start_up():
  """One flags library: no argparse anywhere; every `__main__` block ends in cli.run (the
  converters' through convert/command.py's start). launch.tpu alone parses a FlagValues of its
  own (its main runs many times in one test process), with cli's subcommand and usage_error."""
  commands = []
  for name, path in _modules():
    text = path.read_text()
    tree = ast.parse(text)
    imported = {a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                for a in n.names} | {n.module for n in ast.walk(tree)
                                     if isinstance(n, ast.ImportFrom)}
    assert "argparse" not in imported, name
    block = text.partition('\nif __name__ == "__main__":\n')[2]
    if not block:
      continue
    commands.append(name)
    if name == "launch.tpu":  # its command line is launch/tpu_flags.py's
      parser = (path.parent / "tpu_flags.py").read_text()
      assert "flags.FlagValues()" in parser and "cli.subcommand(" in parser, name
      assert block.startswith("  sys.exit(main())") and "tpu_flags.parse(" in text, name
    else:
      assert re.search(r"\n  (cli\.run|command\.start)\(", block), name
  assert len(commands) >= 19, commands  # the pattern still finds them


def test_importing_every_module_defines_no_flag():
  """Commands define their flags when they run, never at import: importing them all in one
  process (as a test run does) meets no DuplicateFlagError, and leaves no flag of theirs."""
  code = ("import importlib, sys\nfrom absl import flags\n"
          f"for name in {[name for name, _ in _modules()]!r}:\n"
          "  importlib.import_module(name)\n"
          "print(sorted(f'{m}: --{f.name}' for m, defined in flags.FLAGS.flags_by_module_dict()"
          ".items() for f in defined if m.split('.')[0] in ('bertjax', 'launch', '__main__')))\n")
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(1), "TF_CPP_MIN_LOG_LEVEL": "3"}
  done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  assert done.stdout.strip() == "[]", done.stdout


def _private_names_used_across_modules(path: pathlib.Path) -> list[str]:
  """`module._name` and `from module import _name` where module is another of the project's."""
  tree = ast.parse(path.read_text(encoding="utf-8"))
  modules, found = set(), []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      modules |= {a.asname or a.name for a in node.names
                  if a.name.split(".")[0] in ("bertjax", "launch")}
    elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("bertjax",
                                                                                     "launch"):
      for a in node.names:
        if a.name.startswith("_") and not a.name.startswith("__"):
          found.append(f"{path.name}:{node.lineno}: from {node.module} import {a.name}")
        modules.add(a.asname or a.name)  # a module or a name: only module._x is looked for below
  for node in ast.walk(tree):
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
        and node.value.id in modules and node.attr.startswith("_")
        and not node.attr.startswith("__")):
      found.append(f"{path.name}:{node.lineno}: {node.value.id}.{node.attr}")
  return found


def test_no_module_reaches_into_another_ones_private_names():
  # A name with a leading underscore may change without notice; what another module needs is
  # public (issue 27: evaluate_mlm, custom, convert.google and benchmark_predict used _names).
  found = [hit for folder in ("bertjax", "launch")
           for path in sorted(pathlib.Path(ROOT, folder).rglob("*.py"))
           for hit in _private_names_used_across_modules(path)]
  assert not found, found


def test_a_gpu_hosts_xla_flags_are_added_but_never_over_the_users(monkeypatch):
  # platforms.GPU_XLA_FLAGS, the one place a command's GPU flags would be set (none chosen yet).
  from bertjax.parallel import platforms  # pylint: disable=import-outside-toplevel
  assert platforms.GPU_XLA_FLAGS == ()  # today's behaviour until a GPU measurement chooses
  monkeypatch.setattr(platforms, "GPU_XLA_FLAGS", ("--xla_a=1", "--xla_b=2"))
  env = {"XLA_FLAGS": "--xla_b=7 --other"}
  monkeypatch.setattr(platforms, "gpu_attached", lambda: False)
  assert platforms.add_xla_flags(env) == [] and env == {"XLA_FLAGS": "--xla_b=7 --other"}
  monkeypatch.setattr(platforms, "gpu_attached", lambda: True)
  assert platforms.add_xla_flags(env) == ["--xla_a=1"]
  assert env == {"XLA_FLAGS": "--xla_b=7 --other --xla_a=1"}  # the user's --xla_b kept
  empty = {}
  assert platforms.add_xla_flags(empty) == ["--xla_a=1", "--xla_b=2"]
  assert empty == {"XLA_FLAGS": "--xla_a=1 --xla_b=2"}


def test_a_tpu_hosts_libtpu_flags_are_added_where_it_compiles_and_never_over_the_users(monkeypatch):
  # platforms.TPU_LIBTPU_FLAGS: on a TPU host (cli.run) and wherever a slice's step is compiled
  # on this host (aot.topology_devices), so aot measures the program the slice runs.
  from bertjax.parallel import platforms  # pylint: disable=import-outside-toplevel
  names = [flag.split("=", 1)[0] for flag in platforms.TPU_LIBTPU_FLAGS]
  assert "--xla_tpu_enable_windowed_einsum_for_all_gather" in names
  monkeypatch.setattr(platforms, "tpu_attached", lambda: False)
  env = {"LIBTPU_INIT_ARGS": f"{names[0]}=true --other"}
  assert platforms.add_libtpu_flags(env) == [] and env["LIBTPU_INIT_ARGS"] == f"{names[0]}=true --other"
  assert platforms.add_libtpu_flags(env, compiling=True) == list(platforms.TPU_LIBTPU_FLAGS[1:])
  assert env["LIBTPU_INIT_ARGS"].startswith(f"{names[0]}=true --other ")  # the user's kept
  monkeypatch.setattr(platforms, "tpu_attached", lambda: True)
  empty = {}
  assert platforms.add_libtpu_flags(empty) == list(platforms.TPU_LIBTPU_FLAGS)
  assert empty == {"LIBTPU_INIT_ARGS": " ".join(platforms.TPU_LIBTPU_FLAGS)}
  assert platforms.add_libtpu_flags(empty) == []  # a second call adds nothing


def test_only_a_refusal_is_one_line_a_plain_value_error_keeps_its_traceback():
  """cli.explained ends the command in one line on errors.Refusal (and the project's refusals
  built on it, a missing file, a file that is not text); a plain ValueError is a fault of the code
  (an unpacking gone wrong, a library called wrongly) and reaches the user with its traceback."""
  from bertjax import errors  # pylint: disable=import-outside-toplevel
  from bertjax.training import checkpoint  # pylint: disable=import-outside-toplevel

  def raising(error):
    def run():
      raise error
    return run

  for error, said in ((errors.Refusal("config.x=1: use 2"), "bertjax: ValueError: config.x=1: use 2"),
                      (errors.CheckpointMismatchError("hidden_size: 32 vs 64"),
                       "bertjax: CheckpointMismatchError: hidden_size: 32 vs 64"),
                      (FileNotFoundError("no.csv"), "bertjax: FileNotFoundError: no.csv")):
    with pytest.raises(SystemExit) as exited:
      cli.explained(raising(error))
    assert exited.value.code == said
  with pytest.raises(SystemExit):
    cli.explained(lambda: b"\xff".decode("utf-8"))  # a file that is not UTF-8: its input's fault
  bug = ValueError("too many values to unpack (expected 2)")
  with pytest.raises(ValueError) as raised:
    cli.explained(raising(bug))
  assert raised.value is bug
  assert isinstance(errors.Refusal("x"), ValueError)  # `except ValueError` still catches one
