"""Checkpoints: keep-last-K, restore onto another mesh, damage skipped and set aside, mismatches refused."""

import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from bertjax.errors import CheckpointMismatchError
from bertjax.model.config import BertConfig
from bertjax.training.checkpoint import Checkpointer, Expected


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
  step, items, meta = ckpt.restore_latest(_target(4), Expected(model=BertConfig()))
  w = items["params"]["w"]
  assert step == 6 and meta["step"] == 6
  assert len(w.sharding.device_set) == 4 and w.sharding.spec == P(None, "x")
  np.testing.assert_array_equal(w, np.arange(64.0).reshape(8, 8) * 6)


def _damage(step_dir: pathlib.Path) -> None:
  for path in (step_dir / "params").rglob("*"):
    if path.is_file() and path.stat().st_size:
      path.write_bytes(b"")  # as if the disk lost the end of every file


def test_damaged_latest_is_skipped_set_aside_and_its_step_saved_again(saved):
  ckpt, directory = saved
  _damage(directory / "6")
  step, items, _ = ckpt.restore_latest(_target(8), Expected(model=BertConfig()))
  assert step == 4
  np.testing.assert_array_equal(items["params"]["w"], np.arange(64.0).reshape(8, 8) * 4)
  # Kept for inspection, out of the way: the resumed run reaches step 6 again and saves it.
  aside = list((directory.parent / "ckpt.damaged").iterdir())
  assert len(aside) == 1 and aside[0].name.startswith("6-") and (aside[0] / "DAMAGE.txt").exists()
  assert ckpt.all_steps() == [2, 4]
  w = jnp.ones((8, 8))
  ckpt.save(6, {"params": {"w": w}}, _meta(6), force=True)
  ckpt.wait()
  assert ckpt.all_steps() == [2, 4, 6]


def test_when_no_checkpoint_restores_the_run_is_refused_with_each_reason(saved):
  ckpt, directory = saved
  for step in (2, 4, 6):
    _damage(directory / str(step))
  with pytest.raises(RuntimeError, match=r"None of the 3 checkpoint\(s\).*step 6: .*step 4: "
                     r".*step 2: .*does not start over"):
    ckpt.restore_latest(_target(8), Expected(model=BertConfig()))
  assert sorted(p.name for p in directory.iterdir() if p.name.isdigit()) == ["2", "4", "6"]


def test_a_failure_that_is_not_damage_is_not_skipped(saved):
  ckpt, _ = saved
  wrong_shape = {"params": {"w": jax.ShapeDtypeStruct((4, 16), jnp.float32)}}
  with pytest.raises(RuntimeError, match="step 6 could not be restored.*not a known kind"):
    ckpt.restore_latest(wrong_shape, Expected(model=BertConfig()))
  assert ckpt.all_steps() == [2, 4, 6]


def test_other_optimizer_or_vocabulary_is_refused_with_the_keys_named(tmp_path):
  run = Expected(model=BertConfig(), optimizer={"optimizer": "adamw", "num_microbatches": 1},
                 tokenizer_fingerprint="wordpiece-430-aaaa")
  ckpt = Checkpointer(str(tmp_path / "c"), ("params",), save_every=1, keep=1)
  ckpt.save(1, {"params": {"w": jnp.ones(2)}}, {**run.meta(), "step": 1})
  ckpt.wait()
  target = {"params": {"w": jax.ShapeDtypeStruct((2,), jnp.float32)}}
  assert ckpt.restore_latest(target, run)[0] == 1
  other = dataclasses.replace(run, optimizer={"optimizer": "lamb", "num_microbatches": 4},
                              tokenizer_fingerprint="wordpiece-430-bbbb")
  with pytest.raises(CheckpointMismatchError,
                     match=r"train.optimizer: checkpoint 'adamw' vs config 'lamb'; "
                     r"train.num_microbatches: checkpoint 1 vs config 4; "
                     r"tokenizer: checkpoint wordpiece-430-aaaa vs data wordpiece-430-bbbb"):
    ckpt.restore_latest(target, other)
  ckpt.close()


def test_interrupted_save_leaves_no_checkpoint(saved):
  ckpt, directory = saved
  # Orbax writes into a temporary folder renamed at the end; one left by a killed save is ignored
  # by a manager that lists the folder afresh (a new run), not only by one that listed it before.
  (directory / "8.orbax-checkpoint-tmp-1234").mkdir()
  (directory / "8.orbax-checkpoint-tmp-1234" / "params").mkdir()
  fresh = Checkpointer(str(directory), ("params",), save_every=2, keep=3)
  assert fresh.all_steps() == [2, 4, 6]
  assert fresh.restore_latest(_target(8), Expected(model=BertConfig()))[0] == 6
  fresh.close()


def test_checkpoint_of_another_model_size_is_refused(saved):
  ckpt, _ = saved
  with pytest.raises(ValueError, match="num_layers: checkpoint 12 vs config 3"):
    ckpt.restore_latest(_target(8), Expected(model=BertConfig(num_layers=3)))


def test_empty_directory_restores_nothing(tmp_path):
  ckpt = Checkpointer(str(tmp_path / "none"), ("params",), save_every=1, keep=1)
  assert ckpt.restore_latest(_target(8)) is None
  ckpt.close()
  assert pathlib.Path(tmp_path / "none").is_dir()


def test_a_replicated_array_saves_without_a_compile_on_a_cpu(tmp_path):
  """On a CPU orbax writes each replicated array from one device (bertjax/training/checkpoint.py): split
  among its 8 replicas, every save compiled a slice per device and shape (4.6 s for a tiny
  model's first save, against 0.2 s). The restore still gives the array back on every device."""
  import logging  # pylint: disable=import-outside-toplevel
  compiled = []

  class Listen(logging.Handler):
    def emit(self, record):
      if record.getMessage().startswith("Compiling "):
        compiled.append(record.getMessage().split()[1])

  mesh8 = Mesh(np.array(jax.devices()[:8]), ("x",))
  replicated = NamedSharding(mesh8, P())
  # Shapes no other test saves: a slice compiled for them could not come from jax's cache.
  tree = {"a": jax.device_put(jnp.arange(8 * 29.0).reshape(8, 29), replicated),
          "b": jax.device_put(jnp.ones((40, 3)), replicated)}
  listen, log = Listen(), logging.getLogger("jax")
  log.addHandler(listen)
  try:
    with jax.log_compiles(True):
      ckpt = Checkpointer(str(tmp_path / "ckpt"), ("params",), save_every=1, keep=1)
      ckpt.save(1, {"params": tree}, _meta(1))
      ckpt.wait()
  finally:
    log.removeHandler(listen)
  assert not [name for name in compiled if "slice" in name], compiled
  target = {"params": jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), tree)}
  restored = ckpt.restore(1, target)[0]["params"]
  ckpt.close()
  for key, leaf in tree.items():
    np.testing.assert_array_equal(restored[key], leaf)


def test_the_cpu_writer_keeps_orbaxs_metadata_store_or_goes_without(monkeypatch):
  """The one-writer handler takes orbax's private metadata store where orbax has it, and none
  (as orbax's public re-registration gives) where the attribute is gone."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  from bertjax.training import checkpoint as checkpoint_lib  # pylint: disable=import-outside-toplevel
  handlers = ocp.type_handlers
  registered = []
  monkeypatch.setattr(handlers, "register_type_handler",
                      lambda ty, handler, override=False: registered.append(handler))
  for has_store in (True, False):
    current = handlers.ArrayHandler(use_replica_parallel=True)
    store = object()
    if has_store:
      current._array_metadata_store = store  # pylint: disable=protected-access
    else:
      del current._array_metadata_store  # pylint: disable=protected-access
    monkeypatch.setattr(handlers, "get_type_handler", lambda ty, h=current: h)
    monkeypatch.setattr(checkpoint_lib, "_WRITERS_SET", False)
    checkpoint_lib._one_writer_per_array_on_a_cpu()  # pylint: disable=protected-access
    made = registered[-1]
    assert made._use_replica_parallel is False  # pylint: disable=protected-access
    assert made._array_metadata_store is (store if has_store else None)  # pylint: disable=protected-access
  assert len(registered) == 2


def test_each_manager_names_its_own_barriers(tmp_path):
  # Fine-tuning saves its checkpoints and its best parameters by two async managers; with
  # orbax's one barrier key their saves finishing at once failed a two-process pod ("Barrier
  # ThreadSaveMultiHostValueHolder:set_value_start is already ongoing").
  prefixes = [Checkpointer(str(tmp_path / name), ("params",), save_every=1, keep=1)
              ._manager._options.multiprocessing_options.barrier_sync_key_prefix
              for name in ("checkpoints", "best", "best")]
  assert prefixes[0] != prefixes[1] and prefixes[1] == prefixes[2], prefixes
