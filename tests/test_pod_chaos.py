"""A pod (launch/local.sh, 2 processes) killed and hung at random moments, of either process, and
rerun with the same command after each: it ends where a straight run of that pod ends, the final
parameters bit for bit (issue 38, item 9; docs/reliability.md).

The moments and the processes are drawn from a seed printed by the test (BERTJAX_CHAOS_SEED=N
replays one). A kill (SIGKILL) must end the launch at once, the launcher naming the dead process;
a hang (SIGSTOP) must be named by the watchdog of the process left waiting, which ends the run
within `train.watchdog_seconds` and a few seconds, exit status 75 (bertjax/parallel/watchdog.py). A kill
also holds what launch/local.sh owes a pod whose process failed: the others stopped at once
(within 20 s), none left running, the dead process named. The runs share the suite's persistent
compilation cache (tests/conftest.py): only the first compiles.
"""

import os
import random
import re
import signal
import time

import jax
import numpy as np
import pytest

from bertjax.parallel import watchdog
from bertjax.training import checkpoint as checkpoint_lib
from test_launch_local import _alive, _flags, runs  # pylint: disable=unused-import  (a fixture)

STEPS, SAVE_EVERY = 40, 5
WATCHDOG = 10  # seconds; real runs: 300 (configs/base.py)


def _stored_params(workdir, step, folder="checkpoints"):
  """The parameters of one step, read onto one device of this process (a pod's checkpoint was
  written from the devices of two processes)."""
  ckpt = checkpoint_lib.Checkpointer.reader(os.path.join(workdir, folder))
  one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  try:
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one),
                          ckpt.item_metadata(step, "params"))
    tree = ckpt.restore(step, {"params": target})[0]["params"]
  finally:
    ckpt.close()
  return {jax.tree_util.keystr(path): np.asarray(leaf)
          for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def _saved(workdir):
  folder = os.path.join(workdir, "checkpoints")
  return sorted(int(n) for n in os.listdir(folder) if n.isdigit()) if os.path.isdir(folder) else []


@pytest.fixture(name="pod_env")
def _pod_env(monkeypatch):
  monkeypatch.setenv("BERTJAX_HUGE_PAGES", "0")


def test_a_kill_and_a_hang_of_either_process_end_where_a_straight_pod_run_ends(
    tmp_path, runs, pod_env):  # pylint: disable=redefined-outer-name
  del pod_env
  seed = int(os.environ.get("BERTJAX_CHAOS_SEED", time.time_ns() % 10**6))
  rng = random.Random(seed)
  # A kill and a hang, in a drawn order, each of a drawn process at a drawn step (one kill, not
  # the two of before: each launch costs the suite 20-30 s, and the second kill met no code the
  # first had not).
  events = rng.sample(["kill", "hang"], 2)
  plan = [(what, rng.randrange(2), rng.randrange(3, STEPS - 8)) for what in events]
  print(f"BERTJAX_CHAOS_SEED={seed}: {plan}")
  base = [f for f in _flags(tmp_path) if not f.startswith("--workdir=")] + [
      f"--config.train.num_train_steps={STEPS}", f"--config.checkpoint.save_every_steps={SAVE_EVERY}",
      "--config.train.eval_every_steps=0", f"--config.train.watchdog_seconds={WATCHDOG}"]
  options = ["-n", "2", "-d", "2"]
  chaos = str(tmp_path / "chaos")

  for what, victim, at in plan:
    before = _saved(chaos)
    pod = runs.launch(options, base + [f"--workdir={chaos}"])
    pod.wait_for(rf"^\[0\] bertjax: (initialised from scratch|resumed from \S+ at step "
                 rf"{before[-1] if before else -1})$")
    # Each rerun starts from the last save before the previous kill; `at` counts from there.
    start = before[-1] if before else 0
    at = min(start + at, STEPS - 6)  # the kill lands before the run's end, however late
    pod.wait_for(rf"^\[0\] step {at}/{STEPS} ")
    children = pod.find_children()
    assert sorted(children) == [0, 1], pod.output[-3000:]
    os.kill(children[victim], signal.SIGKILL if what == "kill" else signal.SIGSTOP)
    sent = time.time()
    status = pod.finish(timeout=WATCHDOG + 60)
    took = time.time() - sent
    print(f"{what} of process {victim} at step {at}: the launch ended {took:.1f} s "
          f"later, exit status {status}")
    context = f"seed {seed}, {what} of process {victim}:\n" + pod.output[-3000:]
    assert not [pid for pid in children.values() if _alive(pid)], context
    if what == "kill":
      assert status != 0 and took < 20, context
      pod.wait_for(rf"^\[local\.sh\] process {victim} exited with status 137: stopping the other 1$",
                   0)
    else:
      assert status == watchdog.EXIT_STATUS and took < WATCHDOG + 15, (took, context)
      other = 1 - victim
      said = pod.wait_for(rf"^\[{other}\] bertjax: watchdog: process {victim} stopped making "
                          r"progress \(its heartbeat stopped too.*", 0).group(0)
      assert f"train.watchdog_seconds={WATCHDOG:g}" in said and "resume" in said, said
      pod.wait_for(rf"^\[local\.sh\] process {other} exited with status 75: stopping the other 1$",
                   0)

  # It resumes from the last save both processes finished, or starts again where none did (a
  # hang a step after the first save stops the process that had yet to finish writing it).
  before = _saved(chaos)
  pod = runs.launch(options, base + [f"--workdir={chaos}"])
  assert pod.finish() == 0, pod.output[-3000:]
  pod.wait_for(rf"^\[0\] bertjax: resumed from \S+ at step {before[-1]}$" if before else
               r"^\[0\] bertjax: initialised from scratch$", 0)
  straight = runs.launch(options, base + [f"--workdir={tmp_path / 'straight'}"])
  assert straight.finish() == 0, straight.output[-3000:]

  got, want = _stored_params(chaos, STEPS), _stored_params(str(tmp_path / "straight"), STEPS)
  assert got.keys() == want.keys() and len(want) > 10
  print(f"{len(want)} parameter arrays compared")
  for key in want:
    np.testing.assert_array_equal(got[key], want[key], err_msg=f"seed {seed}: {key}")
