"""A task family as one typed record: everything fine-tuning, prediction and the exports ask of a
family, built once by the family's module (`FAMILY` at its end) and listed in the registry
(`FAMILIES` in bertjax/finetune/families/__init__.py).

The record's fields are facts and functions of the family; nothing below fine-tuning sees it: the
task spec (bertjax/formats/taskspec.py) names a family by its name, the weights reader records what a
folder says (its class and labels), and the families package resolves both to a record.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from bertjax.errors import Refusal
from bertjax.finetune.kit.config import TaskConfig
from bertjax.finetune.kit.taskdata import TaskData
from bertjax.formats import taskspec as spec_lib
from bertjax.training import train

Spec = spec_lib.TaskSpec


@dataclasses.dataclass(frozen=True)
class Family:
  name: str  # TaskSpec.family, and one's own task of the family (configs/finetune.py:NAME)
  # The head's parameter subtree beside the encoder's ("bert"); "": none, the family's outputs
  # are the encoder's own vectors (embeddings), exported as the encoder alone.
  head: str
  hf_class: str  # the transformers class an export writes ...
  hf_head: str  # ... and the name of its head there (bertjax/formats/hf.py writes both)
  # The transformers ModernBERT class of the family (formats/modernbert.py writes it, and a
  # folder of it predicts as this family); None where ModernBERT has none.
  modernbert_class: str | None
  min_labels: int  # the fewest label names a spec of the family holds
  main_metrics: tuple[str, ...]  # the dev numbers that may pick the best checkpoint (first: the
  lower_is_better: tuple[str, ...]  # default) ... and those of them where lower is better
  batch_keys: tuple[str, ...]  # the target arrays a batch carries to the device, beside inputs
  # One output per text from its [CLS]: the objective's model takes sequence_ids and
  # cls_positions, and prediction packs several texts into a row (bertjax/predict/rows.py);
  # False for per-token heads.
  packed: bool
  num_outputs: Callable[[Spec], int]  # the head's width
  objective: Callable[[Spec], train.Objective]  # the head, its loss and outputs
  columns: Callable[[Spec, Mapping], list[str]]  # the input columns `predict` needs of a row
  as_row: Callable[[Any, Spec], dict]  # a `Predictor` input that is neither a string nor a dict
  # One prediction record per row (bertjax/predict/predictor.py's docstring); run: features -> outputs.
  records: Callable[[Sequence[Mapping], Spec, Any, Callable], list[dict]]
  load: Callable[[TaskConfig, Any], TaskData]  # one's own task from files
  # The label ids or values of the outputs (a benchmark's scores and submission); None where an
  # example's prediction is not one number (tags, spans).
  predicted: Callable[[Mapping[str, np.ndarray]], np.ndarray] | None = None
  # The input columns of a spec made from a transformers folder, where not ("text", "")
  # (span: SQuAD's question and context).
  folder_columns: tuple[str, str] = ("text", "")
  # How a spec's sentence vectors are made (formats/sentence_transformers.SentenceVectors: the
  # files an export adds so that sentence-transformers loads it); None where the family makes
  # no vectors.
  sentence: Callable[[Spec], Any] | None = None

  def check(self, spec: Spec) -> Spec:
    """`spec`, refused where it holds fewer labels than the family needs (a task.json or a
    config.json written by hand)."""
    if len(spec.labels) < self.min_labels:
      raise Refusal(f"Invalid task spec: a {self.name} task needs at least {self.min_labels} "
                    f"labels, not {list(spec.labels)}")
    return spec
