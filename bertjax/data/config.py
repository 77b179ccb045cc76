"""Pre-training's data section, typed: `DataConfig` is configs/base.py's `config.data`.

It is built once where a run starts (`DataConfig.from_config(config.data)`: the loop, the prepare
command, the benchmarks) and passed down; below that, nothing reads the ConfigDict. The dataclass
holds no defaults: configs/base.py is the one home of every default, so a key the config lacks, or
one the dataclass does not know, is an error that names it. A value of another type (a config
built by hand, not type-checked against base.py's values) is refused too. Fine-tuning's sections
(other data keys) are typed the same way, with `from_section` and `check_types`, in
bertjax/finetune/kit/config.py.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Mapping

from bertjax.errors import Refusal



def from_section(cls, section: Mapping[str, Any], name: str):
  """`cls(**section)`, naming every key of the config section `name` that `cls` does not know and
  every field the section lacks."""
  # dict() of a ConfigDict resolves its FieldReferences (configs/finetune.py's None-able bools).
  values = dict(section)
  known = [f.name for f in dataclasses.fields(cls)]
  unknown = sorted(set(values) - set(known))
  missing = [k for k in known if k not in values]
  problems = []
  if unknown:
    problems.append(f"unknown key(s) {[f'{name}.{k}' for k in unknown]} (known keys: {known})")
  if missing:
    problems.append(f"missing key(s) {[f'{name}.{k}' for k in missing]}")
  if problems:
    raise Refusal(f"{cls.__name__}: " + "; ".join(problems))
  return cls(**values)


def check_types(obj, name: str) -> None:
  """Refuses a field value of another type than the field's (`name`: the config section, for the
  message); an int for a float field becomes a float, as ConfigDict converts it."""
  hints = typing.get_type_hints(type(obj))
  wrong = []
  for f in dataclasses.fields(obj):
    value, kind = getattr(obj, f.name), hints[f.name]
    allowed = typing.get_args(kind) or (kind,)  # `bool | None` -> (bool, NoneType)
    if float in allowed and isinstance(value, int) and not isinstance(value, bool):
      object.__setattr__(obj, f.name, float(value))
      continue
    if value is None and type(None) in allowed:
      continue
    # bool is an int to isinstance; an int field takes no True, a bool field no 1.
    if isinstance(value, bool) != (bool in allowed) or not isinstance(value, allowed):
      types = " or ".join(t.__name__ for t in allowed)
      wrong.append(f"config.{name}.{f.name}={value!r} must be {types}")
  if wrong:
    raise Refusal(f"Invalid {name} config: {'; '.join(wrong)}")


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Typed form of pre-training's `config.data` (configs/base.py says what each key means)."""

  source: str
  tfds_data_dir: str
  tfds_split: str
  text_column: str
  language: str
  tokenizer: str
  vocab_path: str
  spm_vocab_size: int
  do_lower_case: bool
  max_seq_length: int
  max_predictions_per_seq: int
  masked_lm_prob: float
  mask_token_prob: float
  random_token_prob: float
  whole_word_masking: bool
  nsp: bool
  short_seq_prob: float
  dupe_factor: int
  eval_dupe_factor: int
  eval_fraction: float
  num_shards: int
  num_eval_shards: int
  prepare_seed: int
  prepare_workers: int
  prepare_engine: str
  beam_pipeline_options: str
  input_split_bytes: int
  max_shard_bytes: int
  prepared_dir: str
  cache_dir: str
  shuffle_window: int
  packing: bool
  max_sequences_per_row: int
  prefetch_batches: int
  max_replaced_char_share: float
  max_line_chars: int
  max_document_pair_share: float

  def __post_init__(self):
    check_types(self, "data")

  @classmethod
  def from_config(cls, section: Mapping[str, Any]) -> "DataConfig":
    """From `config.data` (a ConfigDict or a plain mapping), naming any unknown or missing key."""
    return from_section(cls, {**RECORDED_BEFORE_THEM, **dict(section)}, "data")


# Keys added after runs were recorded (a workdir's config.json) that only say how preparation runs,
# not what it makes, or that change nothing of what the sources of those runs made (text_column
# and language read Parquet and JSON Lines, which came later; a TFDS source's sentences record
# their segmenter): a record without them ran what these values run. Every other key the section
# lacks is an error.
RECORDED_BEFORE_THEM = {"prepare_engine": "local", "beam_pipeline_options": "",
                        "input_split_bytes": 64 << 20, "max_shard_bytes": 64 << 20,
                        "text_column": "text", "language": "en"}
