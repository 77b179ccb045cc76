"""The Python examples of the README and of docs/using-the-modules.md run as written."""

import pathlib
import re

ROOT = pathlib.Path(__file__).parent.parent


def _run_python_blocks(path):
  blocks = re.findall(r"```python\n(.*?)```", path.read_text(), re.S)
  assert blocks, f"{path} has no python example"
  for block in blocks:
    exec(compile(block, str(path), "exec"), {})  # pylint: disable=exec-used


def test_readme_python_example_runs(capsys):
  _run_python_blocks(ROOT / "README.md")
  assert "(2, 16, 64) (2, 64) (2, 2, 1000) (2, 2) (2, 3)" in capsys.readouterr().out


def test_using_the_modules_examples_run():
  # The examples moved there from the README (a pre-trained encoder on a mesh, NNX).
  _run_python_blocks(ROOT / "docs" / "using-the-modules.md")
