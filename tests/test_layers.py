"""The layers of the house, read from the code (an ast walk over bertjax/, launch/, configs/).

Lowest first; a module imports from its own layer or the ones below it, never from one above:

  base            errors, files, config_files, cli (the commands' shell), versions, parallel/ (the
                  mesh and its rules, processes, watchdog, platforms, TPU slices, host memory)
  model           model/ (the encoder, its config, attention, heads, losses, NNX, the bi-encoder)
  data            data/ (tokenizers, corpora, preparation, the tf.data pipeline) and inputs/ (a
                  user's text to features): nothing of the model
  training        training/ (the steps, optimizer, loop, control, checkpoints, metrics, FLOPs)
  perf            perf/ (a compiled step's roofline and costs)
  formats         formats/ (Hugging Face, Google, ModernBERT and converted folders; TF bundles; the
                  folder an export writes; the task spec): parsing, no reader of folders
  weights         weights/ (the one reader of a weights folder, a folder against the run,
                  load_pretrained)
  runs            pretrain/ (the command and its job), aot
  finetune-kit    finetune/kit/ (what the families share)
  families        finetune/families/ (the families and their registry)
  finetune-tasks  finetune/tasks/ (the benchmark tasks as readers)
  finetune        finetune/job/ (the run, the search) and finetune/'s commands
  configs         configs/, shipped as bertjax.configs (configs/finetune.py reads the families)
  commands        predict/, benchmark/, convert/, tune, evaluate_mlm, launch/
  faces           heads, losses, nnx, sharding, optimizer, pretrained: what users import, handing on
                  the names of the module that defines them

Held here: every module has a layer; no import runs upward; no circle (imports inside functions
and `__main__` blocks included); a project import inside a function says why on its line or in
the comment just above it (`# lazy: ...`). docs/contributing.md#layers states the same order.
Neither prediction nor a task family imports a benchmark's reader (GLUE, SQuAD, CoNLL-2003);
nothing below the families reads their registry; a module stays within 450 lines, a function
within 80, a folder within 15 modules; a face hands on every name of its module.
"""

import ast
import collections
import functools
import pathlib
import re

ROOT = pathlib.Path(__file__).parent.parent
PACKAGES = ("bertjax", "launch", "configs")

LAYERS = (
    ("base", ("bertjax.errors", "bertjax.files", "bertjax.config_files", "bertjax.cli",
              "bertjax.parallel", "bertjax.versions")),
    ("model", ("bertjax.model",)),
    ("data", ("bertjax.data", "bertjax.inputs")),
    ("training", ("bertjax.training",)),
    ("perf", ("bertjax.perf",)),
    ("formats", ("bertjax.formats",)),
    ("weights", ("bertjax.weights",)),
    ("runs", ("bertjax.aot", "bertjax.pretrain")),
    ("finetune-kit", ("bertjax.finetune.kit",)),
    ("families", ("bertjax.finetune.families",)),
    ("finetune-tasks", ("bertjax.finetune.tasks",)),
    ("finetune", ("bertjax.finetune",)),
    ("configs", ("bertjax.configs",)),
    ("commands", ("bertjax.predict", "bertjax.benchmark", "bertjax.convert", "bertjax.evaluate_mlm",
                  "bertjax.tune", "launch")),
    ("faces", ("bertjax.heads", "bertjax.losses", "bertjax.nnx", "bertjax.sharding",
               "bertjax.optimizer", "bertjax.pretrained")),
)
# The public modules the README and docs/using-the-modules.md import, each the face of the module
# that now defines its names (bertjax/model/__init__.py and bertjax/predict/__init__.py are the
# faces of bertjax.model's and bertjax.predict's).
PUBLIC_FACES = {"bertjax.heads": "bertjax.model.heads", "bertjax.losses": "bertjax.model.losses",
                "bertjax.nnx": "bertjax.model.nnx", "bertjax.sharding": "bertjax.parallel.sharding",
                "bertjax.optimizer": "bertjax.training.optimizer",
                "bertjax.pretrained": "bertjax.weights.pretrained"}
FACES = {"bertjax"}  # bertjax/__init__.py: empty, no layer of its own


def _module_name(path: pathlib.Path) -> str:
  parts = list(path.relative_to(ROOT).with_suffix("").parts)
  if parts[0] == "configs":  # shipped as bertjax.configs (setup.py's package_dir)
    parts.insert(0, "bertjax")
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, pathlib.Path]:
  return {_module_name(p): p for package in PACKAGES
          for p in sorted((ROOT / package).rglob("*.py"))}


def _layer(module: str) -> int | None:
  """The index of `module`'s layer: that of its longest entry (a module or a package)."""
  best, found = -1, None
  for index, (_, entries) in enumerate(LAYERS):
    for entry in entries:
      if (module == entry or module.startswith(entry + ".")) and len(entry) > best:
        best, found = len(entry), index
  return found


class _Imports(ast.NodeVisitor):
  """Every project import of one file: (line, module imported, inside a function)."""

  def __init__(self, module: str, modules):
    self.module, self.modules, self.depth, self.found = module, modules, 0, []

  def _resolve(self, name: str) -> str:
    while name and name not in self.modules:
      name = name.rpartition(".")[0]
    return name

  def visit_FunctionDef(self, node):
    self.depth += 1
    self.generic_visit(node)
    self.depth -= 1

  visit_AsyncFunctionDef = visit_FunctionDef

  def visit_Import(self, node):
    for alias in node.names:
      if alias.name.split(".")[0] in PACKAGES:
        self.found.append((node.lineno, self._resolve(alias.name), self.depth > 0))

  def visit_ImportFrom(self, node):
    base = node.module or ""
    if node.level:  # relative: from this module's package, or one above it
      package = self.module.split(".")
      if self.modules[self.module].name != "__init__.py":
        package = package[:-1]
      package = package[:len(package) - node.level + 1]
      base = ".".join(package + ([base] if base else []))
    if base.split(".")[0] not in PACKAGES:
      return
    for alias in node.names:  # `from pkg import module` imports the module, else pkg itself
      self.found.append((node.lineno, self._resolve(f"{base}.{alias.name}"), self.depth > 0))


@functools.cache
def _graph():
  modules = _modules()
  imports = {}
  for module, path in modules.items():
    visitor = _Imports(module, modules)
    visitor.visit(ast.parse(path.read_text(), str(path)))
    imports[module] = visitor.found
  return modules, imports


# Walked once, as pytest collects this file: CPython 3.11's ast.parse can fail with "AST
# constructor recursion depth mismatch" while other threads run (gh-106905), as the threads that
# earlier tests leave behind (orbax, jax) may.
_graph()


def _said_why(lines: list[str], lineno: int) -> bool:
  """Whether the import at `lineno` (1-based) has `# lazy:` on its line or in the comment lines
  right above it."""
  if "# lazy:" in lines[lineno - 1]:
    return True
  at = lineno - 2
  while at >= 0 and lines[at].strip().startswith("#"):
    if "# lazy:" in lines[at]:
      return True
    at -= 1
  return False


def test_every_module_has_a_layer():
  modules, _ = _graph()
  assert len(modules) > 80, len(modules)  # the walk still finds the code
  unplaced = sorted(m for m in modules if m not in FACES and _layer(m) is None)
  assert not unplaced, f"give these a layer in LAYERS (and docs/contributing.md): {unplaced}"


def test_no_import_runs_upward():
  modules, imports = _graph()
  upward = []
  for module, found in imports.items():
    if module in FACES:
      continue
    for lineno, target, _ in found:
      if target in FACES or target == module:
        continue
      if _layer(target) > _layer(module):
        upward.append(f"{modules[module].relative_to(ROOT)}:{lineno}: {module} "
                      f"({LAYERS[_layer(module)][0]}) imports {target} "
                      f"({LAYERS[_layer(target)][0]})")
  assert not upward, "\n".join(upward)


def test_no_circle():
  _, imports = _graph()
  edges = {m: sorted({t for _, t, _ in found if t != m}) for m, found in imports.items()}
  # Tarjan's strongly connected components: a component of two modules or more is a circle.
  index, low, stack, on_stack, circles = {}, {}, [], set(), []

  def visit(node):
    index[node] = low[node] = len(index)
    stack.append(node)
    on_stack.add(node)
    for nxt in edges.get(node, ()):
      if nxt not in index:
        visit(nxt)
        low[node] = min(low[node], low[nxt])
      elif nxt in on_stack:
        low[node] = min(low[node], index[nxt])
    if low[node] == index[node]:
      component = []
      while True:
        top = stack.pop()
        on_stack.discard(top)
        component.append(top)
        if top == node:
          break
      if len(component) > 1:
        circles.append(sorted(component))

  for node in sorted(edges):
    if node not in index:
      visit(node)
  assert not circles, circles


def test_a_project_import_inside_a_function_says_why():
  modules, imports = _graph()
  silent = []
  for module, found in imports.items():
    lines = modules[module].read_text().splitlines()
    for lineno, target, inside in found:
      if inside and not _said_why(lines, lineno):
        silent.append(f"{modules[module].relative_to(ROOT)}:{lineno}: {target}")
  assert not silent, ("move these imports to the top of the module, or say why not in a "
                      "`# lazy: ...` comment:\n" + "\n".join(silent))


def test_the_docs_state_the_same_order():
  text = (ROOT / "docs" / "contributing.md").read_text()
  section = re.search(r"^## Layers\n(.*?)(?=^## |\Z)", text, re.S | re.M).group(1)
  named = re.findall(r"^\d+\. \*\*([\w-]+)\*\*", section, re.M)
  assert named == [name for name, _ in LAYERS], named


# The benchmarks' readers (GLUE, SQuAD, CoNLL-2003): they build on inputs/, as the task families
# and prediction do; what every task reads must not come through one benchmark's files.
BENCHMARK_READERS = ("bertjax.finetune.tasks.glue", "bertjax.finetune.tasks.squad",
                     "bertjax.finetune.tasks.ner")


def _closure(module: str) -> set[str]:
  """Every project module `module` imports, directly or through others (in functions too)."""
  _, imports = _graph()
  seen, todo = set(), [module]
  while todo:
    for _, target, _ in imports.get(todo.pop(), ()):
      if target not in seen:
        seen.add(target)
        todo.append(target)
  return seen


def test_prediction_and_the_families_import_no_benchmark_reader():
  modules, _ = _graph()
  readers = [m for m in modules if m.startswith("bertjax.finetune.families")] + ["bertjax.predict"]
  assert len(readers) > 5, readers  # the walk still finds the families
  through = {m: sorted(_closure(m) & set(BENCHMARK_READERS)) for m in readers}
  assert not any(through.values()), {m: found for m, found in through.items() if found}


def test_nothing_below_the_families_reads_their_registry():
  # The registry is the families package's own (bertjax/finetune/families/); a module below it
  # that read a registry would see it empty until something imported the families (as
  # load_pretrained did, in a fresh interpreter, on a ModernBertFor* folder).
  modules, _ = _graph()
  families = [name for name, _ in LAYERS].index("families")
  below = [m for m in modules if m not in FACES and _layer(m) < families]
  assert len(below) > 60, len(below)
  found = []
  for module in below:
    path = modules[module]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      name = node.id if isinstance(node, ast.Name) else getattr(node, "attr", None)
      if name in ("FAMILIES", "family_of"):
        found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name}")
  assert not found, found


def test_only_the_config_flag_edits_sys_path():
  # The released configs are a package (bertjax.configs), so nothing needs the checkout on the
  # path; the one edit left makes a --config file's own folder importable (bertjax/config_files.py).
  modules, _ = _graph()
  found = set()

  def walk(node, where):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      where = f"{where}.{node.name}"
    if (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
        and node.value.id == "sys"):
      found.add(where)
    for child in ast.iter_child_nodes(node):
      walk(child, where)

  for module, path in modules.items():
    walk(ast.parse(path.read_text(), str(path)), module)
  assert found == {"bertjax.config_files.make_config_folder_importable"}, found


MODULE_LINES = 450
FUNCTION_LINES = 80
SIZED = ("bertjax", "launch")


def _sized_files() -> list[pathlib.Path]:
  return [p for package in SIZED for p in sorted((ROOT / package).rglob("*.py"))]


def test_no_module_is_past_450_lines():
  # A module past 450 lines holds two things: split it along its seam (docs/contributing.md).
  files = _sized_files()
  assert len(files) > 80, len(files)  # the walk still finds the code
  long = {str(p.relative_to(ROOT)): n for p in files
          if (n := len(p.read_text().splitlines())) > MODULE_LINES}
  assert not long, long


FOLDER_MODULES = 15


def test_no_folder_holds_more_than_15_modules():
  # A folder of more holds two things or more: the next cut makes a package named for what it
  # holds, not another x_y.py beside the others (__init__.py and __main__.py are not counted).
  counts = collections.Counter(p.parent for p in _sized_files()
                               if p.name not in ("__init__.py", "__main__.py"))
  assert len(counts) > 5, counts  # the walk still finds the folders
  crowded = {str(folder.relative_to(ROOT)): n for folder, n in counts.items()
             if n > FOLDER_MODULES}
  assert not crowded, crowded


def test_no_function_is_past_80_lines():
  # Every def, methods and nested ones included, from its `def` line (decorators aside) to its
  # last: past 80 lines a function does two things, and one of them wants a name.
  long = {}
  for path in _sized_files():
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        if (n := node.end_lineno - node.lineno + 1) > FUNCTION_LINES:
          long[f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"] = n
  assert not long, long


def _defined_names(tree: ast.Module) -> set[str]:
  """The public names a module defines at its top: functions, classes, assigned names."""
  names = set()
  for node in tree.body:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      names.add(node.name)
    elif isinstance(node, (ast.Assign, ast.AnnAssign)):
      targets = node.targets if isinstance(node, ast.Assign) else [node.target]
      names.update(n.id for target in targets for n in ast.walk(target) if isinstance(n, ast.Name))
  return {name for name in names if not name.startswith("_")}


def test_a_public_face_hands_on_every_name_of_its_module_and_nothing_else():
  # `from bertjax import sharding; sharding.create_mesh(...)` as before the move: a face imports
  # every public name its module defines, from that module alone, and defines nothing itself.
  modules, _ = _graph()
  assert LAYERS[-1] == ("faces", tuple(PUBLIC_FACES)), LAYERS[-1]
  for face, definer in PUBLIC_FACES.items():
    tree = ast.parse(modules[face].read_text())
    body = [node for node in tree.body if not (isinstance(node, ast.Expr)
                                               and isinstance(node.value, ast.Constant))]
    assert all(isinstance(node, ast.ImportFrom) and node.module == definer for node in body), face
    handed = {alias.name for node in body for alias in node.names}
    defined = _defined_names(ast.parse(modules[definer].read_text()))
    assert handed == defined, (face, sorted(defined - handed), sorted(handed - defined))


def _imported_names(tree: ast.Module) -> set[str]:
  return {a.asname or a.name.split(".")[0] for n in tree.body
          if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}


def test_a_name_is_imported_from_the_module_that_defines_it():
  # `from bertjax.model import BertConfig` once took the config from the module of the Flax
  # layers, which only imported it: a parser then depended on the model. A name taken from a
  # project module must be one that module defines, not one it imported.
  modules, _ = _graph()
  trees = {m: ast.parse(p.read_text(), str(p)) for m, p in modules.items()}
  found = []
  for module, tree in trees.items():
    for node in ast.walk(tree):
      if not (isinstance(node, ast.ImportFrom) and node.module in trees and not node.level):
        continue
      passed_on = _imported_names(trees[node.module])
      for alias in node.names:
        if alias.name in passed_on and f"{node.module}.{alias.name}" not in modules:
          found.append(f"{modules[module].relative_to(ROOT)}:{node.lineno}: {alias.name} from "
                       f"{node.module}, which imports it")
  assert not found, found
