"""The fine-tuning run: `python -m bertjax.finetune --config=configs/finetune.py:TASK --workdir=DIR`.

It runs through the pre-training loop's own machinery (`loop.execute`: restore or initialise,
checkpoints, SIGTERM saves, stop agreement on pods, logs, NaN guard), with what fine-tuning adds:

- the encoder of `checkpoint.init_from` (any folder bertjax/weights/reader.py reads: a pre-training or
  fine-tuning workdir, a `convert.hf|google import` folder, a Google or Hugging Face folder), task
  heads new; or `checkpoint.random_init=True` for the same architecture and vocabulary with fresh
  weights (the comparison `make finetune` prints);
- the task's features in memory, shuffled per epoch by (seed, epoch), so a resumed run sees the
  batches an uninterrupted one would;
- an evaluation of the dev set(s) after every epoch with the task's metrics, the best checkpoint by
  the task's main metric kept in `best/` beside the latest ones in `checkpoints/`;
- at the end, predictions of the test splits (and SQuAD's dev predictions) from the best
  checkpoint in `predictions/`, `results.json`, and a one-line summary.

Workdir: config.json, task.json (bertjax/formats/taskspec.py: the label map and the rest of what
prediction and export need), checkpoints/, best/, evaluations.json, metrics.jsonl, tensorboard/,
predictions/, results.json, vocab file (copied from init_from).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Iterator, Mapping

import jax
import numpy as np

from bertjax import errors, files
from bertjax.errors import Refusal
from bertjax.finetune import families
from bertjax.finetune.job.evaluations import (TRAIN_DATA, Evaluations, features_digest,
                                              say_if_data_changed)
from bertjax.finetune.job.init_from import initialiser, resolve_model, resolve_tokenizer
from bertjax.finetune.kit.config import SearchConfig, TaskConfig
from bertjax.finetune.tasks import tasks
from bertjax.formats import taskspec as spec_lib
from bertjax.model.config import BertConfig
from bertjax.parallel import sharding, watchdog
from bertjax.training import checkpoint as checkpoint_lib, control, loop, train
from bertjax.weights import reader as weights

# Keys of the fine-tuning config before data, eval and checkpoint held them (the paths
# pre-training uses for the same things): each old spelling is refused, naming its new path.
MOVED_KEYS = {
    "init_from": "checkpoint.init_from", "random_init": "checkpoint.random_init",
    "init_from_other_vocab": "checkpoint.init_from_other_vocab",
    **{key: f"data.{key}" for key in (
        "source", "data_dir", "train_file", "dev_file", "test_file", "tfds_data_dir",
        "vocab_path", "do_lower_case", "max_seq_length", "doc_stride", "max_query_length")},
    **{key: f"eval.{key}" for key in (
        "n_best_size", "max_answer_length", "null_score_diff_threshold")},
}


# Batches ---------------------------------------------------------------------------------------

def steps_per_epoch(num_examples: int, batch_size: int) -> int:
  """Full batches per epoch (the remainder waits for the next epoch's order, as the original's
  drop_remainder): at least one."""
  return max(1, num_examples // batch_size)


def run_notes(batch_size: int, num_examples: int) -> list[str]:
  """What a legal but unusual setting does, said rather than done silently."""
  notes = []
  if batch_size > num_examples:
    notes.append(f"train.batch_size={batch_size} is larger than the {num_examples} training "
                 f"examples: each batch repeats them (up to {-(-batch_size // num_examples)} "
                 "times) and an epoch is one step; lower train.batch_size to see each example "
                 "once per step")
  return notes


def check_batch(data, batch_size: int) -> None:
  """Refuses a batch larger than a task's distinct examples where copies in one batch change what
  is learnt (TaskData.distinct): a contrastive batch's negatives are its other rows' passages."""
  if data.distinct is not None and data.distinct[0] < batch_size:
    count, what = data.distinct
    raise Refusal(f"train.batch_size={batch_size} is larger than the {count} {what}: a batch's "
                  "negatives are its other rows' passages, and a batch that repeats pairs holds "
                  "copies of a row's own positive, which are none (one pair: loss 0, nothing "
                  f"learnt). Lower train.batch_size to at most {count}, or add pairs.")


def train_batches(features: Mapping[str, np.ndarray], batch_size: int, seed: int, start_step: int,
                  process_index: int = 0, process_count: int = 1) -> Iterator[dict]:
  """This host's rows of each global batch from `start_step` on; the order of epoch e is a
  permutation drawn from (seed, e), so any step's batch is known without replaying the others."""
  n = len(next(iter(features.values())))
  if n < batch_size:
    # Repeat the examples so one batch holds each at least once (a tiny task, a test).
    reps = -(-batch_size // n)
    features = {k: np.concatenate([v] * reps) for k, v in features.items()}
    n *= reps
  per_epoch, rows = steps_per_epoch(n, batch_size), batch_size // process_count
  step, epoch, order = start_step, None, None
  while True:
    if step // per_epoch != epoch:
      epoch = step // per_epoch
      order = np.random.default_rng([seed, epoch]).permutation(n)
    # Sorted over the whole global batch before each host takes its rows, so an example's row
    # in the global batch (which its dropout masks depend on: bertjax/model/dropout.py) is the same
    # whatever the number of processes.
    at = (step % per_epoch) * batch_size
    index = np.sort(order[at:at + batch_size])[process_index * rows:(process_index + 1) * rows]
    batch = {k: v[index] for k, v in features.items()}
    batch["weight"] = np.ones(rows, np.float32)
    yield batch
    step += 1


def eval_batches(features: Mapping[str, np.ndarray], batch_size: int, process_index: int = 0,
                 process_count: int = 1) -> Iterator[dict]:
  """Every example once, in order; the last global batch is filled with weight-0 copies."""
  n = len(next(iter(features.values())))
  rows = batch_size // process_count
  for at in range(0, n, batch_size):
    index = np.arange(at + process_index * rows, at + (process_index + 1) * rows)
    weight = (index < n).astype(np.float32)
    index = np.minimum(index, n - 1)
    batch = {k: v[index] for k, v in features.items()}
    batch["weight"] = weight
    yield batch


def predict(training: train.Training, params_state, features: Mapping[str, np.ndarray],
            batch_size: int, stop: control.StopSignal | None = None
            ) -> dict[str, np.ndarray] | None:
  """The objective's outputs for every example (numpy, on every host); None if `stop` asked.
  A list of features (several inputs of their own shapes) gives a list of outputs."""
  if isinstance(features, (list, tuple)):
    parts = [predict(training, params_state, f, batch_size, stop) for f in features]
    return None if any(p is None for p in parts) else parts
  n = len(next(iter(features.values())))
  parts: dict[str, list] = {}
  for batch in eval_batches(tasks.model_features(features), batch_size, jax.process_index(),
                            jax.process_count()):
    if stop is not None and stop.during_evaluation():
      return None
    out = jax.device_get(training.predict_step(params_state, training.to_global(batch)))
    watchdog.progress()
    for k, v in out.items():
      parts.setdefault(k, []).append(np.asarray(v))
  return {k: np.concatenate(v)[:n] for k, v in parts.items()}


# The run ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class FinetuneConfig:
  """The keys of `config.train` and `config.checkpoint` fine-tuning reads, checked up front."""

  batch_size: int
  eval_batch_size: int
  num_epochs: float
  warmup_proportion: float
  log_every_steps: int
  save_every_steps: int  # 0: at the end of every epoch
  keep: int
  async_save: bool

  @classmethod
  def from_config(cls, config, searched: bool = False) -> "FinetuneConfig":
    """`searched`: a search's config, whose learning rate may be None (its trials say it)."""
    t, c, d, e = config.train, config.checkpoint, config.data, config.eval
    seq, query = d.max_seq_length, d.max_query_length
    lr_ok = (searched and t.learning_rate is None) or (t.learning_rate is not None
                                                       and t.learning_rate > 0)
    problems = [f"{k}={v} must be {why}" for k, v, ok, why in (
        # 0 would run every step and change no weight: a run that only looks like training.
        ("train.learning_rate", t.learning_rate, lr_ok, "> 0"),
        ("train.batch_size", t.batch_size, t.batch_size >= 1, ">= 1"),
        ("train.eval_batch_size", t.eval_batch_size, t.eval_batch_size >= 0,
         ">= 0 (0: train.batch_size)"),
        ("train.num_epochs", t.num_epochs, t.num_epochs > 0, "> 0"),
        ("train.warmup_proportion", t.warmup_proportion, 0 <= t.warmup_proportion <= 1,
         "in [0, 1]"),
        ("train.log_every_steps", t.log_every_steps, t.log_every_steps >= 1, ">= 1"),
        ("checkpoint.save_every_steps", c.save_every_steps, c.save_every_steps >= 0,
         ">= 0 (0: every epoch)"),
        ("checkpoint.keep", c.keep, c.keep >= 1, ">= 1"),
        # The lengths and SQuAD's numbers (every task's config holds them): 0 or less would
        # build no window, no answer or an endless loop over a context.
        ("data.max_seq_length", seq, seq >= 8, ">= 8"),
        ("data.doc_stride", d.doc_stride, d.doc_stride >= 1, ">= 1"),
        ("data.max_query_length", query,
         1 <= query <= seq - 4 or not config.task.startswith("squad"),
         f"in [1, data.max_seq_length - 4 = {seq - 4}] ([CLS] q [SEP] context [SEP])"),
        ("eval.n_best_size", e.n_best_size, e.n_best_size >= 1, ">= 1"),
        ("eval.max_answer_length", e.max_answer_length, e.max_answer_length >= 1,
         ">= 1")) if not ok]
    if problems:
      raise Refusal("Invalid config: " + "; ".join(problems))
    return cls(t.batch_size, t.eval_batch_size or t.batch_size, float(t.num_epochs),
               float(t.warmup_proportion), t.log_every_steps, c.save_every_steps, c.keep,
               c.async_save)


def train_config(config, total_steps: int, warmup: int,
                 learning_rate: float | None = None) -> train.TrainConfig:
  """The TrainConfig of a run of `total_steps` (a search's trial gives its own learning rate)."""
  t = config.train
  return train.TrainConfig(
      batch_size=t.batch_size, num_microbatches=t.num_microbatches, num_train_steps=total_steps,
      seed=t.seed, optimizer=t.optimizer,
      learning_rate=t.learning_rate if learning_rate is None else learning_rate,
      warmup_steps=warmup,
      weight_decay=t.weight_decay, adam_b1=t.adam_b1, adam_b2=t.adam_b2, adam_eps=t.adam_eps,
      bias_correction=t.bias_correction, max_grad_norm=t.max_grad_norm)


@dataclasses.dataclass
class Setup:
  """What every fine-tuning run of a config reads before its first step (one run, or the trials
  of a search: bertjax/finetune/job/search.py)."""

  ft: FinetuneConfig
  task_name: str
  source: weights.Weights | None
  tokenizer: Any
  vocab_file: str
  lower: bool
  model_config: BertConfig
  data: Any  # tasks.TaskData
  train_features: dict
  origin: str  # where the encoder comes from, for results.json
  init: loop.Initialiser | None
  train_data: str = ""  # features_digest of train_features

  def __post_init__(self):
    self.train_data = self.train_data or features_digest(self.train_features)

  @property
  def per_epoch(self) -> int:
    return steps_per_epoch(tasks.num_examples(self.train_features), self.ft.batch_size)

  def meta(self) -> dict:
    return {"task": self.task_name, "init": self.origin,
            spec_lib.META_KEY: self.data.spec.to_dict(), TRAIN_DATA: self.train_data}


def setup(config, workdir: str, ft: FinetuneConfig | None = None) -> Setup:
  """Reads init_from, the tokenizer, the model and the task's data; refuses what cannot run."""
  ft = ft or FinetuneConfig.from_config(config)
  task = TaskConfig.from_config(config)
  task_name = tasks.canonical(task.task)
  loop.check_workdir(workdir)
  init_from = config.checkpoint.init_from
  if config.checkpoint.random_init and not init_from:
    raise Refusal("checkpoint.random_init=True copies init_from's architecture and vocabulary "
                  "with fresh weights: set config.checkpoint.init_from too.")
  source = weights.inspect(init_from, what="checkpoint.init_from") if init_from else None
  tokenizer, vocab_file, lower = resolve_tokenizer(
      task.data, source, allow_other_vocab=config.checkpoint.init_from_other_vocab)
  model_config = resolve_model(config, source)
  if model_config.vocab_size < tokenizer.vocab_size:
    raise Refusal(f"The model's {model_config.vocab_size} embedding rows are fewer than the "
                  f"vocabulary's {tokenizer.vocab_size} pieces ({vocab_file}).")
  if task.data.max_seq_length > model_config.max_position_embeddings:
    raise Refusal(f"data.max_seq_length={task.data.max_seq_length} exceeds the model's "
                  f"max_position_embeddings={model_config.max_position_embeddings}.")
  data = tasks.load(task, tokenizer)
  data.notes += run_notes(ft.batch_size, tasks.num_examples(data.train))
  for note in data.notes:
    loop.say(note)
  _check_task(workdir, task_name, data.spec)
  init = None
  origin = ("random initialisation (checkpoint.random_init=True)" if config.checkpoint.random_init
            else "scratch")
  if source is not None and not config.checkpoint.random_init:
    origin, init = initialiser(source, model_config, task_name, data.spec is not None
                               and not families.get(data.spec.family).head)
  return Setup(ft, task_name, source, tokenizer, vocab_file, lower, model_config, data,
               tasks.model_features(data.train), origin, init)


def finetune(config, workdir: str) -> dict:
  """Runs (or resumes) the fine-tuning job of `config` in `workdir`; returns results.json's dict
  ({} when a stop signal ended the run early). A config whose `search` names several settings
  is a search: the command runs it (bertjax/finetune/job/search.py), this function refuses it."""
  if SearchConfig.from_config(config).wanted(config):
    raise Refusal("config.search lists settings to try (or train.learning_rate is None): a "
                  "search, which bertjax.finetune.job.search.run runs (python -m bertjax.finetune "
                  "does); run.finetune runs one setting.")
  s = setup(config, workdir)
  # Here, not in setup: a search's trials have batch sizes of their own (search.run checks them).
  check_batch(s.data, s.ft.batch_size)
  ft, task_name, data, tokenizer = s.ft, s.task_name, s.data, s.tokenizer
  vocab_file, lower, init, origin = s.vocab_file, s.lower, s.init, s.origin
  model_config, train_features = s.model_config, s.train_features
  init_from = config.checkpoint.init_from
  n_train = tasks.num_examples(train_features)
  per_epoch = s.per_epoch
  total = max(1, int(round(ft.num_epochs * per_epoch)))
  warmup = int(ft.warmup_proportion * total)
  tcfg = train_config(config, total, warmup)
  mesh_config = sharding.MeshConfig.from_dict(config.mesh)
  training = train.build(model_config, tcfg, mesh_config, objective=data.objective)
  sharding.check_batch_size(ft.eval_batch_size, training.mesh)
  schedule = control.Schedule(total_steps=total, log_every=ft.log_every_steps,
                              save_every=ft.save_every_steps or per_epoch, eval_every=per_epoch)
  loop_config = loop.LoopConfig(schedule=schedule, eval_sequences=0, profile_start_step=-1,
                                profile_num_steps=1, keep=ft.keep, async_save=ft.async_save,
                                init_from=init_from, init_from_other_vocab=False)
  expected = checkpoint_lib.Expected(model=model_config,
                                     optimizer=checkpoint_lib.optimizer_fields(tcfg),
                                     tokenizer_fingerprint=tokenizer.fingerprint, heads=True)
  meta = s.meta()
  # best/ records what the loop's checkpoints do (the model and vocabulary it was trained with),
  # so every reader of weights takes it alone (bertjax.predict's default, convert.hf export).
  evaluations = Evaluations(workdir, {**expected.meta(), **meta})
  processes = dict(process_index=jax.process_index(), process_count=jax.process_count())

  def evaluate(step, state, stop):
    scores = {}
    for k, eval_set in enumerate(data.evals):
      outputs = predict(training, state, eval_set.features, ft.eval_batch_size, stop)
      if outputs is None:
        return None
      got = eval_set.score(outputs)
      prefix = "" if len(data.evals) == 1 else f"{eval_set.name}/"
      scores.update({prefix + name: float(v) for name, v in got.items()
                     if name != "main" and isinstance(v, (int, float)) and not isinstance(v, bool)})
      if k == 0:
        scores["main"] = float(got["main"])
    watchdog.disarm()  # scoring and best/'s save are this process's own work
    evaluations.add(step, step / per_epoch, scores, state.params)
    return scores

  def accepted(start):
    evaluations.begin(start)
    if start:
      say_if_data_changed(workdir, start, meta[TRAIN_DATA])
    loop.keep_vocabulary(vocab_file, tokenizer.kind, tokenizer.fingerprint, workdir, lower)
    if jax.process_index() == 0:
      spec_lib.write(data.spec, workdir)

  job = loop.Job(
      training=training, loop=loop_config, expected=expected, meta=meta,
      batches=lambda start: train_batches(train_features, ft.batch_size, tcfg.seed, start,
                                          **processes),
      evaluate=evaluate, seqs_per_step=ft.batch_size, init=init,
      eval_owed=lambda step: step % per_epoch == 0 and not evaluations.done(step),
      on_accepted=accepted)
  loop.say(f"{task_name}: {n_train} training examples, {per_epoch} steps per epoch, {total} "
           f"steps ({ft.num_epochs:g} epochs), warmup {warmup}; dev: "
           + ", ".join(f"{e.name} {e.size or tasks.num_examples(e.features)}"
                       for e in data.evals))
  try:
    state, final = loop.execute(config, workdir, job)
    if not final:
      return {}
    with loop.disk_full_said(workdir):  # results.json and the predictions
      return finish(config, workdir, training, data, evaluations, state, ft, task_name, origin)
  finally:
    evaluations.close()


def _plain(report: Mapping[str, Any]) -> dict:
  """A report as JSON holds it (numpy numbers to Python's; "main" dropped: it is in `best`)."""
  return json.loads(json.dumps({k: v for k, v in report.items() if k != "main"},
                               default=lambda x: x.item() if hasattr(x, "item") else str(x)))


def _check_task(workdir: str, task_name: str, spec: spec_lib.TaskSpec | None = None) -> None:
  """A workdir holds one task: resuming another task's run would put a new head on its state (or
  give its label ids other names)."""
  path = os.path.join(workdir, "results.json")
  config_path = os.path.join(workdir, "config.json")
  for p in (path, config_path):
    if files.exists(p):
      try:
        recorded = files.read_json(p).get("task")
      except errors.DamagedFileError as err:
        # Both are rewritten by this run (config.json at its start, results.json at its end): one
        # cut short by a kill is rebuilt, not trusted.
        loop.say(f"{str(err).split(': it was')[0]}; it is rewritten by this run.")
        continue
      if recorded and tasks.canonical(recorded) != task_name:
        raise Refusal(f"--workdir={workdir} holds a {recorded} run; fine-tuning {task_name} "
                      "needs its own workdir.")
  try:
    recorded_spec = spec_lib.read(workdir)
  except errors.DamagedFileError as err:
    # Written again when this run starts (the checkpoints keep their own copy).
    loop.say(f"{str(err).split(': it was')[0]}; it is rewritten by this run.")
    recorded_spec = None
  if spec is not None and recorded_spec is not None and recorded_spec.labels != spec.labels:
    raise Refusal(f"--workdir={workdir} holds a run with the labels {list(recorded_spec.labels)}"
                  f"; these files give {list(spec.labels)}. Fine-tune them in a workdir of "
                  "their own (or set config.data.labels to the run's).")
  vectors = lambda s: (s.pooling, s.normalize)  # what an embeddings run's vectors mean
  if spec is not None and recorded_spec is not None and vectors(recorded_spec) != vectors(spec):
    raise Refusal(f"--workdir={workdir} holds a run of vectors (pooling, normalize) = "
                  f"{vectors(recorded_spec)}; this config asks {vectors(spec)}. Set "
                  "config.contrastive.pooling and normalize as the run had them, or use a "
                  "workdir of its own.")


def finish(config, workdir, training, data: tasks.TaskData, evaluations: Evaluations, state, ft,
           task_name: str, origin: str) -> dict:
  """What a run writes at its end, from its best checkpoint: the reports, the predictions and
  results.json (a search calls it with its winner's)."""
  best = evaluations.best_record()
  params_state = state
  if best is not None and best["step"] != int(jax.device_get(state.step)):
    if best["step"] in evaluations.best.all_steps():
      items, _ = evaluations.best.restore(best["step"], {"params": checkpoint_lib.abstract_like(
          state.params)})
      params_state = state.replace(params=items["params"])
    else:
      # Only after a rerun on another mesh scored an epoch below its first run's score: the
      # best weights were replaced by that epoch's and then dropped with it.
      data.notes.append(f"the best epoch's checkpoint (step {best['step']}) is gone; "
                        "predictions come from the last step")
      loop.say(data.notes[-1])
  written, reports = [], {}
  out_dir = os.path.join(workdir, "predictions")
  for eval_set in data.evals:
    if eval_set.report is not None:
      outputs = predict(training, params_state, eval_set.features, ft.eval_batch_size)
      reports[f"{eval_set.name}_report"] = _plain(eval_set.report(outputs))
  for predict_set in data.predicts:
    outputs = predict(training, params_state, predict_set.features, ft.eval_batch_size)
    if predict_set.report is not None:
      reports[f"{predict_set.name}_report"] = _plain(predict_set.report(outputs))
    if jax.process_index() == 0:
      written += predict_set.write(outputs, out_dir)
  final = evaluations.records[-1]["scores"] if evaluations.records else {}
  results = {"task": task_name, "init": origin, "main_metric": data.main_metric,
             "labels": list(data.spec.labels), "best": best, "final": final,
             **reports, "evaluations": evaluations.records, "predictions": written,
             "notes": data.notes}
  if jax.process_index() == 0:
    files.write_json(os.path.join(workdir, "results.json"), results)
    where = f" | predictions in {out_dir}" if written else ""
    if best is not None:
      print(f"{task_name}: best dev {data.main_metric} {best['scores']['main']:.4f} at epoch "
            f"{best['epoch']:g} (step {best['step']}); last {final.get('main', float('nan')):.4f}"
            f" | init: {origin} | {os.path.join(workdir, 'results.json')}{where}", flush=True)
  return results
