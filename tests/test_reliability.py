"""Reliability of a workdir and the edges, at unit level (docs/reliability.md lists each case):
a kill at any instant never blocks the rerun, damaged files are named (and skipped where a
readable one is older), a second run on a workdir is refused, a bad input fails in one line before
any work.

No full runs: each case drives the piece that decides it (the Evaluations record, a Checkpointer,
a config check), so the whole file takes seconds.
"""


import os

import jax.numpy as jnp
import pytest

from bertjax import files
from bertjax.finetune import run


# 1. Fine-tuning workdir: a kill between any two writes ------------------------------------------

PARAMS = {"w": jnp.arange(4, dtype=jnp.float32)}


def _evaluations(workdir, start):
  evaluations = run.Evaluations(str(workdir), {"task": "rte"})
  evaluations.begin(start)
  return evaluations


def test_a_best_step_without_its_record_is_evaluated_again(tmp_path):
  # A kill after best/'s save of step 2 and before evaluations.json records it: the rerun
  # restores checkpoints/2, owes step 2's evaluation and must save best/2 again (not die with
  # StepAlreadyExistsError).
  first = _evaluations(tmp_path, 0)
  first.add(1, 1.0, {"main": 0.5}, PARAMS)
  records = files.read_json(str(tmp_path / "evaluations.json"))
  first.add(2, 2.0, {"main": 0.7}, PARAMS)
  first.close()
  files.write_json(str(tmp_path / "evaluations.json"), records)  # the kill: step 2 unrecorded

  rerun = _evaluations(tmp_path, 2)
  assert not rerun.done(2)
  rerun.add(2, 2.0, {"main": 0.7}, PARAMS)
  rerun.close()
  assert [r["step"] for r in files.read_json(str(tmp_path / "evaluations.json"))] == [1, 2]
  assert rerun.best.all_steps() == [2]


def test_a_damaged_evaluations_record_is_rebuilt_from_best(tmp_path, capsys):
  # Written atomically now; one cut short (an older bertjax, a disk fault) keeps what best/
  # records instead of stopping every rerun.
  first = _evaluations(tmp_path, 0)
  first.add(1, 1.0, {"main": 0.5}, PARAMS)
  first.add(2, 2.0, {"main": 0.4}, PARAMS)
  first.close()
  with open(tmp_path / "evaluations.json", "r+") as f:
    f.truncate(20)
  rerun = _evaluations(tmp_path, 2)
  rerun.close()
  out = capsys.readouterr().out
  assert "evaluations.json" in out and "is not valid JSON" in out and "best/" in out
  assert [(r["step"], r["scores"]["main"]) for r in rerun.records] == [(1, 0.5)]
  assert rerun.best.all_steps() == [1]


@pytest.mark.parametrize("name", ["results.json", "config.json"])
def test_a_damaged_derived_file_does_not_stop_the_rerun(tmp_path, name, capsys):
  # results.json and config.json are rewritten by every run: one cut short by a kill is
  # rebuilt, not trusted and not fatal.
  (tmp_path / name).write_text('{"task": "rt')
  run._check_task(str(tmp_path), "rte")
  assert f"{tmp_path / name}" in capsys.readouterr().out
  # A readable one of another task is still refused.
  files.write_json(str(tmp_path / name), {"task": "cola"})
  with pytest.raises(ValueError, match="holds a cola run"):
    run._check_task(str(tmp_path), "rte")


def test_prediction_files_are_written_atomically(tmp_path, monkeypatch):
  # Every file of the workdir goes through files.write_text (temp file + rename): a kill during
  # the write leaves the previous file whole.
  from bertjax.finetune import squad_postprocess
  written = []
  real = files.write_text
  monkeypatch.setattr(files, "write_text", lambda path, text: (written.append(path),
                                                                real(path, text)))
  result = squad_postprocess.SquadPredictions({"q": "a"}, {"q": [{"text": "a"}]}, {"q": -1.0})
  paths = squad_postprocess.write_predictions(result, str(tmp_path / "predictions"))
  assert written == paths and len(paths) == 3
  assert sorted(os.listdir(tmp_path / "predictions")) == [
      "nbest_predictions.json", "null_odds.json", "predictions.json"]
