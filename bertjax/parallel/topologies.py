"""Cloud TPU slice types: accelerator type -> chips along each ICI dimension, hosts, chip facts.

The one table of slice shapes for `bertjax.aot` (what it compiles for) and `launch/tpu.py` (what
it creates); imports nothing heavy, so the launcher loads it without jax.

Where the shapes come from (Cloud TPU documentation):
- v4 and v5p, 3D: https://cloud.google.com/tpu/docs/types-topologies ("AxBxC where A<=B<=C and
  A, B, C are either all <= 4 or all integer multiples of 4"); the shapes below one cube that
  the v4 and v5p pages list (2x2x1, 2x2x2, 2x2x4, 2x4x4); a v4 pod has 4096 chips, 64 cubes of
  4x4x4 (https://cloud.google.com/tpu/docs/v4); "the maximum v5p shape is 16x16x24 (6144 chips,
  96 cubes)" and v5p accelerator types run "v5p-8 ... v5p-1024 ... v5p-12288"
  (https://cloud.google.com/tpu/docs/v5p). So v5p-384 is 3 cubes, 4x4x12; v5p-24 (12 chips)
  does not exist.
- v5e and v6e, 2D: the tables of https://cloud.google.com/tpu/docs/v5e and
  https://cloud.google.com/tpu/docs/v6e (1x1, 2x2, 2x4, 4x4, 4x8, 8x8, 8x16, 16x16).
An accelerator type names a number of TensorCores (v4, v5p: two per chip) or chips (v5e, v6e).
When several shapes have that many chips, Cloud TPU's default is "the one most similar to a
cube" (types-topologies), and so it is here.
"""

from __future__ import annotations

import dataclasses
import math
import re

from bertjax.errors import Refusal



@dataclasses.dataclass(frozen=True)
class Generation:
  name: str  # the prefix of Cloud TPU accelerator types: v4, v5p, v5litepod, v6e
  short: str  # the name people use (v5e for v5litepod)
  cores_per_chip: int  # what the number in an accelerator type counts per chip
  libtpu_name: str  # the prefix of libtpu's topology names ("v5" is v5p)
  chip_config: str  # libtpu's "megacore": both TensorCores of a chip are one JAX device
  hbm_gib: float  # HBM per chip
  runtime_version: str  # https://cloud.google.com/tpu/docs/runtimes
  shapes: tuple[tuple[int, ...], ...]  # every slice shape, in chips along each ICI dimension
  device_kind: str  # jax's Device.device_kind for its chips, which the "auto" settings read


# Below one cube, the shapes the v4 and v5p pages list; from one cube (4x4x4) up, every AxBxC of
# multiples of 4 with A<=B<=C and at most `max_cubes` cubes.
_SMALL_3D = ((2, 2, 1), (2, 2, 2), (2, 2, 4), (2, 4, 4))
_GRIDS = ((1, 1), (2, 2), (2, 4), (4, 4), (4, 8), (8, 8), (8, 16), (16, 16))


def _cube_shapes(max_cubes: int) -> tuple[tuple[int, int, int], ...]:
  out = []
  for a in range(1, max_cubes + 1):
    for b in range(a, max_cubes // a + 1):
      for c in range(b, max_cubes // (a * b) + 1):
        out.append((4 * a, 4 * b, 4 * c))
  return tuple(out)


GENERATIONS = {
    "v4": Generation("v4", "v4", 2, "v4", "megacore", 32.0, "tpu-ubuntu2204-base",
                     _SMALL_3D + _cube_shapes(64), "TPU v4"),
    "v5p": Generation("v5p", "v5p", 2, "v5", "megacore", 95.0, "v2-alpha-tpuv5",
                      _SMALL_3D + _cube_shapes(96), "TPU v5"),
    "v5litepod": Generation("v5litepod", "v5e", 1, "v5e", "default", 16.0, "v2-alpha-tpuv5-lite",
                            _GRIDS, "TPU v5 lite"),
    "v6e": Generation("v6e", "v6e", 1, "v6e", "default", 32.0, "v2-alpha-tpuv6e", _GRIDS,
                     "TPU v6 lite"),
}
ALIASES = {"v5e": "v5litepod"}  # bertjax.aot has always taken v5e-N


@dataclasses.dataclass(frozen=True)
class SliceType:
  """One accelerator type, e.g. v5p-384: 192 chips, 4x4x12, 48 hosts."""

  name: str  # as Cloud TPU spells it (v5litepod-16, never v5e-16)
  generation: Generation
  shape: tuple[int, ...]

  @property
  def chips(self) -> int:
    return math.prod(self.shape)

  @property
  def cores(self) -> int:
    return self.chips * self.generation.cores_per_chip

  @property
  def hosts(self) -> int | None:
    """TPU VMs of the slice: 4 chips each on v4/v5p; on v5e/v6e one VM up to 8 chips, and above
    that a number that depends on the VM shape Cloud TPU picks (None)."""
    if self.generation.cores_per_chip == 2:
      return max(1, self.chips // 4)
    return 1 if self.chips <= 8 else None

  @property
  def libtpu_name(self) -> str:
    return f"{self.generation.libtpu_name}:{'x'.join(map(str, self.shape))}"


def _cubeness(shape: tuple[int, ...]) -> tuple:
  """Smaller is more like a cube: the ratio of the longest side to the shortest, then sides."""
  return (max(shape) / min(shape), max(shape), shape)


def slice_types(generation: str) -> dict[str, SliceType]:
  """Accelerator type -> slice, for one generation, in increasing size."""
  gen = GENERATIONS[generation]
  best: dict[int, tuple[int, ...]] = {}
  for shape in gen.shapes:
    chips = math.prod(shape)
    if chips not in best or _cubeness(shape) < _cubeness(best[chips]):
      best[chips] = shape
  return {f"{gen.name}-{chips * gen.cores_per_chip}": SliceType(
      f"{gen.name}-{chips * gen.cores_per_chip}", gen, shape) for chips, shape in sorted(best.items())}


def describe_known(generation: str) -> str:
  """The accelerator types of a generation, in a line: those below one cube by name, the whole
  cubes as a range."""
  types = slice_types(generation)
  small = [n for n, t in types.items() if t.chips < 64 or len(t.shape) == 2]
  cubes = [t for t in types.values() if t.chips >= 64 and len(t.shape) == 3]
  if not cubes:
    return ", ".join(small)
  per_cube = 64 * cubes[0].generation.cores_per_chip
  return (f"{', '.join(small)}, and {cubes[0].generation.name}-{per_cube}xN for N = 1 to "
          f"{len(cubes)} cubes of 4x4x4 chips ({cubes[0].name} ... {cubes[-1].name})")


def parse(name: str) -> SliceType:
  """"v5p-384" -> SliceType(4x4x12); raises ValueError naming the nearest valid types."""
  found = re.fullmatch(r"(v\d+[a-z]*)-(\d+)", name or "")
  generation = ALIASES.get(found.group(1), found.group(1)) if found else None
  if generation not in GENERATIONS:
    known = "; ".join(f"{g}: {describe_known(g)}" for g in GENERATIONS)
    raise Refusal(f"Unknown accelerator type {name!r}: the generations known here are "
                  f"{', '.join(GENERATIONS)} (v5e is v5litepod). Known types: {known}")
  gen = GENERATIONS[generation]
  size = int(found.group(2))
  canonical = f"{gen.name}-{size}"
  types = slice_types(generation)
  if canonical in types:
    return types[canonical]
  unit = "TensorCores (2 per chip)" if gen.cores_per_chip == 2 else "chips"
  near = sorted(types, key=lambda n: (abs(types[n].cores - size), types[n].cores))[:2]
  near = sorted(near, key=lambda n: types[n].cores)
  shapes = ", ".join(f"{n} ({'x'.join(map(str, types[n].shape))})" for n in near)
  raise Refusal(f"Unknown accelerator type {name!r}: {gen.name} has no slice of {size} {unit}; "
                f"nearest: {shapes}. Known {gen.name} types: {describe_known(generation)}")


@dataclasses.dataclass(frozen=True)
class Topology:
  """A slice (or `num_slices` identical slices) by accelerator type, e.g. "v5p-128"."""

  name: str  # as given, with v5e for v5litepod ("v5e-256")
  generation: str  # v4, v5p, v5e, v6e
  shape: tuple[int, ...]  # chips along each ICI dimension of one slice
  num_slices: int = 1
  slice_type: SliceType | None = None

  @property
  def chips_per_slice(self) -> int:
    return math.prod(self.shape)

  @property
  def num_chips(self) -> int:
    return self.chips_per_slice * self.num_slices

  @property
  def hbm_gib(self) -> float:
    return self.slice_type.generation.hbm_gib

  @property
  def libtpu_name(self) -> str:
    return self.slice_type.libtpu_name

  def __str__(self) -> str:
    return self.name if self.num_slices == 1 else f"{self.num_slices} x {self.name}"


def parse_topology(name: str, num_slices: int = 1) -> Topology:
  """"v5p-128" -> Topology(v5p, 4x4x4); "v5litepod-N" is v5e-N; an unknown name raises naming
  the nearest known ones (bertjax.parallel.topologies holds the table, shared with launch/tpu.py)."""
  try:
    slice_type = parse(name)
  except ValueError as e:
    raise Refusal(str(e).replace("Unknown accelerator type", "Unknown TPU topology", 1)) from None
  if num_slices < 1:
    raise Refusal(f"num_slices={num_slices} must be >= 1")
  gen = slice_type.generation
  short_name = f"{gen.short}-{slice_type.cores}"
  return Topology(short_name, gen.short, slice_type.shape, num_slices, slice_type)
