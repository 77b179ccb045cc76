"""What `bertjax.predict` writes, and what it may write over: an output is written whole (under
OUT.part, renamed at the end, removed if anything fails), never over one of the run's inputs
(--input, --corpus, --corpus_vectors), a folder or a file it did not write (unless --overwrite);
and the progress line on stderr. Prediction's records, vectors and search hits all go through here.

Each output gets a record beside it, OUT.bertjax.json: who wrote it, the sha256 of its bytes, and
what made it (the mode, the model, the input; for vectors the encoder and the texts:
bertjax/predict/vectors.py). A file is prediction's to replace only where its record says so
and the file still has the bytes recorded: ownership is positive, a file of the user's is never
taken for an output by its look (a JSON Lines file of `{"id", "text"}`, an .npy of floats). A
beside record, not a mark inside the file: an .npy header takes no other keys (np.load refuses
them), a field in every JSON line would change the records users read.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import time
from typing import Iterable, Iterator, Mapping

from bertjax import files
from bertjax.errors import Refusal

RECORD = ".bertjax.json"  # the record's name: the output's, with this added
WRITER = "bertjax.predict"
# What an output would replace of each input, for the refusal.
INPUTS = {"--input": "the input file", "--corpus": "the corpus", "--corpus_vectors":
          "the corpus's vectors"}


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


def record_path(output: str) -> str:
  return output + RECORD


def digest(path: str) -> str:
  """The sha256 of a file's bytes, read a block at a time."""
  h = hashlib.sha256()
  with open(path, "rb") as f:
    while block := f.read(1 << 22):
      h.update(block)
  return h.hexdigest()


def read_record(output: str) -> dict | None:
  """The record prediction wrote beside `output`; None where there is none (or it is not one)."""
  path = record_path(output)
  if "://" in path or not os.path.isfile(path):
    return None
  try:
    with open(path, encoding="utf-8") as f:
      record = json.load(f)
  except (OSError, ValueError):
    return None
  return record if isinstance(record, dict) and record.get("written_by") == WRITER else None


def written_by_us(path: str) -> bool:
  """Whether `path` is an earlier output of this command, unchanged since (so replacing it loses
  nothing of the user's): an empty file, or one whose record holds its sha256."""
  if os.path.getsize(path) == 0:
    return True
  record = read_record(path)
  return record is not None and record.get("sha256") == digest(path)


def _same(a: str, b: str) -> bool:
  if "://" in a or "://" in b:
    return a.rstrip("/") == b.rstrip("/")
  return os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b)


def check_output(output_path: str, inputs: Mapping[str, str], *, overwrite: bool,
                 embed: bool) -> None:
  """Refuses an output that would destroy something: one of the run's `inputs` (flag -> path;
  always), a folder, or an existing file (or record beside it) this command did not write, unless
  `overwrite`. Removes the `.part` a killed run left, saying so."""
  for flag, path in inputs.items():
    if path and _same(output_path, path):
      raise Refusal(f"--output={output_path} is {INPUTS.get(flag, flag)} ({flag}={path}): the "
                    "output would replace it. Name another output file.")
  if files.isdir(output_path):
    raise Refusal(f"--output={output_path} is a folder; name a file in it "
                  f"({'OUT.npy' if embed else 'OUT.jsonl'}).")
  if "://" not in output_path and os.path.exists(output_path) and not overwrite and (
      not written_by_us(output_path)):
    raise Refusal(f"--output={output_path} exists and is not a file bertjax.predict wrote (no "
                  f"{os.path.basename(record_path(output_path))} beside it holding its sha256): "
                  "name another file, or pass --overwrite to replace it.")
  beside = record_path(output_path)
  if "://" not in beside and os.path.exists(beside) and not overwrite and (
      read_record(output_path) is None):
    raise Refusal(f"{beside} exists and is not a record bertjax.predict wrote; the output's "
                  "record would replace it. Name another output file, or pass --overwrite.")
  part = output_path + ".part"
  if "://" not in part and os.path.exists(part):
    print(f"predict: removing {part}, the unfinished output of an earlier run that was stopped "
          "or refused", file=sys.stderr, flush=True)
    os.remove(part)


@contextlib.contextmanager
def part_file(output_path: str, record: dict) -> Iterator[str]:
  """The temporary name the output is written under; removed if anything fails, renamed over
  the output when the block ends, so a reader never takes a part for the result. With it the
  record beside it: `record` (what made it; a caller may fill it inside the block) and the file's
  sha256, written under a part name too and renamed after the output (two renames, no space
  needed: a full disk leaves the earlier output and its record as they were)."""
  tmp, record_tmp = output_path + ".part", record_path(output_path) + ".part"
  try:
    with files.writing(tmp):  # a full disk or EIO said with the file
      yield tmp
    said = {"written_by": WRITER, "file": os.path.basename(output_path), "sha256": digest(tmp),
            "bytes": os.path.getsize(tmp), **record}
    with files.writing(record_tmp), open(record_tmp, "w", encoding="utf-8") as f:
      f.write(json.dumps(said, indent=2) + "\n")
  except BaseException:
    for path in (tmp, record_tmp):
      with contextlib.suppress(OSError):
        os.remove(path)
    raise
  os.replace(tmp, output_path)
  os.replace(record_tmp, record_path(output_path))


def write_lines(output_path: str, made: dict, records: Iterable[dict], progress: Progress,
                empty: str) -> int:
  """Writes `records` as JSON lines to `output_path` under `part_file` with the record `made`
  (its input's row count added); refuses with `empty` where there are none. Returns the count."""
  files.makedirs(os.path.dirname(output_path) or ".")
  n = 0
  with part_file(output_path, made) as tmp:
    with files.open_file(tmp, "w") as out:
      for record in records:
        out.write(json.dumps(record, ensure_ascii=False) + "\n")
        n += 1
        progress.update(n)
    if n == 0:
      raise Refusal(empty)
    made["input"]["rows"] = n
  progress.update(n, final=True)
  return n
