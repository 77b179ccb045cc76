"""What launch/tpu.py checks before anything is created or started: the accelerator type, the
config's mesh against the slice (ICI) and the slices (DCN), a shared workdir and data cache for
multi-host jobs.

`bertjax` (bertjax.parallel.topologies, no jax) and `configs` are imported through the sys.path entry that
found this package: the project's root, which holds all three.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import math
import os
import re

from bertjax.parallel import topologies
from launch.tpu_cloud import LaunchError
from launch.tpu_remote import RunPlan

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MESH_AXES = ("data", "fsdp", "tensor")


# --- The slice. --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Accelerator:
  name: str
  slice_type: topologies.SliceType

  @property
  def chips(self) -> int:
    return self.slice_type.chips

  @property
  def hosts(self) -> int | None:  # None: several, as many as the VM shape Cloud TPU picks
    return self.slice_type.hosts

  @property
  def multi_host(self) -> bool:
    return self.hosts is None or self.hosts > 1

  @property
  def runtime_version(self) -> str:
    return self.slice_type.generation.runtime_version

  def describe(self) -> str:
    hosts = "several hosts" if self.hosts is None else (
        f"{self.hosts} host{'s' if self.hosts > 1 else ''}")
    shape = "x".join(map(str, self.slice_type.shape))
    return f"{self.name}: {self.chips} chips (JAX devices) in {shape}, {hosts}"


def parse_accelerator(name: str) -> Accelerator:
  """`v5p-128` -> 64 chips on 16 hosts; every shape of bertjax.parallel.topologies (the table bertjax.aot
  compiles for). Raises LaunchError naming the nearest types for one that does not exist."""
  try:
    slice_type = topologies.parse(name)
  except ValueError as err:
    hint = (f" (Cloud TPU calls v5e slices v5litepod-N: --accelerator-type="
            f"{name.replace('v5e-', 'v5litepod-')})" if (name or "").startswith("v5e-") else "")
    raise LaunchError(f"{err}{hint}") from None
  if slice_type.name != name:  # v5e-N: create needs Cloud TPU's own name
    raise LaunchError(f"Unknown accelerator type {name!r}: Cloud TPU calls it {slice_type.name} "
                      f"(--accelerator-type={slice_type.name})")
  return Accelerator(name, slice_type)


# --- The config and its overrides (checked here so that a mismatch fails before paying). -------------


def config_overrides(flags: list[str]) -> dict[str, str]:
  """`--config.mesh.dcn_data=2` (or `--config.mesh.dcn_data 2`) -> {"mesh.dcn_data": "2"}."""
  out = {}
  for i, flag in enumerate(flags):
    if not flag.startswith("--config."):
      continue
    key, sep, value = flag[len("--config."):].partition("=")
    if not sep:
      if i + 1 >= len(flags) or flags[i + 1].startswith("--"):
        continue  # a boolean flag (--config.data.nsp): not one this launcher checks
      value = flags[i + 1]
    out[key] = value
  return out


def load_config(spec: str):
  """The ConfigDict of `configs/x.py[:arg]` (its own get_config; configs/base.py imports
  bertjax.sharding for its default rules, so jax is imported too)."""
  path, _, arg = spec.partition(":")
  module_path = os.path.join(REPO, path)
  module_spec = importlib.util.spec_from_file_location("_launch_config", module_path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  if arg:
    return module.get_config(arg)
  if inspect.signature(module.get_config).parameters:
    return module.get_config(None)
  return module.get_config()


def relative_config(spec: str) -> str:
  """The config as a path inside the project (the job runs from the project root on each VM)."""
  path, sep, arg = spec.partition(":")
  full = os.path.abspath(path) if os.path.isabs(path) or os.path.exists(path) else os.path.join(
      REPO, path)
  rel = os.path.relpath(full, REPO)
  if rel.startswith(".."):
    raise LaunchError(f"--config={spec}: the config must be inside the project ({REPO}); it is "
                      "shipped to the TPU VMs with it")
  if not os.path.isfile(full):
    raise LaunchError(f"--config={spec}: no such file {full}")
  return rel + sep + arg


def fill(sizes: dict[str, int], total: int, group: str) -> str | None:
  """None if `sizes` (one may be -1) can cover `total` devices or slices, else why not (as sharding.py)."""
  named = ", ".join(f"{group}_{a}={s}" for a, s in sizes.items())
  if sum(s == -1 for s in sizes.values()) > 1:
    return f"at most one {group} size may be -1 ({named})"
  if any(s == 0 or s < -1 for s in sizes.values()):
    return f"{group} sizes must be positive or -1 ({named})"
  known = math.prod(s for s in sizes.values() if s != -1)
  if -1 in sizes.values():
    return None if total % known == 0 else (
        f"{named} needs a multiple of {known}, but there are {total}")
  return None if known == total else f"{named} multiplies to {known}, but there are {total}"


def check_mesh(values: dict[str, int], accel: Accelerator | None, num_slices: int) -> list[str]:
  """Problems of the config's mesh on this slice (ICI: devices per slice) and slices (DCN)."""
  problems = []
  dcn = {a: values[f"dcn_{a}"] for a in MESH_AXES if f"dcn_{a}" in values}
  if len(dcn) == len(MESH_AXES):
    why = fill(dcn, num_slices, "dcn")
    if why:
      fix = (f"set --config.mesh.dcn_data={num_slices} (or -1) and the other dcn_* to 1"
             if num_slices > 1 else "set every --config.mesh.dcn_* to 1 (or dcn_data to -1)")
      problems.append(f"the mesh does not fit --num-slices={num_slices}: {why}; {fix}")
  ici = {a: values[f"ici_{a}"] for a in MESH_AXES if f"ici_{a}" in values}
  if accel is not None and len(ici) == len(MESH_AXES):
    why = fill(ici, accel.chips, "ici")
    if why:
      problems.append(f"the mesh does not fit {accel.name} ({accel.chips} devices per slice): {why}")
  return problems


def unknown_key(cfg, key: str) -> str | None:
  """Why the dotted `key` names nothing in `cfg` (a ConfigDict), with the nearest name; None if
  it does."""
  import difflib  # pylint: disable=import-outside-toplevel
  node = cfg
  for part in key.split("."):
    if not hasattr(node, "keys") or part not in node.keys():
      known = list(node.keys()) if hasattr(node, "keys") else []
      near = difflib.get_close_matches(part, known, n=1)
      return f"the config has no key {part!r}" + (f"; did you mean {near[0]!r}?" if near else "")
    node = node[part]
  return None


def plan_run(config: str, workdir: str, flags: list[str], accel: Accelerator | None,
             num_slices: int) -> RunPlan:
  """Validates a run before anything is created or started; raises LaunchError with the fix."""
  rel = relative_config(config)
  multi_host = num_slices > 1 or accel is None or accel.multi_host
  if accel is None:
    hosts_text = "no --accelerator-type given, so taken as multi-host"
  else:
    hosts_text = (f"{num_slices} slices of " if num_slices > 1 else "") + accel.describe()
  if multi_host and not workdir.startswith("gs://"):
    raise LaunchError(
        f"--workdir={workdir} is not on gs://. Every host of a multi-host job ({hosts_text}) writes "
        "the same checkpoint directory; a local path would be a different folder on each VM, lost "
        "when the slice is deleted. Use e.g. --workdir=gs://BUCKET/run1")
  warnings = []
  overrides = config_overrides(flags)
  try:
    cfg = load_config(rel)
    mesh = {k: int(v) for k, v in cfg.mesh.items() if k != "logical_axis_rules"}
    data = {k: cfg.data[k] for k in ("cache_dir", "prepared_dir", "vocab_path", "num_shards")}
  except Exception as err:  # pylint: disable=broad-except
    warnings.append(f"could not load {rel} here ({type(err).__name__}: {err}); only the "
                    "--config.* flags given are checked")
    cfg, mesh, data = None, {}, {}
  if cfg is not None:
    # A misspelled key would pass here and fail on every worker after the slice is created.
    for key in overrides:
      problem = unknown_key(cfg, key)
      if problem:
        raise LaunchError(f"--config.{key}: {problem} ({rel}; every key: configs/base.py)")
  for key, value in overrides.items():
    group, _, name = key.partition(".")
    if group == "mesh" and name != "logical_axis_rules":
      try:
        mesh[name] = int(value)
      except ValueError:
        raise LaunchError(f"--config.{key}={value} is not an integer") from None
    elif group == "data" and name in ("cache_dir", "prepared_dir", "vocab_path"):
      data[name] = value
    elif group == "data" and name == "num_shards" and value.isdigit():
      data[name] = int(value)
  problems = check_mesh(mesh, accel, num_slices)
  if problems:
    raise LaunchError(f"{rel}: " + "; ".join(problems))
  if not all(f"dcn_{a}" in mesh for a in MESH_AXES):
    warnings.append("the config's dcn_* sizes are unknown here: not checked against --num-slices")
  if multi_host:
    shared = str(data.get("cache_dir", "")).startswith("gs://") or (
        str(data.get("prepared_dir", "")).startswith("gs://") and data.get("vocab_path"))
    if "cache_dir" in data and not shared:
      raise LaunchError(
          f"data.cache_dir={data['cache_dir']!r} is local to each VM, but in a multi-host job "
          f"({hosts_text}) process 0 prepares the vocabulary and shards and every other host reads "
          "them. Pass --config.data.cache_dir=gs://BUCKET/bertjax-cache (or "
          "--config.data.prepared_dir=gs://... with --config.data.vocab_path=...)")
    hosts = (accel.hosts or 0) * num_slices if accel else 0
    if hosts and data.get("num_shards") and data["num_shards"] < hosts:
      warnings.append(f"data.num_shards={data['num_shards']} < {hosts} hosts: every host reads "
                      "every shard (works, slower); prepare at least one shard per host")
  return RunPlan(rel, workdir, list(flags), warnings)


def from_setup_py(pattern: str, default: str) -> str:
  """A requirement as setup.py states it: the lowest Python (the venv's)."""
  try:
    with open(os.path.join(REPO, "setup.py"), encoding="utf-8") as f:
      m = re.search(pattern, f.read())
  except OSError:
    return default
  return m.group(1) if m else default


PYTHON_REQUIREMENT = r"python_requires\s*=\s*[\"']>=\s*([0-9.]+)"  # ">=3.11" -> 3.11


