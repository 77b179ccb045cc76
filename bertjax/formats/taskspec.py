"""What a fine-tuned model does with text, beside its weights: the `TaskSpec` of a fine-tuning run.

Prediction (`bertjax.predict`) and export (`convert.hf export`) read a fine-tuning workdir through
it: the head's family, the label names by id, the input columns, the sequence length and how
spans or tags are decoded. A run writes it to `WORKDIR/task.json` before its first step and into
the record of every checkpoint it saves (the key "task_spec"), so the weights never travel
without their label map.

The family is a name here. Its record (bertjax/finetune/families/: the head, its parameter subtree
beside "bert" and its width, the objective, the prediction records, the export class) is
fine-tuning's, a layer above this spec (docs/contributing.md#layers), and is looked up there
(`families.get`), as is the task of a fine-tuned transformers folder (`families.spec_of`).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

from bertjax import files
from bertjax.errors import Refusal

FILE = "task.json"
META_KEY = "task_spec"  # in the record saved beside every checkpoint
TAG_SCHEMES = ("IO", "BIO", "IOB1", "IOBES")


@dataclasses.dataclass(frozen=True)
class TaskSpec:
  task: str  # the run's task: "classification", ..., or a benchmark's name ("MRPC", "conll2003")
  family: str  # the name of a family of bertjax/finetune/families/
  labels: tuple[str, ...] = ()  # classification: class names by id; tagging: tag names by id
  max_seq_length: int = 128
  # Input columns `predict` reads (CSV/TSV header names or JSON Lines keys).
  text_a: str = "text"
  text_b: str = ""  # "" = one text per example
  label: str = "label"
  tokens: str = "tokens"  # tagging: a JSON list of words ...
  tags: str = "tags"  # ... and of their tags
  tag_scheme: str = ""  # tagging: one of TAG_SCHEMES
  # span (SQuAD's layout): windows over long contexts, and how answers are decoded
  version_2_with_negative: bool = False
  doc_stride: int = 128
  max_query_length: int = 64
  n_best_size: int = 20
  max_answer_length: int = 30
  null_score_diff_threshold: float = 0.0
  # embeddings (the query's length is max_query_length, a passage's max_seq_length): how a
  # text's vector is made, which prediction and the sentence-transformers export repeat
  pooling: str = ""  # "mean" or "cls" ([CLS]'s last state); "" where a family makes no vectors
  normalize: bool = False  # unit vectors

  def __post_init__(self):
    if self.tag_scheme and self.tag_scheme not in TAG_SCHEMES:
      raise Refusal(f"Invalid task spec: tag_scheme={self.tag_scheme!r} is not one of "
                    f"{TAG_SCHEMES}")

  def to_dict(self) -> dict:
    out = dataclasses.asdict(self)
    out["labels"] = list(self.labels)
    return out

  @classmethod
  def from_dict(cls, values: Mapping[str, Any]) -> "TaskSpec":
    known = {f.name for f in dataclasses.fields(cls)}
    values = {k: v for k, v in values.items() if k in known}
    values["labels"] = tuple(values.get("labels", ()))
    return cls(**values)


def write(spec: TaskSpec, workdir: str) -> None:
  files.write_json(os.path.join(workdir, FILE), spec.to_dict())


def read(workdir: str) -> TaskSpec | None:
  """The spec of a fine-tuning workdir; None where it has none (a pre-training run)."""
  path = os.path.join(workdir, FILE)
  if not files.exists(path):
    return None
  return TaskSpec.from_dict(files.read_json(path, "the fine-tuned task's spec"))


def of(source) -> TaskSpec | None:
  """The spec of a weights folder (a `weights.Weights`): the one recorded with its checkpoint,
  else its task.json; None for a model with no task recorded (a pre-training run, an imported
  encoder; a transformers task class says its own in config.json: `families.spec_of`)."""
  recorded = (source.meta or {}).get(META_KEY)
  if recorded:
    return TaskSpec.from_dict(recorded)
  return read(source.path)
