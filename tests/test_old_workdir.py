"""A workdir written by older code still resumes: tests/fixtures/workdir_b49986a holds a tiny run
stopped by SIGTERM at step 3 of 6, written by bertjax at b49986a (before issue 27's changes to
weights, configs and checkpoints; make_fixture.py in that folder wrote it), and the parameters
that code's uninterrupted run ended with. Today's code must resume it and end with those.

Since issue 34 (prepared-data format 3: documents go to shards by a hash of their text) the data
prepared again here differs from what b49986a's run trained on, so steps 4 to 6 see other batches:
the resumed run is compared with resumed_step6_params_format3.npz, the parameters today's code
ended with when it first resumed this workdir on format-3 data (8.7e-3 at most from the old code's
straight run, about what three steps move)."""

import pathlib
import shutil

import jax
import numpy as np

from bertjax.pretrain import job as pretrain_job
from test_loop import _config, _final_params, _Recorder

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "workdir_b49986a"


def test_a_workdir_of_older_code_resumes_and_ends_where_that_code_ended(tmp_path, monkeypatch,
                                                                          capsys):
  workdir = tmp_path / "old"
  shutil.copytree(FIXTURE / "workdir", workdir)
  # The same tiny config and synthetic corpus the fixture was written with (paths aside: the data
  # is prepared again here, from the same text, vocabulary and seed).
  config = _config(tmp_path)
  _Recorder(monkeypatch)
  pretrain_job.train_and_evaluate(config, str(workdir))
  assert "resumed from" in capsys.readouterr().out
  got = {"/".join(str(getattr(k, "key", k)) for k in path): np.asarray(v)
         for path, v in jax.tree_util.tree_flatten_with_path(_final_params(workdir, 6))[0]}
  with np.load(FIXTURE / "resumed_step6_params_format3.npz") as expected:
    assert sorted(got) == sorted(expected.files)
    # Bit for bit on the CPU that wrote the fixture. Another CPU's float rounding differs in the
    # last bits (up to 1.5e-8 seen on a machine with AVX-512), while the three resumed steps move
    # every array by about 5e-3: a change of the step's math or of what resume restores lands far
    # outside 1e-6 (1% more learning rate on resume is 5e-5 off).
    for name in expected.files:
      np.testing.assert_allclose(got[name], expected[name], rtol=0, atol=1e-6, err_msg=name)
