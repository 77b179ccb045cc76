"""A weights folder against the run that takes it: its vocabulary, casing and model refused or
warned about before anything compiles, and what of it the run reads and leaves, for the console.
bertjax/weights/reader.py recognises and reads the folder."""

from __future__ import annotations

import dataclasses

from absl import logging

from bertjax import errors
from bertjax.data import tokenizer as tokenizer_lib
from bertjax.formats import hf
from bertjax.model.config import BertConfig
from bertjax.training import checkpoint as checkpoint_lib
from bertjax.weights.reader import ENCODER, Weights


# Vocabulary, casing, model ---------------------------------------------------------------------

def fingerprint_of(source: Weights, do_lower_case: bool) -> str | None:
  """The vocabulary's fingerprint: as recorded with the weights, else computed from its file
  under `do_lower_case` (the casing is part of a WordPiece fingerprint)."""
  if source.fingerprint is not None:
    return source.fingerprint
  if source.vocab_file is None:
    return None
  return tokenizer_lib.load_vocabulary(source.vocab_file, source.tokenizer_kind,
                                       do_lower_case).fingerprint


def check_vocabulary(source: Weights, fingerprint: str, do_lower_case: bool, *,
                     vocab_file: str | None = None, allow_other: bool = False) -> None:
  """Refuses a source whose vocabulary is not the run's (`fingerprint`, from `vocab_file` under
  `do_lower_case`): its embedding rows would index other pieces. The run's own copy of the
  source's file passes without a second read. Differing casing alone is warned about."""
  warn_casing(source, do_lower_case)
  if allow_other or (vocab_file is not None and vocab_file == source.vocab_file):
    return
  have = fingerprint_of(source, do_lower_case)
  if have is not None and have != fingerprint:
    raise errors.CheckpointMismatchError(
        f"checkpoint.init_from={source.describe()} was trained with another vocabulary "
        f"(fingerprint {have}) than this run's (fingerprint {fingerprint}): its embedding rows "
        "would index other pieces. Leave data.vocab_path empty to take init_from's, or set "
        "checkpoint.init_from_other_vocab=True to take the weights anyway.")


def warn_casing(source: Weights, do_lower_case: bool) -> None:
  if source.do_lower_case is not None and source.do_lower_case != do_lower_case:
    logging.warning("data.do_lower_case=%s, but init_from=%s is %s (%s).", do_lower_case,
                    source.path, "uncased" if source.do_lower_case else "cased",
                    source.casing_why)


def check_model(source: Weights, config: BertConfig, what: str = "checkpoint.init_from") -> None:
  """Refuses a source whose model differs from `config` in a shape-defining field."""
  stored = dataclasses.asdict(dataclasses.replace(source.config, scan_layers=config.scan_layers))
  checkpoint_lib.check_model_matches(stored, config, f"{what}={source.describe()}")


# What a run reads of it -------------------------------------------------------------------

def describe_heads(source: Weights, wanted) -> str:
  """Which of `wanted` (a model's heads) the source gives, for the console."""
  given = [h for h in wanted if h != ENCODER and h in source.subtrees]
  fresh = [h for h in wanted if h != ENCODER and h not in source.subtrees]
  parts = ["encoder"] + given
  return " + ".join(parts) + (f" (heads {', '.join(fresh)} new: the source has none)"
                              if fresh else "")


def unread(source: Weights, taken) -> str:
  """What a reader of the subtrees `taken` leaves of a fine-tuned `source`, and starts fresh, for
  the console ("" where nothing): its task head (named by its class where config.json names one;
  pre-training's heads go unsaid) and the pooler its class never built."""
  left = [s for s in source.subtrees if s not in (ENCODER, *hf.HEAD_PREFIXES, *taken)]
  task, said = source.task_class, []
  if left or task is not None:
    what = ", ".join(left + ([f"{len(task.labels)} labels"] if task and task.labels else []))
    name = f"its {task.architecture} head" if task and task.architecture else "its task head"
    said.append(name + (f" ({what})" if what else "") + " not read")
  if "pooler" in source.lacks:
    said.append("its pooler new (the class builds none)")
  return "; ".join(said)
