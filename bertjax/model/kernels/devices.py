"""What the kernels that take tokens (mlp_kernel, end_kernel, mlm_kernel) share: their call on
each device's rows under the mesh in scope (a Pallas kernel is one device's program, so they run
in shard_map over the activations' batch axes, their weights whole on each device), a whole array
as one block, and the weights' gradients a backward sums over its token blocks, written once.
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec

from bertjax.parallel import platforms

TOKEN_BLOCKS = (512, 256, 128, 64, 32, 16, 8)  # tokens a grid step, the largest that divides
CHUNKS = (512, 256, 128)  # columns made or written at a time inside a step


def token_block(tokens: int, largest: int = TOKEN_BLOCKS[0]) -> int:
  """A kernel's tokens a grid step: the largest of TOKEN_BLOCKS up to `largest` dividing them."""
  return next((b for b in TOKEN_BLOCKS if b <= largest and tokens % b == 0), tokens)


def chunk(width: int) -> int:
  """Columns of a `width`-wide array a step handles at a time: the largest of CHUNKS dividing
  it, else all of them."""
  return next((c for c in CHUNKS if width % c == 0), width)


def whole(shape):
  """A block that is the whole array, fetched once (its index never changes) and not double
  buffered (nothing to overlap it with)."""
  return pl.BlockSpec(shape, lambda *_: (0,) * len(shape), pipeline_mode=pl.Buffered(1))


def per_device(fn, tokens: tuple, whole: tuple, outputs: tuple, inputs: tuple | None = None):
  """fn(*tokens, *whole) on each device's rows under the mesh in scope (shard_map over the
  activations' batch axes), or once without one. `tokens`: arrays split by rows, [N, ...]
  ("tokens") or [3, N, ...] ("thirds"), as `inputs` names each (all "tokens" by default);
  `whole`: arrays every device gets whole; `outputs`: each result's kind, "tokens", "thirds",
  "sums" ([1, ...] per device, stacked over the devices for the caller to add) or `summed`'s (a
  parameter's gradient, the total of every device's and core's sums, float32)."""
  mesh = jax.sharding.get_abstract_mesh()
  # Each `summed` output's mesh axes to reduce-scatter it over inside the shard_map, () where
  # its shards would not fill whole tiles (stacked over the devices, for XLA to add).
  split = {i: _split_axes(mesh, kind) for i, kind in enumerate(outputs)
           if isinstance(kind, tuple)}
  if mesh.empty:
    return _added(fn(*tokens, *whole), {i: (0, ()) for i in split}, None)
  batch = nn.logical_to_mesh_axes(("activation_batch",))[0]
  spec = {"tokens": PartitionSpec(batch, None), "sums": PartitionSpec(batch, None, None),
          "thirds": PartitionSpec(None, batch, None)}
  out_specs = tuple(
      spec[kind] if i not in split
      else PartitionSpec(*([None] * kind[1]), split[i]) if split[i]
      else PartitionSpec(batch, *([None] * len(kind[2]))) for i, kind in enumerate(outputs))
  inputs = ("tokens",) * len(tokens) if inputs is None else inputs
  inside = {i: (outputs[i][1], axes) for i, axes in split.items() if axes}
  rest = lambda axes: tuple(a for a in _mesh_axes(mesh, "activation_batch") if a not in axes)
  outs = jax.shard_map(
      lambda *args: _added(fn(*args), inside, rest), mesh=mesh,
      in_specs=tuple(spec[kind] for kind in inputs) + (PartitionSpec(),) * len(whole),
      out_specs=out_specs[0] if len(out_specs) == 1 else out_specs,
      # pallas_call's outputs carry no varying-manual-axes type for shard_map to check.
      check_vma=False)(*tokens, *whole)
  return _added(outs, {i: (0, ()) for i, axes in split.items() if not axes}, None)


def summed(axis: int, shape: tuple) -> tuple:
  """per_device's output kind for a parameter's gradient of `shape`, a device's [cores, *shape]
  sums: the total over every device and core, float32, its `axis` split as the parameters'
  "embed" axis is. The devices' sums are reduce-scattered as the kernel wrote them and the
  cores' added on the shard after (added first, they were read and written whole again: 0.9 GB
  of BERT-Large L 128's step on v5p-8), where the shards fill whole tiles (`splits`); else
  stacked over the devices and added by XLA."""
  return ("summed", axis, tuple(shape))


def splits(kind) -> bool:
  """Whether a `summed` output is reduce-scattered over the chips in its shard_map (the mesh in
  scope's batch axes split the parameters' "embed" axis, divide its length, and leave each
  shard whole tiles: 128 lanes along the last axis, 16 rows along another)."""
  return bool(_split_axes(jax.sharding.get_abstract_mesh(), kind))


def _mesh_axes(mesh, logical: str) -> tuple[str, ...]:
  """The mesh axes (more than one device each) the rules in scope map `logical` to."""
  axes = nn.logical_to_mesh_axes((logical,))[0]
  axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
  return tuple(a for a in axes if dict(mesh.shape)[a] > 1)


def _split_axes(mesh, kind) -> tuple[str, ...]:
  if mesh.empty:
    return ()
  batch = _mesh_axes(mesh, "activation_batch")
  split = tuple(a for a in _mesh_axes(mesh, "embed") if a in batch)
  _, axis, shape = kind
  ways = math.prod(dict(mesh.shape)[a] for a in split)
  tile = 128 if axis == len(shape) - 1 else 16
  return split if split and shape[axis] % (ways * tile) == 0 else ()


def _added(outs, which: dict, rest):
  """fn's results with each output `which` names, {index: (axis, mesh axes)}, reduce-scattered
  over those mesh axes along its gradient's `axis` and summed over the batch's `rest(axes)`
  (inside per_device's shard_map; no mesh axes: neither), then added over its leading axis
  (the cores', or the devices' where stacked) in float32."""
  if not which:
    return outs
  single = not isinstance(outs, (tuple, list))
  outs = [outs] if single else list(outs)
  for i, (axis, axes) in which.items():
    partial = outs[i]
    if axes:
      partial = jax.lax.psum_scatter(partial, axes, scatter_dimension=axis + 1, tiled=True)
      if rest(axes):
        partial = jax.lax.psum(partial, rest(axes))
    outs[i] = partial.astype(jnp.float32).sum(0)
  return outs[0] if single else tuple(outs)


def on_platform(kernel, fallback, *args, cpu_interprets: bool = True, **kwargs):
  """kernel(*args, **kwargs) by Mosaic on a TPU (also a TPU program compiled on a CPU host), by
  Pallas' interpreter on a CPU (tests; `fallback` there where not `cpu_interprets`), and
  elsewhere (a GPU) `fallback`, XLA's arithmetic of the same formula, so a config that asks for
  the kernels still runs there."""
  xla = functools.partial(fallback, **kwargs)
  return jax.lax.platform_dependent(
      *args, tpu=functools.partial(kernel, **kwargs, interpret=False),
      cpu=functools.partial(kernel, **kwargs, interpret=True) if cpu_interprets else xla,
      default=xla)


def with_first_token(key_1x4, tokens: int):
  """Inside per_device's fn, of `tokens` rows a device: key_1x4 (int32 [1, 4]) with [0, 2] the
  global index of the device's first row (the batch axes split the rows in order)."""
  mesh = jax.sharding.get_abstract_mesh()
  batch = None if mesh.empty else nn.logical_to_mesh_axes(("activation_batch",))[0]
  first = 0 if batch is None else jax.lax.axis_index(batch) * tokens
  return key_1x4.at[0, 2].set(jnp.asarray(first, jnp.int32))


def sequences(blocks: int) -> int:
  """A backward's sequences of its `blocks` token blocks: the chip's TensorCores (each sums its
  own, the parallel axis of the grid) where they divide the blocks, else one."""
  cores = platforms.tpu_cores()
  return cores if blocks % cores == 0 else 1


def copied(src_ref, dst_ref, sem):
  """src_ref copied into dst_ref (a VMEM block into an output left in HBM), waited for."""
  copy = pltpu.make_async_copy(src_ref, dst_ref, sem)
  copy.start()
  copy.wait()


def write_sums(outs, accs, stage_ref, sem, chunk: int):
  """At a core's last token block: each float32 sum in `accs` (VMEM scratch) into its output in
  HBM (`outs`, [cores, ...], the core's row), in the output's dtype. A sum in another dtype is
  rounded a chunk of `chunk` columns at a time through `stage_ref` ([rows, chunk]), or where
  its rows are not the stage's, a chunk of `chunk` rows through `stage_ref`'s transposed twin
  (the second of a pair `stage_ref`, [chunk, columns]): an output block of the whole sum would
  hold another copy of the weights in VMEM (BERT-Large's MLP over v5p's 64 MiB)."""
  core = pl.program_id(0)  # read outside the branch: Pallas' interpreter finds it only here
  stages = stage_ref if isinstance(stage_ref, (tuple, list)) else (stage_ref,)

  @pl.when(pl.program_id(1) == pl.num_programs(1) - 1)
  def _():
    for out, acc in zip(outs, accs):
      if out.dtype == acc.dtype:
        copied(acc, out.at[core], sem)
        continue
      if acc.shape[0] == stages[0].shape[0]:
        for start in range(0, acc.shape[1], chunk):
          stages[0][...] = acc[:, pl.ds(start, chunk)].astype(stages[0].dtype)
          copied(stages[0], out.at[core, :, pl.ds(start, chunk)], sem)
        continue
      for start in range(0, acc.shape[0], chunk):
        stages[1][...] = acc[pl.ds(start, chunk), :].astype(stages[1].dtype)
        copied(stages[1], out.at[core, pl.ds(start, chunk), :], sem)
