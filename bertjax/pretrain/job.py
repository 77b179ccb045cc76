"""Pre-training's job for the loop: `train_and_evaluate(config, workdir)`, what `python -m
bertjax.pretrain` runs. The run's vocabulary (init_from's, or trained once) and its prepared shards,
the start from `init_from`, the tf.data batches, the held-out evaluation (the first
`eval_sequences`, masked with the preparation seed, so every run and seed is scored on the same
predictions) and the closing summary; bertjax/training/loop.py's `execute` runs the steps, saves, logs and
stops, as it does fine-tuning's job.
"""

from __future__ import annotations

import copy
import os
import dataclasses
from typing import Iterator, Mapping

import jax
import numpy as np
from jax.experimental import multihost_utils

from bertjax.data import prepare, storage, tokenizer as tokenizer_lib
from bertjax.data.config import DataConfig
from bertjax.errors import Refusal
from bertjax.training import checkpoint as checkpoint_lib, control, flops, loop, train
from bertjax.weights import match as weights_match, reader as weights


def resolve_vocab_size(config_vocab: int, tokenizer_vocab: int) -> int:
  """0 in the config takes the tokenizer's size; a larger value pads the table (never smaller)."""
  if config_vocab == 0:
    return tokenizer_vocab
  if config_vocab < tokenizer_vocab:
    raise Refusal(f"config.model.vocab_size={config_vocab} is smaller than the tokenizer's "
                  f"{tokenizer_vocab} pieces; set it to 0 (use the tokenizer's size) or larger")
  return config_vocab


def prepare_data(data: DataConfig) -> tuple[tokenizer_lib.Tokenizer, dict]:
  """The run's tokenizer, loaded once here and passed down, and the manifest of its prepared
  shards. Process 0 trains the vocabulary (once, on a bounded sample: the others wait only for
  that); then every process prepares its share of the pieces of input and of the shards, and they
  wait for each other only between the two steps and for the last shards (prepare.prepare)."""
  storage.check_shared_storage(data, jax.process_index(), jax.process_count())
  hosts = jax.process_count()

  def barrier(name: str):
    if hosts > 1:
      multihost_utils.sync_global_devices(name)

  if jax.process_index() == 0 and data.tokenizer == "sentencepiece":
    tokenizer_lib.ensure_sentencepiece(data)
  barrier("bertjax vocabulary ready")
  tok = tokenizer_lib.load_tokenizer(data)
  return tok, prepare.ensure_prepared(data, tok, host_index=jax.process_index(),
                                      host_count=hosts, barrier=barrier)


def init_from_source(source: weights.Weights, training: train.Training, data: DataConfig,
                     fingerprint: str, allow_other_vocab: bool) -> loop.Initialiser:
  """Pre-training's start from `source` (bertjax/weights/reader.py reads every kind): its encoder and
  whichever pre-training heads it holds (a fine-tuning run's has none: they start fresh). A
  source of another shape or vocabulary is refused here, before anything compiles."""
  weights_match.check_model(source, training.model_config)
  weights_match.check_vocabulary(source, fingerprint, data.do_lower_case,
                           vocab_file=tokenizer_lib.vocab_path_of(data),
                           allow_other=allow_other_vocab)

  def load(fresh):
    kept = {k: v for k, v in fresh.items() if k in source.subtrees}
    return {**fresh, **weights.read(source, like=checkpoint_lib.abstract_like(kept), fresh=kept)}

  said = weights_match.unread(source, training.abstract_state.params)
  return loop.Initialiser(f"parameters from checkpoint.init_from={source.describe()}: "
                     f"{weights_match.describe_heads(source, training.abstract_state.params)}, "
                     "optimizer fresh" + (f"; {said}" if said else ""), load)


def _init_vocabulary(data: DataConfig, source: weights.Weights) -> DataConfig:
  """`data` with the vocabulary of init_from when it is a folder with a vocabulary (converted,
  Google or Hugging Face) and the config names none: its tokenizer, cased as the folder says.
  The original pairs each checkpoint with its vocab.txt; another vocabulary would scramble the
  embeddings. A workdir's vocabulary is the one its data config makes, checked by fingerprint."""
  if source.kind == "workdir" or source.vocab_file is None or data.vocab_path:
    return data  # a vocabulary the config names is checked against the source's (weights)
  if data.do_lower_case != source.lower:
    # The config's casing (often base.py's default) gives way to the vocabulary's: said, since
    # a --config.data.do_lower_case given on purpose would otherwise be dropped silently.
    loop.say(f"config.data.do_lower_case={data.do_lower_case} is replaced by init_from's "
        f"casing ({source.lower}); to use another, set config.data.vocab_path too (it is checked "
        "against init_from's vocabulary)")
  loop.say(f"vocabulary from checkpoint.init_from: {source.vocab_file} ({source.tokenizer_kind}, "
      f"do_lower_case={source.lower}: {source.casing_why})")
  return dataclasses.replace(data, tokenizer=source.tokenizer_kind, vocab_path=source.vocab_file,
                             do_lower_case=source.lower)


def _recorded(config, data: DataConfig):
  """The config config.json records: as given, with the data section the run uses (init_from's
  vocabulary may have replaced the config's)."""
  config = copy.deepcopy(config)
  config.data.update(dataclasses.asdict(data))
  return config


def evaluate(training: train.Training, state, batches: Iterator[Mapping[str, np.ndarray]],
             max_sequences: int, stop: control.StopSignal | None = None
             ) -> dict[str, float] | None:
  """Held-out metrics over the first `max_sequences` (0: the whole split), as one weighted average;
  None when `stop` asks every host to stop before the end."""
  batch_size = training.train_config.batch_size
  max_batches = max(1, max_sequences // batch_size) if max_sequences else 0
  total, count, not_next, pairs = control.MetricsBuffer(guard=False), 0, 0.0, 0
  for batch in batches:
    if stop is not None and stop.during_evaluation():
      return None
    # Summed on the device: the host reads the held-out figures once, not after every batch.
    total.push(count, training.eval_step(state, training.to_global(batch)))
    if "next_sentence_labels" in batch:
      # The NSP figure means little without the share of the majority label in the same pairs.
      not_next += float(np.sum(batch["next_sentence_labels"]))
      pairs += batch["next_sentence_labels"].size
    count += 1
    if max_batches and count >= max_batches:
      break
  scalars = total.take()
  if scalars is None:
    raise Refusal("The held-out split yielded no batch: lower train.batch_size or hold out "
                  "more documents (data.eval_fraction)")
  if jax.process_count() > 1:
    # Counts as float32 (jax without x64 would narrow float64 anyway): exact below 2**24 pairs.
    gathered = multihost_utils.process_allgather(np.array([not_next, pairs], np.float32))
    not_next, pairs = (float(x) for x in np.sum(gathered, axis=0))
  if pairs:
    scalars["nsp_majority_baseline"] = max(not_next, pairs - not_next) / pairs
  scalars["num_sequences"] = float(count * batch_size)
  return scalars


def model_batches(pipe: Iterator[dict], nsp: bool) -> Iterator[dict[str, np.ndarray]]:
  """The pipeline's batches; without NSP (MLM-only data) the all-zero labels are dropped, so
  neither the loss nor the metrics contain a next-sentence term."""
  for batch in pipe:
    if not nsp:
      for name in ("next_sentence_labels", "nsp_positions", "nsp_weights"):
        batch.pop(name, None)
    yield batch


def train_and_evaluate(config, workdir: str) -> dict[str, float]:
  """Runs (or resumes) the pre-training job described by `config` in `workdir`; returns the final
  eval metrics ({} when a stop signal ended the run early)."""
  # lazy: tf.data is pre-training's input alone; fine-tuning, which runs through `execute` too,
  # reads its rows without TensorFlow (docs/contributing.md, "TensorFlow").
  from bertjax.data import pipeline  # pylint: disable=import-outside-toplevel
  loop_config = loop.LoopConfig.from_config(config)
  data = DataConfig.from_config(config.data)
  loop.check_workdir(workdir)
  source = None
  if loop_config.init_from:
    source = weights.inspect(loop_config.init_from, what="checkpoint.init_from")
    data = _init_vocabulary(data, source)
  tok, manifest = prepare_data(data)
  vocab_size = resolve_vocab_size(config.model.vocab_size, manifest["vocab_size"])
  training = train.from_config(config, vocab_size=vocab_size)
  tcfg = training.train_config
  per_host = dict(global_batch_size=tcfg.batch_size, process_index=jax.process_index(),
                  process_count=jax.process_count())

  def eval_batches():
    # The preparation seed, not the run's: every run and seed is scored on the same masks.
    return model_batches(pipeline.make_pipeline(data, tok, split="eval", seed=data.prepare_seed,
                                           **per_host), data.nsp)

  eval_batches()  # an empty or too small held-out split fails here, not after training
  fingerprint = manifest["settings"]["tokenizer_fingerprint"]
  expected = checkpoint_lib.Expected(model=training.model_config,
                                     optimizer=checkpoint_lib.optimizer_fields(tcfg),
                                     tokenizer_fingerprint=fingerprint)
  init = None if source is None else init_from_source(source, training, data, fingerprint,
                                                      loop_config.init_from_other_vocab)
  job = loop.Job(
      training=training, loop=loop_config, expected=expected, meta={"data_source": data.source},
      batches=lambda start: model_batches(pipeline.make_pipeline(
          data, tok, split="train", seed=tcfg.seed, start_step=start, **per_host), data.nsp),
      evaluate=lambda step, state, stop: evaluate(training, state, eval_batches(),
                                                  loop_config.eval_sequences, stop),
      seqs_per_step=tcfg.batch_size,  # rows; packed batches report their sequences (log)
      # packed rows (data.packing) hold S x M masked slots, as flops.rows_shape counts them
      flops_per_step=flops.train_flops(training.model_config, tcfg.batch_size,
                                       data.max_seq_length, flops.rows_shape(data)[1]),
      init=init,
      on_accepted=lambda start: loop.keep_vocabulary(
          tokenizer_lib.vocab_path_of(data), data.tokenizer, fingerprint, workdir,
          data.do_lower_case))
  _, final = loop.execute(_recorded(config, data), workdir, job)
  if final and jax.process_index() == 0:
    print(summary(final, workdir), flush=True)
  return final


def summary(final: Mapping[str, float], workdir: str) -> str:
  """The closing lines of a run: held-out accuracy against its baseline, and where things are."""
  lines = [f"Held-out MLM accuracy {final['mlm_accuracy']:.3f} "
           f"(loss {final['mlm_loss']:.3f}) on {int(final['num_sequences'])} sequences"]
  if "nsp_accuracy" in final:
    lines.append(f"Held-out NSP accuracy {final['nsp_accuracy']:.3f} (majority-label baseline "
                 f"{final['nsp_majority_baseline']:.3f})")
  lines += [f"Checkpoints: {os.path.join(workdir, 'checkpoints')}",
            f"Logs: {os.path.join(workdir, 'metrics.jsonl')}; "
            f"tensorboard --logdir {os.path.join(workdir, 'tensorboard')}"]
  return "\n".join(lines)
