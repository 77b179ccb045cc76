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
user's XLA_FLAGS already names stays as the user set it.
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


# XLA flags for GPU hosts, added by every command before jax starts (cli.run). None yet: each
# candidate waits for its measurement (docs/performance.md, "The next GPU session").
GPU_XLA_FLAGS: tuple[str, ...] = ()


def add_xla_flags(environ=None) -> list[str]:
  """Appends the platform's XLA flags to XLA_FLAGS (os.environ by default) where a GPU is
  attached, but those the user's XLA_FLAGS already names; returns those added. Call before jax
  starts a backend (XLA reads its flags once)."""
  environ = os.environ if environ is None else environ
  if not (GPU_XLA_FLAGS and gpu_attached()):
    return []
  present = environ.get("XLA_FLAGS", "")
  named = {flag.split("=", 1)[0] for flag in present.split()}
  added = [flag for flag in GPU_XLA_FLAGS if flag.split("=", 1)[0] not in named]
  if added:
    environ["XLA_FLAGS"] = " ".join([present, *added]).strip()
  return added
