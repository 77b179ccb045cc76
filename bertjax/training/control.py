"""What a training loop decides at each step, shared by pre-training and fine-tuning.

- `Schedule`: whether a step logs, saves or evaluates; every interval is checked before anything runs.
- `StopSignal`: whether every host should stop now. One process: SIGTERM / SIGINT set a flag.
  Several: jax's preemption sync point, which the coordination service agrees on in the
  background, so asking costs no communication and is done at every step, to save inside a
  preemption's grace period.
- `MetricsBuffer`: the steps' metrics are summed on the device and read once per log interval
  (and at saves); between reads the host runs at most `MAX_STEPS_IN_FLIGHT` steps ahead of the
  devices (see there why); a non-finite loss or gradient norm at any step raises at that read,
  before anything of that state can be saved.
- `run_steps`: the steps themselves, in the one order both loops follow: step, check, log, save,
  stop, evaluate.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import signal
from typing import Any, Callable, Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from bertjax.errors import NonFiniteError, Refusal
from bertjax.parallel import watchdog
from bertjax.training import metrics as metrics_lib


@dataclasses.dataclass(frozen=True)
class Schedule:
  """Intervals of one run, in optimizer steps; `eval_every` 0 evaluates only at the end."""

  total_steps: int
  log_every: int
  save_every: int
  eval_every: int = 0

  def __post_init__(self):
    problems = [f"{key}={value} must be >= {low}" for key, value, low in (
        ("train.num_train_steps", self.total_steps, 1),
        ("train.log_every_steps", self.log_every, 1),
        ("checkpoint.save_every_steps", self.save_every, 1),
        ("train.eval_every_steps", self.eval_every, 0)) if int(value) < low]
    if problems:
      raise Refusal("Invalid intervals: " + "; ".join(problems)
                    + " (eval_every_steps 0 means: evaluate at the end only)")

  def at_log(self, step: int) -> bool:
    return step % self.log_every == 0 or step == self.total_steps

  def at_save(self, step: int) -> bool:
    return step % self.save_every == 0 or step == self.total_steps

  def at_eval(self, step: int) -> bool:
    """Periodic evaluations; the one at the end is the loop's own (after the last save)."""
    return bool(self.eval_every) and step % self.eval_every == 0 and step != self.total_steps


def _has_sync_service() -> bool:
  """Whether jax.distributed.initialize started the preemption sync service (it does when this
  flag is on, its default), which `multihost_utils.reached_preemption_sync_point` asks."""
  return bool(jax.config.jax_enable_preemption_service)


class StopSignal:
  """A preemption notice (SIGTERM) or Ctrl-C, agreed on by every host at the same step.

  With several hosts the sync point is numbered by training steps: the hosts agree on the step
  after the highest any of them had reached when the notice arrived. Orbax asks the same sync
  point, with the same numbers, when it saves; so the ids must be the training steps, and an
  evaluation (no steps) cannot be cut short there: the notice is honoured at the step after it,
  which `train.eval_sequences` keeps near.
  """

  def __init__(self):
    self.received: str | None = None
    self._previous = {}
    self._multi = jax.process_count() > 1
    self._synced = self._multi and _has_sync_service()

  def __enter__(self):
    # With the sync manager, jax's own SIGTERM notifier must keep the signal: a Python handler
    # would replace it and the other hosts would never hear of the notice.
    signals = (signal.SIGINT,) if self._synced else (signal.SIGTERM, signal.SIGINT)
    for sig in signals:
      try:
        self._previous[sig] = signal.signal(sig, self._handle)
      except ValueError:  # not the main thread (a test harness): no handler, no stop
        pass
    return self

  def _handle(self, signum, frame):
    del frame
    self.received = signal.Signals(signum).name
    if self._synced:
      # Ctrl-C on one host becomes a notice every host hears, through jax's notifier.
      signal.raise_signal(signal.SIGTERM)

  def __exit__(self, *exc):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)

  def at_step(self, step: int) -> bool:
    """Whether every host stops after `step`; called once per step, with increasing steps."""
    if not self._multi:
      return self.received is not None
    if self._synced:
      if multihost_utils.reached_preemption_sync_point(step):
        self.received = self.received or "a preemption notice"
        return True
      return False
    return self._gathered()

  def during_evaluation(self) -> bool:
    """Whether to abandon an evaluation now (every host alike; see the class docstring)."""
    if not self._multi:
      return self.received is not None
    return False if self._synced else self._gathered()

  def _gathered(self) -> bool:
    # No preemption service (jax_enable_preemption_service off): one tiny all-gather per check.
    flags = multihost_utils.process_allgather(np.array([self.received is not None], np.int32))
    if np.any(flags):
      self.received = self.received or "a stop signal on another host"
      return True
    return False

  def describe(self) -> str:
    return self.received or "a stop signal"


# Scalars that must stay finite for a state to be worth saving: every loss, and the gradient norm
# (a bf16 overflow can leave the loss finite and the gradients infinite).
def _guarded(name: str) -> bool:
  return "loss" in name or name == "grad_norm"


def _nonfinite(metrics: Mapping[str, Any]) -> jax.Array:
  """Whether any guarded metric of one step is non-finite (a bool scalar, on the device)."""
  leaves = [x for k, v in metrics.items() if _guarded(k) for x in jax.tree.leaves(v)]
  return functools.reduce(jnp.logical_or, [~jnp.all(jnp.isfinite(x)) for x in leaves],
                          jnp.zeros([], bool))


@jax.jit
def _start(metrics, step):
  # float32 like the step's own sums; the host divides once per interval.
  total = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), metrics)
  return total, jnp.where(_nonfinite(metrics), step, -1).astype(jnp.int32)


@functools.partial(jax.jit, donate_argnums=(0,))
def _add(carry, metrics, step):
  total, first_bad = carry
  total = jax.tree.map(lambda t, x: t + x.astype(jnp.float32), total, metrics)
  first_bad = jnp.where((first_bad < 0) & _nonfinite(metrics), step, first_bad)
  return total, first_bad


# How many pushed steps may still be running when the host dispatches the next one. A few keep the
# device queue full (dispatch latency hidden); an unbounded queue deadlocks XLA's CPU client with
# several devices (jaxlib 0.10): each device admits 32 programs in flight, and a sharded program's
# launch on a device whose 32 are taken blocks a thread of the client's pool (one thread per
# device) while the other devices' threads wait for it in the program's all-reduce, so the
# programs queued on that device never get a thread to finish on. XLA aborts after 40 s
# ("Expected 8 threads to join the rendezvous"). Each step is two programs (the step and `_add`).
MAX_STEPS_IN_FLIGHT = 4


class MetricsBuffer:
  """Step metrics ({name: (sum, denominator)}) summed on the device over a log interval.

  The host adds each step's metrics into a device-side total without reading them, so it never
  waits for a step's result between logs; it only waits, at a push, for the step
  `MAX_STEPS_IN_FLIGHT` pushes back to have finished. The one read is `flush` (the loop calls it
  at log and save steps): it waits for the last pushed step, and raises if any step since the
  interval began had a non-finite loss or gradient norm, naming the first such step, before
  anything of that state can be saved.
  """

  def __init__(self, guard: bool = True, max_in_flight: int = MAX_STEPS_IN_FLIGHT):
    self._guard = guard  # off for evaluation: its batches change no state
    self._carry = None
    self._steps = 0
    self._read: tuple[dict, int] | None = None  # (host totals, steps) of the last flush
    # The metrics of the latest steps (outputs of their programs; the carry is donated, so it
    # cannot be waited on later): waiting for one waits for its step.
    self._in_flight = collections.deque(maxlen=max(1, max_in_flight))

  def push(self, step: int, device_metrics: Mapping[str, Any]) -> None:
    """Adds `step`'s metrics to the interval's device total. Waits only for the step
    `max_in_flight` pushes back (MAX_STEPS_IN_FLIGHT says why), never for this one."""
    if len(self._in_flight) == self._in_flight.maxlen:
      jax.block_until_ready(self._in_flight[0])
    self._in_flight.append(device_metrics)
    step = np.int32(step)
    if self._carry is None:
      self._carry = _start(dict(device_metrics), step)
    else:
      self._carry = _add(self._carry, dict(device_metrics), step)
    self._steps += 1
    self._read = None
    watchdog.progress()  # the push `max_in_flight` back is done

  def flush(self) -> None:
    """Reads the interval's totals (waits for the last pushed step) and checks them."""
    if self._carry is None or self._read is not None:
      return
    total, first_bad = jax.device_get(self._carry)
    scalars = metrics_lib.reduce(total, self._steps)
    bad = {k: v for k, v in scalars.items() if _guarded(k) and not math.isfinite(v)}
    if self._guard and int(first_bad) >= 0:  # a non-finite step leaves its sums non-finite
      raise NonFiniteError(
          f"Non-finite {', '.join(sorted(bad))} at step {int(first_bad)}: {bad} "
          f"(averaged over the {self._steps} steps since the last log). Training stopped; no "
          "checkpoint of this state was written, the last good one is kept. Lower the learning "
          "rate, raise warmup, compute in float32, or check the data around this step.")
    self._read = (total, self._steps)

  def take(self) -> dict[str, float] | None:
    """The interval's averages (after `flush`), and a fresh interval; None if it was empty."""
    if self._carry is None:
      return None
    self.flush()
    total, steps = self._read
    self._carry, self._steps, self._read = None, 0, None
    return metrics_lib.reduce(total, steps)


def run_steps(step_fn: Callable, state: Any, batches: Iterator, start: int, schedule: Schedule,
              stop: StopSignal, *, save: Callable, evaluate: Callable, log: Callable,
              before_step: Callable | None = None) -> tuple[Any, int | None]:
  """Steps `start`..`schedule.total_steps`: (state, None) at the end, (state, step) when a stop
  signal ended them (that step is saved).

  step_fn(state, host_batch) -> (state, device metrics); save(step, state); log(step, scalars);
  evaluate(step, state, stop) -> metrics, or None when the stop signal cut it short (the step is
  then saved, so the rerun goes on from it); before_step(step) for a profiler.
  """
  buffer = MetricsBuffer()
  step = start
  while step < schedule.total_steps:
    if before_step is not None:
      before_step(step)
    state, step_metrics = step_fn(state, next(batches))
    step += 1
    buffer.push(step, step_metrics)
    watchdog.progress(step)
    stopping = stop.at_step(step)
    at_save = schedule.at_save(step) or stopping
    if schedule.at_log(step) or at_save:
      buffer.flush()  # the non-finite guard runs before anything of this state is saved
    if schedule.at_log(step):
      log(step, buffer.take())
    if at_save:
      save(step, state)
    if stopping:
      return state, step
    if schedule.at_eval(step) and evaluate(step, state, stop) is None:
      if not schedule.at_save(step):  # stopped during the evaluation: keep this step
        save(step, state)
      return state, step
  return state, None
