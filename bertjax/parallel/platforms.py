"""Which of jax's backends a command lets jax start, on a host where only one can start.

With the `tpu` extra installed (libtpu: `make test` installs it, for ahead-of-time compiles on a
CPU), jax tries its TPU backend at start-up on every host. Where no TPU chip is attached that
attempt fails, quietly for jax, but libtpu first prints its discovery errors (`E0000 ...
INVALID_ARGUMENT: Error: unexpected worker hostname ...`) to stderr: a CPU user sees errors that
are not errors before the command's first line.

So a command (bertjax/cli.py `run`) asks jax for the CPU backend alone when nothing else could
start: no TPU chip on the PCI bus (Google's vendor id, as jax itself looks), no GPU device file,
and the user has not chosen (`JAX_PLATFORMS` / `jax_platforms` set win). Compiling for a TPU slice
on a CPU (`python -m bertjax.aot`) uses libtpu's compile-only client, not this backend, and is
unaffected. Code that imports bertjax as a library is left to its own choice.

The same start-up is where a command adds XLA flags for a platform (`add_xla_flags`): on a host
with a GPU, `GPU_XLA_FLAGS`, empty until a GPU measurement chooses one (docs/performance.md, "The
next GPU session", names the candidates and the reading that would justify each); a flag the
user's XLA_FLAGS already names stays as the user set it. On a TPU host, and wherever bertjax
compiles for a TPU slice on a CPU (bertjax.aot, bertjax.tune), `add_libtpu_flags` does the same
with `TPU_LIBTPU_FLAGS` in LIBTPU_INIT_ARGS, so the step a slice runs is the step aot measured.
"""

from __future__ import annotations

import glob
import os

GOOGLE_PCI_VENDOR = "0x1ae0"
# Device files of the GPUs jax has plugins for (NVIDIA's, and AMD's ROCm).
GPU_DEVICE_FILES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/kfd")


def tpu_attached() -> bool:
  for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
    try:
      with open(vendor, encoding="ascii") as f:
        if f.read().strip() == GOOGLE_PCI_VENDOR:
          return True
    except OSError:
      continue
  return os.path.exists("/dev/accel0") or os.path.isdir("/dev/vfio") and any(
      name != "vfio" for name in os.listdir("/dev/vfio"))


def gpu_attached() -> bool:
  return any(os.path.exists(path) for path in GPU_DEVICE_FILES)


def skip_absent_tpu() -> bool:
  """Sets jax's platforms to "cpu" where no accelerator is attached and the user chose none;
  returns whether it did. Call before jax starts a backend."""
  if os.environ.get("JAX_PLATFORMS") is not None or tpu_attached() or gpu_attached():
    return False
  import jax  # pylint: disable=import-outside-toplevel  # lazy: a command's flags come first
  if jax.config.jax_platforms:  # set in code by the user
    return False
  jax.config.update("jax_platforms", "cpu")
  return True


# A TensorCore's VMEM where jax names no TPU chip: a CPU runs the kernels in Pallas' interpreter,
# where VMEM holds anything, so the kernels take the sizes they take on v5e and v6e.
VMEM_UNKNOWN = 128 << 20


def _tpu_info():
  """Pallas' TpuInfo of the TPU chips the step is traced for (the mesh in scope's, set by
  `jax.set_mesh`, as `bertjax.aot` compiles for a slice on a CPU; else jax's default device),
  or None where that is no TPU."""
  from jax.experimental.pallas import tpu as pltpu  # pylint: disable=import-outside-toplevel
  try:  # lazy, like skip_absent_tpu's: a command adds its flags before jax is imported
    return pltpu.get_tpu_info()
  except ValueError:  # jax 0.10: "Unsupported TPU device kind: cpu"
    return None


def vmem_bytes() -> int:
  """A TensorCore's VMEM on the TPU chips the step is traced for, what a Pallas kernel's blocks
  must fit: v4 16 MiB, v5p 64, v5e and v6e 128. VMEM_UNKNOWN where that is no TPU."""
  info = _tpu_info()
  return VMEM_UNKNOWN if info is None else int(info.vmem_capacity_bytes)


def tpu_chip() -> str:
  """The TPU generation the step is traced for ("TPU_V6E", "TPU_V5P", ...); "" where that is no
  TPU."""
  info = _tpu_info()
  return "" if info is None else info.chip_version.name


def tpu_cores() -> int:
  """The TensorCores of a chip of the TPU the step is traced for (v5p and v4: 2, one device
  each chip), 1 where that is no TPU."""
  info = _tpu_info()
  return 1 if info is None else int(info.num_cores)


def vmem_limit(need: int, vmem: int | None = None) -> int:
  """The scoped VMEM a Pallas kernel asks Mosaic for (its default, 16-32 MiB, is below what
  bertjax's kernels hold): the `need` of its blocks and temporaries, a quarter more and 16 MiB
  for Mosaic's own, within a core's VMEM (`vmem`, the chip's by default)."""
  return min(int(need * 1.25) + (16 << 20), vmem_bytes() if vmem is None else vmem)


# XLA flags for GPU hosts, added by every command before jax starts (cli.run). None yet: each
# candidate waits for its measurement (docs/performance.md, "The next GPU session").
GPU_XLA_FLAGS: tuple[str, ...] = ()


# libtpu flags for TPU hosts, added by every command before jax starts (cli.run) and by the
# compile-only client (aot.topology_devices). XLA's TPU compiler splits a matmul whose weights
# are sharded over fsdp into a loop over the shards ("windowed einsum") that re-reads the
# activations once per shard: BERT-Large L 512 on v6e-8 (fsdp, splash) moves 273 GB a chip a
# step with it and 113 without (roofline MFU 0.22 -> 0.53, docs/performance.md). The loop
# overlaps the weights' all-gather with the matmul; without it the gather is one collective a
# layer (BERT-Large: ~25 MB of bf16 weights, under a millisecond of ICI a layer), which XLA's
# scheduler still overlaps with the layers' other work.
TPU_LIBTPU_FLAGS: tuple[str, ...] = (
    "--xla_tpu_enable_windowed_einsum_for_all_gather=false",
    "--xla_tpu_enable_windowed_einsum_for_reduce_scatter=false",
)


def _append_flags(environ, variable: str, wanted: tuple[str, ...]) -> list[str]:
  """Appends to environ[variable] those of `wanted` whose names it does not hold yet."""
  present = environ.get(variable, "")
  named = {flag.split("=", 1)[0] for flag in present.split()}
  added = [flag for flag in wanted if flag.split("=", 1)[0] not in named]
  if added:
    environ[variable] = " ".join([present, *added]).strip()
  return added


def add_xla_flags(environ=None) -> list[str]:
  """Appends the platform's XLA flags to XLA_FLAGS (os.environ by default) where a GPU is
  attached, but those the user's XLA_FLAGS already names; returns those added. Call before jax
  starts a backend (XLA reads its flags once)."""
  environ = os.environ if environ is None else environ
  if not (GPU_XLA_FLAGS and gpu_attached()):
    return []
  return _append_flags(environ, "XLA_FLAGS", GPU_XLA_FLAGS)


def add_libtpu_flags(environ=None, compiling: bool = False) -> list[str]:
  """Appends TPU_LIBTPU_FLAGS to LIBTPU_INIT_ARGS (os.environ by default) where a TPU is
  attached, or `compiling` for one on this host, but those the user's LIBTPU_INIT_ARGS already
  names; returns those added. Call before libtpu starts (it reads its flags once)."""
  environ = os.environ if environ is None else environ
  if not (TPU_LIBTPU_FLAGS and (compiling or tpu_attached())):
    return []
  return _append_flags(environ, "LIBTPU_INIT_ARGS", TPU_LIBTPU_FLAGS)
