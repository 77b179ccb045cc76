"""A hung process of a multi-process run, noticed: which one stopped, and the run ended.

A process that dies ends the others' collectives with an error (launch/local.sh stops the rest at
once). One that hangs instead (SIGSTOP, a wedged host, a main thread stuck in I/O) does not: the
others wait in their next collective for ever. jax's own heartbeat notices a process stopped whole
(`jax.distributed.initialize(heartbeat_timeout_seconds=...)`, 100 s by default: every other process
then aborts with a C++ stack trace, `UNAVAILABLE: ... tasks are unhealthy`, or `DEADLINE_EXCEEDED`
when the stopped one is process 0), but not a process whose heartbeat thread lives on while its
steps do not.

So every process of a run (inside `loop.execute`, from its first completed step) counts its own
progress (a training step or an evaluation batch done: `progress`; not counting the start of an
evaluation, its compilation, nor the wait for a save: `disarm`) and, in a thread, writes a
heartbeat, `WORKDIR/heartbeats/process-I.json` (its step, progress count and a beat that the
thread alone advances), every few seconds. When a process has made no progress for
`train.watchdog_seconds`, its thread reads every heartbeat and names the process that stopped: one
whose beat stopped too (stopped whole, or its host gone), else the one furthest behind (its main
thread wedged); it says so in one line and ends its own process with `EXIT_STATUS`, so the
launcher stops the others and the same command resumes from the last checkpoint. The heartbeat
is compared with itself only (beats seen changing, on this host's clock), never with another
host's clock.

jax's heartbeat is set to `train.watchdog_seconds` + 60 s, above the watchdog's, so that a stopped
process is named by the watchdog's line rather than by jax's abort.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

from bertjax import files

EXIT_STATUS = 75  # sysexits' EX_TEMPFAIL: a temporary failure, run the same command again
JAX_HEARTBEAT_MARGIN = 60  # seconds jax's own heartbeat waits beyond the watchdog

_active: "Watchdog | None" = None


def progress(step: int | None = None) -> None:
  """A training step or an evaluation batch done (a no-op unless a watchdog runs)."""
  if _active is not None:
    _active.progress(step)


def disarm() -> None:
  """Long work of this process alone follows (an evaluation's compilation, a save waited for):
  not counted until the next `progress`."""
  if _active is not None:
    _active.disarm()


def jax_heartbeat_seconds(watchdog_seconds: float) -> int | None:
  """What jax.distributed's heartbeat timeout should be for this watchdog (None: jax's own)."""
  if not watchdog_seconds or watchdog_seconds <= 0:
    return None
  return max(100, int(watchdog_seconds) + JAX_HEARTBEAT_MARGIN)


class Watchdog:
  """See the module docstring. A context: the thread runs inside it; `seconds` <= 0 or a single
  process: nothing runs."""

  def __init__(self, workdir: str, seconds: float, process_index: int, process_count: int,
               last_checkpoint=None, end=os._exit):
    self.seconds = float(seconds)
    self.enabled = self.seconds > 0 and process_count > 1
    self.index, self.count = process_index, process_count
    self.folder = os.path.join(workdir, "heartbeats")
    self.interval = min(5.0, max(0.2, self.seconds / 10))
    self._last_checkpoint = last_checkpoint or (lambda: "")
    self._end = end
    self._step = -1
    self._ticks = 0
    self._beat = 0
    self._last_progress: float | None = None  # armed at the first progress
    self._seen: dict[int, tuple] = {}  # process -> (its beat, when this process saw it change)
    self._done = threading.Event()
    self._thread: threading.Thread | None = None

  def progress(self, step: int | None) -> None:
    if step is not None:
      self._step = step
    self._ticks += 1
    self._last_progress = time.monotonic()

  def disarm(self) -> None:
    self._last_progress = None

  def __enter__(self):
    global _active  # pylint: disable=global-statement
    if self.enabled:
      files.makedirs(self.folder)
      _active = self
      self._thread = threading.Thread(target=self._watch, name="bertjax-watchdog", daemon=True)
      self._thread.start()
    return self

  def __exit__(self, *exc):
    global _active  # pylint: disable=global-statement
    if _active is self:
      _active = None
    self._done.set()
    if self._thread is not None:
      self._thread.join(self.interval + 5)

  def _path(self, index: int) -> str:
    return os.path.join(self.folder, f"process-{index}.json")

  def _write(self) -> None:
    self._beat += 1
    try:
      files.write_json(self._path(self.index), {
          "process": self.index, "step": self._step, "progress": self._ticks, "beat": self._beat,
          "pid": os.getpid()})
    except OSError:  # a heartbeat that cannot be written only weakens the diagnosis
      pass

  def _read(self, index: int) -> dict | None:
    try:
      return files.read_json(self._path(index))
    except (OSError, ValueError):
      return None

  def _watch(self) -> None:
    while not self._done.wait(self.interval):
      self._write()
      if self._last_progress is None:
        continue
      stalled = time.monotonic() - self._last_progress
      if stalled > self.seconds / 2:  # watch the others' beats from here on
        now = time.monotonic()
        for i in range(self.count):
          beat = (self._read(i) or {}).get("beat")
          if i not in self._seen or self._seen[i][0] != beat:
            self._seen[i] = (beat, now)
      else:
        self._seen.clear()
      if stalled > self.seconds and not self._done.is_set():
        print(self.message(stalled), file=sys.stderr, flush=True)
        self._end(EXIT_STATUS)
        self._last_progress = None  # `end` returned (a test's): disarmed, beating on

  def culprits(self) -> tuple[list[int], str]:
    """The processes that stopped, and how they were told apart."""
    now = time.monotonic()
    beats = {i: self._read(i) for i in range(self.count)}
    # A live heartbeat changes every `interval`; one unchanged for three is silent.
    silent = [i for i in range(self.count) if i != self.index and (
        beats[i] is None or now - self._seen.get(i, (None, now))[1] > 3 * self.interval)]
    if silent:
      return silent, "its heartbeat stopped too: stopped whole (SIGSTOP) or its host gone"
    progress = {i: (b.get("step", -1), b.get("progress", 0)) for i, b in beats.items() if b}
    progress[self.index] = (self._step, self._ticks)
    low = min(progress.values())
    behind = [i for i, p in progress.items() if p == low]
    if len(behind) < self.count:
      return behind, "its heartbeat goes on but its steps do not: its main thread is wedged"
    return [], ""

  def message(self, stalled: float) -> str:
    culprits, how = self.culprits()
    if culprits:
      who = " and ".join(f"process {i}" + (" (this one)" if i == self.index else "")
                         for i in culprits)
      what = f"{who} stopped making progress ({how})"
    else:
      what = "no process made progress (every heartbeat at the same step)"
    kept = self._last_checkpoint()
    return (f"bertjax: watchdog: {what}; process {self.index} waited {stalled:.0f} s at step "
            f"{self._step} (train.watchdog_seconds={self.seconds:g}) and ends the run (exit status "
            f"{EXIT_STATUS}) rather than wait for ever. Run the same command to resume"
            + (f" from {kept}." if kept else "."))
