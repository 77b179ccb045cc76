"""A fine-tuning run's scores after each epoch (evaluations.json) and its best checkpoint (best/):
what a rerun keeps of an earlier timeline, and how a damaged record is rebuilt. A search keeps one
per trial and adopts its winner's as the workdir's (bertjax/finetune/job/search.py). And what a
resumed run says of its earlier timeline's data: each checkpoint records the sha256 of the
features it trained on (TRAIN_DATA)."""

from __future__ import annotations

import hashlib
import math
import os
from typing import Any, Mapping

import jax
import numpy as np

from bertjax import errors, files
from bertjax.training import checkpoint as checkpoint_lib, loop

TRAIN_DATA = "train_data"  # a checkpoint record's key: the sha256 of the features it trained on


def _better(value: float, best: float | None) -> bool:
  if not math.isfinite(value):
    return False
  return best is None or value > best


class Evaluations:
  """Scores after each epoch (evaluations.json) and the best checkpoint (best/)."""

  def __init__(self, workdir: str, meta: Mapping[str, Any]):
    self.path = os.path.join(workdir, "evaluations.json")
    self.records: list[dict] = []
    self.best = checkpoint_lib.Checkpointer(os.path.join(workdir, "best"), ("params",),
                                            save_every=1, keep=1, async_save=False)
    self._meta = dict(meta)

  def begin(self, start: int) -> None:
    """Takes the scores of earlier runs in the workdir up to `start`, the step this run restored:
    later ones (and a best checkpoint of such a step, after a crash between an evaluation and the
    next checkpoint) belong to a timeline the run no longer has; it evaluates those steps again."""
    self.records = [r for r in self._read() if r["step"] <= start]
    recorded = {r["step"] for r in self.records}
    for step in self.best.all_steps():
      # A best step without a record is a kill between best/'s save and the record's write: the
      # step is evaluated again, which saves it again (left here, that save would collide).
      if step > start or step not in recorded:
        self.best.delete(step)

  def _read(self) -> list[dict]:
    """evaluations.json's records; a damaged file (written atomically, so only by an older bertjax
    or a disk fault) is said and rebuilt from best/'s record, which is all a rerun can recover."""
    if not files.exists(self.path):
      return []
    try:
      return files.read_json(self.path, "the run's evaluations")
    except errors.DamagedFileError as err:
      rebuilt = []
      for step in self.best.all_steps():
        meta = self.best.read_meta(step)
        rebuilt.append({"step": meta["step"], "epoch": meta["epoch"], "scores": meta["scores"]})
      loop.say(f"{str(err).split(': it was')[0]}; rebuilt from best/ (steps "
               f"{[r['step'] for r in rebuilt]}), the other epochs' scores are lost.")
      return rebuilt

  def done(self, step: int) -> bool:
    return any(r["step"] == step for r in self.records)

  def best_record(self) -> dict | None:
    scored = [r for r in self.records if math.isfinite(r["scores"]["main"])]
    return max(scored, key=lambda r: r["scores"]["main"]) if scored else None

  def add(self, step: int, epoch: float, scores: Mapping[str, float], params) -> None:
    best = self.best_record()
    record = {"step": step, "epoch": epoch, "scores": dict(scores)}
    self.records = [r for r in self.records if r["step"] != step] + [record]
    if _better(scores["main"], best["scores"]["main"] if best else None):
      self.best.save(step, {"params": params}, {**self._meta, "step": step, "epoch": epoch,
                                                "scores": dict(scores)}, force=True)
      self.best.wait()
    if jax.process_index() == 0:
      files.write_json(self.path, self.records)

  def adopt(self, records: list[dict], best: dict, params) -> None:
    """Takes another run's records and its best epoch's parameters as this one's (a search's
    winner becomes the workdir's run): best/ holds that step alone."""
    for step in self.best.all_steps():
      self.best.delete(step)
    self.records = list(records)
    self.best.save(best["step"], {"params": params}, {**self._meta, "step": best["step"],
                                                      "epoch": best["epoch"],
                                                      "scores": dict(best["scores"])}, force=True)
    self.best.wait()
    if jax.process_index() == 0:
      files.write_json(self.path, self.records)

  def close(self) -> None:
    self.best.close()


def features_digest(features: Mapping[str, np.ndarray]) -> str:
  """sha256 of training features (each array's name, dtype, shape and bytes, by name): what a
  resumed run compares with the record of the step it restores."""
  h = hashlib.sha256()
  for key in sorted(features):
    a = np.ascontiguousarray(features[key])
    h.update(f"{key} {a.dtype} {a.shape}".encode())
    h.update(a.reshape(-1).view(np.uint8))
  return h.hexdigest()


def say_if_data_changed(workdir: str, step: int, now: str) -> None:
  """Says that a resumed run's training data is not what its restored steps trained on (a file
  edited or replaced, another file, other lengths); the steps left train on what it has now."""
  reader = checkpoint_lib.Checkpointer.reader(os.path.join(workdir, "checkpoints"))
  try:
    before = reader.read_meta(step).get(TRAIN_DATA)
  finally:
    reader.close()
  if before is not None and before != now:
    loop.say(f"the training data is not what steps 1-{step} trained on (its features' sha256 "
             f"{before[:12]}, now {now[:12]}: a training file changed, or the config names "
             "another); the steps left train on it. A new workdir trains on it alone.")
