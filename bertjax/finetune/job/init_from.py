"""What a fine-tuning run takes from `checkpoint.init_from` (any folder bertjax/weights/reader.py reads):
its model, with the config's overrides; its vocabulary, or the config's checked against it; and
where the run's parameters start (its encoder, ModernBERT's prediction head). The run itself is
bertjax/finetune/job/run.py's."""

from __future__ import annotations

import dataclasses

from bertjax.data import tokenizer as tokenizer_lib
from bertjax.errors import Refusal
from bertjax.finetune.job import init_heads
from bertjax.finetune.kit.config import FinetuneDataConfig
from bertjax.model.config import INHERITED_FIELDS, SHAPE_FIELDS, BertConfig
from bertjax.training import checkpoint as checkpoint_lib, loop
from bertjax.weights import reader as weights, match as weights_match


def resolve_model(config, source: weights.Weights | None) -> BertConfig:
  """init_from's model with the config's overrides (dropout, dtype, ...); without init_from the
  config's model keys must say the shape."""
  wanted = dict(config.model)
  base = dataclasses.asdict(source.config) if source is not None else {}
  base.pop("scan_layers", None)  # a layout of ours, chosen by the task's config
  if source is None:
    unset = [k for k in SHAPE_FIELDS if k != "scan_layers" and not wanted[k]]
    if unset:
      raise Refusal("Without init_from the model's shape must be given: set "
                    + ", ".join(f"config.model.{k}" for k in unset)
                    + " (or checkpoint.init_from, to copy a run's model).")
  merged = dict(base)
  for key, value in wanted.items():
    if key in INHERITED_FIELDS and value in (0, 0.0, ""):
      continue
    fixed = SHAPE_FIELDS + checkpoint_lib.ARCHITECTURE_FIELDS
    if source is not None and key in fixed and key in base and (
        base[key] != value):
      raise Refusal(f"config.model.{key}={value!r} but checkpoint.init_from={source.path} "
                    f"has {base[key]!r}; leave it at 0 to take init_from's.")
    merged[key] = value
  known = {f.name for f in dataclasses.fields(BertConfig)}
  return BertConfig(**{k: v for k, v in merged.items() if k in known})


def resolve_tokenizer(data: FinetuneDataConfig, source: weights.Weights | None, *,
                      allow_other_vocab: bool):
  """The task's tokenizer: data.vocab_path, else init_from's, cased as data.do_lower_case says,
  else as init_from is. A vocabulary other than the one init_from was trained with is refused,
  naming both fingerprints (weights_match.check_vocabulary), unless `allow_other_vocab`
  (checkpoint.init_from_other_vocab)."""
  path = data.vocab_path or (source.vocab_file if source is not None else None)
  if not path:
    where = (f"checkpoint.init_from={source.path} records none" if source is not None
             else "there is no checkpoint.init_from")
    raise Refusal(f"No vocabulary for the task: {where}. Set config.data.vocab_path (a "
                  "SentencePiece .model, a WordPiece vocab.txt or a tokenizer.json).")
  if data.do_lower_case is not None:
    lower = data.do_lower_case
  else:
    lower = source.lower if source is not None else True
  kind = (source.tokenizer_kind if source is not None and path == source.vocab_file
          and source.tokenizer_kind else tokenizer_lib.kind_of(path))
  tokenizer = tokenizer_lib.load_vocabulary(path, kind, lower)
  if source is not None:
    weights_match.check_vocabulary(source, tokenizer.fingerprint, lower,
                                   vocab_file=None if data.vocab_path else path,
                                   allow_other=allow_other_vocab)
  return tokenizer, path, lower


def _encoder_loader(source: weights.Weights):
  """fresh params -> the same params with `bert` (the encoder) read from init_from (and a
  ModernBERT prediction head: bertjax/finetune/job/init_heads.py)."""
  def load(fresh):
    like = {weights.ENCODER: checkpoint_lib.abstract_like(fresh[weights.ENCODER])}
    out = {**fresh, **weights.read(source, like=like, fresh=fresh)}
    if init_heads.HEAD in fresh:  # ModernBERT's task head: as transformers starts it
      out[init_heads.HEAD] = init_heads.prediction_head(source, fresh[init_heads.HEAD])
    return out
  return load


def initialiser(source: weights.Weights, model: BertConfig, task_name: str,
                headless: bool = False) -> tuple[str, loop.Initialiser]:
  """Where a run's parameters start from init_from (results.json's "init", and the console's
  line): its encoder, and ModernBERT's prediction head where the model has one; what of a
  fine-tuned source is left out is said."""
  head = init_heads.start_from(source) if model.task_head == "modernbert" else ""
  also = f" and prediction head ({head})" if head else ""
  said = weights_match.unread(source, (weights.ENCODER, init_heads.HEAD) if head else ())
  return (f"the encoder{also} of checkpoint.init_from={source.describe()}",
          loop.Initialiser(f"encoder{also} from checkpoint.init_from={source.describe()}, "
                           + (f"{task_name}: no head, the encoder's vectors" if headless else
                              f"{task_name} {'classifier' if head else 'head'} new")
                           + (f"; {said}" if said else ""), _encoder_loader(source)))
