"""Fine-tuning settings chosen on dev, as the paper chose them: `config.search` lists values of
`train` keys (learning rate, epochs, warmup, weight decay, seeds as restarts, batch size); every
combination is a trial, scored on dev after each of its epochs, and the best is kept.

    python -m bertjax.finetune --config=configs/finetune.py:classification ... \
      --config.search.learning_rate=1e-4,3e-4,1e-3 --config.search.seed=0,1,2 --workdir=DIR

The trials of one batch size train together as one compiled program (bertjax/finetune/job/trials.py),
in as few programs as memory allows (`trials_per_program`, or decided from the estimate of
trials.per_trial_bytes against the host's or the devices' free memory). Settings are ranked by
the median, over their seeds, of each trial's best dev score (a trial's best epoch, as a run alone
keeps); the winner is the best seed of the best settings, the paper's "best on dev" over restarts.

The workdir holds what a run alone leaves (best/ is the winner's best epoch, so `bertjax.predict`
and the exports read it unchanged; results.json, predictions/), and beside it `search.json` (every
trial's scores per epoch, the median and range over seeds per setting, the winner), `search.svg`
(dev score against the settings, a point per seed) and `search/` (each program's checkpoints, each
trial's best epoch). A killed search resumes where it stopped: the same command again.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import statistics
import time
from typing import Any

import jax
import numpy as np

from bertjax import errors, files
from bertjax.errors import Refusal
from bertjax.finetune.job import run as run_lib, svg, trials as trials_lib
from bertjax.finetune.job.evaluations import Evaluations
from bertjax.finetune.kit.config import AUTO, SEARCH_KEYS, SearchConfig
from bertjax.finetune.tasks import tasks
from bertjax.formats import taskspec as spec_lib
from bertjax.parallel import sharding
from bertjax.training import checkpoint as checkpoint_lib, control, loop, train
from bertjax.weights import reader as weights

SEARCH_FILE = "search.json"


def auto_learning_rates(model_config) -> tuple[float, ...]:
  """The rates tried where train.learning_rate is None: the paper's four (2e-5 to 5e-5, Appendix
  A.3) for an encoder of BERT-Base's width or more; for a narrower one, which takes larger rates,
  4 rates a factor 2 apart from 2e-5 x 768 / hidden, so the span moves up with the width and is
  wider than the paper's. A 128-wide encoder (configs/tiny.py) gets 1.2e-4 to 9.6e-4: on the
  routing example its best rate of a wide search (3e-5 to 1e-3) was 1e-3, on NEXT 3e-5 (1e-4 and
  3e-4 within a point) (docs/finetuning.md#settings-chosen-on-dev)."""
  if model_config.hidden_size >= 768:
    return (2e-5, 3e-5, 4e-5, 5e-5)
  scale = 768 / model_config.hidden_size
  return tuple(float(f"{r * scale:.2g}") for r in (2e-5, 4e-5, 8e-5, 1.6e-4))


def expand(config, search: SearchConfig, model_config) -> list[trials_lib.Trial]:
  """Every combination of the listed values (the train section's one value elsewhere)."""
  t = config.train
  values = dict(search.values)
  if values.get("learning_rate") == AUTO or (t.learning_rate is None
                                             and "learning_rate" not in values):
    values["learning_rate"] = auto_learning_rates(model_config)
  axes = {key: values.get(key, (t[key],)) for key in SEARCH_KEYS}
  for key, listed in axes.items():
    bad = [v for v in listed if v is None or not np.isfinite(v) or (
        v <= 0 if key in ("learning_rate", "num_epochs", "batch_size") else v < 0)]
    if bad or (key == "warmup_proportion" and max(listed) > 1):
      raise Refusal(f"config.search.{key}: {bad or listed} out of range (learning_rate, "
                    "num_epochs, batch_size > 0; warmup_proportion in [0, 1]; weight_decay, "
                    "seed >= 0).")
  combos = itertools.product(*(axes[k] for k in SEARCH_KEYS))
  return [trials_lib.Trial(index=k, **{key: (int(v) if key in ("seed", "batch_size") else
                                              float(v)) for key, v in zip(SEARCH_KEYS, combo)})
          for k, combo in enumerate(combos)]


def available_bytes() -> tuple[int, str]:
  """Memory the trials may take, and where it was read: the devices' limits where jax reports
  them (GPU, TPU), else the host's available memory (a CPU)."""
  limits = [d.memory_stats().get("bytes_limit", 0) if d.memory_stats() else 0
            for d in jax.local_devices()]
  if all(limits) and jax.default_backend() != "cpu":
    return int(sum(limits)), f"{len(limits)} {jax.default_backend()} device(s)"
  with open("/proc/meminfo", encoding="ascii") as f:
    free = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))
  return free, "the host's available memory"


def program_size(search: SearchConfig, count: int, one_trial: int, budget: int, where: str) -> int:
  """Trials per program: the configured number (refused, before any work, where it does not fit)
  or as many as fit in 70% of `budget` (the rest for the input, the compiler and the host)."""
  fits = int(0.7 * budget // max(one_trial, 1))
  mb = lambda b: f"{b / 2**20:,.0f} MB"
  if fits < 1:
    raise Refusal(f"One trial needs about {mb(one_trial)} (parameters, optimizer and "
                  f"activations, trials.per_trial_bytes) and {where} has {mb(budget)}: none "
                  "fits. Lower train.batch_size or data.max_seq_length.")
  if search.trials_per_program > fits:
    raise Refusal(f"config.search.trials_per_program={search.trials_per_program}: one trial "
                  f"needs about {mb(one_trial)} and {where} has {mb(budget)}, so at most "
                  f"{fits} fit in a program; set {fits} or less (0: decided for you).")
  return min(count, search.trials_per_program or fits)


def groups(all_trials, size: int) -> list[list[trials_lib.Trial]]:
  """Programs: trials of one batch size together, at most `size` each."""
  out = []
  for batch_size in sorted({t.batch_size for t in all_trials}):
    same = [t for t in all_trials if t.batch_size == batch_size]
    out += [same[at:at + size] for at in range(0, len(same), size)]
  return out


def _grid_record(all_trials) -> list[dict]:
  return [{"index": t.index, **t.settings(), "seed": t.seed} for t in all_trials]


def _check_same_grid(workdir: str, record: list[dict]) -> None:
  path = os.path.join(workdir, SEARCH_FILE)
  if files.exists(path):
    try:
      found = files.read_json(path, "the search's record").get("grid")
    except errors.DamagedFileError:
      found = None  # rewritten below; the programs' own checkpoints say what they hold
    if found is not None and found != record:
      raise Refusal(f"--workdir={workdir} holds a search over other settings "
                    f"({len(found)} trials); a search of {len(record)} trials needs its own "
                    "workdir (or the same config.search as before, to resume).")


def _run_program(config, s: run_lib.Setup, group, number: int, workdir: str, mesh_config,
                 records: dict[int, Evaluations]) -> bool:
  """Trains and evaluates one program's trials (resuming its checkpoints); False if stopped."""
  ft, data, per_epoch = s.ft, s.data, s.per_epoch
  total = max(t.total_steps(per_epoch) for t in group)
  first = group[0]
  base = dataclasses.replace(run_lib.train_config(config, total, 0),
                             batch_size=first.batch_size, learning_rate=first.learning_rate,
                             weight_decay=first.weight_decay, seed=first.seed)
  mesh = sharding.create_mesh(mesh_config)
  training = trials_lib.build(s.model_config, base, group, per_epoch, mesh, data.objective)
  directory = os.path.join(workdir, "search", f"program-{number}")
  expected = checkpoint_lib.Expected(model=s.model_config,
                                     optimizer=checkpoint_lib.optimizer_fields(base),
                                     tokenizer_fingerprint=s.tokenizer.fingerprint, heads=True)
  schedule = control.Schedule(total_steps=total, log_every=ft.log_every_steps,
                              save_every=per_epoch, eval_every=per_epoch)
  loop_config = loop.LoopConfig(schedule=schedule, eval_sequences=0, profile_start_step=-1,
                                profile_num_steps=1, keep=1, async_save=ft.async_save,
                                init_from=config.checkpoint.init_from, init_from_other_vocab=False)
  init = None
  if s.init is not None:
    source = s.source
    init = loop.Initialiser(s.init.origin, trials_lib.broadcast_loader(
        lambda like: weights.read(source, like={weights.ENCODER: like})[weights.ENCODER],
        weights.ENCODER))
  evaluated: dict[int, dict] = {}

  def evaluate(step, state, stop):
    if step in evaluated:
      return evaluated[step]
    due = [(k, t) for k, t in enumerate(group)
           if not records[t.index].done(min(step, t.total_steps(per_epoch)))]
    outputs = []
    for eval_set in data.evals:
      got = _predict_all(training, state, eval_set.features, ft.eval_batch_size, stop)
      if got is None:
        return None
      outputs.append(got)
    best = []
    for k, t in due:
      scores = {}
      for m, eval_set in enumerate(data.evals):
        got = eval_set.score(_trial_outputs(outputs[m], k))
        prefix = "" if len(data.evals) == 1 else f"{eval_set.name}/"
        scores.update({prefix + name: float(v) for name, v in got.items() if name != "main"
                       and isinstance(v, (int, float)) and not isinstance(v, bool)})
        if m == 0:
          scores["main"] = float(got["main"])
      at = min(step, t.total_steps(per_epoch))
      records[t.index].add(at, at / per_epoch, scores,
                           trials_lib.trial_params(state.params, k))
      best.append(scores["main"])
    finite = [b for b in best if np.isfinite(b)]
    evaluated[step] = {"trials scored": float(len(best)),
                       "best main": max(finite) if finite else float("nan")}
    return evaluated[step]

  def batches(start):
    return trials_lib.stacked_batches([
        run_lib.train_batches(s.train_features, t.batch_size, t.seed, start) for t in group])

  meta = {**s.meta(), "trials": _grid_record(group)}
  job = loop.Job(training=training, loop=loop_config, expected=expected, meta=meta,
                 batches=batches, evaluate=evaluate, seqs_per_step=first.batch_size * len(group),
                 init=init,
                 eval_owed=lambda step: step % per_epoch == 0 and any(
                     not records[t.index].done(min(step, t.total_steps(per_epoch)))
                     for t in group),
                 on_accepted=lambda start: [records[t.index].begin(start) for t in group])
  loop.say(f"search program {number}: {len(group)} trial(s) of batch {first.batch_size} as one "
           f"program, {total} steps ({per_epoch} per epoch)")
  _, final = loop.execute(config, directory, job)
  return bool(final)


def _predict_all(training, state, features, batch_size, stop):
  """Every trial's outputs on every example: {name: [T, N, ...]} (a list of them for a list of
  features: several inputs); None if `stop` asked."""
  if isinstance(features, (list, tuple)):
    parts = [_predict_all(training, state, f, batch_size, stop) for f in features]
    return None if any(p is None for p in parts) else parts
  n = len(next(iter(features.values())))
  parts: dict[str, list] = {}
  for batch in run_lib.eval_batches(tasks.model_features(features), batch_size):
    if stop is not None and stop.during_evaluation():
      return None
    for k, v in jax.device_get(training.predict_step(state, batch)).items():
      parts.setdefault(k, []).append(np.asarray(v))
  return {k: np.concatenate(v, axis=1)[:, :n] for k, v in parts.items()}


def _trial_outputs(outputs, k: int):
  """Trial k's share of _predict_all's outputs."""
  if isinstance(outputs, list):
    return [_trial_outputs(o, k) for o in outputs]
  return {name: v[k] for name, v in outputs.items()}


def summarise(all_trials, records: dict[int, Evaluations], main_metric: str) -> dict:
  """search.json's figures: each trial's epochs and best, each setting's median and range over
  its seeds, the winner."""
  rows = []
  for t in all_trials:
    best = records[t.index].best_record()
    rows.append({"index": t.index, **t.settings(), "seed": t.seed,
                 "best": best, "epochs": records[t.index].records})
  by = {}
  for row, t in zip(rows, all_trials):
    key = json.dumps(t.settings(), sort_keys=True)
    score = row["best"]["scores"]["main"] if row["best"] else float("nan")
    by.setdefault(key, {"settings": t.settings(), "seeds": [], "scores": [], "trials": []})
    entry = by[key]
    entry["seeds"].append(t.seed)
    entry["scores"].append(score)
    entry["trials"].append(t.index)
  settings = []
  for entry in by.values():
    finite = [x for x in entry["scores"] if np.isfinite(x)]
    entry.update(median=statistics.median(finite) if finite else None,
                 min=min(finite) if finite else None, max=max(finite) if finite else None)
    settings.append(entry)
  ranked = sorted((e for e in settings if e["median"] is not None),
                  key=lambda e: -e["median"])
  if not ranked:
    raise Refusal("Every trial of the search diverged or scored NaN on dev: lower the "
                  "learning rates (config.search.learning_rate).")
  top = ranked[0]
  winner = max(zip(top["scores"], top["trials"]),
               key=lambda x: x[0] if np.isfinite(x[0]) else -np.inf)[1]
  return {"main_metric": main_metric, "grid": _grid_record(all_trials), "trials": rows,
          "settings": settings, "winner": {"index": winner, **top["settings"],
                                           "seed": all_trials[winner].seed,
                                           "median": top["median"], "min": top["min"],
                                           "max": top["max"]}}


def finetune(config, workdir: str) -> dict:
  """What `python -m bertjax.finetune` runs: the search `config.search` lists (or the automatic
  learning rates, where train.learning_rate is None), else the one run of the config."""
  if SearchConfig.from_config(config).wanted(config):
    return run(config, workdir)
  return run_lib.finetune(config, workdir)


def run(config, workdir: str) -> dict:
  """Runs (or resumes) the search of `config` in `workdir`; returns results.json's dict (the
  winner's, as a run alone writes it, with `search` added); {} when stopped early."""
  if jax.process_count() > 1:
    raise Refusal("A search runs in one process (its trials spread over that host's devices); "
                  f"this is process {jax.process_index()} of {jax.process_count()}. Run it on "
                  "one host, or fine-tune single settings across the pod.")
  search = SearchConfig.from_config(config)
  ft = run_lib.FinetuneConfig.from_config(config, searched=True)
  s = run_lib.setup(config, workdir, ft)
  all_trials = expand(config, search, s.model_config)
  run_lib.check_batch(s.data, max(t.batch_size for t in all_trials))
  _check_same_grid(workdir, _grid_record(all_trials))
  base = run_lib.train_config(config, 1, 0, learning_rate=all_trials[0].learning_rate)
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(
      train.build(s.model_config, base,
                  sharding.MeshConfig(ici_data=1, dcn_data=1), devices=[jax.devices()[0]],
                  objective=s.data.objective).abstract_state.params))
  budget, where = available_bytes()
  if search.memory_gb:
    budget, where = int(search.memory_gb * 2**30), f"config.search.memory_gb={search.memory_gb:g}"
  seq = tasks.tokens_per_example(s.train_features)
  one = max(trials_lib.per_trial_bytes(s.model_config, t.batch_size, seq, n_params)
            for t in all_trials)
  size = program_size(search, len(all_trials), one, budget, where)
  programs = groups(all_trials, size)
  loop.say(f"search: {len(all_trials)} trial(s) in {len(programs)} program(s) of up to {size} "
           f"(one trial ~{one / 2**20:,.0f} MB of {budget / 2**20:,.0f} MB: {where})")
  if jax.process_index() == 0:
    files.makedirs(workdir)
    files.write_json(os.path.join(workdir, SEARCH_FILE), {"grid": _grid_record(all_trials)})
  meta_base = {**checkpoint_lib.Expected(
      model=s.model_config, optimizer=checkpoint_lib.optimizer_fields(base),
      tokenizer_fingerprint=s.tokenizer.fingerprint).meta(), **s.meta()}
  records = {t.index: Evaluations(
      os.path.join(workdir, "search", f"trial-{t.index}"), {**meta_base, "trial": t.settings(),
                                                             "seed": t.seed}) for t in all_trials}
  mesh_config = sharding.MeshConfig.from_dict(config.mesh)
  timings = []
  try:
    for number, group in enumerate(programs):
      began = time.perf_counter()
      if not _run_program(config, s, group, number, workdir, mesh_config, records):
        return {}
      timings.append({"program": number, "trials": [t.index for t in group],
                      "seconds": round(time.perf_counter() - began, 1)})
    summary = summarise(all_trials, records, s.data.main_metric)
    summary["programs"] = timings
    results = _keep_winner(config, workdir, s, all_trials, records, summary, meta_base)
  finally:
    for r in records.values():
      r.close()
  return results


def _keep_winner(config, workdir, s: run_lib.Setup, all_trials, records, summary, meta_base):
  """best/ <- the winner's best epoch; then what a run alone writes at its end (predictions,
  results.json) from it, with the search's figures added; search.json and search.svg."""
  winner = all_trials[summary["winner"]["index"]]
  record = records[winner.index]
  best = record.best_record()
  total = winner.total_steps(s.per_epoch)
  tcfg = dataclasses.replace(run_lib.train_config(config, total, winner.warmup_steps(s.per_epoch),
                                                  learning_rate=winner.learning_rate),
                             batch_size=winner.batch_size, weight_decay=winner.weight_decay,
                             seed=winner.seed)
  training = train.build(s.model_config, tcfg, sharding.MeshConfig.from_dict(config.mesh),
                         objective=s.data.objective)
  items, _ = record.best.restore(best["step"], {"params": checkpoint_lib.abstract_like(
      training.abstract_state.params)})
  kept = Evaluations(workdir, {**meta_base, "trial": winner.settings(),
                                       "seed": winner.seed})
  try:
    kept.adopt(record.records, best, items["params"])
    if jax.process_index() == 0:
      loop.keep_vocabulary(s.vocab_file, s.tokenizer.kind, s.tokenizer.fingerprint, workdir,
                           s.lower)
      spec_lib.write(s.data.spec, workdir)
    ft = dataclasses.replace(s.ft, batch_size=winner.batch_size)
    # A state to hand `finish`: its step (-1) is no evaluated one, so finish reads best/.
    state = training.init_state(train.rng_streams(winner.seed)[0]).replace(step=np.int32(-1))
    results = run_lib.finish(config, workdir, training, s.data, kept, state, ft, s.task_name,
                             s.origin)
  finally:
    kept.close()
  results["search"] = {k: v for k, v in summary.items() if k != "trials"}
  if jax.process_index() == 0:
    files.write_json(os.path.join(workdir, "results.json"), results)
    files.write_json(os.path.join(workdir, SEARCH_FILE), summary)
    files.write_text(os.path.join(workdir, "search.svg"), svg.search_picture(summary))
    w = summary["winner"]
    seeds = next(e["seeds"] for e in summary["settings"] if winner.index in e["trials"])
    print(f"search: {len(all_trials)} trials; best on dev: {winner.label()} ({s.data.main_metric}"
          f" {best['scores']['main']:.4f}; over its {len(seeds)} seed(s)"
          f" median {w['median']:.4f}, range {w['min']:.4f}-{w['max']:.4f}) | "
          f"{os.path.join(workdir, SEARCH_FILE)}, {os.path.join(workdir, 'search.svg')}",
          flush=True)
  return results
