"""Checkpoints: keep-last-K, restore onto another mesh, a damaged latest skipped, model mismatch."""

import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from bertjax.checkpoint import Checkpointer
from bertjax.model import BertConfig


def _meta(step, config=BertConfig()):
  return {"model": dataclasses.asdict(config), "step": step}


@pytest.fixture()
def saved(tmp_path):
  mesh8 = Mesh(np.array(jax.devices()[:8]), ("x",))
  w = jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(mesh8, P("x")))
  ckpt = Checkpointer(str(tmp_path / "ckpt"), ("params",), save_every=2, keep=3)
  for step in range(1, 8):
    ckpt.save(step, {"params": {"w": w * step}}, _meta(step))
  ckpt.wait()
  yield ckpt, tmp_path / "ckpt"
  ckpt.close()


def _target(devices):
  mesh = Mesh(np.array(jax.devices()[:devices]), ("x",))
  return {"params": {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32,
                                               sharding=NamedSharding(mesh, P(None, "x")))}}


def test_saves_every_n_keeps_last_k_and_restores_onto_another_mesh(saved):
  ckpt, _ = saved
  assert ckpt.all_steps() == [2, 4, 6]
  step, items, meta = ckpt.restore_latest(_target(4), BertConfig())
  w = items["params"]["w"]
  assert step == 6 and meta["step"] == 6
  assert len(w.sharding.device_set) == 4 and w.sharding.spec == P(None, "x")
  np.testing.assert_array_equal(w, np.arange(64.0).reshape(8, 8) * 6)


def test_damaged_latest_is_skipped_for_the_one_before(saved):
  ckpt, directory = saved
  for path in (directory / "6" / "params").rglob("*"):
    if path.is_file() and path.stat().st_size:
      path.write_bytes(b"")  # as if the disk lost the end of every file
  step, items, _ = ckpt.restore_latest(_target(8), BertConfig())
  assert step == 4
  np.testing.assert_array_equal(items["params"]["w"], np.arange(64.0).reshape(8, 8) * 4)


def test_interrupted_save_leaves_no_checkpoint(saved):
  ckpt, directory = saved
  # Orbax writes into a temporary folder renamed at the end; one left by a killed save is ignored.
  (directory / "8.orbax-checkpoint-tmp-1234").mkdir()
  assert ckpt.all_steps() == [2, 4, 6]


def test_checkpoint_of_another_model_size_is_refused(saved):
  ckpt, _ = saved
  with pytest.raises(ValueError, match="num_layers: checkpoint 12 vs config 3"):
    ckpt.restore_latest(_target(8), BertConfig(num_layers=3))


def test_empty_directory_restores_nothing(tmp_path):
  ckpt = Checkpointer(str(tmp_path / "none"), ("params",), save_every=1, keep=1)
  assert ckpt.restore_latest(_target(8)) is None
  ckpt.close()
  assert pathlib.Path(tmp_path / "none").is_dir()
