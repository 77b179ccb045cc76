"""The README's Python example runs as written."""

import pathlib
import re


def test_readme_python_example_runs(capsys):
  readme = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
  blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
  assert blocks, "README.md has no python example"
  for block in blocks:
    exec(compile(block, "README.md", "exec"), {})  # pylint: disable=exec-used
  assert "(2, 16, 64) (2, 64) (2, 2, 1000) (2, 2) (2, 3)" in capsys.readouterr().out
