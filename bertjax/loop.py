"""The training loop: every side effect of a run (data, checkpoints, evaluation, logs, signals).

`execute(config, workdir, job)` is the one loop of every run: restore or initialise, the steps
(`control.run_steps`), saves, logs, stop signals, evaluations. A `Job` says what differs between
runs: the `train.Training` (its objective), the batches, the evaluation, where new parameters come
from. `train_and_evaluate(config, workdir)` is pre-training's job, what `python -m bertjax.pretrain`
runs; fine-tuning's is `bertjax.finetune.run.finetune`. Resume is exact: the
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
import copy
import dataclasses
import os
import time
from typing import Any, Callable, Iterator, Mapping

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from bertjax import checkpoint as checkpoint_lib, control, flops, metrics as metrics_lib, train
from bertjax import files, watchdog as watchdog_lib, weights, weights_match
from bertjax.data import prepare, storage, tokenizer as tokenizer_lib, vocab_record
from bertjax.data.config import DataConfig
from bertjax.errors import Refusal

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
      raise Refusal("Invalid config: " + "; ".join(problems))
    return cls(schedule=schedule, eval_sequences=t.eval_sequences,
               profile_start_step=t.profile_start_step, profile_num_steps=t.profile_num_steps,
               keep=c.keep, async_save=c.async_save, init_from=c.init_from,
               init_from_other_vocab=c.init_from_other_vocab)


def check_workdir(workdir: str) -> None:
  """Fail before compiling anything if the workdir cannot be written."""
  try:
    files.makedirs(workdir)
    probe = os.path.join(workdir, f".write_probe_{jax.process_index()}")
    with files.open_file(probe, "w") as f:
      f.write("ok")
    files.remove(probe)
  except Exception as err:  # pylint: disable=broad-except
    raise PermissionError(f"Cannot write to --workdir={workdir} ({type(err).__name__}: {err}); "
                          "choose a directory (or gs:// bucket path) this job may write") from err


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


def _restore_or_init(training: train.Training, ckpt: checkpoint_lib.Checkpointer,
                     expected: checkpoint_lib.Expected, seed: int,
                     init: "Initialiser | None") -> tuple[train.TrainState, str]:
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
  if init is not None:
    state = state.replace(params=init.load(state.params))
    return state, init.origin
  return state, "initialised from scratch"


@dataclasses.dataclass(frozen=True)
class Initialiser:
  """Where a new run's parameters come from when its workdir has no checkpoint (init_from)."""

  origin: str  # said on the console: "parameters from ..."
  load: Callable[[Any], Any]  # freshly initialised params -> the params to start from


def init_from_source(source: weights.Weights, training: train.Training, data: DataConfig,
                     fingerprint: str, allow_other_vocab: bool) -> Initialiser:
  """Pre-training's start from `source` (bertjax/weights.py reads every kind): its encoder and
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
  return Initialiser(f"parameters from checkpoint.init_from={source.describe()}: "
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
    say(f"config.data.do_lower_case={data.do_lower_case} is replaced by init_from's "
        f"casing ({source.lower}); to use another, set config.data.vocab_path too (it is checked "
        "against init_from's vocabulary)")
  say(f"vocabulary from checkpoint.init_from: {source.vocab_file} ({source.tokenizer_kind}, "
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


def _write_config(config, workdir: str) -> None:
  """What this run was asked to do, beside its results; written once the run is accepted, so a
  refused command leaves the workdir's record of its real run untouched."""
  if jax.process_index() == 0:
    files.write_text(os.path.join(workdir, "config.json"), config.to_json_best_effort(indent=2))


@dataclasses.dataclass(frozen=True)
class Job:
  """One run for `execute`: what pre-training and fine-tuning each bring to the shared loop."""

  training: train.Training
  loop: LoopConfig
  expected: checkpoint_lib.Expected  # what a checkpoint in the workdir must match
  meta: Mapping[str, Any]  # saved beside every checkpoint (besides `expected`'s facts)
  batches: Callable[[int], Iterator[Mapping[str, np.ndarray]]]  # host batches from a step on
  evaluate: Callable  # (step, state, stop) -> scalars, or None when stopped part way
  seqs_per_step: int
  flops_per_step: float | None = None
  init: Initialiser | None = None
  # (restored step) -> whether its periodic evaluation is still owed (a stop came between its
  # save and its evaluation); it is then run before any further step.
  eval_owed: Callable[[int], bool] | None = None
  # (the step the run starts from), on every process, once the workdir's checkpoints are accepted
  on_accepted: Callable[[int], None] | None = None


def execute(config, workdir: str, job: Job) -> tuple[Any, dict[str, float]]:
  """Runs (or resumes) `job` in `workdir`: restore or initialise, train with saves, logs, stop
  signals and periodic evaluations, then the final evaluation. Returns (state, final metrics);
  the metrics are {} when a stop signal ended the run early."""
  training, loop, schedule = job.training, job.loop, job.loop.schedule
  tcfg = training.train_config
  ckpt = checkpoint_lib.Checkpointer(os.path.join(workdir, "checkpoints"),
                                     checkpoint_lib.TRAIN_ITEMS,
                                     save_every=schedule.save_every, keep=loop.keep,
                                     async_save=loop.async_save)
  state, origin = _restore_or_init(training, ckpt, job.expected, tcfg.seed, job.init)
  _write_config(config, workdir)
  start = int(jax.device_get(state.step))
  if job.on_accepted is not None:
    job.on_accepted(start)
  is_main = jax.process_index() == 0
  logging.info("Run %s: %s; %d parameters.", workdir, origin,
               sum(x.size for x in jax.tree_util.tree_leaves(state.params)))
  say(origin)
  writer = metrics_lib.Writer(workdir, enabled=is_main)
  meta = {**job.expected.meta(), **job.meta, "train": dataclasses.asdict(tcfg)}

  def save(step, state):
    ckpt.save(step, {"params": state.params, "opt_state": state.opt_state},
              {**meta, "step": step}, force=True)

  def run_eval(step, state, stop):
    began = time.perf_counter()
    watchdog_lib.disarm()  # its first batch compiles; counted again from that batch on
    scalars = job.evaluate(step, state, stop)
    watchdog_lib.disarm()  # what a job does after its batches (fine-tuning saves best/)
    speed.exclude(time.perf_counter() - began)
    if scalars is not None:
      writer.write(step, scalars, prefix="eval/")
      say(f"eval at step {step}: " + " | ".join(
          f"{k} {v:.4f}" for k, v in scalars.items() if k != "num_sequences"), prefix=False)
    return scalars

  speed = metrics_lib.Throughput(start, tcfg.num_train_steps, job.seqs_per_step,
                                 job.flops_per_step, _peak_flops())

  def log(step, scalars):
    rates = speed.update(step)
    if "sequences_per_step" in scalars:  # packed rows: real sequences and tokens, not rows
      rates["seqs_per_sec"] = scalars["sequences_per_step"] * rates["steps_per_sec"]
      rates["tokens_per_sec"] = scalars["tokens_per_step"] * rates["steps_per_sec"]
    writer.write(step, {**scalars, **rates}, prefix="train/")
    say(metrics_lib.progress_line(step, tcfg.num_train_steps, scalars, rates), prefix=False)

  rng = train.rng_streams(tcfg.seed)[1]  # dropout; fold_in(rng, step) inside the step

  first = [True]

  def step_fn(state, host_batch):
    state, metrics = training.train_step(state, training.to_global(host_batch), rng)
    if first[0]:  # it compiled the step: the one wait outside log intervals, to time it apart
      first[0] = False
      jax.block_until_ready(metrics)
      speed.restart(start + 1)
    return state, metrics

  # Every exit, an error's too, waits for the saves under way: a good checkpoint is never lost
  # because a later step failed.
  # A process of several that stops making progress ends the run (bertjax/watchdog.py); armed at
  # the first step done (the first compiles), it lasts until the final evaluation's end.
  watchdog = watchdog_lib.Watchdog(workdir, watchdog_seconds(config), jax.process_index(),
                                   jax.process_count(), last_checkpoint=lambda: newest_checkpoint(
                                       ckpt.directory))
  with disk_full_said(workdir), contextlib.closing(ckpt), contextlib.closing(writer), \
      control.StopSignal() as stop, _Profiler(loop, workdir) as profiler, watchdog:
    if (0 < start < tcfg.num_train_steps and job.eval_owed is not None and job.eval_owed(start)
        and run_eval(start, state, stop) is None):
      say(f"{stop.describe()} received; the run is saved at step {start}. Run the same "
          "command to resume.")
      return state, {}
    if start < tcfg.num_train_steps:
      state, stopped_at = control.run_steps(
          step_fn, state, job.batches(start), start, schedule, stop, save=save,
          evaluate=run_eval, log=log, before_step=profiler.before_step)
      if stopped_at is not None:
        ckpt.wait()
        say(f"{stop.describe()} received; saved step {stopped_at} in {ckpt.directory}. Run the "
            "same command to resume.")
        return state, {}
    else:
      say(f"the run in {workdir} is complete ({start} of {tcfg.num_train_steps} steps).")
    watchdog_lib.disarm()
    ckpt.wait()  # the last checkpoint is final before the (long) final evaluation
    final = run_eval(tcfg.num_train_steps, state, stop)
  if final is None:
    say(f"{stop.describe()} received during the final evaluation; the run is complete and saved. "
        "Run the same command to evaluate it.")
    return state, {}
  return state, final


def watchdog_seconds(config) -> float:
  """`train.watchdog_seconds`, checked: 0 (off) or at least 5 (the heartbeats' resolution)."""
  seconds = float(config.train.get("watchdog_seconds", 0) or 0)
  if seconds < 0 or 0 < seconds < 5:
    raise Refusal(f"Invalid config: train.watchdog_seconds={seconds:g} must be 0 (off) or "
                  ">= 5")
  return seconds


def newest_checkpoint(folder: str) -> str:
  """"step N in FOLDER" for the newest complete checkpoint, or "" when there is none."""
  steps = sorted(int(n) for n in files.listdir(folder) if n.isdigit()) if files.isdir(
      folder) else []
  return f"step {steps[-1]} in {folder}" if steps else ""


def disk_full_said(workdir: str):
  """A context in which a full disk ends the run with one line naming the workdir and its newest
  complete checkpoint (orbax writes a save into a temporary folder and deletes older steps only
  once it is complete, so a save that found no space loses nothing saved before)."""
  folder = os.path.join(workdir, "checkpoints")

  def kept() -> str:
    steps = sorted(int(n) for n in files.listdir(folder) if n.isdigit()) if files.isdir(
        folder) else []
    if not steps:
      return "no checkpoint was complete yet"
    return f"its newest complete checkpoint, step {steps[-1]} in {folder}, is kept"
  return files.disk_full_said(f"--workdir={workdir}", kept)


def keep_vocabulary(vocab_file: str, kind: str, fingerprint: str, workdir: str,
                    do_lower_case: bool) -> None:
  """The run's vocabulary copied beside its checkpoints (process 0 writes), so that the workdir
  alone can be fine-tuned or continued elsewhere."""
  if jax.process_index() == 0:
    vocab_record.copy_to_workdir(vocab_file, kind, fingerprint, workdir, do_lower_case)


def say(text: str, prefix: bool = True) -> None:
  """A console line from process 0 (the others would repeat it)."""
  if jax.process_index() == 0:
    print(f"bertjax: {text}" if prefix else text, flush=True)


def _peak_flops() -> float | None:
  peak = flops.peak_tflops(jax.devices()[0].device_kind)
  return peak * 1e12 * jax.device_count() if peak else None


class _Profiler(contextlib.ExitStack):
  """A profiler trace of `train.profile_num_steps` steps from `train.profile_start_step`."""

  def __init__(self, loop: LoopConfig, workdir: str):
    super().__init__()
    self._loop, self._workdir = loop, workdir

  def before_step(self, step: int) -> None:
    first = self._loop.profile_start_step
    if step == first and jax.process_index() == 0:
      self.enter_context(jax.profiler.trace(os.path.join(self._workdir, "profile")))
    if first >= 0 and step == first + self._loop.profile_num_steps:
      self.close()


def train_and_evaluate(config, workdir: str) -> dict[str, float]:
  """Runs (or resumes) the pre-training job described by `config` in `workdir`; returns the final
  eval metrics ({} when a stop signal ended the run early)."""
  # lazy: tf.data is pre-training's input alone; fine-tuning, which runs through `execute` too,
  # reads its rows without TensorFlow (docs/contributing.md, "TensorFlow").
  from bertjax.data import pipeline  # pylint: disable=import-outside-toplevel
  loop = LoopConfig.from_config(config)
  data = DataConfig.from_config(config.data)
  check_workdir(workdir)
  source = None
  if loop.init_from:
    source = weights.inspect(loop.init_from, what="checkpoint.init_from")
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
                                                      loop.init_from_other_vocab)
  job = Job(
      training=training, loop=loop, expected=expected, meta={"data_source": data.source},
      batches=lambda start: model_batches(pipeline.make_pipeline(
          data, tok, split="train", seed=tcfg.seed, start_step=start, **per_host), data.nsp),
      evaluate=lambda step, state, stop: evaluate(training, state, eval_batches(),
                                                  loop.eval_sequences, stop),
      seqs_per_step=tcfg.batch_size,  # rows; packed batches report their sequences (log)
      # packed rows (data.packing) hold S x M masked slots, as flops.rows_shape counts them
      flops_per_step=flops.train_flops(training.model_config, tcfg.batch_size,
                                       data.max_seq_length, flops.rows_shape(data)[1]),
      init=init,
      on_accepted=lambda start: keep_vocabulary(
          tokenizer_lib.vocab_path_of(data), data.tokenizer, fingerprint, workdir,
          data.do_lower_case))
  _, final = execute(_recorded(config, data), workdir, job)
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
