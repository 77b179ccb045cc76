"""Checkpoints with orbax: async saves every N steps, the last K kept, restores that never lose a run.

A checkpoint is a set of named items (pytrees such as `params` and `opt_state`, saved with
orbax's standard handler so they restore onto any mesh) plus a JSON `meta` item: the model config,
the optimizer-shaping train keys and the tokenizer fingerprint, checked before anything is restored.

Restore order: the newest checkpoint that restores. One with known damage (files missing, cut short
or unparsable) is skipped for the one before, and once an older one has restored it is moved aside
to `<checkpoints>.damaged/` (kept for inspection; left in place it would collide with the step the
run saves next). Any other failure, and a workdir whose checkpoints all fail, is an error with each
step's reason: a run never starts over silently where checkpoints exist. Every host restores the
step process 0 chose. Orbax writes each save into a temporary folder renamed only when complete, so
an interrupted save never even looks like a checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import logging as logging_std
import os
import re
import time
from typing import Any, Mapping

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from jax.experimental import multihost_utils

from bertjax import errors
from bertjax.errors import CheckpointMismatchError
from bertjax.training import relayout
# The model fields compared on resume (their roles: bertjax/model/config.py).
from bertjax.model.config import ARCHITECTURE_FIELDS, HEAD_FIELDS, SHAPE_FIELDS, BertConfig


class _ReaderNoiseFilter(logging_std.Filter):
  """Drops orbax's warnings about what a reader of weights does on purpose: it restores `params`
  alone (the optimizer state is for resuming) from a manager opened read-only. Printed several
  times per read, they read like faults to a user exporting or predicting."""

  EXPECTED = ("was found in the checkpoint, but could not be restored",
              "CheckpointManagerOptions.read_only=True", "Given directory is read only")

  def filter(self, record) -> bool:
    message = record.getMessage()
    return not any(fragment in message for fragment in self.EXPECTED)


logging_std.getLogger("absl").addFilter(_ReaderNoiseFilter())

_WRITERS_SET = False  # whether _one_writer_per_array_on_a_cpu has run in this process


def _one_writer_per_array_on_a_cpu() -> None:
  """On a CPU, each replicated array is written whole by one device, not split among its replicas.

  Orbax splits a replicated array's write among the devices holding it ("replica-parallel"),
  through a jitted slice per device and shape: compiled afresh in every process, it made the
  first save of a tiny model on an 8-device CPU mesh take 4.6 s against 0.2 s, and each later
  save 2-3x as long. A CPU's devices share one host's memory and disk, so the split writes
  nothing faster there. Orbax already turns it off on GPUs, by its own default; accelerators other
  than GPUs keep it. Orbax's handler of jax arrays is process-wide: this replaces it, on a CPU
  backend, only while it is orbax's own (a handler the user registered stays).
  """
  global _WRITERS_SET  # pylint: disable=global-statement
  if _WRITERS_SET or jax.default_backend() != "cpu":
    return
  _WRITERS_SET = True
  handlers = ocp.type_handlers
  current = handlers.get_type_handler(jax.Array)
  if type(current) is not handlers.ArrayHandler:  # pylint: disable=unidiomatic-typecheck
    return
  # The metadata store (which records typed random keys) carries over. Orbax 0.12.8 exposes it
  # under no public name (only the handler's `_array_metadata_store`); an orbax that names it
  # otherwise gets none, as its own public register_standard_handlers_with_options gives, and
  # bertjax saves no typed keys (tests/test_checkpoint.py covers both).
  store = getattr(current, "_array_metadata_store", None)
  handlers.register_type_handler(jax.Array, handlers.ArrayHandler(
      use_replica_parallel=False, array_metadata_store=store), override=True)


# Train keys that shape the optimizer state or what one step means; resuming under other values
# would continue another run's moments (or its data position) silently.
OPTIMIZER_FIELDS = ("optimizer", "max_grad_norm", "num_microbatches", "bias_correction")

META = "meta"
# The items of a training run's checkpoint (the loop's state); a reader of another run's weights
# asks for "params" alone.
TRAIN_ITEMS = ("params", "opt_state")
# Messages of known damage: tensorstore's status codes for missing or cut-short files, orbax's for a
# missing item. Anything else (a shape or sharding error) is not skipped.
# A data file cut short reads as OUT_OF_RANGE, a deleted one (OCDBT reads it as empty) as
# FAILED_PRECONDITION "Truncated ... stream"; both sit in the __cause__ of orbax's error.
_DAMAGE_MARKERS = ("NOT_FOUND", "DATA_LOSS", "OUT_OF_RANGE", "No such file", "was not found in "
                   "the checkpoint", "Unexpected end", "truncated", "Truncated",
                   "FAILED_PRECONDITION: Error reading")


def _abspath(path: str) -> str:
  # Orbax wants absolute local paths; gs:// and other URLs pass through.
  return path if "://" in path else os.path.abspath(path)


@dataclasses.dataclass(frozen=True)
class Expected:
  """What a checkpoint must match to be resumed (a field None is not checked)."""

  model: BertConfig | None = None
  optimizer: Mapping[str, Any] | None = None  # OPTIMIZER_FIELDS of the train config
  tokenizer_fingerprint: str | None = None
  heads: bool = False  # compare HEAD_FIELDS too: a fine-tuning run resuming its own checkpoints

  def meta(self) -> dict:
    """The same facts, to be written beside a checkpoint."""
    out = {}
    if self.model is not None:
      out["model"] = dataclasses.asdict(self.model)
    if self.optimizer is not None:
      out["optimizer"] = dict(self.optimizer)
    if self.tokenizer_fingerprint is not None:
      out["tokenizer_fingerprint"] = self.tokenizer_fingerprint
    return out

  def check(self, saved: Mapping[str, Any], where: str, relayable: bool = False) -> None:
    """Raises CheckpointMismatchError naming every difference. Keys the checkpoint lacks (older
    checkpoints) are not compared. `relayable`: the layers' layout (LAYOUT_FIELDS) may differ,
    the caller restacking them (Checkpointer.restore_latest)."""
    diffs = []
    if self.model is not None:
      current, have = dataclasses.asdict(self.model), saved.get("model", {})
      diffs += [f"model.{k}: checkpoint {have[k]!r} vs config {current[k]!r}"
                for k in SHAPE_FIELDS + ARCHITECTURE_FIELDS + (HEAD_FIELDS if self.heads else ())
                if k in have and have[k] != current[k]
                and not (relayable and k in relayout.LAYOUT_FIELDS)]
    if self.optimizer is not None:
      have = saved.get("optimizer", {})
      diffs += [f"train.{k}: checkpoint {have[k]!r} vs config {v!r}"
                for k, v in self.optimizer.items() if k in have and have[k] != v]
    fp = saved.get("tokenizer_fingerprint")
    if self.tokenizer_fingerprint is not None and fp is not None and (
        fp != self.tokenizer_fingerprint):
      diffs.append(f"tokenizer: checkpoint {fp} vs data {self.tokenizer_fingerprint} (the "
                   "embedding rows would index other pieces)")
    if diffs:
      raise CheckpointMismatchError(
          f"The checkpoint at {where} was saved by a different run ({'; '.join(diffs)}). Use the "
          "config it was trained with, or a new --workdir to start another run (to start from its "
          "weights with a new layout or vocabulary, convert them first).")


def optimizer_fields(train_config) -> dict:
  return {k: getattr(train_config, k) for k in OPTIMIZER_FIELDS}


def check_model_matches(saved: Mapping[str, Any], config: BertConfig, where: str) -> None:
  """Raises if the saved model config differs from `config` in a shape-defining field."""
  Expected(model=config).check({"model": saved}, where)


def is_damage(err: BaseException) -> bool:
  """Whether a restore failed on damaged files (skippable) rather than on a real error."""
  for cause in _causes(err):
    if isinstance(cause, (FileNotFoundError, EOFError, json.JSONDecodeError,
                          errors.DamagedFileError)):
      return True
    text = f"{type(cause).__name__}: {cause}"
    if any(marker in text for marker in _DAMAGE_MARKERS):
      return True
  return False


def damage_summary(err: BaseException) -> str:
  """What is damaged, in one short line: the file tensorstore could not read and its status code
  when the error names them (which array failed first varies from run to run; the file does
  not), else the error's first line."""
  text = str(err)
  for cause in _causes(err):
    if isinstance(cause, errors.DamagedFileError):
      return str(cause).split(": it was")[0]
    found = re.findall(r'local file "([^"]+)"', str(cause))
    if found:
      code = re.match(r"([A-Z_]+):", str(cause))
      return f"{code.group(1) + ': ' if code else ''}{found[-1]} is missing or cut short"
  return f"{type(err).__name__}: {text.splitlines()[0][:300] if text else ''}"


def _causes(err: BaseException):
  """The error and the ones it was raised from (orbax wraps tensorstore's)."""
  seen = set()
  while err is not None and id(err) not in seen:
    seen.add(id(err))
    yield err
    err = err.__cause__ or err.__context__


def _agree(value: int) -> int:
  """Process 0's value on every process (one host's listing of shared storage decides)."""
  if jax.process_count() == 1:
    return value
  return int(multihost_utils.broadcast_one_to_all(np.array(value, np.int64)))


def _all_true(flag: bool) -> bool:
  if jax.process_count() == 1:
    return flag
  return bool(np.all(multihost_utils.process_allgather(np.array([flag], np.int32))))


class Checkpointer:
  """Orbax CheckpointManager over named pytree items and a JSON meta item."""

  def __init__(self, directory: str, items: tuple[str, ...], *, save_every: int, keep: int,
               async_save: bool = True, read_only: bool = False):
    self.directory = _abspath(directory)
    self.items = tuple(items)
    # A reader of another run's checkpoints creates and removes nothing there (that run may be
    # saving). Each manager names its barriers by its folder: two async managers of one run
    # (fine-tuning's "best" beside its checkpoints) finishing at once met at orbax's one key.
    options = ocp.CheckpointManagerOptions(
        save_interval_steps=save_every, max_to_keep=keep, create=not read_only,
        enable_async_checkpointing=async_save, cleanup_tmp_directories=not read_only,
        read_only=read_only, multiprocessing_options=ocp.options.MultiprocessingOptions(
            barrier_sync_key_prefix=re.sub(r"\W", "_", self.directory)))
    _one_writer_per_array_on_a_cpu()
    handlers = {name: ocp.StandardCheckpointHandler() for name in self.items}
    handlers[META] = ocp.JsonCheckpointHandler()
    self._manager = ocp.CheckpointManager(self.directory, options=options,
                                          item_handlers=handlers)

  @classmethod
  def reader(cls, directory: str) -> "Checkpointer":
    """Reads the parameters and records of a run's checkpoints, touching nothing there."""
    return cls(directory, ("params",), save_every=1, keep=1, async_save=False, read_only=True)

  def item_metadata(self, step: int, item: str) -> Any:
    """The stored tree of one item (shapes and dtypes, no arrays)."""
    return self._manager.item_metadata(step)[item]

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

  def restore_relaid(self, step: int, abstract_items: Mapping[str, Any], model: BertConfig,
                     where: str) -> tuple[dict, dict]:
    """`restore` of a step saved in the other layer layout: each item read whole onto one local
    device, restacked (relayout.relaid) and placed as `abstract_items` says."""
    relayout.check_restackable(model, where)
    one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    items, meta = self.restore(step, {name: jax.tree.map(
        lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one),
        self.item_metadata(step, name)) for name in abstract_items})
    out = {name: put_like(relayout.relaid(jax.tree.map(np.asarray, items[name]), abstract,
                                          model.num_layers, where), abstract)
           for name, abstract in abstract_items.items()}
    if jax.process_index() == 0:
      print(f"bertjax: {where} was saved with model.scan_layers={not model.scan_layers}; its "
            f"parameters and optimizer state restacked for model.scan_layers={model.scan_layers}",
            flush=True)
    return out, meta

  def restore_subtree(self, step: int, item: str, key: str, target: Any, elsewhere) -> Any:
    """`item[key]` of one step, placed like `target` (a tree of ShapeDtypeStructs with shardings,
    the same structure as the stored subtree); the rest of the item is read onto `elsewhere` (a
    sharding) and dropped. For taking a pre-trained encoder out of a run with other heads."""
    stored = self._manager.item_metadata(step)[item]
    abstract = subtrees_target(stored, {key: target}, elsewhere,
                               f"{self.directory} step {step}", item)
    items, _ = self.restore(step, {item: abstract})
    return items[item][key]

  def restore_stored(self, step: int, item: str) -> Any:
    """One item of one step with the shapes and dtypes it was saved with, on this process's
    devices (to read a run's parameters outside a run, e.g. to export them)."""
    restored = self._manager.restore(step, args=ocp.args.Composite(
        **{item: ocp.args.StandardRestore()}))
    return restored[item]

  def delete(self, step: int) -> None:
    self._manager.delete(step)

  def read_meta(self, step: int) -> dict:
    try:
      return dict(self._manager.restore(step, args=ocp.args.Composite(
          **{META: ocp.args.JsonRestore()}))[META])
    except json.JSONDecodeError as err:
      # Orbax's error names no file: name the record (the layout orbax writes it in).
      path = os.path.join(self.directory, str(step), META, "metadata")
      raise errors.DamagedFileError(
          f"{path} (step {step}'s record) is not valid JSON ({err.msg} at line {err.lineno}, "
          f"column {err.colno}): it was cut short") from err

  def restore_latest(self, abstract_items: Mapping[str, Any], expected: Expected | None = None
                     ) -> tuple[int, dict, dict] | None:
    """(step, items, meta) of the newest checkpoint that restores, or None if there is none.

    A mismatch with `expected` is an error, never skipped: resuming a run with the wrong config
    must not silently fall back or start over. See the module docstring for damage.
    """
    steps = self.all_steps()
    damaged: list[tuple[int, str]] = []
    candidate = _agree(steps[-1] if steps else -1)
    while candidate >= 0:
      step = candidate
      where = f"{self.directory} step {step}"
      error = None
      try:
        meta = self.read_meta(step)
        if expected is not None:
          expected.check(meta, where, relayable=True)
        if expected is not None and expected.model is not None and relayout.differs(
            meta, expected.model):
          items, meta = self.restore_relaid(step, abstract_items, expected.model, where)
        else:
          items, meta = self.restore(step, abstract_items)
      except CheckpointMismatchError:
        raise
      except Exception as err:  # pylint: disable=broad-except
        if not is_damage(err):
          raise RuntimeError(
              f"Checkpoint {where} could not be restored ({type(err).__name__}: {err}). This is "
              "not a known kind of damage, so it is not skipped: fix the cause (the config, the "
              "mesh, the installed versions) and run again.") from err
        error = damage_summary(err)
      if _all_true(error is None):
        for bad_step, reason in damaged:
          self._set_aside(bad_step, reason)
        return step, items, meta
      damaged.append((step, error or "damaged on another host"))
      older = [s for s in steps if s < step]
      candidate = _agree(older[-1] if older else -1)
      logging.warning("Checkpoint %s is damaged (%s); trying the one before.", where,
                      damaged[-1][1])
      if jax.process_index() == 0:
        print(f"bertjax: skipping checkpoint step {step}, damaged ({damaged[-1][1]}); "
              + (f"trying step {candidate}" if candidate >= 0 else "no older step"), flush=True)
    if damaged:
      raise RuntimeError(
          f"None of the {len(damaged)} checkpoint(s) in {self.directory} restores: "
          + "; ".join(f"step {s}: {r}" for s, r in damaged)
          + ". The run does not start over in a workdir that holds checkpoints: repair or move "
          "them away (or use a new --workdir) and run again.")
    return None

  def _set_aside(self, step: int, reason: str) -> None:
    """Moves a damaged step out of the manager's folder, where it would collide with a new save."""
    aside = epath.Path(self.directory + ".damaged") / f"{step}-{int(time.time())}"
    if jax.process_index() == 0:
      aside.parent.mkdir(parents=True, exist_ok=True)
      epath.Path(self.directory, str(step)).rename(aside)
      (aside / "DAMAGE.txt").write_text(reason + "\n")
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f"bertjax set aside checkpoint {step}")
    self._manager.reload()
    logging.warning("Moved damaged checkpoint step %d to %s (%s).", step, aside, reason)
    if jax.process_index() == 0:
      print(f"bertjax: checkpoint step {step} was damaged ({reason}); moved to {aside}",
            flush=True)

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


def put_like(values: Any, abstract: Any) -> Any:
  """Host arrays (numpy, the same on every process) placed as `abstract` (ShapeDtypeStructs with
  shardings, the same tree) says: each device takes its own slice. Every array of another shape
  is named in one CheckpointMismatchError."""
  problems = [f"{jax.tree_util.keystr(path)}: {np.shape(value)}, model {tuple(like.shape)}"
              for (path, value), like in zip(jax.tree_util.tree_leaves_with_path(values),
                                             jax.tree.leaves(abstract))
              if tuple(np.shape(value)) != tuple(like.shape)]
  if problems:
    raise CheckpointMismatchError(f"{len(problems)} array(s) do not fit the model: "
                                  + "; ".join(problems[:10]))

  def put(value, like):
    value = np.asarray(value, like.dtype)
    if like.sharding is None:
      return jax.device_put(value)
    return jax.make_array_from_callback(value.shape, like.sharding, lambda index: value[index])
  return jax.tree.map(put, values, abstract)


def subtrees_target(stored: Any, targets: Mapping[str, Any], elsewhere, where: str,
                    item: str = "params") -> Any:
  """A restore target for a stored tree (orbax metadata, or anything with shapes) whose subtrees
  named in `targets` go where those say (ShapeDtypeStructs with shardings) and the rest onto
  `elsewhere` (a sharding) in its stored shapes. Raises CheckpointMismatchError listing every
  leaf that does not fit."""
  lacking = sorted(set(targets) - set(stored))
  if lacking:
    raise CheckpointMismatchError(f"{where} holds no {item}{lacking} (it holds {sorted(stored)}).")
  wanted = {(jax.tree_util.DictKey(key),) + path: leaf for key, target in targets.items()
            for path, leaf in jax.tree_util.tree_flatten_with_path(target)[0]}
  problems = []

  def place(path, leaf):
    if path[:1] and path[0] in {jax.tree_util.DictKey(k) for k in targets}:
      like = wanted.pop(path, None)
      if like is None:
        problems.append(f"unexpected {jax.tree_util.keystr(path)}")
      elif tuple(like.shape) != tuple(leaf.shape):
        problems.append(f"{jax.tree_util.keystr(path)}: stored {tuple(leaf.shape)}, model "
                        f"{tuple(like.shape)}")
      else:
        return jax.ShapeDtypeStruct(leaf.shape, like.dtype, sharding=like.sharding)
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=elsewhere)

  abstract = jax.tree_util.tree_map_with_path(place, stored)
  problems += [f"missing {jax.tree_util.keystr(path)}" for path in wanted]
  if problems:
    raise CheckpointMismatchError(
        f"{where}: its {', '.join(targets)} do not fit this model: "
        + "; ".join(problems[:10]) + (f" (and {len(problems) - 10} more)"
                                      if len(problems) > 10 else ""))
  return abstract
