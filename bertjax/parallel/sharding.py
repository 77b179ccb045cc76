"""The device mesh, logical-axis sharding and the host-local -> global batch, from `config.mesh`.

Mesh axes, outermost first:
  data    pure data parallelism: the batch is split, parameters are replicated;
  fsdp    the batch is split AND parameters / optimizer state are split (ZeRO-3 style; XLA gathers
          each weight just before it is used);
  tensor  Megatron-style model parallelism: heads and the MLP are split (the default rules keep
          the vocabulary whole; see the comment in configs/base.py).

Sizes come in two groups: ICI (chips linked inside one slice) and DCN (between slices of a
multi-slice job). Axis size = ici * dcn. One ICI size and one DCN size may be -1: it takes what is
left. Parameters name their dimensions logically (bertjax/model/encoder.py); `DEFAULT_RULES` (the default
of `config.mesh.logical_axis_rules`) maps those names to mesh axes, so the model code never names a
mesh axis.

In your own code: build the mesh with `create_mesh` (or any mesh whose axes are `AxisType.Auto`)
and trace every init, apply and jitted step of the model inside `logical_context(mesh)`.

Every check here raises before anything is compiled, with the numbers that do not fit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, Mapping, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from bertjax.errors import Refusal


MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")  # the mesh axes the batch dimension is split over

Rules = tuple[tuple[str, Any], ...]

# Logical axis name -> mesh axis (or axes, or None = replicated). Parameters are named in
# bertjax/model/encoder.py ("vocab", "embed", "heads", "kv", "mlp", "layers"); activations carry
# "activation_*" names. `data` and `fsdp` split the batch; `fsdp` also splits parameters and
# optimizer state (ZeRO-3 style); `tensor` splits heads and the MLP (Megatron).
DEFAULT_RULES: Rules = (
    ("activation_batch", ("data", "fsdp")),
    ("activation_length", None),
    ("activation_embed", None),
    ("activation_heads", "tensor"),
    ("activation_kv", None),
    ("activation_mlp", "tensor"),
    # The vocabulary stays whole: XLA (jax 0.10.2, Shardy and GSPMD alike) miscompiles the
    # gradients of the MLM head when the tied table is split over both tensor and fsdp while
    # data > 1 too. Only the M masked positions are projected, so the cost is a few percent.
    ("activation_vocab", None),
    ("vocab", None),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv", None),
    ("mlp", "tensor"),
    ("layers", None),
)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Typed form of `config.mesh` (see configs/base.py for the meaning of each key)."""

  ici_data: int = -1
  ici_fsdp: int = 1
  ici_tensor: int = 1
  dcn_data: int = -1
  dcn_fsdp: int = 1
  dcn_tensor: int = 1
  logical_axis_rules: Rules = DEFAULT_RULES

  @classmethod
  def from_dict(cls, values: Mapping[str, Any]) -> "MeshConfig":
    values = dict(values)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
      raise Refusal(f"Unknown mesh config keys {unknown}; known keys are {sorted(known)}")
    if "logical_axis_rules" in values:  # absent: the field's own default, DEFAULT_RULES
      values["logical_axis_rules"] = rules_from_config(values["logical_axis_rules"])
    return cls(**values)

  @property
  def ici(self) -> tuple[int, int, int]:
    return (self.ici_data, self.ici_fsdp, self.ici_tensor)

  @property
  def dcn(self) -> tuple[int, int, int]:
    return (self.dcn_data, self.dcn_fsdp, self.dcn_tensor)


def rules_from_config(rules: Sequence) -> Rules:
  """Logical rules as hashable tuples (ConfigDict may hand back lists)."""
  out = []
  for name, axes in rules:
    if isinstance(axes, (list, tuple)):
      axes = tuple(axes)
    out.append((str(name), axes))
  return tuple(out)


def fill_sizes(sizes: Sequence[int], total: int, group: str) -> tuple[int, ...]:
  """Replaces the one -1 in `sizes` so that their product is `total`; raises with the numbers."""
  sizes = [int(s) for s in sizes]
  named = ", ".join(f"{group}_{a}={s}" for a, s in zip(MESH_AXES, sizes))
  if sum(s == -1 for s in sizes) > 1:
    raise Refusal(f"At most one {group} mesh size may be -1; got {named}")
  if any(s == 0 or s < -1 for s in sizes):
    raise Refusal(f"{group} mesh sizes must be positive or -1; got {named}")
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if total % known:
      raise Refusal(f"The {group} mesh ({named}) needs a multiple of {known} devices, but "
                    f"there are {total}")
    sizes[sizes.index(-1)] = total // known
  elif known != total:
    raise Refusal(f"The {group} mesh ({named}) has {known} devices but there are {total}; "
                  f"make the product {total} or set one size to -1")
  return tuple(sizes)


def _num_slices(devices) -> int:
  return len({getattr(d, "slice_index", 0) for d in devices})


def mesh_shape(config: MeshConfig, num_devices: int, num_slices: int = 1) -> dict[str, int]:
  """The size of each mesh axis, -1 filled. Raises if the sizes cannot match the devices."""
  if num_devices % num_slices:
    raise Refusal(f"{num_devices} devices cannot be split into {num_slices} slices evenly")
  dcn = fill_sizes(config.dcn, num_slices, "dcn")
  ici = fill_sizes(config.ici, num_devices // num_slices, "ici")
  return {a: i * d for a, i, d in zip(MESH_AXES, ici, dcn)}


def create_mesh(config: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """The global (data, fsdp, tensor) mesh over all devices of all processes.

  Inside one slice `create_device_mesh` orders devices so that neighbouring mesh coordinates are
  physical ICI neighbours; across slices `create_hybrid_device_mesh` keeps the DCN hops on the
  outer (slow) dimensions.
  """
  devices = list(jax.devices() if devices is None else devices)
  num_slices = _num_slices(devices)
  mesh_shape(config, len(devices), num_slices)  # raises with the numbers if they do not fit
  dcn = fill_sizes(config.dcn, num_slices, "dcn")
  ici = fill_sizes(config.ici, len(devices) // num_slices, "ici")
  if num_slices > 1:
    grid = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, allow_split_physical_axes=True)
  else:
    grid = mesh_utils.create_device_mesh(ici, devices, allow_split_physical_axes=True)
  return Mesh(grid, MESH_AXES)


def check_auto_axes(mesh: Mesh | AbstractMesh | None, where: str = "") -> None:
  """Raises if `mesh` has Explicit axes, which the model does not support.

  On Explicit axes every sharding must be stated and each of the model's sharding constraints
  becomes an assertion: the embedding lookup (a gather) then fails with a ShardingTypeError deep in
  the trace. `jax.make_mesh` makes Explicit axes unless told otherwise.
  """
  if mesh is None or mesh.empty:
    return
  explicit = [name for name, kind in zip(mesh.axis_names, mesh.axis_types)
              if kind == AxisType.Explicit]
  if explicit:
    n = len(mesh.axis_names)
    raise Refusal(
        f"{where or 'The mesh'} has Explicit axes {explicit} (mesh {dict(mesh.shape)}, axis types "
        f"{tuple(t.name for t in mesh.axis_types)}); bertjax's modules shard by logical names, "
        "which needs Auto axes. Build the mesh with bertjax.sharding.create_mesh(MeshConfig(...)), or "
        f"jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * {n})")


def _mesh_scope(mesh: Mesh | AbstractMesh):
  if isinstance(mesh, AbstractMesh):
    return jax.sharding.use_abstract_mesh(mesh)
  try:
    # Outside jit the concrete mesh: eager code (an un-jitted apply, NNX variables created
    # sharded) needs devices, and traces started inside see its abstract mesh too.
    return jax.set_mesh(mesh)
  except ValueError:  # inside a trace only the abstract mesh may be set
    return jax.sharding.use_abstract_mesh(mesh.abstract_mesh)


@contextlib.contextmanager
def logical_context(mesh: Mesh | AbstractMesh | None = None, rules: Rules | None = None):
  """The logical-axis `rules` (default `DEFAULT_RULES`) and `mesh` in scope, for the model's
  sharding constraints. A context manager and a decorator:

      @jax.jit
      @sharding.logical_context(mesh)
      def step(params, batch): ...

  Trace every init, apply and step inside it. The model's activations carry
  `nn.with_logical_constraint`s (batch over data x fsdp, heads and MLP over tensor); traced
  without rules and mesh they are dropped without a word and XLA lays activations out as it
  guesses. `mesh=None` applies the rules alone (enough for `init` under `jax.eval_shape`, and for
  jit's `out_shardings` to place the parameters). Flax's rules are not part of jit's cache key:
  decorate the function you jit (as above) rather than calling an already traced one inside.
  """
  check_auto_axes(mesh)
  rules = DEFAULT_RULES if rules is None else rules_from_config(rules)
  with nn.logical_axis_rules(rules):
    if mesh is None:
      yield
    else:
      with _mesh_scope(mesh):
        yield


def logical_shards(name: str) -> int:
  """How many ways the mesh in scope splits the logical axis `name` (1 without a mesh): the
  product of the sizes of the mesh axes the rules in scope map it to."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return 1
  axes = nn.logical_to_mesh_axes((name,))[0]
  axes = (axes,) if isinstance(axes, str) else (axes or ())
  return math.prod(dict(mesh.shape)[a] for a in axes if a is not None)


def batch_axis_size(mesh: Mesh) -> int:
  """Number of ways the batch dimension is split (data x fsdp)."""
  return math.prod(mesh.shape[a] for a in BATCH_AXES)


def check_batch_size(global_batch_size: int, mesh: Mesh, num_microbatches: int = 1) -> None:
  """Each microbatch must split evenly over data x fsdp; raises with the numbers otherwise."""
  n = batch_axis_size(mesh)
  need = n * num_microbatches
  if global_batch_size % need:
    fix = global_batch_size - global_batch_size % need
    raise Refusal(
        f"Global batch size {global_batch_size} is not divisible by data x fsdp x microbatches = "
        f"{mesh.shape['data']} x {mesh.shape['fsdp']} x {num_microbatches} = {need}; "
        f"use a multiple of {need} such as {max(fix, need)}")


def check_model_fits(model_config, mesh: Mesh) -> None:
  """Tensor parallelism splits heads and the MLP: both must divide by the tensor axis."""
  t = mesh.shape["tensor"]
  problems = []
  if model_config.num_heads % t:
    problems.append(f"num_heads={model_config.num_heads} is not divisible by tensor={t}")
  if model_config.intermediate_size % t:
    problems.append(
        f"intermediate_size={model_config.intermediate_size} is not divisible by tensor={t}")
  if problems:
    raise Refusal("The model does not split over the mesh: " + "; ".join(problems)
                  + f" (mesh {dict(mesh.shape)})")


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Leading (batch) dimension over data x fsdp, everything else replicated."""
  return NamedSharding(mesh, PartitionSpec(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def check_spec_divides(spec: PartitionSpec, shape: tuple[int, ...], mesh: Mesh, where: str,
                       logical_names=None) -> None:
  """Raises if a mesh axis of `spec` does not divide the dimension it splits.

  jit needs every argument to split evenly. Replicating such a dimension instead would change the
  memory per device (and with fsdp, the whole point of the axis) without a word, so it is an
  error, raised while the shardings are derived, before anything is compiled.
  """
  problems = []
  for i, (dim, axes) in enumerate(zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec)))):
    names = () if axes is None else (axes if isinstance(axes, tuple) else (axes,))
    ways = math.prod(mesh.shape[a] for a in names)
    if ways > 1 and dim % ways:
      logical = "" if logical_names is None else f" (logical name {logical_names[i]!r})"
      sizes = " x ".join(f"{a}={mesh.shape[a]}" for a in names)
      fits = [d for d in range(1, min(dim, mesh.size) + 1) if dim % d == 0]
      problems.append(f"dimension {i} of size {dim}{logical} does not split {ways} ways over "
                      f"{sizes} (sizes that divide {dim}: {fits})")
  if problems:
    raise Refusal(
        f"Parameter {where} of shape {tuple(shape)} does not fit the mesh {dict(mesh.shape)}: "
        + "; ".join(problems) + ". Choose mesh sizes (mesh.ici_* x mesh.dcn_*) that divide it, "
        "or map its logical name to another mesh axis or to None in mesh.logical_axis_rules")


def _path_name(path) -> str:
  """(DictKey('params'), DictKey('bert'), ...) -> "params/bert/..."."""
  parts = (getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path)
  return "/".join(str(p) for p in parts)


def logical_shardings(boxed_tree: Any, mesh: Mesh, rules: Rules) -> Any:
  """NamedSharding for every leaf of a tree whose leaves may be `nn.Partitioned` (abstract ok).

  Leaves without logical names (step counters, scalars) are replicated.
  """
  specs = nn.get_partition_spec(boxed_tree)
  mesh_specs = nn.logical_to_mesh(specs, rules)
  values = nn.unbox(boxed_tree)

  def one(path, spec, logical, value):
    spec = spec if isinstance(spec, PartitionSpec) else PartitionSpec()
    logical = tuple(logical) if isinstance(logical, PartitionSpec) else None
    check_spec_divides(spec, value.shape, mesh, _path_name(path), logical)
    return NamedSharding(mesh, spec)

  is_spec = lambda x: isinstance(x, PartitionSpec) or x is None
  return jax.tree_util.tree_map_with_path(one, mesh_specs, specs, values, is_leaf=is_spec)


def host_batch_to_global(batch: Mapping[str, np.ndarray], mesh: Mesh,
                         global_batch_size: int | None = None) -> dict[str, jax.Array]:
  """Each process's numpy slice of the batch -> one global jax.Array per feature.

  Process p passes rows [p * B/P, (p+1) * B/P) of the global batch (in the order of
  `jax.process_index()`); with one process this is a sharded device_put.
  """
  sharding = batch_sharding(mesh)
  out = {}
  for name, local in batch.items():
    local = np.asarray(local)
    global_shape = (local.shape[0] * jax.process_count(),) + local.shape[1:]
    if global_batch_size is not None and global_shape[0] != global_batch_size:
      raise ValueError(f"Feature {name!r}: {jax.process_count()} processes x {local.shape[0]} "
                       f"local rows = {global_shape[0]}, expected global batch "
                       f"{global_batch_size}")
    check_batch_size(global_shape[0], mesh)
    out[name] = jax.make_array_from_process_local_data(sharding, local, global_shape)
  return out
