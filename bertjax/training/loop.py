"""The training loop: every side effect of a run (checkpoints, evaluation, logs, signals).

`execute(config, workdir, job)` is the one loop of every run: restore or initialise, the steps
(`control.run_steps`), saves, logs, stop signals, evaluations. A `Job` says what differs between
runs: the `train.Training` (its objective), the batches, the evaluation, where new parameters come
from. Pre-training's job is `bertjax.pretrain.job.train_and_evaluate(config, workdir)`, what
`python -m bertjax.pretrain` runs; fine-tuning's is `bertjax.finetune.job.run.finetune`. Resume is
exact: the state is (step, params, opt_state); dropout keys are fold_in(seed, step) and the input
pipeline restarts at any step with the same batches, so an interrupted-and-resumed run computes
what an uninterrupted one computes. Restore order: the workdir's newest checkpoint that restores >
`init_from` (parameters only) > scratch (bertjax/training/checkpoint.py says what is skipped and what refused).

Everything that can be checked is checked before the first step: the intervals, the workdir, the
data (the held-out split too), the mesh and batch, and the checkpoint's model, optimizer and
vocabulary.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from typing import Any, Callable, Iterator, Mapping

import jax
import numpy as np
from absl import logging

from bertjax import files
from bertjax.data import vocab_record
from bertjax.errors import Refusal
from bertjax.parallel import watchdog as watchdog_lib
from bertjax.training import (checkpoint as checkpoint_lib, control, flops, metrics as metrics_lib,
                              train)


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


def _begin(config, workdir: str, job: Job
           ) -> tuple[checkpoint_lib.Checkpointer, train.TrainState, int]:
  """The run's checkpointer, its state (restored, or initialised) and the step it starts from;
  the workdir's record of the run written and the start said, once the checkpoints are accepted."""
  loop = job.loop
  ckpt = checkpoint_lib.Checkpointer(os.path.join(workdir, "checkpoints"),
                                     checkpoint_lib.TRAIN_ITEMS,
                                     save_every=loop.schedule.save_every, keep=loop.keep,
                                     async_save=loop.async_save)
  state, origin = _restore_or_init(job.training, ckpt, job.expected,
                                   job.training.train_config.seed, job.init)
  _write_config(config, workdir)
  start = int(jax.device_get(state.step))
  if job.on_accepted is not None:
    job.on_accepted(start)
  logging.info("Run %s: %s; %d parameters.", workdir, origin,
               sum(x.size for x in jax.tree_util.tree_leaves(state.params)))
  say(origin)
  return ckpt, state, start


def _train_logger(speed: metrics_lib.Throughput, writer: metrics_lib.Writer, total_steps: int):
  """(step, scalars) -> a log interval's line on the console and its figures in the logs."""
  def log(step, scalars):
    rates = speed.update(step)
    if "sequences_per_step" in scalars:  # packed rows: real sequences and tokens, not rows
      rates["seqs_per_sec"] = scalars["sequences_per_step"] * rates["steps_per_sec"]
      rates["tokens_per_sec"] = scalars["tokens_per_step"] * rates["steps_per_sec"]
    writer.write(step, {**scalars, **rates}, prefix="train/")
    say(metrics_lib.progress_line(step, total_steps, scalars, rates), prefix=False)
  return log


def execute(config, workdir: str, job: Job) -> tuple[Any, dict[str, float]]:
  """Runs (or resumes) `job` in `workdir`: restore or initialise, train with saves, logs, stop
  signals and periodic evaluations, then the final evaluation. Returns (state, final metrics);
  the metrics are {} when a stop signal ended the run early."""
  training, schedule = job.training, job.loop.schedule
  tcfg = training.train_config
  ckpt, state, start = _begin(config, workdir, job)
  writer = metrics_lib.Writer(workdir, enabled=jax.process_index() == 0)
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

  log = _train_logger(speed, writer, tcfg.num_train_steps)
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
  # A process of several that stops making progress ends the run (bertjax/parallel/watchdog.py); armed at
  # the first step done (the first compiles), it lasts until the final evaluation's end.
  watchdog = watchdog_lib.Watchdog(workdir, watchdog_seconds(config), jax.process_index(),
                                   jax.process_count(), last_checkpoint=lambda: newest_checkpoint(
                                       ckpt.directory))
  with disk_full_said(workdir), contextlib.closing(ckpt), contextlib.closing(writer), \
      control.StopSignal() as stop, _Profiler(job.loop, workdir) as profiler, watchdog:
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


