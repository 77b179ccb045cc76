"""The text of an optimised XLA module, as `compiled.as_text()` prints it: its computations, their
instructions and shapes (with their layouts' memory spaces), what each calls, and how often a loop
runs. Read by bertjax/perf/hlocost.py (what each instruction costs) and bertjax/perf/layercost.py (what a
compiled step does per encoder layer)."""

from __future__ import annotations

import math
import re

NAME = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_OPCODE = re.compile(r"\s*([a-z][\w\-]*)\(")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_CALLED = re.compile(r"\b(?:calls|to_apply|body|condition|branch_computations|"
                     r"called_computations)=\{?(%?[\w.\-]+(?:,\s*%?[\w.\-]+)*)\}?")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\](\{[^}]*\})?")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CONDITION = re.compile(r"condition=%?([\w.\-]+)")
BODY = re.compile(r"body=%?([\w.\-]+)")

# Instructions that only name or regroup buffers: no work, no traffic.
PLUMBING = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all",
            "opt-barrier", "partition-id", "replica-id"}
def blocks(hlo_text: str) -> dict[str, list[str]]:
  """{computation name: its lines, header to closing brace} of a module's text; an instruction
  printed over several lines (a Pallas call's kernel metadata) is one line with its newlines."""
  out, current = {}, None
  for line in hlo_text.splitlines():
    header = None if line.startswith((" ", "HloModule")) else _HEADER.match(line)
    if header:
      current = header.group(1)
      out[current] = [line]
    elif current is not None:
      if line.rstrip() == "}":
        out[current].append(line)
        current = None
      elif line.startswith("  ") or len(out[current]) == 1:
        out[current].append(line)
      else:  # the rest of the instruction above
        out[current][-1] += "\n" + line
  return out


def entry_name(hlo_text: str) -> str:
  return re.search(r"^ENTRY\s+%?([\w.\-]+)", hlo_text, re.M).group(1)


def shape_end(line: str, at: int) -> int:
  """Where the shape starting at `at` ends (a tuple's closing parenthesis, else a space)."""
  if line[at:at + 1] != "(":
    end = line.find(" ", at)
    return len(line) if end < 0 else end
  depth = 0
  for i in range(at, len(line)):
    depth += {"(": 1, ")": -1}.get(line[i], 0)
    if depth == 0:
      return i + 1
  return len(line)


def parenthesised(line: str, start: int) -> str:
  """The text inside the parentheses opening just before `start`."""
  depth, i = 1, start
  while depth and i < len(line):
    depth += {"(": 1, ")": -1}.get(line[i], 0)
    i += 1
  return line[start:i - 1]


def parse(lines: list[str]) -> list[tuple[str, str, str, str]]:
  """(name, shape text, opcode, line) of each instruction among `lines`."""
  out = []
  for line in lines:
    named = NAME.match(line)
    if not named:
      continue
    end = shape_end(line, named.end())
    opcode = _OPCODE.match(line, end)
    if opcode:
      out.append((named.group(1), line[named.end():end], opcode.group(1), line))
  return out


def elements(shape: str) -> list[str]:
  """The top-level elements of a tuple shape's text ("(a, (b, c))" -> ["a", "(b, c)"]); an
  array shape is its own one element."""
  shape = shape.strip()
  if not shape.startswith("("):
    return [shape]
  inner, parts, depth, start = shape[1:-1], [], 0, 0
  for i, ch in enumerate(inner):
    depth += {"(": 1, ")": -1, "{": 1, "}": -1, "[": 1, "]": -1}.get(ch, 0)
    if ch == "," and depth == 0:
      parts.append(inner[start:i].strip())
      start = i + 1
  parts.append(inner[start:].strip())
  return [p for p in parts if p]


def array_bytes(shape: str, space: str | None = None) -> int:
  """Bytes of a shape's arrays; `space` "hbm" or "chip": only those in HBM (memory space 0) or
  only those in another memory space (`S(n)` in the layout)."""
  total = 0
  for dtype, dims, layout in _ARRAY.findall(shape):
    if dtype == "token":
      continue
    on_chip = bool(layout and re.search(r"S\([1-9]\d*\)", layout))
    if (space == "hbm" and on_chip) or (space == "chip" and not on_chip):
      continue
    bits = 8 if dtype == "pred" else int(re.sub(r"\D", "", dtype) or 8)
    total += bits * math.prod(int(d) for d in dims.split(",") if d) // 8
  return total


def sub_shape(shape: str, index: str) -> str:
  for i in (int(x) for x in index.split(",") if x):
    parts = elements(shape)
    shape = parts[i] if i < len(parts) else ""
  return shape


def called(line: str) -> list[str]:
  names = []
  for group in _CALLED.findall(line):
    names += [n.strip().lstrip("%") for n in group.split(",")]
  return [n for n in names if n and n != "backend_config"]


def reachable(comps: dict[str, list[str]], roots: list[str]) -> list[str]:
  """Computations called from `roots`, each after those it calls (the parser's order)."""
  order, seen = [], set()

  def visit(name):
    if name in seen or name not in comps:
      return
    seen.add(name)
    for line in comps[name][1:]:
      for callee in called(line):
        visit(callee)
    order.append(name)

  for root in roots:
    visit(root)
  return order


def _defs(lines: list[str]) -> dict[str, tuple[str, str, str]]:
  return {name: (shape, opcode, line) for name, shape, opcode, line in parse(lines)}


def operands(line: str, opcode: str) -> list[str]:
  """The names of an instruction's operands, in order, repeats included."""
  named = NAME.match(line)
  start = line.index(opcode + "(", shape_end(line, named.end())) + len(opcode) + 1
  return re.findall(r"%([\w.\-]+)", parenthesised(line, start))


def _constant(defs: dict, name: str, depth: int = 0) -> int | None:
  """The integer a scalar instruction holds, through copies and conversions; None if unknown."""
  if name not in defs or depth > 8:
    return None
  _, opcode, line = defs[name]
  if opcode == "constant":
    found = re.search(r"constant\((-?\d+)\)", line)
    return int(found.group(1)) if found else None
  if opcode in ("copy", "convert", "bitcast"):
    names = operands(line, opcode)
    return _constant(defs, names[0], depth + 1) if names else None
  return None


def _tuple_index(defs: dict, name: str) -> int | None:
  """i where `name` is get-tuple-element(the computation's parameter, index=i), through
  conversions."""
  if name not in defs:
    return None
  _, opcode, line = defs[name]
  if opcode in ("convert", "copy", "bitcast"):
    return _tuple_index(defs, operands(line, opcode)[0])
  found = re.search(r"index=(\d+)", line) if opcode == "get-tuple-element" else None
  return int(found.group(1)) if found else None


def _induction(comps: dict[str, list[str]], while_line: str, parent: str) -> int | None:
  """The trip count of a loop whose condition compares one counter of its state with a
  constant, the body adding a constant step to that counter, from its initial value (a constant
  in the caller, else 0): XLA's windowed matmuls count by 2 from 0 or 1."""
  condition, body = _CONDITION.search(while_line), BODY.search(while_line)
  if not condition or not body or condition.group(1) not in comps or body.group(1) not in comps:
    return None
  cond_defs = _defs(comps[condition.group(1)][1:])
  root = [line for _, _, line in cond_defs.values() if line.lstrip().startswith("ROOT")]
  if len(root) != 1 or " compare(" not in root[0]:
    return None
  direction = re.search(r"direction=(\w+)", root[0])
  left, right = (operands(root[0], "compare") + [None, None])[:2]
  index, limit = _tuple_index(cond_defs, left), _constant(cond_defs, right)
  if index is None or limit is None or not direction or direction.group(1) not in ("LT", "LE"):
    return None
  body_defs = _defs(comps[body.group(1)][1:])
  body_root = [line for _, _, line in body_defs.values() if line.lstrip().startswith("ROOT")]
  if len(body_root) != 1 or " tuple(" not in body_root[0]:
    return None
  elements = operands(body_root[0], "tuple")
  if index >= len(elements) or elements[index] not in body_defs:
    return None
  _, opcode, line = body_defs[elements[index]]
  terms = operands(line, opcode) if opcode == "add" else []
  steps = [_constant(body_defs, t) for t in terms if _tuple_index(body_defs, t) != index]
  if len(terms) != 2 or len(steps) != 1 or not steps[0] or steps[0] < 0:
    return None
  start = 0
  init = operands(while_line, "while")
  parent_defs = _defs(comps.get(parent, [])[1:])
  if init and init[0] in parent_defs and parent_defs[init[0]][1] == "tuple":
    values = operands(parent_defs[init[0]][2], "tuple")
    if index < len(values):
      start = _constant(parent_defs, values[index]) or 0
  span = limit - start + (1 if direction.group(1) == "LE" else 0)
  return max(0, -(-span // steps[0]))


def trip_counts(comps: dict[str, list[str]], while_line: str, parent: str = "") -> set[int]:
  """A loop's trip count as XLA annotated it (GPU, CPU); else, a TPU's program carrying no
  annotation, from its counter (`_induction`: the condition's limit, the body's step, the
  initial value); else the integer constants its condition compares with."""
  known = _TRIP_COUNT.search(while_line)
  if known:
    return {int(known.group(1))}
  counted = _induction(comps, while_line, parent)
  if counted is not None:
    return {counted}
  condition = _CONDITION.search(while_line)
  lines = comps.get(condition.group(1), []) if condition else []
  return {int(v) for line in lines
          for v in re.findall(r"[su]32\[\]\S*\s+constant\((\d+)\)", line)}


def trip_count(comps: dict[str, list[str]], while_line: str, parent: str = "") -> int | None:
  """`trip_counts` where it names one count; None when unknown."""
  counts = trip_counts(comps, while_line, parent)
  return counts.pop() if len(counts) == 1 else None

