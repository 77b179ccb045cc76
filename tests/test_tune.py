"""bertjax.tune: a config's best settings for a TPU slice, found by compiling (compile-only, on CPU).

The command runs in a subprocess, as tests/test_aot.py's: it loads libtpu, which this CPU-only
test process should not.
"""

import importlib.util
import json
import os
import subprocess
import sys

from bertjax import tune
from bertjax.configs import bert_base, bert_large, tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_each_setting_is_tried_on_top_of_the_best_so_far():
  config = tiny.get_config()
  best = {"model.remat_policy": "dots"}
  mesh = tune.candidates("mesh", config, best)
  assert mesh == [{"model.remat_policy": "dots", "mesh.ici_data": 1, "mesh.ici_fsdp": -1}]
  remat = tune.candidates("remat", config, best)
  assert [c["model.remat_policy"] for c in remat] == ["none", "dots_all", "full", "dots_kernels",
                                                     "dots_outputs"]
  base = bert_base.get_config()  # trained with attention dropout, as the paper
  [splash] = tune.candidates("attention", base, {})  # it ships with the fused kernel
  assert splash["model.attention_dropout"] == 0.0  # the kernel has none: said in the table
  assert "no attention dropout (was 0.1)" in tune.note(splash, base)
  splash, fused = tune.candidates("attention", base, {"model.attention_impl": "xla"})
  assert fused == {"model.attention_impl": "fused"} and not tune.note(fused, base)  # it has
  # The MLP: the other implementation, or both where the config leaves it to "auto".
  assert tune.candidates("mlp", config, {}) == [{"model.mlp_impl": "xla_remade"},
                                               {"model.mlp_impl": "pallas"},
                                               {"model.mlp_impl": "pallas_kept"}]
  assert [c["model.mlp_impl"] for c in tune.candidates("mlp", base, {})] == [
      "xla", "xla_remade", "pallas", "pallas_kept"]  # "xla_remade": phase 1 has remat "none"
  # What "auto" gives the slice's chips is the config as given: not compiled a second time.
  large512 = bert_large.get_config("phase=2")
  large512.model.remat_policy = "auto"  # remat and MLP "auto"
  v6e, v5p = "TPU v6 lite", "TPU v5"
  assert [c["model.remat_policy"] for c in tune.candidates("remat", large512, {}, v6e)] == [
      "none", "dots", "dots_all", "full", "dots_kernels"]  # not dots_outputs
  assert [c["model.remat_policy"] for c in tune.candidates("remat", large512, {}, v5p)] == [
      "none", "dots", "dots_all", "full", "dots_outputs"]  # not dots_kernels
  assert [c["model.mlp_impl"] for c in tune.candidates("mlp", large512, {}, v6e)] == [
      "xla", "pallas_kept"]  # "pallas" under dots_outputs
  assert [c["model.mlp_impl"] for c in tune.candidates("mlp", base, {}, v6e)] == [
      "xla", "xla_remade", "pallas"]  # "pallas_kept" under "none" (phase 1)
  assert [c["model.mlp_impl"] for c in tune.candidates("mlp", base, {}, v5p)] == [
      "xla", "xla_remade", "pallas"]  # "pallas_kept" under "none" on v5p too
  # q, k and v: the product count "auto" does not give the chips, or both without a chip.
  assert [c["model.qkv_product"] for c in tune.candidates("qkv", base, {})] == ["three", "one"]
  for chip, other in ((v6e, "three"), (v5p, "three"), ("TPU v5 lite", "one")):
    assert tune.candidates("qkv", base, {}, chip) == [{"model.qkv_product": other}], chip
  rows = tune.candidates("rows", config, {})
  assert [c["train.batch_size"] for c in rows] == [2 * config.train.batch_size,
                                                   4 * config.train.batch_size]
  assert "set its learning rate" in tune.note(rows[0], config)
  # The config given is not changed by trying.
  assert tune.apply(config, rows[0]).train.batch_size != config.train.batch_size
  assert config.train.batch_size == tiny.get_config().train.batch_size


def test_the_ranking_puts_what_fits_first_by_roofline():
  results = [tune.Result({}, 0.3, fits=True), tune.Result({"a.b": 1}, 0.9, fits=False),
             tune.Result({"a.c": 2}, 0.5, memory_gib=None),
             tune.Result({"a.d": 3}, note="not possible: no")]
  order = tune.ranked(results)
  assert [r.changes for r in order] == [{"a.c": 2}, {}, {"a.b": 1}, {"a.d": 3}]


def test_the_search_compiles_candidates_and_writes_the_winner(tmp_path):
  # The tiny config, scanned (one compile a candidate), on v5e-8: the config as given and the
  # other mesh, compiled at once in two processes; the winner's flags printed and written as a
  # config file that loads to the winner's settings.
  out, figures = tmp_path / "tuned.py", tmp_path / "results.json"
  env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="2")
  result = subprocess.run(
      [sys.executable, "-m", "bertjax.tune", "--config=configs/tiny.py",
       "--config.model.vocab_size=8000", "--config.model.scan_layers=True",
       "--topology=v5e-8", "--dimensions=mesh", "--jobs=2", f"--write_config={out}",
       f"--json={figures}"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  results = json.loads(figures.read_text())
  assert len(results) == 2 and all(r["roofline_mfu"] > 0 and r["fits"] for r in results)
  best = max(results, key=lambda r: r["roofline_mfu"])
  assert "bertjax.tune: ranked" in result.stdout
  flags = tune.flags_of(best["changes"])
  assert f"bertjax.tune: flags: {flags or '(none'}" in result.stdout
  spec = importlib.util.spec_from_file_location("tuned", out)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  tuned = module.get_config()
  # The search started from the command line's own settings: the file keeps them too.
  assert tuned.model.scan_layers is True and tuned.model.vocab_size == 8000
  for key, value in best["changes"].items():
    section, name = key.split(".", 1)
    assert tuned[section][name] == value, (key, tuned[section][name])


def crash_on_changes(conn, config, changes, topology_name, whole):
  """compile_all's target in the test below: a process that dies as libtpu does where the
  candidate changes anything, and gives a result otherwise."""
  del config, topology_name, whole
  if changes.get("model.remat_policy") == "full":
    os.kill(os.getpid(), 11)
  if changes:  # ends as a process whose import failed does, before any compile
    os._exit(1)  # pylint: disable=protected-access
  conn.send(tune.Result(changes, 0.5, fits=True))
  conn.close()


def test_a_candidate_whose_compile_crashes_ends_no_search():
  # libtpu 0.0.42 overflows its stack compiling some steps at length 512 (signal 11): each
  # candidate compiles in a process of its own, and one that dies is listed with its exit.
  said = []
  results = tune.compile_all(tiny.get_config(), [{}, {"model.remat_policy": "full"},
                                                  {"model.remat_policy": "dots"}], "v5e-8",
                             jobs=2, say=said.append, target=crash_on_changes)
  assert results[0].ok and results[0].roofline_mfu == 0.5
  assert not results[1].ok and results[1].note == "the compiler crashed (signal 11)", results[1]
  # A process that exits with a status was not killed by the compiler: its own output says why.
  assert not results[2].ok and results[2].note.startswith("the candidate's process ended "
                                                          "without a result (exit 1)"), results[2]
  assert len(said) == 3


def test_a_straight_winner_s_whole_compile_takes_its_extrapolated_row_s_place(monkeypatch):
  given = tune.Result({}, 0.72, hbm_gb=83.0, memory_gib=8.6, fits=True)
  straight = tune.Result({"model.scan_layers": False}, 0.75, hbm_gb=76.0)  # extrapolated
  for whole_mfu, expected in ((0.74, "straight"), (0.70, "given")):
    whole = tune.Result({"model.scan_layers": False}, whole_mfu, hbm_gb=79.5, memory_gib=8.3,
                        fits=True)
    calls = []

    def compile_all(*args, result=whole, **kwargs):
      calls.append(args)
      assert len(calls) == 1, "compiled the same candidate again"  # red, not a hang
      return [result]
    monkeypatch.setattr(tune, "compile_all", compile_all)
    winner, results = tune.settle_winner(None, "v6e-8", [given, straight], say=lambda _: None)
    assert winner is (whole if expected == "straight" else given)
    assert results == [given, whole]  # one row for the candidate: its whole compile's


def test_a_straight_candidate_compiles_whole_at_once_where_a_core_would_wait(monkeypatch):
  config = tiny.get_config()
  config.model.scan_layers = True
  straight = {"model.scan_layers": False}
  assert tune.at_once_whole(config, [straight], jobs=2) == [True]
  assert tune.at_once_whole(config, [straight], jobs=1) == [False]  # no core free
  assert tune.at_once_whole(config, [{}, straight], jobs=2) == [False, False]
  assert tune.at_once_whole(config, [straight, straight], jobs=3) == [True, False]
  calls = []

  def compile_all(config, batch, topology_name, jobs, whole=False, say=print):
    calls.append((batch, whole))
    return [tune.Result(c, 0.5 if c else 0.4, hbm_gb=1.0, memory_gib=1.0, fits=True)
            for c in batch]
  monkeypatch.setattr(tune, "compile_all", compile_all)
  results = tune.search(config, "v5e-8", ["mesh", "layers"], 1e9, jobs=2, say=lambda _: None)
  assert [w for _, w in calls] == [[False, False], [True]]
  assert calls[1][0] == [{**tune.MESHES["fsdp"], **straight}]  # on top of the mesh's winner
  assert len(results) == 3



def test_the_winner_compiles_whole_beside_the_config_as_given_and_the_next_candidates(monkeypatch):
  # A figure from 1 and 2 layers can miss what XLA does at full depth (BERT-Large L 128 on v6e-8,
  # remat "none": 0.937 extrapolated, 0.979 whole): the winner is compiled whole beside the config
  # as given, and beside the next extrapolated candidates where cores are spare.
  given = tune.Result({}, 0.937, hbm_gb=15.2)
  kernels = tune.Result({"model.remat_policy": "dots_kernels"}, 0.978, hbm_gb=14.1)
  scanned = tune.Result({"model.scan_layers": True}, 0.956, hbm_gb=14.9, memory_gib=3.4, fits=True)
  outputs = tune.Result({"model.remat_policy": "dots_outputs"}, 0.888, hbm_gb=13.0)
  results = [given, kernels, scanned, outputs]
  assert tune.whole_batch(results, jobs=1) == [kernels, given]
  assert tune.whole_batch(results, jobs=2) == [kernels, given]
  assert tune.whole_batch(results, jobs=3) == [kernels, given, outputs]
  assert tune.whole_batch([given, outputs], jobs=2) == [given, outputs]
  whole_mfu = {"": 0.979, "dots_kernels": 0.978, "dots_outputs": 0.89}
  calls = []

  def compile_all(config, batch, topology_name, jobs, whole=False, say=print):
    calls.append((batch, whole))
    return [tune.Result(c, whole_mfu[c.get("model.remat_policy", "")], hbm_gb=13.0,
                        memory_gib=4.0, fits=True) for c in batch]
  monkeypatch.setattr(tune, "compile_all", compile_all)
  said = []
  winner, settled = tune.settle_winner(None, "v6e-8", results, say=said.append, jobs=2)
  assert calls == [([kernels.changes, given.changes], True)]
  assert winner.changes == {} and winner.roofline_mfu == 0.979 and winner is settled[0]
  assert [r.roofline_mfu for r in settled] == [0.979, 0.978, 0.956, 0.888]
  assert "beside it (as given)" in said[0], said
