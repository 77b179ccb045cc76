"""What the kernels that take tokens (mlp_kernel, mlm_kernel) share: their call on each device's
rows under the mesh in scope (a Pallas kernel is one device's program, so they run in shard_map
over the activations' batch axes, their weights whole on each device), and a whole array as one
block.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec


def whole(shape):
  """A block that is the whole array, fetched once (its index never changes) and not double
  buffered (nothing to overlap it with)."""
  return pl.BlockSpec(shape, lambda *_: (0,) * len(shape), pipeline_mode=pl.Buffered(1))


def per_device(fn, tokens: tuple, whole: tuple, outputs: tuple):
  """fn(*tokens, *whole) on each device's rows under the mesh in scope (shard_map over the
  activations' batch axes), or once without one. `tokens`: [N, ...] arrays split by rows;
  `whole`: arrays every device gets whole; `outputs`: each result's kind, "tokens" (split by
  rows) or "sums" ([1, ...] per device, stacked over the devices for the caller to add)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return fn(*tokens, *whole)
  batch = nn.logical_to_mesh_axes(("activation_batch",))[0]
  spec = {"tokens": PartitionSpec(batch, None), "sums": PartitionSpec(batch, None, None)}
  out_specs = tuple(spec[kind] for kind in outputs)
  return jax.shard_map(
      fn, mesh=mesh,
      in_specs=(spec["tokens"],) * len(tokens) + tuple(PartitionSpec(None, None) for _ in whole),
      out_specs=out_specs[0] if len(out_specs) == 1 else out_specs,
      # pallas_call's outputs carry no varying-manual-axes type for shard_map to check.
      check_vma=False)(*tokens, *whole)


def with_first_token(key_1x4, tokens: int):
  """Inside per_device's fn, of `tokens` rows a device: key_1x4 (int32 [1, 4]) with [0, 2] the
  global index of the device's first row (the batch axes split the rows in order)."""
  mesh = jax.sharding.get_abstract_mesh()
  batch = None if mesh.empty else nn.logical_to_mesh_axes(("activation_batch",))[0]
  first = 0 if batch is None else jax.lax.axis_index(batch) * tokens
  return key_1x4.at[0, 2].set(jnp.asarray(first, jnp.int32))
