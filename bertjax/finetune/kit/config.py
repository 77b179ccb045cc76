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
from bertjax.errors import Refusal
from bertjax.model.contrastive import ContrastiveConfig


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
  # embeddings (bertjax/inputs/passages.py): the columns of a query, its positive passage (dev
  # with corpus_file: the ids of its relevant passages) and its hard negatives ("a,b"), the
  # corpus a dev or test query is searched in (id and `passage` columns)
  query: str
  positive: str
  negatives: str
  corpus_file: str
  passage: str

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
  class_weights: str  # train.class_weights, read with the labels (families/classification.py)
  contrastive: ContrastiveConfig  # config.contrastive: the embeddings family's vectors and loss

  @classmethod
  def from_config(cls, config) -> "TaskConfig":
    return cls(task=config.task, data=FinetuneDataConfig.from_config(config.data),
               eval=EvalConfig.from_config(config.eval),
               class_weights=config.train.class_weights,
               contrastive=from_section(ContrastiveConfig, config.contrastive, "contrastive"))


# The `train` keys a search may list, and whether trials of different values can share one
# compiled program (a traced scalar of the step) or each value needs its own.
SEARCH_KEYS = {"learning_rate": True, "num_epochs": True, "warmup_proportion": True,
               "weight_decay": True, "seed": True, "batch_size": False}


# `config.search.learning_rate=auto`: the rates scaled to the encoder's width
# (search.auto_learning_rates), where the task's config gives a rate of its own (NEXT, GLUE).
AUTO = "auto"


@dataclasses.dataclass(frozen=True)
class SearchConfig:
  """Typed form of `config.search`: the values of each `train` key to try (empty: the train
  section's one value), and how many trials one program may hold (0: as many as memory allows)."""

  values: dict  # key -> tuple of numbers, for the keys that list any (learning_rate: or AUTO)
  trials_per_program: int
  memory_gb: float  # what the trials may take; 0: what the devices (or the host) have

  @classmethod
  def from_config(cls, config) -> "SearchConfig":
    section = config.search
    unknown = sorted(set(section) - set(SEARCH_KEYS) - {"trials_per_program", "memory_gb"})
    if unknown:  # the locked config already refuses these; a config file could still add one
      raise Refusal(f"config.search.{unknown[0]}: a search lists {sorted(SEARCH_KEYS)}.")
    values = {}
    for key in SEARCH_KEYS:
      raw = section[key]
      if raw in ("", None):
        continue
      items = raw if isinstance(raw, (list, tuple)) else str(raw).split(",")
      texts = [str(x).strip() for x in items if str(x).strip()]
      if key == "learning_rate" and [t.lower() for t in texts] == [AUTO]:
        values[key] = AUTO
        continue
      if not texts:
        raise Refusal(f"config.search.{key}={raw!r} names no value; give numbers separated by "
                      f"commas (e.g. {_EXAMPLES[key]}) or leave it empty for train.{key}.")
      numbers = []
      for text in texts:
        try:
          number = float(text)
        except ValueError:
          raise Refusal(f"config.search.{key}: {text!r} is not a number; give numbers "
                        f"separated by commas (e.g. {_EXAMPLES[key]})"
                        + (", or auto alone" if key == "learning_rate" else "") + ".") from None
        if key in ("seed", "batch_size") and number != int(number):
          raise Refusal(f"config.search.{key}: {text!r} is not a whole number.")
        numbers.append(int(number) if key in ("seed", "batch_size") else number)
      if len(set(numbers)) != len(numbers):
        raise Refusal(f"config.search.{key}={raw!r} names a value twice.")
      values[key] = tuple(numbers)
    if section.trials_per_program < 0:
      raise Refusal(f"config.search.trials_per_program={section.trials_per_program} must be "
                    ">= 0 (0: as many as memory allows).")
    if section.memory_gb < 0:
      raise Refusal(f"config.search.memory_gb={section.memory_gb} must be >= 0.")
    return cls(values, int(section.trials_per_program), float(section.memory_gb))

  def wanted(self, config) -> bool:
    """Whether the run is a search: a key lists values, or no learning rate is given."""
    return bool(self.values) or config.train.learning_rate is None


_EXAMPLES = {"learning_rate": "5e-5,4e-5,3e-5,2e-5", "num_epochs": "2,3,4",
             "warmup_proportion": "0.06,0.1", "weight_decay": "0,0.01", "seed": "0,1,2",
             "batch_size": "16,32"}
