"""What a run reports: metric reduction, TensorBoard + JSON-lines writers, speed, progress lines.

The FLOP model and the devices' peaks are bertjax/training/flops.py; the non-finite guard is
bertjax/training/control.py.

Only process 0 writes. Metrics arrive as {name: (sum, denominator)} already summed over the
global batch; `reduce` divides them once, after any accumulation over steps.
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any, Mapping

from bertjax import files


def reduce(total: Mapping[str, Any], steps: int = 1) -> dict[str, float]:
  """sum / denominator for pairs; scalars (learning rate, gradient norm) averaged over steps."""
  out = {}
  for k, v in total.items():
    if isinstance(v, (tuple, list)):
      out[k] = float(v[0]) / max(float(v[1]), 1e-9)
    else:
      out[k] = float(v) / max(steps, 1)
  return out


class EventFile:
  """A TensorBoard event file written without TensorFlow: TensorBoard's own Event protos and
  record framing (the `tensorboard` package), scalars as `simple_value`, which TensorBoard shows
  as it shows tf.summary.scalar's. A fine-tuning run, whose input is not tf.data, then never
  imports TensorFlow (seconds and ~600 MB a process; docs/contributing.md, "TensorFlow")."""

  _opened = 0  # two writers of one process, opened within a second, get two files

  def __init__(self, folder: str):
    # pylint: disable=import-outside-toplevel
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.summary.writer.record_writer import RecordWriter
    self._event, self._summary = event_pb2.Event, summary_pb2.Summary
    files.makedirs(folder)
    EventFile._opened += 1
    # TensorBoard reads the files whose names hold "tfevents", in the order of their names.
    name = (f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}."
            f"{EventFile._opened}.v2")
    self.path = os.path.join(folder, name)
    self._records = RecordWriter(files.open_file(self.path, "wb"))
    self._add(self._event(wall_time=time.time(), file_version="brain.Event:2"))
    self._records.flush()

  def _add(self, event) -> None:
    self._records.write(event.SerializeToString())

  def scalars(self, step: int, scalars: Mapping[str, float]) -> None:
    values = [self._summary.Value(tag=k, simple_value=float(v)) for k, v in scalars.items()]
    self._add(self._event(wall_time=time.time(), step=int(step),
                          summary=self._summary(value=values)))
    self._records.flush()

  def close(self) -> None:
    self._records.close()


class Writer:
  """TensorBoard event files and a `metrics.jsonl` in the workdir, written by process 0 only."""

  def __init__(self, workdir: str, enabled: bool):
    self.enabled = enabled
    self._tb = None
    self._jsonl = None
    if not enabled:
      return
    self._tb = EventFile(os.path.join(workdir, "tensorboard"))
    self._jsonl = files.open_file(os.path.join(workdir, "metrics.jsonl"), "a")

  def write(self, step: int, scalars: Mapping[str, float], prefix: str = "") -> None:
    if not self.enabled:
      return
    self._tb.scalars(step, {prefix + k: v for k, v in scalars.items()})
    # float(): numpy and jax scalars are not JSON-serialisable.
    self._jsonl.write(json.dumps({"step": step,
                                  **{prefix + k: float(v) for k, v in scalars.items()}})
                      + "\n")
    self._jsonl.flush()

  def close(self) -> None:
    if self.enabled:
      self._tb.close()
      self._jsonl.close()


class Throughput:
  """Sequences/s, MFU and time left over the interval since the last call.

  Training time only: `restart` after the first (compiling) step and `exclude` around
  evaluations keep compilation and held-out scoring out of the rates.
  """

  def __init__(self, start_step: int, total_steps: int, seqs_per_step: int,
               flops_per_step: float | None = None, peak_flops: float | None = None):
    self.total_steps = total_steps
    self.seqs_per_step = seqs_per_step
    self.flops_per_step = flops_per_step
    self.peak_flops = peak_flops
    self._step, self._time = start_step, time.perf_counter()

  def restart(self, step: int) -> None:
    """Counts from `step`, now: what came before (compilation) is not training speed."""
    self._step, self._time = step, time.perf_counter()

  def exclude(self, seconds: float) -> None:
    """Leaves `seconds` (an evaluation) out of the current interval."""
    self._time += seconds

  def update(self, step: int) -> dict[str, float]:
    now = time.perf_counter()
    steps, seconds = step - self._step, max(now - self._time, 1e-9)
    self._step, self._time = step, now
    out = {"steps_per_sec": steps / seconds,
           "seqs_per_sec": steps * self.seqs_per_step / seconds,
           "eta_sec": (self.total_steps - step) * seconds / max(steps, 1)}
    if self.flops_per_step:
      out["tflops_per_sec"] = steps * self.flops_per_step / seconds / 1e12
      if self.peak_flops:
        out["mfu"] = steps * self.flops_per_step / seconds / self.peak_flops
    return out


def format_duration(seconds: float) -> str:
  seconds = int(max(seconds, 0))
  return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def progress_line(step: int, total_steps: int, scalars: Mapping[str, float],
                  speed: Mapping[str, float]) -> str:
  """One console line per interval: what a person watching the run wants to see."""
  parts = [f"step {step}/{total_steps}", f"loss {scalars.get('loss', float('nan')):.4f}"]
  for key, label in (("mlm_accuracy", "mlm_acc"), ("nsp_accuracy", "nsp_acc"),
                     ("accuracy", "acc")):
    if key in scalars:
      parts.append(f"{label} {scalars[key]:.3f}")
  if "learning_rate" in scalars:
    parts.append(f"lr {scalars['learning_rate']:.2e}")
  parts.append(f"{speed['seqs_per_sec']:.0f} seq/s")
  if "mfu" in speed:
    parts.append(f"MFU {100 * speed['mfu']:.1f}%")
  parts.append(f"eta {format_duration(speed['eta_sec'])}")
  return " | ".join(parts)
