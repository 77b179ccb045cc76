"""Starting the multi-process JAX runtime: Cloud TPU pods, and several local CPU processes.

Call `initialize()` once per process before anything touches a device (jax.devices(), a jit).
- Cloud TPU (a TPU VM, one process per host): `jax.distributed.initialize()` with no arguments;
  JAX reads the coordinator, process count and id from the TPU metadata.
- CPU (tests, local "pods"; GPUs likewise): the coordinator address ("host:port" of process 0),
  the number of processes and this process's id come from the arguments (the entry point's flags)
  or from the environment: BERTJAX_COORDINATOR_ADDRESS, BERTJAX_NUM_PROCESSES, BERTJAX_PROCESS_ID.
  CPU collectives across processes go through gloo.
- Otherwise nothing happens: one process owns every device it sees.

After it, `jax.devices()` lists the devices of every process, so `sharding.create_mesh` builds
one global mesh.
"""

from __future__ import annotations

import glob
import logging
import os

import jax

from bertjax.errors import Refusal


ENV_COORDINATOR = "BERTJAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "BERTJAX_NUM_PROCESSES"
ENV_PROCESS_ID = "BERTJAX_PROCESS_ID"
# Set by the Cloud TPU runtime on TPU VMs; the device files exist on TPU VMs of every generation.
_TPU_ENV = ("TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES", "TPU_WORKER_ID", "CLOUD_TPU_TASK_ID")


def on_cloud_tpu() -> bool:
  """True on a Cloud TPU VM, without initialising a JAX backend (that must wait for us)."""
  if "tpu" not in os.environ.get("JAX_PLATFORMS", "tpu").lower():
    return False
  return any(os.environ.get(k) for k in _TPU_ENV) or bool(glob.glob("/dev/accel*")) or bool(
      glob.glob("/dev/vfio/[0-9]*"))


def _int_or_none(value, name: str) -> int | None:
  if value is None or value == "":
    return None
  try:
    return int(value)
  except ValueError:
    raise Refusal(f"{name}={value!r} is not an integer") from None


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, heartbeat_seconds: int | None = None) -> bool:
  """Joins this process to the others of the job, if there are others. Returns whether it did.
  `heartbeat_seconds`: jax's heartbeat timeout (a process silent that long aborts the others),
  None for jax's default (bertjax/parallel/watchdog.py sets it above the watchdog's)."""
  extra = {} if heartbeat_seconds is None else {"heartbeat_timeout_seconds": heartbeat_seconds}
  coordinator_address = coordinator_address or os.environ.get(ENV_COORDINATOR) or None
  num_processes = _int_or_none(
      num_processes if num_processes is not None else os.environ.get(ENV_NUM_PROCESSES),
      "num_processes")
  process_id = _int_or_none(
      process_id if process_id is not None else os.environ.get(ENV_PROCESS_ID), "process_id")

  if coordinator_address:
    if num_processes is None or process_id is None:
      raise Refusal(
          f"A coordinator address ({coordinator_address}) needs the number of processes and this "
          f"process's id too; got num_processes={num_processes}, process_id={process_id} (flags "
          f"or {ENV_NUM_PROCESSES} / {ENV_PROCESS_ID})")
    if not 0 <= process_id < num_processes:
      raise Refusal(f"process_id={process_id} must be in [0, num_processes={num_processes})")
    # Only read by the CPU client: without it, CPU computations cannot span processes.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=num_processes, process_id=process_id, **extra)
    logging.info("Process %d of %d joined %s", process_id, num_processes, coordinator_address)
    return True
  if num_processes not in (None, 1):
    raise Refusal(f"num_processes={num_processes} needs a coordinator address (flag or "
                  f"{ENV_COORDINATOR}), e.g. localhost:12345")
  if on_cloud_tpu():
    jax.distributed.initialize(**extra)
    return True
  return False
