"""The README is a map: its links and those of docs/ (and of docstrings into docs/) resolve to a
file, and an `#anchor` to a heading of that file; config docstrings stay short."""

import pathlib
import re

ROOT = pathlib.Path(__file__).parent.parent
PAGES = [ROOT / "README.md", ROOT / "launch" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _slug(heading):
  # GitHub's anchors: lower case, punctuation other than '-' and '_' dropped, spaces to '-'.
  return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path):
  text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # '#' in code is no heading
  return {_slug(m) for m in re.findall(r"^#+ (.*)$", text, re.M)}


def _broken(source, target):
  """Why `target` (a link written in `source`) does not resolve, or None."""
  path, _, anchor = target.partition("#")
  resolved = (source.parent / path).resolve() if path else source
  if not resolved.exists():
    return f"{source.relative_to(ROOT)}: {target}: no such file"
  if anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
    return f"{source.relative_to(ROOT)}: {target}: no heading #{anchor}"
  return None


def test_every_relative_link_resolves():
  links, broken = 0, []
  for page in PAGES:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
      if re.match(r"[a-z]+:", target):  # https:, mailto: ...
        continue
      links += 1
      broken.append(_broken(page, target))
  assert links > 20, links  # the pattern still finds the links
  assert not [b for b in broken if b], [b for b in broken if b]


def test_docstrings_point_at_existing_docs_headings():
  refs, broken = 0, []
  for path in [*ROOT.glob("bertjax/**/*.py"), *ROOT.glob("configs/*.py")]:
    for target in re.findall(r"docs/[\w-]+\.md(?:#[\w-]+)?", path.read_text()):
      refs += 1
      broken.append(_broken(ROOT / "README.md", target))
  assert refs >= 4, refs
  assert not [b for b in broken if b], [b for b in broken if b]


def test_readme_is_a_map_and_config_docstrings_are_short():
  assert len((ROOT / "README.md").read_text().splitlines()) <= 200
  for path in sorted((ROOT / "configs").glob("*.py")):
    doc = re.match(r'"""(.*?)"""', path.read_text(), re.S)
    if doc:  # the command and the figures; the lab notes live in docs/lab-notes.md
      assert len(doc.group(1).strip().splitlines()) <= 15, path.name


def test_tests_named_in_the_docs_exist():
  # docs/reliability.md names the test holding each guarantee; a renamed test must not rot there.
  named = []
  for page in PAGES:
    for path, name in re.findall(r"tests/(\w+\.py)(?:::(\w+))?", page.read_text()):
      test_file = ROOT / "tests" / path
      named.append((path, name))
      assert test_file.exists(), path
      assert not name or f"def {name}(" in test_file.read_text(), f"{path}::{name}"
  assert len(named) >= 5, named
