"""bertjax/parallel/watchdog.py: a process of several that stops making progress is named, and the run
ended (the end to end test, a SIGSTOPped process of a pod: tests/test_pod_chaos.py)."""

import time

from bertjax.parallel import watchdog


def _wait(condition, timeout=20.0):
  deadline = time.time() + timeout
  while not condition() and time.time() < deadline:
    time.sleep(0.05)


def test_a_stopped_process_and_a_wedged_one_are_named(tmp_path, capsys):
  # Process 1 stopped whole (SIGSTOP: its heartbeat thread stops too); process 0 waits for it.
  ended = []
  waiting = watchdog.Watchdog(str(tmp_path / "a"), 2, 0, 2, end=ended.append)
  stopped = watchdog.Watchdog(str(tmp_path / "a"), 2, 1, 2, end=lambda status: None)
  with waiting, stopped:
    waiting.progress(7)
    began = time.monotonic()
    stopped.progress(5)
    _wait(lambda: (tmp_path / "a" / "heartbeats" / "process-1.json").exists())  # it beat once
    stopped._done.set()  # pylint: disable=protected-access  (as SIGSTOP stops its thread)
    _wait(lambda: ended)
    took = time.monotonic() - began
  assert ended == [watchdog.EXIT_STATUS] and 2 <= took < 4, (ended, took)
  said = capsys.readouterr().err.strip().splitlines()
  assert said == [
      "bertjax: watchdog: process 1 stopped making progress (its heartbeat stopped too: stopped "
      "whole (SIGSTOP) or its host gone); process 0 waited 2 s at step 7 "
      "(train.watchdog_seconds=2) and ends the run (exit status 75) rather than wait for ever. "
      "Run the same command to resume."], said

  # Process 1's main thread wedged (its heartbeat goes on) behind process 0: both stop making
  # progress; each names process 1.
  ended = {0: [], 1: []}
  first = watchdog.Watchdog(str(tmp_path / "b"), 2, 0, 2, end=ended[0].append,
                            last_checkpoint=lambda: "step 5 in CKPT")
  wedged = watchdog.Watchdog(str(tmp_path / "b"), 2, 1, 2, end=ended[1].append)
  with first, wedged:
    first.progress(7)
    wedged.progress(5)
    _wait(lambda: ended[0] and ended[1])
  said = capsys.readouterr().err.strip().splitlines()
  assert ended == {0: [75], 1: [75]} and len(said) == 2, (ended, said)
  for line in said:
    assert ("process 1" in line and "stopped making progress (its heartbeat goes on but its steps "
            "do not: its main thread is wedged)" in line), line
  assert any("process 1 (this one)" in line for line in said), said
  assert any(line.endswith("from step 5 in CKPT.") for line in said), said


def test_one_process_or_zero_seconds_runs_no_watchdog(tmp_path):
  for seconds, count in ((300, 1), (0, 2)):
    with watchdog.Watchdog(str(tmp_path), seconds, 0, count, end=None) as dog:
      assert not dog.enabled and dog._thread is None  # pylint: disable=protected-access
  assert not (tmp_path / "heartbeats").exists()
  assert watchdog.jax_heartbeat_seconds(0) is None
  assert watchdog.jax_heartbeat_seconds(10) == 100 and watchdog.jax_heartbeat_seconds(300) == 360
