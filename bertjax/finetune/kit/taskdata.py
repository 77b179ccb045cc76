"""What a fine-tuning task gives the run (`tasks.load`): its objective, training features, the sets
scored after every epoch and those only predicted. Its own module so that the task readers
(tasks.py, custom.py) build it without importing each other."""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

import numpy as np

from bertjax.formats import taskspec as spec_lib
from bertjax.training import train


@dataclasses.dataclass
class EvalSet:
  """Features of one split, how to score its outputs (None: predict only) and what to write."""

  name: str
  features: dict[str, np.ndarray]
  score: Callable[[Mapping[str, np.ndarray]], dict[str, float]] | None
  write: Callable[[Mapping[str, np.ndarray], str], list[str]] | None = None
  # The full report of the best checkpoint for results.json (per-class scores, confusion, ...).
  report: Callable[[Mapping[str, np.ndarray]], dict] | None = None
  size: str = ""  # how many it holds, for the console, where not examples (queries and passages)


@dataclasses.dataclass
class TaskData:
  name: str  # canonical: "MRPC", "squad_v1.1", "conll2003", ...
  objective: train.Objective
  train: dict[str, np.ndarray]
  evals: list[EvalSet]  # after every epoch; the first one's "main" picks the best checkpoint
  predicts: list[EvalSet]  # once, at the end, with the best checkpoint
  main_metric: str  # the name of "main" in the first eval set (said in results)
  notes: list[str] = dataclasses.field(default_factory=list)  # counted repairs, skipped rows
  spec: spec_lib.TaskSpec | None = None  # what the model does with text (task.json)
  # (count, what they are) of the distinct training examples where a batch may not hold copies
  # (a contrastive batch: a copy of a row's positive is no negative of it); None: copies train.
  distinct: tuple[int, str] | None = None
