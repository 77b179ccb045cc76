"""A checkpoint read into the other layout of the layers (`model.scan_layers`): scanned, one
stacked `layers/layer` tree, or straight, `layer_0`, `layer_1`, ... The parameters and every
parameter-shaped tree of the optimizer state are restacked, so a run resumes in either layout
(bertjax/training/checkpoint.py's `restore_latest`) and may move to a config, or a chip, whose step
is faster the other way.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import numpy as np

from bertjax.errors import CheckpointMismatchError

# The shape fields (bertjax/model/config.py) that only lay the same parameters out otherwise.
LAYOUT_FIELDS = ("scan_layers",)


def check_restackable(model, where: str) -> None:
  """Raises CheckpointMismatchError where `model` (a BertConfig) is not restacked on resume:
  scanned, layer 0 of a model whose first layer has no attention norm carries an identity one
  that straight code lacks, and its parameters and moments would need values of their own."""
  if model.skips_first_attention_norm:
    raise CheckpointMismatchError(
        f"{where} was saved with model.scan_layers={not model.scan_layers}, and this model "
        "(its first layer without an attention norm) is not restacked on resume: resume with "
        f"--config.model.scan_layers={not model.scan_layers}.")


def differs(meta: dict, model) -> bool:
  """Whether a checkpoint's record (`meta`, as Expected.meta writes it) lays the layers out
  otherwise than `model` (a BertConfig). A record without the field is taken as the same."""
  stored = meta.get("model", {})
  return any(k in stored and stored[k] != getattr(model, k) for k in LAYOUT_FIELDS)


def _names(path) -> tuple:
  """A pytree path as plain names: a dict key, an attribute (a NamedTuple's field, which orbax
  stores as a dict key) and a sequence index read alike."""
  return tuple(str(next((getattr(key, a) for a in ("key", "name", "idx") if hasattr(key, a)),
                        key)) for key in path)


def relaid(stored: Any, abstract: Any, num_layers: int, where: str) -> Any:
  """`stored` (a restored tree of host arrays, in the other layer layout) as `abstract`'s tree
  (ShapeDtypeStructs): each leaf found under the same names, and the layers' leaves restacked,
  scanned `.../layers/layer/X` [num_layers, ...] <-> straight `.../layer_i/X`. Works on any tree
  that holds parameter-shaped subtrees (the parameters, the optimizer's moments). Raises
  CheckpointMismatchError naming what has no counterpart."""
  have = {_names(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(stored)}
  values, problems = [], []
  for path, like in jax.tree_util.tree_leaves_with_path(abstract):
    names = _names(path)
    if names in have:
      values.append(have[names])
      continue
    found = None
    for at in range(len(names) - 1):
      if names[at:at + 2] == ("layers", "layer"):  # wanted scanned: stack the straight layers
        parts = [have.get(names[:at] + (f"layer_{i}",) + names[at + 2:])
                 for i in range(num_layers)]
        if all(p is not None for p in parts):
          found = np.stack(parts)
        break
      layer = re.fullmatch(r"layer_(\d+)", names[at])
      if layer:  # wanted straight: one layer of the stack
        stack = have.get(names[:at] + ("layers", "layer") + names[at + 1:])
        if stack is not None:
          found = np.asarray(stack)[int(layer.group(1))]
        break
    if found is None:
      problems.append("/".join(names))
    values.append(found)
  if problems:
    raise CheckpointMismatchError(
        f"{where}: its layers could not be restacked to this config's layout (no counterpart "
        f"for {', '.join(problems[:5])}{' ...' if len(problems) > 5 else ''}). Resume with the "
        "config's model.scan_layers as the checkpoint has it.")
  return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(abstract), values)
