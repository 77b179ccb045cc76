"""What `bertjax.predict` writes, and what it may write over: an output is written whole (under
OUT.part, renamed at the end, removed if anything fails), never over the input, a folder or a file
it did not write (unless --overwrite); and the progress line on stderr. Prediction's records,
vectors and search hits all go through here."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from typing import Iterator

import numpy as np

from bertjax import files
from bertjax.errors import Refusal
from bertjax.finetune import families


class Progress:
  """One line on stderr: rows done and sequences per second (rewritten in place on a terminal)."""

  def __init__(self, predictor, every: float = 2.0):
    self.predictor, self.every, self.start = predictor, every, time.perf_counter()
    self.last, self.tty = self.start, sys.stderr.isatty()

  def update(self, rows: int, final: bool = False) -> None:
    now = time.perf_counter()
    if not final and now - self.last < (self.every if self.tty else 30.0):
      return
    self.last = now
    rate = self.predictor.sequences / max(now - self.start, 1e-9)
    line = f"predict: {rows:,} rows, {self.predictor.sequences:,} sequences, {rate:,.0f} seq/s"
    end = "\n" if final or not self.tty else ""
    sys.stderr.write(("\r" if self.tty else "") + line + end)
    sys.stderr.flush()


def record_keys() -> frozenset[str]:
  """The keys of a record predict writes (the module docstring), of every family: an existing
  file whose first line is such a record was written by predict, and may be written again."""
  return frozenset({"id"}).union(*(f.record_keys for f in families.FAMILIES.values()))


def written_by_us(path: str, embed: bool) -> bool:
  """Whether `path` is an earlier output of this command (so replacing it loses nothing of the
  user's): an empty file, an .npy of float32 vectors (embed), or JSON Lines of our records."""
  if os.path.getsize(path) == 0:
    return True
  with open(path, "rb") as f:
    if embed:
      try:
        version = np.lib.format.read_magic(f)
        read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                       else np.lib.format.read_array_header_2_0)
        shape, _, dtype = read_header(f)
      except (ValueError, OSError, EOFError):
        return False
      return len(shape) == 2 and dtype == np.float32
    first = f.readline(1 << 20)
  try:
    record = json.loads(first)
  except ValueError:
    return False
  return isinstance(record, dict) and bool(record) and set(record) <= record_keys()


def check_output(input_path: str, output_path: str, *, overwrite: bool, embed: bool) -> None:
  """Refuses an output that would destroy something: the input itself (always), a folder, or an
  existing file this command did not write (unless `overwrite`). Removes the `.part` a killed
  run left, saying so."""
  if "://" in output_path or "://" in input_path:
    same = output_path.rstrip("/") == input_path.rstrip("/")
  else:
    same = os.path.exists(output_path) and os.path.exists(input_path) and os.path.samefile(
        output_path, input_path)
  if same:
    raise Refusal(f"--output={output_path} is the input file: the predictions would replace "
                  "its texts. Name another output file.")
  if files.isdir(output_path):
    raise Refusal(f"--output={output_path} is a folder; name a file in it "
                  f"({'OUT.npy' if embed else 'OUT.jsonl'}).")
  if "://" not in output_path and os.path.exists(output_path) and not overwrite and (
      not written_by_us(output_path, embed)):
    raise Refusal(f"--output={output_path} exists and is not a file bertjax.predict wrote "
                  f"({'an .npy of vectors' if embed else 'JSON Lines of predictions'}): "
                  "name another file, or pass --overwrite to replace it.")
  part = output_path + ".part"
  if "://" not in part and os.path.exists(part):
    print(f"predict: removing {part}, the unfinished output of an earlier run that was stopped "
          "or refused", file=sys.stderr, flush=True)
    os.remove(part)


@contextlib.contextmanager
def part_file(output_path: str) -> Iterator[str]:
  """The temporary name the output is written under; removed if anything fails, renamed over
  the output when the block ends, so a reader never takes a part for the result."""
  tmp = output_path + ".part"
  try:
    with files.writing(tmp):  # a full disk or EIO said with the file
      yield tmp
  except BaseException:
    with contextlib.suppress(OSError):
      os.remove(tmp)
    raise
  os.replace(tmp, output_path)
