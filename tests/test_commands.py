"""One command surface: every module that runs as a command (an `if __name__ == "__main__":`
block in bertjax/ or launch/) is in the README's commands table, or is internal with a reason;
every entry of the table exists and its page speaks of it; the benchmarks are subcommands of
`python -m bertjax.benchmark`."""

import ast
import json
import os
import pathlib
import re
import subprocess
import sys

from bertjax.benchmark import commands as benchmark_commands

from conftest import xla_flags

ROOT = pathlib.Path(__file__).parent.parent
# Commands no user types, and why.
INTERNAL = {"launch.logsync": "launch.tpu starts it on each worker to copy the job's log"}
# The benchmarks, reached as subcommands of `python -m bertjax.benchmark` (their `__main__` block
# is what the subcommand runs): the README's benchmark row lists them.
SUBCOMMAND_MODULES = {module for module, _ in benchmark_commands.SUBCOMMANDS.values()
                      if module != "bertjax.benchmark"}


def _runs_as_a_command(tree: ast.Module) -> bool:
  return any(isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
             and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__"
             and any(isinstance(c, ast.Constant) and c.value == "__main__"
                     for c in node.test.comparators)
             for node in tree.body)


def _commands() -> set[str]:
  """`python -m NAME` of every module with a `__main__` block (a package's __main__.py: NAME is
  the package)."""
  found = set()
  for folder in ("bertjax", "launch"):
    for path in (ROOT / folder).rglob("*.py"):
      if _runs_as_a_command(ast.parse(path.read_text())):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        found.add(name.removesuffix(".__main__"))
  return found


def _table() -> list[tuple[str, str]]:
  """(command, link) of each row of the README's `## Commands` table: a module (`python -m
  NAME`) or a script's path."""
  section = (ROOT / "README.md").read_text().split("\n## Commands\n", 1)[1].split("\n## ", 1)[0]
  rows = re.findall(r"^\| `(?:python -m )?([\w./]+)[^`]*` \| [^|]+ \| \[[^]]+\]\(([^)]+)\) \|$",
                    section, re.M)
  assert len(rows) == section.count("\n| `"), "a row of the table is not `command` | ... | [page](link)"
  return rows


def test_every_command_is_in_the_readme_table_and_every_entry_exists():
  table = _table()
  listed = [command for command, _ in table]
  assert len(listed) == len(set(listed)), listed
  modules = {c for c in listed if "/" not in c}
  commands = _commands()
  assert len(commands) >= 20, commands  # the walk still finds them
  missing = commands - modules - set(INTERNAL) - SUBCOMMAND_MODULES
  assert not missing, f"commands not in the README's table (add a row, or list them here): {missing}"
  stale = modules - commands
  assert not stale, f"the README's table names commands that do not exist: {stale}"
  assert not (modules & set(INTERNAL)) and not (modules & SUBCOMMAND_MODULES)
  for script in {c for c in listed if "/" in c}:
    assert os.access(ROOT / script, os.X_OK), script
  for command, link in table:
    page = (ROOT / link.split("#")[0]).read_text()
    assert command in page, f"{link} does not mention {command}"
  readme = (ROOT / "README.md").read_text()
  row = next(line for line in readme.splitlines() if line.startswith("| `python -m bertjax.benchmark`"))
  assert re.findall(r"`(\w+)`", row.split("|")[2]) == list(benchmark_commands.SUBCOMMANDS)


def test_every_benchmark_module_is_a_subcommand():
  benchmarks = {c for c in _commands() if c.split(".")[:2] == ["bertjax", "benchmark"]}
  assert len(benchmarks) > 8, benchmarks  # the walk still finds them
  assert benchmarks == {module for module, _ in benchmark_commands.SUBCOMMANDS.values()}
  assert not {c for c in _commands() if "benchmark" in c} - benchmarks  # all in bertjax/benchmark/


def _run(*args):
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(1)}
  return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=300)


def test_benchmark_subcommands_run_their_module():
  # A subcommand's flags are its module's own (a flag of another is refused by name), its
  # messages name it as typed.
  done = _run("bertjax.benchmark", "finetune", "--seq_lengths=128")
  assert done.returncode == 2, done.stderr[-2000:]
  assert done.stderr.startswith("bertjax.benchmark finetune: error: Unknown command line flag "
                                "'seq_lengths'"), done.stderr[-2000:]
  done = _run("bertjax.benchmark", "trian", "--steps=1")
  assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr[-2000:]
  assert done.stderr.startswith("bertjax.benchmark: error: unknown benchmark 'trian'")
  assert "one of train, hf, predict, data, prepare, finetune" in done.stderr


def test_train_is_the_benchmark_without_a_subcommand(monkeypatch, capsys):
  # `train` is taken off the command line and bertjax/benchmark/train.py goes on with its own flags;
  # a first word that is a flag is the old command line, left as it is.
  for argv, left in ((["b", "train", "--steps=1"], ["b", "--steps=1"]),
                     (["b", "--steps=1"], ["b", "--steps=1"]), (["b"], ["b"])):
    monkeypatch.setattr(sys, "argv", list(argv))
    assert benchmark_commands.dispatch(sys.argv) is None
    assert sys.argv == left
  monkeypatch.setattr(sys, "argv", ["b", "--help"])
  benchmark_commands.dispatch(sys.argv)
  assert "predict: bertjax.predict side by side with PyTorch" in capsys.readouterr().out


# The pages a user reads: every `from bertjax... import ...`, `import bertjax...`, `python -m
# bertjax...` and backticked `bertjax.NAME...` they show is what a user types, and must run.
PAGES = ("README.md", "docs/using-the-modules.md", "docs/your-own-task.md", "docs/data.md",
         "docs/pretraining.md", "docs/finetuning.md", "docs/interop.md", "docs/modern.md",
         "docs/performance.md", "docs/reliability.md", "launch/README.md")


def _names_the_pages_show() -> dict[str, set[str]]:
  """Dotted name -> the pages that show it: `pkg.module` or `pkg.module.attribute`."""
  found: dict[str, set[str]] = {}
  for page in PAGES:
    text = (ROOT / page).read_text()
    names = set()
    for module, items in re.findall(r"from (bertjax[\w.]*) import ([\w ,]+)", text):
      names.update(f"{module}.{item.split(' as ')[0].strip()}" for item in items.split(",")
                   if item.strip())
    names.update(re.findall(r"(?:^|[\s;,(`])import (bertjax[\w.]*\w)", text, re.M))
    names.update(re.findall(r"python3? -m (bertjax[\w.]*\w)", text))
    names.update(re.findall(r"`(bertjax\.[\w.]*\w)", text))
    for name in names:
      found.setdefault(name, set()).add(page)
  return found


def test_every_name_the_pages_show_imports():
  # In a fresh interpreter: each name is a module, or an attribute of the longest module it starts
  # with (`bertjax.sharding.DEFAULT_RULES`, `bertjax.optimizer.adamw`).
  shown = _names_the_pages_show()
  assert {"bertjax.model.BertConfig", "bertjax.heads.BertForPreTraining", "bertjax.losses",
          "bertjax.sharding.logical_context", "bertjax.nnx.to_nnx", "bertjax.optimizer.adamw",
          "bertjax.pretrained.load_pretrained", "bertjax.predict.Predictor",
          "bertjax.formats.converted", "bertjax.data.prepare"} <= shown.keys()  # the walk reads them
  code = ("import importlib, sys\nbad = []\n"
          f"for name in {sorted(shown)!r}:\n"
          "  parts = name.split('.')\n"
          "  for cut in range(len(parts), 0, -1):\n"
          "    try:\n"
          "      found = importlib.import_module('.'.join(parts[:cut]))\n"
          "      break\n"
          "    except ModuleNotFoundError:\n"
          "      continue\n"
          "  for part in parts[cut:]:\n"
          "    found = getattr(found, part, None)\n"
          "  if found is None:\n"
          "    bad.append(name)\n"
          "print(bad)\n")
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(1), "TF_CPP_MIN_LOG_LEVEL": "3"}
  done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  bad = eval(done.stdout.strip().splitlines()[-1])  # pylint: disable=eval-used
  assert not bad, {name: sorted(shown[name]) for name in bad}


def test_every_command_of_the_readme_table_shows_its_help():
  # `--help` of each row (a benchmark's: of each subcommand the row names): the command starts,
  # defines its flags and lists them, without a traceback (absl's --help exits 1). Each runs in a
  # fork of one process that imported the third-party libraries once (tests/command_help.py).
  commands = [[c] for c, _ in _table() if "/" not in c]
  commands += [["bertjax.benchmark", name] for name in benchmark_commands.SUBCOMMANDS]
  assert len(commands) > 20, commands
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(1), "TF_CPP_MIN_LOG_LEVEL": "3"}
  scripts = [c for c, _ in _table() if "/" in c]
  running = [subprocess.Popen([str(ROOT / s), "--help"], cwd=ROOT, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for s in scripts]
  done = subprocess.run([sys.executable, str(ROOT / "tests" / "command_help.py"),
                         json.dumps(commands)], cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=900)
  assert done.returncode == 0, done.stderr[-3000:]
  failed = json.loads(done.stdout.strip().splitlines()[-1])
  for script, proc in zip(scripts, running):
    out, err = proc.communicate(timeout=60)
    if proc.returncode not in (0, 1) or "--help" not in out + err:
      failed[script] = (proc.returncode, (out + err)[-500:])
  assert not failed, failed
