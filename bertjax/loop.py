"""The training loop: every side effect of a run (data, checkpoints, evaluation, logs, signals).

`train_and_evaluate(config, workdir)` is what `python -m bertjax.main` runs. Resume is exact: the
state is (step, params, opt_state); dropout keys are fold_in(seed, step) and the input pipeline
restarts at any step with the same batches, so an interrupted-and-resumed run computes what an
uninterrupted one computes. Restore order: the workdir's newest checkpoint that restores >
`init_from` (parameters only) > scratch (bertjax/checkpoint.py says what is skipped and what refused).

Everything that can be checked is checked before the first step: the intervals, the workdir, the
data (the held-out split too), the mesh and batch, and the checkpoint's model, optimizer and
vocabulary. Evaluation reads a fixed held-out set (the first `eval_sequences`, masked with the
preparation seed, so every run and seed is scored on the same predictions).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any, Callable, Iterator, Mapping

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from bertjax import checkpoint as checkpoint_lib, control, metrics as metrics_lib, train
from bertjax.data import pipeline, prepare, storage, tokenizer as tokenizer_lib
from bertjax.model import BertConfig

ITEMS = ("params", "opt_state")


@dataclasses.dataclass(frozen=True)
class LoopConfig:
  """Keys of `config.train` and `config.checkpoint` that only the loop reads."""

  schedule: control.Schedule
  eval_sequences: int
  profile_start_step: int
  profile_num_steps: int
  keep: int
  async_save: bool
  init_from: str
  init_from_other_vocab: bool

  @classmethod
  def from_config(cls, config) -> "LoopConfig":
    """Raises on any interval or count that cannot work, before anything runs."""
    t, c = config.train, config.checkpoint
    schedule = control.Schedule(total_steps=t.num_train_steps, log_every=t.log_every_steps,
                                save_every=c.save_every_steps, eval_every=t.eval_every_steps)
    problems = [f"{key}={value} must be >= {low}" for key, value, low in (
        ("train.eval_sequences", t.eval_sequences, 0), ("checkpoint.keep", c.keep, 1),
        ("train.profile_num_steps", t.profile_num_steps, 1)) if int(value) < low]
    if problems:
      raise ValueError("Invalid config: " + "; ".join(problems))
    return cls(schedule=schedule, eval_sequences=t.eval_sequences,
               profile_start_step=t.profile_start_step, profile_num_steps=t.profile_num_steps,
               keep=c.keep, async_save=c.async_save, init_from=c.init_from,
               init_from_other_vocab=c.init_from_other_vocab)


def check_workdir(workdir: str) -> None:
  """Fail before compiling anything if the workdir cannot be written."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  try:
    tf.io.gfile.makedirs(workdir)
    probe = os.path.join(workdir, f".write_probe_{jax.process_index()}")
    with tf.io.gfile.GFile(probe, "w") as f:
      f.write("ok")
    tf.io.gfile.remove(probe)
  except Exception as err:  # pylint: disable=broad-except
    raise PermissionError(f"Cannot write to --workdir={workdir} ({type(err).__name__}: {err}); "
                          "choose a directory (or gs:// bucket path) this job may write") from err


def resolve_vocab_size(config_vocab: int, tokenizer_vocab: int) -> int:
  """0 in the config takes the tokenizer's size; a larger value pads the table (never smaller)."""
  if config_vocab == 0:
    return tokenizer_vocab
  if config_vocab < tokenizer_vocab:
    raise ValueError(f"config.model.vocab_size={config_vocab} is smaller than the tokenizer's "
                     f"{tokenizer_vocab} pieces; set it to 0 (use the tokenizer's size) or larger")
  return config_vocab


def prepare_data(config) -> dict:
  """Vocabulary and prepared shards (process 0 builds them, the others wait), then the manifest."""
  data = config.data
  storage.check_shared_storage(data, jax.process_index(), jax.process_count())
  if jax.process_index() == 0:
    if data.tokenizer == "sentencepiece":
      tokenizer_lib.ensure_sentencepiece(data)
    prepare.ensure_prepared(data)
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices("bertjax data prepared")
  return prepare.load_manifest(data)


def _restore_or_init(training: train.Training, ckpt: checkpoint_lib.Checkpointer,
                     loop: LoopConfig, expected: checkpoint_lib.Expected, seed: int
                     ) -> tuple[train.TrainState, str]:
  abstract = training.abstract_state
  found = ckpt.restore_latest({"params": abstract.params, "opt_state": abstract.opt_state},
                              expected)
  if found is not None:
    step, items, _ = found
    state = train.TrainState(step=jax.device_put(np.int32(step), training.abstract_state.step
                                                 .sharding), **items)
    train.check_step_counters(state)
    return state, f"resumed from {ckpt.directory} at step {step}"
  state = training.init_state(train.rng_streams(seed)[0])
  if loop.init_from:
    vocab_check = None if loop.init_from_other_vocab else expected.tokenizer_fingerprint
    params = load_init_params(loop.init_from, abstract.params, training.model_config,
                              tokenizer_fingerprint=vocab_check)
    state = state.replace(params=params)
    return state, f"parameters from init_from={loop.init_from}, optimizer fresh"
  return state, "initialised from scratch"


def load_init_params(path: str, abstract_params: Any, config: BertConfig,
                     tokenizer_fingerprint: str | None = None) -> Any:
  """Parameters of another run (its workdir or checkpoints folder) or of `convert.hf import`.

  With `tokenizer_fingerprint`, a run whose vocabulary differs is refused (its embedding rows would
  index other pieces).
  """
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  if not tf.io.gfile.exists(path):
    raise FileNotFoundError(f"init_from={path} does not exist")
  if tf.io.gfile.exists(os.path.join(path, "bert_config.json")):  # written by convert.hf import
    from bertjax.convert import hf  # pylint: disable=import-outside-toplevel
    checkpoint_lib.check_model_matches(dataclasses.asdict(hf.read_config(path)), config, path)
    return hf.load_params(path, abstract_params)[1]
  folder = path if not tf.io.gfile.exists(os.path.join(path, "checkpoints")) else os.path.join(
      path, "checkpoints")
  ckpt = checkpoint_lib.Checkpointer(folder, ITEMS, save_every=1, keep=1)
  steps = ckpt.all_steps()
  if not steps:
    raise FileNotFoundError(f"init_from={path} holds no checkpoint")
  meta = ckpt.read_meta(steps[-1])
  where = f"init_from={folder} step {steps[-1]}"
  checkpoint_lib.Expected(model=config, tokenizer_fingerprint=tokenizer_fingerprint).check(
      meta, where + " (set checkpoint.init_from_other_vocab=True to take it anyway)")
  items, _ = ckpt.restore(steps[-1], {"params": abstract_params})
  ckpt.close()
  return items["params"]


def evaluate(training: train.Training, state, batches: Iterator[Mapping[str, np.ndarray]],
             max_sequences: int, stop: control.StopSignal | None = None
             ) -> dict[str, float] | None:
  """Held-out metrics over the first `max_sequences` (0: the whole split), as one weighted average;
  None when `stop` asks every host to stop before the end."""
  batch_size = training.train_config.batch_size
  max_batches = max(1, max_sequences // batch_size) if max_sequences else 0
  total, count, not_next, pairs = None, 0, 0.0, 0
  for batch in batches:
    if stop is not None and stop.during_evaluation():
      return None
    total = metrics_lib.accumulate(total, training.eval_step(state, training.to_global(batch)))
    if "next_sentence_labels" in batch:
      # The NSP figure means little without the share of the majority label in the same pairs.
      not_next += float(np.sum(batch["next_sentence_labels"]))
      pairs += batch["next_sentence_labels"].size
    count += 1
    if max_batches and count >= max_batches:
      break
  if total is None:
    raise ValueError("The held-out split yielded no batch: lower train.batch_size or hold out "
                     "more documents (data.eval_fraction)")
  scalars = metrics_lib.reduce(total)
  if jax.process_count() > 1:
    # Counts as float32 (jax without x64 would narrow float64 anyway): exact below 2**24 pairs.
    gathered = multihost_utils.process_allgather(np.array([not_next, pairs], np.float32))
    not_next, pairs = (float(x) for x in np.sum(gathered, axis=0))
  if pairs:
    scalars["nsp_majority_baseline"] = max(not_next, pairs - not_next) / pairs
  scalars["num_sequences"] = float(count * batch_size)
  return scalars


def _batches(pipe: Iterator[dict], nsp: bool) -> Iterator[dict[str, np.ndarray]]:
  """The pipeline's batches; without NSP (MLM-only data) the all-zero labels are dropped, so
  neither the loss nor the metrics contain a next-sentence term."""
  for batch in pipe:
    if not nsp:
      batch.pop("next_sentence_labels", None)
    yield batch


def _write_config(config, workdir: str) -> None:
  """What this run was asked to do, beside its results; written once the run is accepted, so a
  refused command leaves the workdir's record of its real run untouched."""
  if jax.process_index() == 0:
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    with tf.io.gfile.GFile(os.path.join(workdir, "config.json"), "w") as f:
      f.write(config.to_json_best_effort(indent=2))


def train_and_evaluate(config, workdir: str) -> dict[str, float]:
  """Runs (or resumes) the job described by `config` in `workdir`; returns the final eval metrics
  ({} when a stop signal ended the run early)."""
  loop = LoopConfig.from_config(config)
  schedule = loop.schedule
  check_workdir(workdir)
  if loop.init_from:
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    if not tf.io.gfile.exists(loop.init_from):
      raise FileNotFoundError(f"checkpoint.init_from={loop.init_from} does not exist")
  manifest = prepare_data(config)
  vocab_size = resolve_vocab_size(config.model.vocab_size, manifest["vocab_size"])
  training = train.from_config(config, vocab_size=vocab_size)
  tcfg = training.train_config
  data = config.data
  per_host = dict(global_batch_size=tcfg.batch_size, process_index=jax.process_index(),
                  process_count=jax.process_count())

  def eval_batches():
    # The preparation seed, not the run's: every run and seed is scored on the same masks.
    return _batches(pipeline.make_pipeline(data, split="eval", seed=data.prepare_seed,
                                           **per_host), data.nsp)

  eval_batches()  # an empty or too small held-out split fails here, not after training
  fingerprint = manifest["settings"]["tokenizer_fingerprint"]
  expected = checkpoint_lib.Expected(model=training.model_config,
                                     optimizer=checkpoint_lib.optimizer_fields(tcfg),
                                     tokenizer_fingerprint=fingerprint)
  ckpt = checkpoint_lib.Checkpointer(os.path.join(workdir, "checkpoints"), ITEMS,
                                     save_every=schedule.save_every, keep=loop.keep,
                                     async_save=loop.async_save)
  state, origin = _restore_or_init(training, ckpt, loop, expected, tcfg.seed)
  _write_config(config, workdir)
  start = int(jax.device_get(state.step))
  is_main = jax.process_index() == 0
  logging.info("Run %s: %s; %d parameters.", workdir, origin,
               sum(x.size for x in jax.tree_util.tree_leaves(state.params)))
  say = (lambda text: print(f"bertjax: {text}", flush=True)) if is_main else (lambda text: None)
  say(origin)
  writer = metrics_lib.Writer(workdir, enabled=is_main)
  meta = {**expected.meta(), "train": dataclasses.asdict(tcfg), "data_source": data.source}

  def save(step, state):
    ckpt.save(step, {"params": state.params, "opt_state": state.opt_state},
              {**meta, "step": step}, force=True)

  def run_eval(step, state, stop):
    scalars = evaluate(training, state, eval_batches(), loop.eval_sequences, stop)
    if scalars is not None:
      writer.write(step, scalars, prefix="eval/")
      if is_main:
        print(f"eval at step {step}: " + " | ".join(
            f"{k} {v:.4f}" for k, v in scalars.items() if k != "num_sequences"), flush=True)
    return scalars

  # Every exit, an error's too, waits for the saves under way: a good checkpoint is never lost
  # because a later step failed.
  with contextlib.closing(ckpt), contextlib.closing(writer), control.StopSignal() as stop:
    if start < tcfg.num_train_steps:
      train_batches = _batches(pipeline.make_pipeline(data, split="train", seed=tcfg.seed,
                                                      start_step=start, **per_host), data.nsp)
      flops = metrics_lib.train_flops(training.model_config, tcfg.batch_size,
                                      data.max_seq_length, data.max_predictions_per_seq)
      peak = metrics_lib.peak_tflops(jax.devices()[0].device_kind)
      speed = metrics_lib.Throughput(start, tcfg.num_train_steps, tcfg.batch_size, flops,
                                     peak * 1e12 * jax.device_count() if peak else None)
      state, stopped_at = _train(training, state, train_batches, start, loop, stop, save,
                                 run_eval, writer, speed, workdir)
      if stopped_at is not None:
        ckpt.wait()
        say(f"{stop.describe()} received; saved step {stopped_at} in {ckpt.directory}. Run the "
            "same command to resume.")
        return {}
    else:
      say(f"the run in {workdir} is complete ({start} of {tcfg.num_train_steps} steps).")
    ckpt.wait()  # the last checkpoint is final before the (long) final evaluation
    final = run_eval(tcfg.num_train_steps, state, stop)
  if final is None:
    say(f"{stop.describe()} received during the final evaluation; the run is complete and saved. "
        "Run the same command to evaluate it.")
    return {}
  if is_main:
    print(summary(final, workdir), flush=True)
  return final


def _train(training: train.Training, state, batches: Iterator[dict], start: int,
           loop: LoopConfig, stop: control.StopSignal, save: Callable, run_eval: Callable,
           writer: metrics_lib.Writer, speed: metrics_lib.Throughput, workdir: str):
  """The steps from `start`: (state, None) at the end, (state, step) when a stop signal ended them
  (that step is saved)."""
  schedule, tcfg = loop.schedule, training.train_config
  is_main = jax.process_index() == 0
  rng = train.rng_streams(tcfg.seed)[1]  # dropout; fold_in(rng, step) inside the step
  buffer = control.MetricsBuffer()
  with contextlib.ExitStack() as profiling:
    step = start
    while step < tcfg.num_train_steps:
      if step == loop.profile_start_step and is_main:
        profiling.enter_context(jax.profiler.trace(os.path.join(workdir, "profile")))
      if loop.profile_start_step >= 0 and step == loop.profile_start_step + loop.profile_num_steps:
        profiling.close()
      state, step_metrics = training.train_step(state, training.to_global(next(batches)), rng)
      step += 1
      buffer.push(step, step_metrics)
      stopping = stop.at_step(step)
      at_save = schedule.at_save(step) or stopping
      if schedule.at_log(step) or at_save:
        buffer.flush()  # the non-finite guard runs before anything of this state is saved
      if schedule.at_log(step):
        scalars, rates = buffer.take(), speed.update(step)
        writer.write(step, {**scalars, **rates}, prefix="train/")
        if is_main:
          print(metrics_lib.progress_line(step, tcfg.num_train_steps, scalars, rates), flush=True)
      if at_save:
        save(step, state)
      if stopping:
        return state, step
      if schedule.at_eval(step) and run_eval(step, state, stop) is None:
        if not schedule.at_save(step):  # stopped during the evaluation: keep this step
          save(step, state)
        return state, step
  return state, None


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
