"""The order in which a chip stores an array's shard in its memory, and gradients put in it.

A TPU stores an array in tiles of 8 x 128 (f32) along its two minor dimensions, and its runtime
lays a shard out to pad least: the word-embedding table's float32 shard on a v5p-8's 4 chips,
[30522, 192] under fsdp, is stored column-major ({0, 1}), since 192 lanes would pad to 256. The
parameters, and Adam's moments beside them, live in that order between steps. Their gradients
come from products and kernels that write rows ({1, 0}), and XLA meets the two at the update by
turning each of the parameter and its two moments to the gradient's order and back: six copies
of the table a step (~0.3 GB of BERT-Base L 128's 11.2 on v5p-8, docs/performance.md, "The
embedding table's gradient in the order the chip stores it"). A gradient put in the stored
order first (`as_stored`) is turned once, or not at all where its producer writes it so
(on v5p mlm_grads writes the table's gradient [D, V] where a shard's D would not fill a
tile's lanes).

The order is the runtime's own answer (the client's default layout for the shard's shape and
dtype), asked of the devices the step is compiled for: libtpu's compile-only client answers as a
TPU host's does. A CPU and a GPU store every array row-major, and nothing is constrained there.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.experimental import layout as jax_layout


def stored(dtype, shard_shape: tuple, device) -> tuple[int, ...] | None:
  """The major-to-minor order (jax's Layout) in which `device` stores an array shard of
  `shard_shape` and `dtype`; None where that is row-major (every CPU and GPU array) or the
  runtime does not say. A query of the runtime, not of a trace: also inside jit."""
  try:
    layout = device.client.get_default_layout(np.dtype(dtype), tuple(shard_shape), device)
  except (AttributeError, NotImplementedError, jax.errors.JaxRuntimeError):
    return None  # a client without the query keeps XLA's own choice
  order = tuple(jax_layout.Layout.from_pjrt_layout(layout).major_to_minor)
  return None if order == tuple(range(len(shard_shape))) else order


def as_stored(tree, shardings):
  """Each array of `tree` (gradients, float32) constrained to the order its parameter's shard is
  stored in under `shardings` (a matching tree of NamedShardings); unchanged where that is
  row-major, or without shardings."""
  if shardings is None:
    return tree

  def one(x, sharding):
    if x.ndim < 2 or math.prod(x.shape) == 0:
      return x
    # This process's own device: the runtime answers for the devices it holds (a pod's other
    # hosts' store their shards as it does).
    local = sharding.mesh.local_devices
    order = stored(x.dtype, sharding.shard_shape(x.shape),
                   local[0] if local else sharding.mesh.devices.flat[0])
    return x if order is None else jax_layout.with_layout_constraint(
        x, jax_layout.Layout(major_to_minor=order))

  return jax.tree.map(one, tree, shardings)
