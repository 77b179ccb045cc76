"""The training loop: every side effect of a run (data, checkpoints, evaluation, logs, signals).

`train_and_evaluate(config, workdir)` is what `python -m bertjax.main` runs. Resume is exact: the
state is (step, params, opt_state); dropout keys are fold_in(seed, step) and the input pipeline
restarts at any step with the same batches, so an interrupted-and-resumed run computes what an
uninterrupted one computes. Restore order: the workdir's newest readable checkpoint > `init_from`
(parameters only) > scratch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
from typing import Any, Iterator, Mapping

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from bertjax import checkpoint as checkpoint_lib, metrics as metrics_lib, train
from bertjax.data import pipeline, prepare, storage, tokenizer as tokenizer_lib
from bertjax.model import BertConfig

ITEMS = ("params", "opt_state")


@dataclasses.dataclass(frozen=True)
class LoopConfig:
  """Keys of `config.train` and `config.checkpoint` that only the loop reads."""

  log_every_steps: int
  eval_every_steps: int
  eval_batches: int
  profile_start_step: int
  profile_num_steps: int
  save_every_steps: int
  keep: int
  async_save: bool
  init_from: str

  @classmethod
  def from_config(cls, config) -> "LoopConfig":
    t, c = config.train, config.checkpoint
    return cls(log_every_steps=t.log_every_steps, eval_every_steps=t.eval_every_steps,
               eval_batches=t.eval_batches, profile_start_step=t.profile_start_step,
               profile_num_steps=t.profile_num_steps, save_every_steps=c.save_every_steps,
               keep=c.keep, async_save=c.async_save, init_from=c.init_from)


class _StopSignal:
  """SIGTERM (a preemption notice) or SIGINT asks the loop to save at the next step and exit."""

  def __init__(self):
    self.received = None
    self._previous = {}

  def __enter__(self):
    for sig in (signal.SIGTERM, signal.SIGINT):
      try:
        self._previous[sig] = signal.signal(sig, self._handle)
      except ValueError:  # not the main thread (e.g. a test harness): no handler, no stop
        pass
    return self

  def _handle(self, signum, frame):
    del frame
    self.received = signal.Signals(signum).name

  def __exit__(self, *exc):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)

  def should_stop(self, step: int) -> bool:
    """Whether every process should stop now; all processes agree on the same step."""
    local = self.received is not None
    if jax.process_count() == 1:
      return local
    # One tiny all-gather keeps the hosts in step: a host that stops alone would hang the others.
    flags = multihost_utils.process_allgather(np.array([local], np.int32))
    del step
    return bool(np.any(flags))


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
                     loop: LoopConfig, seed: int) -> tuple[train.TrainState, str]:
  abstract = training.abstract_state
  found = ckpt.restore_latest({"params": abstract.params, "opt_state": abstract.opt_state},
                              training.model_config)
  if found is not None:
    step, items, _ = found
    state = train.TrainState(step=jax.device_put(np.int32(step), training.abstract_state.step
                                                 .sharding), **items)
    return state, f"resumed from {ckpt.directory} at step {step}"
  state = training.init_state(jax.random.PRNGKey(seed))
  if loop.init_from:
    params = load_init_params(loop.init_from, abstract.params, training.model_config)
    state = state.replace(params=params)
    return state, f"parameters from init_from={loop.init_from}, optimizer fresh"
  return state, "initialised from scratch"


def load_init_params(path: str, abstract_params: Any, config: BertConfig) -> Any:
  """Parameters of another run (its workdir or checkpoints folder) or of `convert.hf import`."""
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
  checkpoint_lib.check_model_matches(meta.get("model", {}), config, f"{folder} step {steps[-1]}")
  items, _ = ckpt.restore(steps[-1], {"params": abstract_params})
  ckpt.close()
  return items["params"]


def evaluate(training: train.Training, state, batches: Iterator[Mapping[str, np.ndarray]],
             max_batches: int) -> dict[str, float]:
  """Held-out metrics over `max_batches` batches (0: the whole split), as one weighted average."""
  total, count, not_next, pairs = None, 0, 0.0, 0
  for batch in batches:
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
  scalars["num_sequences"] = float(count * training.train_config.batch_size)
  return scalars


def _batches(data_config, **kw) -> Iterator[dict[str, np.ndarray]]:
  """The pipeline's batches; without NSP (MLM-only data) the all-zero labels are dropped, so
  neither the loss nor the metrics contain a next-sentence term."""
  for batch in pipeline.make_pipeline(data_config, **kw):
    if not data_config.nsp:
      batch.pop("next_sentence_labels", None)
    yield batch


def _meta(config, training: train.Training, step: int) -> dict:
  return {"model": dataclasses.asdict(training.model_config), "step": step,
          "train": dataclasses.asdict(training.train_config), "data_source": config.data.source}


def train_and_evaluate(config, workdir: str) -> dict[str, float]:
  """Runs (or resumes) the job described by `config` in `workdir`; returns the final eval metrics."""
  loop = LoopConfig.from_config(config)
  check_workdir(workdir)
  if loop.init_from:
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    if not tf.io.gfile.exists(loop.init_from):
      raise FileNotFoundError(f"checkpoint.init_from={loop.init_from} does not exist")
  if jax.process_index() == 0:  # what this run was asked to do, beside its results
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    with tf.io.gfile.GFile(os.path.join(workdir, "config.json"), "w") as f:
      f.write(config.to_json_best_effort(indent=2))
  manifest = prepare_data(config)
  vocab_size = resolve_vocab_size(config.model.vocab_size, manifest["vocab_size"])
  training = train.from_config(config, vocab_size=vocab_size)
  tcfg = training.train_config
  ckpt = checkpoint_lib.Checkpointer(os.path.join(workdir, "checkpoints"), ITEMS,
                                     save_every=loop.save_every_steps, keep=loop.keep,
                                     async_save=loop.async_save)
  state, origin = _restore_or_init(training, ckpt, loop, tcfg.seed)
  start = int(jax.device_get(state.step))
  is_main = jax.process_index() == 0
  logging.info("Run %s: %s; %d parameters.", workdir, origin,
               sum(x.size for x in jax.tree_util.tree_leaves(state.params)))
  if is_main:
    print(f"bertjax: {origin}", flush=True)
  writer = metrics_lib.Writer(workdir, enabled=is_main)
  data = config.data
  per_host = dict(global_batch_size=tcfg.batch_size, process_index=jax.process_index(),
                  process_count=jax.process_count(), seed=tcfg.seed)

  def run_eval(step):
    scalars = evaluate(training, state, _batches(data, split="eval", **per_host),
                       loop.eval_batches)
    writer.write(step, scalars, prefix="eval/")
    if is_main:
      print(f"eval at step {step}: " + " | ".join(
          f"{k} {v:.4f}" for k, v in scalars.items() if k != "num_sequences"), flush=True)
    return scalars

  def finish(step):
    final = run_eval(step)
    ckpt.close()
    writer.close()
    if is_main:
      print(summary(final, workdir), flush=True)
    return final

  if start >= tcfg.num_train_steps:
    if is_main:
      print(f"bertjax: the run in {workdir} is complete ({start} of {tcfg.num_train_steps} steps)."
            , flush=True)
    return finish(start)

  flops = metrics_lib.train_flops(training.model_config, tcfg.batch_size, data.max_seq_length,
                                  data.max_predictions_per_seq)
  peak = metrics_lib.peak_tflops(jax.devices()[0].device_kind)
  speed = metrics_lib.Throughput(start, tcfg.num_train_steps, tcfg.batch_size, flops,
                                 peak * 1e12 * jax.device_count() if peak else None)
  batches = _batches(data, split="train", start_step=start, **per_host)
  rng = jax.random.PRNGKey(tcfg.seed)
  total, interval_steps, pending = None, 0, None
  with _StopSignal() as stop, contextlib.ExitStack() as profiling:
    step = start
    while step < tcfg.num_train_steps:
      if step == loop.profile_start_step and is_main:
        profiling.enter_context(jax.profiler.trace(os.path.join(workdir, "profile")))
      if loop.profile_start_step >= 0 and step == loop.profile_start_step + loop.profile_num_steps:
        profiling.close()
      state, step_metrics = training.train_step(state, training.to_global(next(batches)), rng)
      # Read the previous step's metrics now, so the host never waits for the step it dispatched.
      if pending is not None:
        total, interval_steps = _consume(pending, total, interval_steps)
      pending = (step + 1, step_metrics)
      step += 1
      at_log = step % loop.log_every_steps == 0 or step == tcfg.num_train_steps
      at_save = step % loop.save_every_steps == 0 or step == tcfg.num_train_steps
      stopping = stop.should_stop(step) if (at_log or jax.process_count() == 1) else False
      if at_log or at_save or stopping:
        total, interval_steps = _consume(pending, total, interval_steps)  # NaN check before saving
        pending = None
      if at_log and total is not None:
        scalars = metrics_lib.reduce(total, interval_steps)
        rates = speed.update(step)
        writer.write(step, {**scalars, **rates}, prefix="train/")
        if is_main:
          print(metrics_lib.progress_line(step, tcfg.num_train_steps, scalars, rates), flush=True)
        total, interval_steps = None, 0
      if at_save or stopping:
        ckpt.save(step, {"params": state.params, "opt_state": state.opt_state},
                  _meta(config, training, step), force=True)
      if stopping:
        ckpt.wait()
        if is_main:
          print(f"bertjax: {stop.received or 'a stop signal on another host'} received; saved "
                f"step {step} in {ckpt.directory}. "
                "Run the same command to resume.", flush=True)
        writer.close()
        ckpt.close()
        return {}
      if loop.eval_every_steps and step % loop.eval_every_steps == 0 and (
          step != tcfg.num_train_steps):
        run_eval(step)
  return finish(tcfg.num_train_steps)


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


def _consume(pending, total, interval_steps):
  step, step_metrics = pending
  host = jax.device_get(step_metrics)
  metrics_lib.check_finite(step, {k: float(v[0]) / max(float(v[1]), 1e-9)
                                  for k, v in host.items()})
  return metrics_lib.accumulate(total, host), interval_steps + 1

