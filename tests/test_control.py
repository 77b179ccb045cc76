"""The step loop on an emulated 8-device CPU mesh: the host never queues enough steps to deadlock
XLA's CPU client (control.MAX_STEPS_IN_FLIGHT says how that deadlock comes about)."""

import os
import subprocess
import sys
import textwrap

import jax
import numpy as np

from bertjax.training import control

from conftest import xla_flags

# A data-parallel step (its gradient is an all-reduce over 8 devices) driven by `run_steps` with
# one log at the end, so nothing but the in-flight bound makes the host wait. Without the bound
# XLA aborted this within the first 40 steps, every time (SIGABRT after its 40 s rendezvous
# timeout).
_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from bertjax.training import control
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    rows, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())

    @jax.jit
    def step(w, x):
      loss, grad = jax.value_and_grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)
      return w - 0.01 * grad, {"loss": (loss, jnp.float32(1)), "grad_norm": jnp.linalg.norm(grad)}

    x = jax.device_put(np.random.default_rng(0).random((64, 128), np.float32), rows)
    w = jax.device_put(jnp.full((128, 128), 0.01), replicated)
    logged = {}
    control.run_steps(lambda w, batch: step(w, batch), w, iter(lambda: x, None), 0,
                      control.Schedule(total_steps=400, log_every=400, save_every=400),
                      control.StopSignal(), save=lambda *a: None, evaluate=lambda *a: {},
                      log=lambda step, scalars: logged.update(scalars))
    print("finished", round(logged["loss"], 6))
""")


def test_a_long_unread_run_of_sharded_steps_finishes_on_8_cpu_devices():
  env = {**os.environ, "XLA_FLAGS": xla_flags(8),
         "JAX_PLATFORMS": "cpu"}
  done = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True,
                        timeout=240, check=False)
  assert done.returncode == 0 and "finished" in done.stdout, (
      f"exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")


def test_a_push_waits_for_the_step_max_in_flight_back_and_no_later_one(monkeypatch):
  waited = []
  real = jax.block_until_ready
  monkeypatch.setattr(jax, "block_until_ready", lambda x: waited.append(x) or real(x))
  buffer = control.MetricsBuffer(max_in_flight=3)
  pushed = [{"loss": (jax.numpy.float32(i), jax.numpy.float32(1))} for i in range(1, 8)]
  for step, metrics in enumerate(pushed, 1):
    buffer.push(step, metrics)
  # Steps 1..4 waited for at the pushes of 4..7: each push waits for the step three back.
  assert [float(m["loss"][0]) for m in waited] == [1.0, 2.0, 3.0, 4.0]
  np.testing.assert_allclose(buffer.take()["loss"], np.mean(range(1, 8)))
