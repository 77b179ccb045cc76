"""A pre-training run resumes across the layers' layout (model.scan_layers): its parameters and its
optimizer state restacked (bertjax/training/relayout.py, `relaid`), it ends where the run that
kept one layout ends. Apart from tests/test_loop.py so that the suite's two workers share them."""

import numpy as np
import pytest
from flax import traverse_util

from bertjax.errors import CheckpointMismatchError
from bertjax.pretrain import job as pretrain_job
from bertjax.training import relayout
from bertjax.weights.reader import restack
from test_loop import _config, _final_params, _Recorder

LAYERS = 3


def _layout(base, scan: bool, steps: int):
  config = _config(base, num_train_steps=steps)
  config.model.num_layers, config.model.scan_layers = LAYERS, scan
  # Without dropout: the two layouts compute the same step but for the order of float sums.
  config.model.hidden_dropout = config.model.attention_dropout = 0.0
  return config


def _straight(params):
  """Stored parameters of either layout, the layers unrolled."""
  bert = params["bert"]
  if "layers" in bert["encoder"]:
    bert = restack(bert, LAYERS, scan=False)
  return {**params, "bert": bert}


def _assert_close(got, want):
  got, want = (traverse_util.flatten_dict(_straight(t), sep="/") for t in (got, want))
  assert got.keys() == want.keys() and len(want) > 20
  for key in want:
    # Scanned and straight steps sum in other orders: float32 rounding, over a few Adam steps.
    np.testing.assert_allclose(got[key], want[key], rtol=1e-4, atol=2e-6, err_msg=key)


def test_a_run_resumes_in_the_other_layout_and_ends_where_one_layout_ends(tmp_path, capsys,
                                                                         monkeypatch):
  kept, moved = str(tmp_path / "kept"), str(tmp_path / "moved")
  pretrain_job.train_and_evaluate(_layout(tmp_path, True, 6), kept)
  with monkeypatch.context() as patched:
    _Recorder(patched, sigterm_at=2)  # a preemption notice: the run saves step 3 and stops
    pretrain_job.train_and_evaluate(_layout(tmp_path, True, 6), moved)
  assert "saved step 3" in capsys.readouterr().out
  # Scanned -> straight at step 3, to step 6.
  pretrain_job.train_and_evaluate(_layout(tmp_path, False, 6), moved)
  said = capsys.readouterr().out
  assert "was saved with model.scan_layers=True; its parameters and optimizer state restacked" \
      in said and "resumed from" in said, said
  _assert_close(_final_params(moved, 6), _final_params(kept, 6))
  # Straight -> scanned at step 6, to step 8, against the scanned run taken on to 8.
  pretrain_job.train_and_evaluate(_layout(tmp_path, True, 8), kept)
  pretrain_job.train_and_evaluate(_layout(tmp_path, True, 8), moved)
  assert "restacked for model.scan_layers=True" in capsys.readouterr().out
  _assert_close(_final_params(moved, 8), _final_params(kept, 8))


def test_relaid_names_what_has_no_counterpart():
  stored = {"bert": {"encoder": {"layer_0": {"w": np.zeros(2)}, "layer_1": {"w": np.ones(2)}}}}
  like = lambda shape: np.zeros(shape)
  scanned = {"bert": {"encoder": {"layers": {"layer": {"w": like((2, 2))}}}}}
  out = relayout.relaid(stored, scanned, 2, "here")
  np.testing.assert_array_equal(out["bert"]["encoder"]["layers"]["layer"]["w"], [[0, 0], [1, 1]])
  back = relayout.relaid(out, stored, 2, "here")
  np.testing.assert_array_equal(back["bert"]["encoder"]["layer_1"]["w"], [1, 1])
  with pytest.raises(CheckpointMismatchError, match="no counterpart for bert/encoder/layers/"
                     "layer/w.*model.scan_layers"):
    relayout.relaid(stored, scanned, 3, "here")  # a third layer it does not hold
