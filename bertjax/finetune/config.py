"""Fine-tuning's config sections, typed: `TaskConfig` holds what a task's data is read with
(configs/finetune.py's `task`, its `data` and `eval` sections, and `train.class_weights`).

The run builds it once (`TaskConfig.from_config(config)`) and passes it to the task readers
(tasks.py, families/); below that, nothing reads the ConfigDict. As pre-training's `DataConfig`
(bertjax/data/config.py), the dataclasses hold no defaults (configs/finetune.py has them): a key
the config lacks or one a dataclass does not know is an error that names it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from bertjax.data.config import check_types, from_section


@dataclasses.dataclass(frozen=True)
class FinetuneDataConfig:
  """Typed form of fine-tuning's `config.data`: other keys than pre-training's (the task's files,
  its columns, SQuAD's windows), the shared ones (vocab_path, max_seq_length, ...) by the same
  names."""

  source: str
  data_dir: str
  train_file: str
  dev_file: str
  test_file: str
  tfds_data_dir: str
  vocab_path: str
  do_lower_case: bool | None  # None: init_from's casing
  max_seq_length: int
  doc_stride: int
  max_query_length: int
  format: str
  text_a: str
  text_b: str
  label: str
  tokens: str
  tags: str
  tag_scheme: str
  labels: str
  version_2_with_negative: bool | None  # None: v2.0 if the training file has an unanswerable

  def __post_init__(self):
    check_types(self, "data")

  @classmethod
  def from_config(cls, section: Mapping[str, Any]) -> "FinetuneDataConfig":
    return from_section(cls, section, "data")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  """Typed form of `config.eval`: how SQuAD's answers are decoded, the metric that picks the best
  checkpoint."""

  n_best_size: int
  max_answer_length: int
  null_score_diff_threshold: float
  main_metric: str

  def __post_init__(self):
    check_types(self, "eval")

  @classmethod
  def from_config(cls, section: Mapping[str, Any]) -> "EvalConfig":
    return from_section(cls, section, "eval")


@dataclasses.dataclass(frozen=True)
class TaskConfig:
  """What the task readers get from a fine-tuning config."""

  task: str  # as given (tasks.canonical names it)
  data: FinetuneDataConfig
  eval: EvalConfig
  class_weights: str  # train.class_weights: read with the task's labels (families/classification.py)

  @classmethod
  def from_config(cls, config) -> "TaskConfig":
    return cls(task=config.task, data=FinetuneDataConfig.from_config(config.data),
               eval=EvalConfig.from_config(config.eval),
               class_weights=config.train.class_weights)
