"""Settings chosen on dev (bertjax/finetune/job/search.py, trials.py): a trial of a search equals the
same settings run alone; the winner is the best on dev; a stopped search resumes to the same end;
bad grids are refused before any work."""

import json
import os
import signal
import threading

import numpy as np
import pytest

from bertjax.finetune.job import run, search, trials as trials_lib
from bertjax.finetune.kit import config as ft_config
import finetune_fixtures as fx
from test_finetune_custom import custom_config, route_rows, write_csv


# One program of 4 trials: 2 rates x 2 seeds, 2 epochs of 8 steps.
GRID = {"learning_rate": "1e-3,3e-4", "seed": "0,1"}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  root = tmp_path_factory.mktemp("search")
  pretrained = fx.pretrain(str(root / "pre"))
  train = write_csv(root / "train.csv", route_rows(128, 0))
  dev = write_csv(root / "dev.csv", route_rows(32, 1))
  return root, pretrained, train, dev


def grid_config(files, **grid):
  _, pretrained, train, dev = files
  config = custom_config("classification", pretrained, train, dev)
  config.train.num_epochs = 2
  config.train.log_every_steps = 8
  # A warmup of 7 of the 16 steps: 1/7 rounds, so a rate computed from a Python warmup and one
  # from a trial's traced warmup could part (they did, before optimizer.learning_rate_schedule's
  # barrier); 1 step, or a power of 2, would hide it.
  config.train.warmup_proportion = 0.45
  for key, value in (grid or GRID).items():
    config.search[key] = value
  return config


@pytest.fixture(scope="module")
def grid(files):
  workdir = str(files[0] / "grid")
  return workdir, search.finetune(grid_config(files), workdir)


def read(path):
  with open(path) as f:
    return json.load(f)


def test_a_trial_in_the_grid_equals_the_same_settings_run_alone(files, grid):
  workdir, results = grid
  summary = read(os.path.join(workdir, search.SEARCH_FILE))
  trial = next(t for t in summary["trials"] if t["learning_rate"] == 3e-4 and t["seed"] == 1)
  config = grid_config(files)
  config.search.learning_rate = config.search.seed = ""
  config.train.learning_rate, config.train.seed = 3e-4, 1
  alone = run.finetune(config, str(files[0] / "alone"))
  # Each epoch's dev scores: the same examples, in the same order, with the same masks.
  ours = [(e["step"], e["scores"]) for e in trial["epochs"]]
  theirs = [(e["step"], e["scores"]) for e in alone["evaluations"]]
  assert [s for s, _ in ours] == [s for s, _ in theirs] == [8, 16]
  for (_, a), (_, b) in zip(ours, theirs):
    assert a.keys() == b.keys()
    for k in a:  # a vmapped matmul may sum in another order: scores within one example's worth
      assert a[k] == pytest.approx(b[k], abs=1.5 / 32), (k, a, b)
  # The weights of the trial's best epoch against the run's: the same bits.
  from bertjax.weights import reader as weights  # pylint: disable=import-outside-toplevel
  mine = weights.read(weights.inspect_trained(
      os.path.join(workdir, "search", f"trial-{trial['index']}")))
  alone_params = weights.read(weights.inspect_trained(str(files[0] / "alone")))
  # Within float rounding, as a run on another mesh (tests/test_finetune_run.py): the trial runs
  # in the body of a loop over trials (lax.map), the run alone as a program of its own, and XLA
  # may fuse and vectorise the two differently (the bits agreed on two x86 CPUs; no construction
  # promises it). A wrong batch, mask or rate moves the weights far more: the other seed's trial
  # is checked to lie outside the tolerance. The rate itself, whose last bit once differed between
  # a trial and a run, is held to the bit by tests/test_optimizer.py.
  close = lambda a, b: all(np.allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=2e-5)
                           for x, y in zip(jax_leaves(a), jax_leaves(b), strict=True))
  assert close(mine, alone_params)
  other = next(t for t in summary["trials"] if t["learning_rate"] == 3e-4 and t["seed"] == 0)
  assert not close(alone_params, weights.read(weights.inspect_trained(
      os.path.join(workdir, "search", f"trial-{other['index']}"))))


def jax_leaves(tree):
  import jax  # pylint: disable=import-outside-toplevel
  return jax.tree.leaves(tree)


def test_the_winner_is_the_best_on_dev_and_the_workdir_is_a_run_of_it(grid):
  workdir, results = grid
  summary = read(os.path.join(workdir, search.SEARCH_FILE))
  best = {t["index"]: t["best"]["scores"]["main"] for t in summary["trials"]}
  medians = {}
  for t in summary["trials"]:
    medians.setdefault(t["learning_rate"], []).append(best[t["index"]])
  top_rate = max(medians, key=lambda r: np.median(medians[r]))
  w = summary["winner"]
  assert w["learning_rate"] == top_rate
  assert best[w["index"]] == max(best[t["index"]] for t in summary["trials"]
                                 if t["learning_rate"] == top_rate)
  assert w["median"] == pytest.approx(np.median(medians[top_rate]))
  assert (w["min"], w["max"]) == (min(medians[top_rate]), max(medians[top_rate]))
  # The workdir reads as the winner's run: best/ its best epoch, results.json its scores.
  assert results["best"]["scores"]["main"] == best[w["index"]]
  from bertjax.predict import predictor as predict_lib  # pylint: disable=import-outside-toplevel
  assert predict_lib.Predictor.from_workdir(workdir)(["refund please"])[0]["label"]
  assert os.path.getsize(os.path.join(workdir, "search.svg")) > 500
  assert "search" in results and results["search"]["winner"]["index"] == w["index"]


def test_a_stopped_search_resumes_to_the_same_end(files, grid, monkeypatch):
  """SIGTERM after the first epoch's evaluation: the search saves and returns; the same call
  again ends with every trial's scores as the uninterrupted grid's."""
  workdir = str(files[0] / "stopped")
  real_add = run.Evaluations.add
  fired = []

  def add_then_stop(self, step, *args, **kwargs):
    real_add(self, step, *args, **kwargs)
    if not fired:
      fired.append(step)
      threading.Timer(0, os.kill, (os.getpid(), signal.SIGTERM)).start()
      threading.Event().wait(0.2)
  monkeypatch.setattr(run.Evaluations, "add", add_then_stop)
  assert search.finetune(grid_config(files), workdir) == {}
  monkeypatch.setattr(run.Evaluations, "add", real_add)
  resumed = search.finetune(grid_config(files), workdir)
  straight = read(os.path.join(grid[0], search.SEARCH_FILE))
  again = read(os.path.join(workdir, search.SEARCH_FILE))
  assert [[e["scores"] for e in t["epochs"]] for t in again["trials"]] == \
      [[e["scores"] for e in t["epochs"]] for t in straight["trials"]]
  assert again["winner"] == straight["winner"]
  assert resumed["best"] == grid[1]["best"]


def test_the_summary_ranks_settings_by_their_median_over_seeds():
  trials = [trials_lib.Trial(k, lr, 2.0, 0.1, 0.01, seed, 16)
            for k, (lr, seed) in enumerate([(a, b) for a in (1e-4, 1e-3) for b in (0, 1, 2)])]
  planted = [0.50, 0.90, 0.52, 0.70, 0.71, 0.69]  # 1e-4 has the best single seed, not median

  class Record:
    def __init__(self, score):
      self.records = [{"step": 8, "epoch": 1.0, "scores": {"main": score}}]

    def best_record(self):
      return self.records[0]
  summary = search.summarise(trials, {t.index: Record(s) for t, s in zip(trials, planted)},
                             "accuracy")
  w = summary["winner"]
  assert (w["learning_rate"], w["index"], w["median"]) == (1e-3, 4, 0.70)
  assert (w["min"], w["max"]) == (0.69, 0.71)
  planted[1] = float("nan")  # a diverged trial never wins, and leaves its setting's median
  summary = search.summarise(trials, {t.index: Record(s) for t, s in zip(trials, planted)}, "a")
  assert summary["winner"]["index"] == 4
  with pytest.raises(ValueError, match="Every trial of the search diverged"):
    search.summarise(trials[:1], {0: Record(float("nan"))}, "a")


@pytest.mark.parametrize("key, value, message", [
    ("learning_rate", ",", r"config.search.learning_rate=',' names no value"),
    ("learning_rate", "1e-4,fast", r"config.search.learning_rate: 'fast' is not a number"),
    ("seed", "0,1.5", r"config.search.seed: '1.5' is not a whole number"),
    ("num_epochs", "2,2", r"names a value twice"),
])
def test_bad_grids_are_refused(key, value, message):
  from bertjax.configs import finetune as finetune_config  # pylint: disable=import-outside-toplevel
  config = finetune_config.get_config("classification")
  config.search[key] = value
  with pytest.raises(ValueError, match=message):
    ft_config.SearchConfig.from_config(config)


def test_a_program_larger_than_memory_is_refused_with_the_largest_that_fits():
  from bertjax.configs import finetune as finetune_config  # pylint: disable=import-outside-toplevel
  config = finetune_config.get_config("classification")
  config.search.trials_per_program = 12
  s = ft_config.SearchConfig.from_config(config)
  with pytest.raises(ValueError, match=r"trials_per_program=12: one trial needs about 100 MB and "
                     r"here has 1,000 MB, so at most 7 fit in a program; set 7 or less"):
    search.program_size(s, 12, 100 * 2**20, 1000 * 2**20, "here")
  config.search.trials_per_program = 0
  s = ft_config.SearchConfig.from_config(config)
  assert search.program_size(s, 12, 100 * 2**20, 1000 * 2**20, "here") == 7
  assert [len(g) for g in search.groups(
      [trials_lib.Trial(k, 1e-4, 1.0, 0.1, 0.0, k, 16 if k < 9 else 32) for k in range(12)], 7)
  ] == [7, 2, 3]
  with pytest.raises(ValueError, match="none fits"):
    search.program_size(s, 12, 2000 * 2**20, 1000 * 2**20, "here")


def test_no_learning_rate_means_rates_chosen_on_dev_scaled_to_the_width():
  from bertjax.configs import finetune as finetune_config  # pylint: disable=import-outside-toplevel
  from bertjax.model.config import BertConfig  # pylint: disable=import-outside-toplevel
  config = finetune_config.get_config("classification")
  assert config.train.learning_rate is None  # one's own task: no rate known in advance
  s = ft_config.SearchConfig.from_config(config)
  assert s.wanted(config)
  tiny = BertConfig(hidden_size=128, num_heads=2, intermediate_size=512)
  rates = [t.learning_rate for t in search.expand(config, s, tiny)]
  assert rates == [1.2e-4, 2.4e-4, 4.8e-4, 9.6e-4]  # around the 3e-4 to 1e-3 a 128-wide one took
  base = BertConfig(hidden_size=768, num_heads=12, intermediate_size=3072)
  assert [t.learning_rate for t in search.expand(config, s, base)] == [2e-5, 3e-5, 4e-5, 5e-5]
  config.train.learning_rate = 3e-4  # given: that rate, one run
  assert not ft_config.SearchConfig.from_config(config).wanted(config)
  config.search.learning_rate = "auto"  # ... unless the scaled rates are asked for by name
  s = ft_config.SearchConfig.from_config(config)
  assert s.wanted(config)
  assert [t.learning_rate for t in search.expand(config, s, tiny)] == rates
  config.search.learning_rate = ""
  with pytest.raises(ValueError, match="a search, which bertjax.finetune.job.search.run runs"):
    config.train.learning_rate = None
    run.finetune(config, "/nonexistent")
  assert finetune_config.get_config("mrpc").train.learning_rate == 2e-5  # benchmarks: the paper's


def test_the_trials_program_compiles_ahead_of_time_and_grows_with_the_trials():
  """bertjax.finetune.search_aot's compile (on 4 CPU devices here; on a TPU slice's compile-only
  devices there): memory per device grows with the trials a device holds."""
  import jax  # pylint: disable=import-outside-toplevel
  from bertjax import aot  # pylint: disable=import-outside-toplevel
  from bertjax.finetune import search_aot  # pylint: disable=import-outside-toplevel
  from bertjax.model.config import BertConfig  # pylint: disable=import-outside-toplevel
  config = BertConfig(vocab_size=128, hidden_size=32, num_layers=1, num_heads=2,
                      intermediate_size=64, max_position_embeddings=32)
  # Side by side, as on a TPU (a CPU's own program runs the trials one after another).
  sizes = [aot.Memory.of(search_aot.compile_trials(config, jax.devices()[:4], t, 8, 32,
                                                   vectorize=True)).total for t in (4, 8)]
  assert sizes[1] > 1.5 * sizes[0], sizes


def test_one_runs_step_compiles_ahead_of_time_and_grows_with_the_length():
  """search_aot --run: one fine-tuning run's step of a modern model (its ModernBERT head), the
  batch over 4 devices; its memory per device grows with the rows' length."""
  import jax  # pylint: disable=import-outside-toplevel
  from bertjax import aot  # pylint: disable=import-outside-toplevel
  from bertjax.configs import modern_tiny  # pylint: disable=import-outside-toplevel
  from bertjax.finetune import search_aot  # pylint: disable=import-outside-toplevel
  from bertjax.model.config import BertConfig  # pylint: disable=import-outside-toplevel
  config = modern_tiny.get_config()
  model = BertConfig.from_dict(config.model, vocab_size=128, hidden_size=32, num_heads=2,
                               intermediate_size=48, max_position_embeddings=512)
  assert model.task_head == "modernbert"
  sizes = [aot.Memory.of(search_aot.compile_run(config, model, jax.devices()[:4], 8, n)).total
           for n in (64, 512)]
  assert sizes[1] > 2 * sizes[0], sizes


def test_trials_side_by_side_equal_trials_one_after_another():
  """The accelerators' way (vmap: batched matmuls) against the CPU's (lax.map), one step of 2
  trials of a tiny model: the same parameters to float32 reordering."""
  import jax  # pylint: disable=import-outside-toplevel
  from bertjax.finetune.families import classification  # pylint: disable=import-outside-toplevel
  from bertjax.model.config import BertConfig  # pylint: disable=import-outside-toplevel
  from bertjax.training import train  # pylint: disable=import-outside-toplevel
  config = BertConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=2,
                      intermediate_size=64, max_position_embeddings=16)
  base = train.TrainConfig(batch_size=4, num_train_steps=4, warmup_steps=1, learning_rate=1e-3)
  trials = [trials_lib.Trial(k, lr, 1.0, 0.1, 0.01, k, 4) for k, lr in enumerate((1e-3, 3e-4))]
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
  rng = np.random.default_rng(0)
  batch = {"input_ids": rng.integers(5, 64, (2, 4, 16)).astype(np.int32),
           "input_mask": np.ones((2, 4, 16), np.int32), "segment_ids": np.zeros((2, 4, 16), np.int32),
           "label": rng.integers(0, 3, (2, 4)).astype(np.int32), "weight": np.ones((2, 4), np.float32)}
  params = []
  for vectorize in (True, False):
    t = trials_lib.build(config, base, trials, 4, mesh, classification.objective_of(3), vectorize)
    state = t.init_state(None)
    for _ in range(2):
      state, _ = t.train_step(state, t.to_global(batch), None)
    params.append(jax.tree.leaves(jax.device_get(state.params)))
  assert max(float(np.max(np.abs(a - b))) for a, b in zip(*params)) < 1e-6
