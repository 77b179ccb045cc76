"""Two local processes with 4 CPU devices each (one global mesh of 8) == one process with 8.

Run as a script, this file is one of the two processes (see `worker`).
"""

import json
import os
import socket
import subprocess
import sys

import numpy as np

from conftest import xla_flags

STEPS = 5
B, L, M, VOCAB = 16, 16, 4, 96
MESH = {"ici_data": 4, "ici_fsdp": 2}


def global_batch(step: int) -> dict:
  """The step's global batch, the same in every process (each keeps its own rows)."""
  rng = np.random.default_rng(step)
  return {
      "input_ids": rng.integers(1, VOCAB, (B, L)).astype(np.int32),
      "input_mask": np.ones((B, L), np.int32),
      "segment_ids": (np.arange(L)[None] >= L // 2).repeat(B, 0).astype(np.int32),
      "masked_lm_positions": rng.integers(1, L, (B, M)).astype(np.int32),
      "masked_lm_ids": rng.integers(0, VOCAB, (B, M)).astype(np.int32),
      "masked_lm_weights": (rng.random((B, M)) < 0.8).astype(np.float32),
      "next_sentence_labels": rng.integers(0, 2, B).astype(np.int32),
  }


def train_losses() -> list[float]:
  """STEPS steps of a tiny BERT with dropout on the global mesh; the loss of each step."""
  import jax

  from bertjax.configs import base
  from bertjax.model.config import BertConfig
  from bertjax.parallel import sharding
  from bertjax.training import train

  model = BertConfig(vocab_size=VOCAB, hidden_size=32, num_layers=1, num_heads=4,
                     intermediate_size=64, max_position_embeddings=L)
  cfg = train.TrainConfig(batch_size=B, learning_rate=1e-3, warmup_steps=2, num_train_steps=10)
  t = train.build(model, cfg, sharding.MeshConfig.from_dict({**base.get_config().mesh, **MESH}))
  assert t.mesh.size == 8, t.mesh
  rng = jax.random.PRNGKey(0)
  state = t.init_state(rng)
  rows = B // jax.process_count()
  mine = slice(jax.process_index() * rows, (jax.process_index() + 1) * rows)
  losses = []
  for step in range(STEPS):
    local = {k: v[mine] for k, v in global_batch(step).items()}
    state, metrics = t.train_step(state, t.to_global(local), rng)
    losses.append(float(metrics["loss"][0].addressable_data(0)))  # replicated: any copy
  return losses


def worker(address: str, process_id: int) -> None:
  from bertjax.parallel import distributed
  assert distributed.initialize(address, 2, process_id)
  print("LOSSES " + json.dumps(train_losses()), flush=True)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def test_two_processes_follow_one_process():
  address = f"localhost:{_free_port()}"
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": xla_flags(4)}
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
  procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), address, str(i)],
                            env=env, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True) for i in range(2)]
  outputs = []
  try:
    for p in procs:
      out, err = p.communicate(timeout=300)
      assert p.returncode == 0, err[-3000:]
      outputs.append(json.loads(out.split("LOSSES ", 1)[1].splitlines()[0]))
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  want = train_losses()  # this pytest process: 8 devices (tests/conftest.py)
  assert outputs[0] == outputs[1]
  np.testing.assert_allclose(outputs[0], want, rtol=1e-5)
  assert want[0] != want[-1]


if __name__ == "__main__":
  worker(sys.argv[1], int(sys.argv[2]))
