"""The built-in corpus's text: English prose shipped with Python, the standard library's
docstrings (one document per module) and `pydoc_data.topics` (one document per help topic), cut
into sentences by a rule written for it. No download; identical on every run of the same Python.

Its rule (`split_sentences`) stays its own, not the segmenter of the other sources
(bertjax/data/corpora/sentences.py): it is tuned to docstrings (initials are rare there, "A. B" is more
often a variable ending a sentence), and the built-in corpus's documents, the fine-tuning task
NEXT made from them and the figures recorded on them would all change with it.
"""

import ast
import functools
import os
import re
import sysconfig

# Ends a sentence: . ! or ? (optionally closing quotes/brackets), whitespace, then a likely start.
_SENTENCE_END = re.compile(r"(?:(?<=[.!?])|(?<=[.!?][\"')\]]))\s+(?=[\"'(\[]?[A-Z0-9])")
_ONLY_PUNCT = re.compile(r"^[\W_]+$")
# A piece ending so is no sentence end: a title or a common abbreviation. (Not initials: in
# technical prose "A. B" is more often a variable ending a sentence than a name.)
_NOT_AN_END = re.compile(r"(?:^|[\s(\"'])(?:Mr|Mrs|Ms|Dr|Prof|Sr|Jr|St|Mt|Gen|Col|Lt|Sgt|Capt|Rev|"
                         r"Hon|vs|cf|Fig|Vol|pp|approx|e\.g|i\.e)\.$")


def split_sentences(text: str) -> list[str]:
  """Rule-based splitter (no model to download): newlines, then sentence-final punctuation not
  after a title, a common abbreviation or an initial."""
  out = []
  for line in text.splitlines():
    line = " ".join(line.split())
    if not line:
      continue
    pieces = [s for s in _SENTENCE_END.split(line) if s.strip()]
    for i, piece in enumerate(pieces):
      if i and _NOT_AN_END.search(pieces[i - 1]):
        out[-1] += " " + piece
      else:
        out.append(piece)
  return out


def _clean_prose(text: str) -> list[str]:
  """Sentences of a docstring or help topic, without code blocks, doctests and heading rules."""
  sentences = []
  for para in re.split(r"\n\s*\n", text):
    lines = para.split("\n")
    # Indented paragraphs are code examples or tables in reST; doctests start with >>>.
    if not lines or lines[0][:1].isspace() or lines[0].lstrip().startswith(">>>"):
      continue
    kept = [ln for ln in lines if not _ONLY_PUNCT.match(ln.strip() or "x")
            and not ln.lstrip().startswith((">>>", "... "))]
    sentences.extend(split_sentences(" ".join(kept)))
  return sentences


def _module_docstrings(path: str) -> list[list[str]]:
  """The sentences of each docstring of a module (module, classes, functions), in source order;
  docstrings without prose left out."""
  try:
    with open(path, encoding="utf-8") as f:
      tree = ast.parse(f.read())
  except (SyntaxError, UnicodeDecodeError, ValueError):
    return []  # a few stdlib files are deliberately invalid (lib2to3 test data and the like)
  nodes = [n for n in ast.walk(tree)
           if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
  nodes.sort(key=lambda n: getattr(n, "lineno", 0))  # source order: a module reads top to bottom
  texts = (ast.get_docstring(node, clean=True) for node in nodes)
  return [sentences for sentences in (_clean_prose(t) for t in texts if t) if sentences]


@functools.lru_cache(maxsize=1)
def builtin_modules() -> tuple[tuple[tuple[str, ...], ...], ...]:
  """Each stdlib module's docstrings (their sentences), in a sorted walk of the library: the
  built-in documents' first ones, one a module, with the docstring boundaries they drop."""
  root = sysconfig.get_paths()["stdlib"]
  skip_dirs = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__",
               "pydoc_data"}
  modules = []
  for dirpath, dirnames, filenames in os.walk(root):
    # Sorted walk: the same Python installation always gives the same corpus in the same order.
    dirnames[:] = sorted(d for d in dirnames if d not in skip_dirs)
    for name in sorted(filenames):
      if name.endswith(".py"):
        docstrings = _module_docstrings(os.path.join(dirpath, name))
        if docstrings:
          modules.append(tuple(tuple(d) for d in docstrings))
  return tuple(modules)


@functools.lru_cache(maxsize=1)
def documents() -> tuple[tuple[str, ...], ...]:
  """Every built-in document: the modules' (their docstrings' sentences), then the help topics'."""
  import pydoc_data.topics
  docs = [tuple(s for d in docstrings for s in d) for docstrings in builtin_modules()]
  for key in sorted(pydoc_data.topics.topics):
    doc = _clean_prose(pydoc_data.topics.topics[key])
    if doc:
      docs.append(tuple(doc))
  return tuple(docs)
