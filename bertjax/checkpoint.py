"""Checkpoints with orbax: async saves every N steps, the last K kept, restores that never lose a run.

A checkpoint is a set of named items (pytrees such as `params` and `opt_state`, saved with
orbax's standard handler so they restore onto any mesh) plus a JSON `meta` item (the model
config and whatever the loop needs to resume exactly). Restore order: the newest readable
checkpoint of the run; one that cannot be read (cut off mid-save, truncated file) is reported and
skipped in favour of the one before. Orbax writes each save into a temporary folder renamed only
when complete, so an interrupted save never even looks like a checkpoint.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

import jax
import orbax.checkpoint as ocp
from absl import logging

from bertjax.model import BertConfig

# BertConfig fields that change the shape or layout of the parameters: a checkpoint that differs
# in any of them cannot be resumed by this model.
SHAPE_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size",
                "max_position_embeddings", "type_vocab_size", "scan_layers")

META = "meta"


def _abspath(path: str) -> str:
  # Orbax wants absolute local paths; gs:// and other URLs pass through.
  return path if "://" in path else os.path.abspath(path)


def check_model_matches(saved: Mapping[str, Any], config: BertConfig, where: str) -> None:
  """Raises if the saved model config differs from `config` in a shape-defining field."""
  current = dataclasses.asdict(config)
  diffs = [f"{k}: checkpoint {saved.get(k)!r} vs config {current[k]!r}"
           for k in SHAPE_FIELDS if k in saved and saved[k] != current[k]]
  if diffs:
    raise ValueError(
        f"The checkpoint at {where} was saved by a different model ({'; '.join(diffs)}). "
        "Use the config it was trained with, or a new --workdir to start another run "
        "(to start from its weights with a new layout, convert them first).")


class Checkpointer:
  """Orbax CheckpointManager over named pytree items and a JSON meta item."""

  def __init__(self, directory: str, items: tuple[str, ...], *, save_every: int, keep: int,
               async_save: bool = True):
    self.directory = _abspath(directory)
    self.items = tuple(items)
    options = ocp.CheckpointManagerOptions(
        save_interval_steps=save_every, max_to_keep=keep, create=True,
        enable_async_checkpointing=async_save, cleanup_tmp_directories=True)
    handlers = {name: ocp.StandardCheckpointHandler() for name in self.items}
    handlers[META] = ocp.JsonCheckpointHandler()
    self._manager = ocp.CheckpointManager(self.directory, options=options,
                                          item_handlers=handlers)

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(self, step: int, items: Mapping[str, Any], meta: Mapping[str, Any],
           force: bool = False) -> bool:
    """Starts an async save if `step` is due (or `force`); returns whether it saves."""
    missing = set(self.items) - set(items)
    if missing:
      raise ValueError(f"save() is missing items {sorted(missing)}")
    args = {name: ocp.args.StandardSave(items[name]) for name in self.items}
    args[META] = ocp.args.JsonSave(dict(meta))
    return self._manager.save(step, args=ocp.args.Composite(**args), force=force)

  def restore(self, step: int, abstract_items: Mapping[str, Any]) -> tuple[dict, dict]:
    """(items, meta) of one step; `abstract_items` (a subset of the items, leaves with
    shardings) says what to read and where each array goes."""
    args = {name: ocp.args.StandardRestore(tree) for name, tree in abstract_items.items()}
    args[META] = ocp.args.JsonRestore()
    restored = self._manager.restore(step, args=ocp.args.Composite(**args))
    return {name: restored[name] for name in abstract_items}, dict(restored[META])

  def read_meta(self, step: int) -> dict:
    return dict(self._manager.restore(step, args=ocp.args.Composite(
        **{META: ocp.args.JsonRestore()}))[META])

  def restore_latest(self, abstract_items: Mapping[str, Any], config: BertConfig | None = None
                     ) -> tuple[int, dict, dict] | None:
    """(step, items, meta) of the newest readable checkpoint, or None if there is none.

    A checkpoint of another model (see SHAPE_FIELDS) is an error, never skipped: resuming a run
    with the wrong config must not silently start over.
    """
    for step in reversed(self.all_steps()):
      try:
        meta = self.read_meta(step)
      except Exception as err:  # pylint: disable=broad-except
        logging.warning("Checkpoint step %d in %s is unreadable (%s: %s); trying the one before.",
                        step, self.directory, type(err).__name__, err)
        continue
      if config is not None:
        check_model_matches(meta.get("model", {}), config, f"{self.directory} step {step}")
      try:
        items, meta = self.restore(step, abstract_items)
      except Exception as err:  # pylint: disable=broad-except
        logging.warning("Checkpoint step %d in %s is unreadable (%s: %s); trying the one before.",
                        step, self.directory, type(err).__name__, err)
        continue
      return step, items, meta
    return None

  def wait(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()


def abstract_like(tree: Any) -> Any:
  """ShapeDtypeStructs (with shardings) of a pytree of arrays: a restore target."""
  return jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
      tree)

