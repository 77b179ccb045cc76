"""The jitted train step: sharded == one device, k microbatches == one batch, state handling."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bertjax import errors
from bertjax.configs import base
from bertjax.model.config import BertConfig
from bertjax.parallel import layouts, sharding
from bertjax.training import control, optimizer, train

# Dropout off so that microbatching changes nothing (tests/test_multihost.py runs with dropout).
TINY = BertConfig(vocab_size=96, hidden_size=32, num_layers=1, num_heads=4,
                  intermediate_size=64, max_position_embeddings=16, hidden_dropout=0.0,
                  attention_dropout=0.0)
B, L, M = 16, 16, 4


def mesh_config(**sizes) -> sharding.MeshConfig:
  return sharding.MeshConfig.from_dict({**base.get_config().mesh, **sizes})


def make_batch(seed=0, batch=B):
  """Padded rows and a varying number of real predictions per row (the denominators differ)."""
  rng = np.random.default_rng(seed)
  lengths = rng.integers(L // 2, L + 1, batch)
  input_mask = (np.arange(L)[None] < lengths[:, None]).astype(np.int32)
  n_real = rng.integers(0, M + 1, batch)
  return {
      "input_ids": (rng.integers(1, TINY.vocab_size, (batch, L)) * input_mask).astype(np.int32),
      "input_mask": input_mask,
      "segment_ids": (np.arange(L)[None] >= lengths[:, None] // 2).astype(np.int32) * input_mask,
      "masked_lm_positions": rng.integers(1, L // 2, (batch, M)).astype(np.int32),
      "masked_lm_ids": rng.integers(0, TINY.vocab_size, (batch, M)).astype(np.int32),
      "masked_lm_weights": (np.arange(M)[None] < n_real[:, None]).astype(np.float32),
      "next_sentence_labels": rng.integers(0, 2, batch).astype(np.int32),
  }


def one_step(mesh_sizes, devices=None, microbatches=1, training=None):
  """Builds (unless given `training`), initialises and takes one step; returns host copies and
  what the checks need."""
  cfg = train.TrainConfig(batch_size=B, num_microbatches=microbatches, learning_rate=1e-3,
                          warmup_steps=0, num_train_steps=10)
  t = training or train.build(TINY, cfg, mesh_config(**mesh_sizes), devices=devices)
  rng = jax.random.PRNGKey(0)
  state = t.init_state(rng)
  before = state
  batch = t.to_global(make_batch())
  state, metrics = t.train_step(state, batch, rng)
  return jax.device_get((state.params, metrics)), {"training": t, "before": before,
                                                    "after": state, "batch": batch}


@pytest.fixture(scope="module")
def one_device_training():
  """TINY's training on one device, built (traced and compiled) once for the tests that use it."""
  cfg = train.TrainConfig(batch_size=B, learning_rate=1e-3, warmup_steps=0, num_train_steps=10)
  return train.build(TINY, cfg, mesh_config(), devices=jax.devices()[:1])


@pytest.fixture(scope="module")
def single_device(one_device_training):
  return one_step({}, training=one_device_training)[0]


def assert_trees_close(a, b, atol=1e-5):
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(x, y, atol=atol, rtol=1e-5, err_msg=jax.tree_util.keystr(path))


# Data parallelism alone ({"ici_data": 8}) is the dropout test's first mesh below; without dropout
# the data axis is sharded here in the (data 2, fsdp 2, tensor 2) mesh.
@pytest.mark.parametrize("sizes", [
    {"ici_data": 1, "ici_fsdp": 8}, {"ici_data": 2, "ici_fsdp": 2, "ici_tensor": 2}])
def test_sharded_step_equals_single_device(single_device, sizes):
  want_params, want_metrics = single_device
  (params, metrics), run = one_step(sizes)
  assert run["training"].mesh.size == 8
  assert_trees_close(params, want_params)
  assert_trees_close(metrics, want_metrics)
  assert float(metrics["learning_rate"][0]) == pytest.approx(1e-3)  # no warmup: peak at step 0
  assert float(metrics["grad_norm"][0]) > 0
  if sizes.get("ici_fsdp") == 8:
    check_state_handling(run)


def test_the_update_takes_each_gradient_in_the_order_its_parameter_is_stored(single_device,
                                                                              monkeypatch):
  # A TPU stores some shards column-major (bertjax/parallel/layouts.py); a CPU none, so the
  # runtime's answer is stood in for: every 2-D shard column-major. Each such gradient is
  # constrained to it in the program, and the step is the same.
  asked = []

  def column_major(dtype, shape, device):
    asked.append(tuple(shape))
    return (1, 0) if len(shape) == 2 else None

  monkeypatch.setattr(layouts, "stored", column_major)
  (params, metrics), run = one_step({"ici_data": 1, "ici_fsdp": 8})
  two_d = [x for x in jax.tree.leaves(params) if x.ndim == 2]
  assert len([s for s in asked if len(s) == 2]) == len(two_d) > 0
  assert (32, 4) in asked  # a [hidden, hidden] kernel's shard over fsdp's 8
  text = run["training"].train_step.lower(run["after"], run["batch"], jax.random.PRNGKey(0))
  assert text.as_text().count("@LayoutConstraint") == len(two_d)
  assert_trees_close(params, single_device[0])


def test_a_sharded_step_with_dropout_equals_one_device(single_device):
  """Each device draws its own shard of every dropout mask, and the shards make the mask one
  device draws (dropout.py): the step is the same on 1 device and on three 8-device meshes."""
  def step(sizes, devices=None):
    cfg = train.TrainConfig(batch_size=B, learning_rate=1e-3, warmup_steps=0, num_train_steps=10)
    model = dataclasses.replace(TINY, hidden_dropout=0.1, attention_dropout=0.1)
    t = train.build(model, cfg, mesh_config(**sizes), devices=devices)
    rng = jax.random.PRNGKey(0)
    state, metrics = t.train_step(t.init_state(rng), t.to_global(make_batch()), rng)
    return jax.device_get((state.params, metrics))

  want = step({}, jax.devices()[:1])
  no_dropout = single_device  # the same step without dropout
  assert abs(float(want[1]["loss"][0]) - float(no_dropout[1]["loss"][0])) > 1e-3  # dropout acts
  for sizes in ({"ici_data": 8}, {"ici_data": 2, "ici_fsdp": 2, "ici_tensor": 2}):
    got = step(sizes)
    assert_trees_close(got[0], want[0])
    assert_trees_close(got[1], want[1])


def test_microbatches_equal_one_large_batch(single_device):
  # 4 microbatches of 4 rows on a (data 2, fsdp 2) mesh == the 16-row batch on one device.
  want_params, want_metrics = single_device
  (params, metrics), _ = one_step({"ici_data": 2, "ici_fsdp": 2}, jax.devices()[:4],
                                  microbatches=4)
  assert_trees_close(params, want_params)
  assert_trees_close(metrics, want_metrics)


def check_state_handling(run):
  """Born sharded, donated, metrics as (sum, denominator), evaluation pure."""
  t, before, after, batch = run["training"], run["before"], run["after"], run["batch"]
  table = before.params["bert"]["embeddings"]["word_embeddings"]["embedding"]
  assert table.is_deleted()  # donated: the step reused the old state's buffers
  assert table.sharding.shard_shape(table.shape) == (96, 4)  # born split: D 32 / fsdp 8
  new_table = after.params["bert"]["embeddings"]["word_embeddings"]["embedding"]
  assert {s.data.shape for s in new_table.addressable_shards} == {(96, 4)}
  assert int(after.step) == 1
  host = make_batch()
  metrics = t.eval_step(after, batch)
  assert float(metrics["mlm_loss"][1]) == host["masked_lm_weights"].sum()
  assert float(metrics["nsp_accuracy"][1]) == B
  assert jax.device_get(metrics) == jax.device_get(t.eval_step(after, batch))
  assert int(after.step) == 1


def test_init_and_dropout_draw_from_separate_streams():
  init_rng, dropout_rng = train.rng_streams(0)
  keys = lambda k: {tuple(np.asarray(jax.random.key_data(k)).ravel())}
  assert keys(init_rng) != keys(dropout_rng)
  # train_step's dropout key of step 0, microbatch 0 is fold_in(fold_in(dropout_rng, 0), 0). The
  # same derivation from the init key (what one shared key gave) must not reproduce it, nor may
  # the init key itself or the seed's key.
  step0 = lambda k: jax.random.fold_in(jax.random.fold_in(k, 0), 0)
  from_init = (keys(init_rng) | keys(step0(init_rng)) | keys(jax.random.PRNGKey(0))
               | keys(step0(jax.random.PRNGKey(0))))
  assert not keys(step0(dropout_rng)) & from_init
  # Reproducible from the seed; another seed, other streams.
  assert keys(train.rng_streams(0)[1]) == keys(dropout_rng)
  assert not (keys(train.rng_streams(1)[0]) | keys(train.rng_streams(1)[1])) & (
      keys(init_rng) | keys(dropout_rng))


def test_the_optimizer_count_follows_the_train_step():
  cfg = train.TrainConfig(batch_size=B, num_microbatches=2, learning_rate=1e-3, warmup_steps=4,
                          num_train_steps=10)
  t = train.build(TINY, cfg, mesh_config(ici_data=2, ici_fsdp=2), devices=jax.devices()[:4])
  init_rng, dropout_rng = train.rng_streams(0)
  state = t.init_state(init_rng)
  batch = t.to_global(make_batch())
  for _ in range(3):
    state, _ = t.train_step(state, batch, dropout_rng)
  assert int(state.step) == 3
  assert [int(c) for c in optimizer.step_counts(state.opt_state)] == [3]
  train.check_step_counters(state)  # agrees: no error
  # A state put together from two points of a run (step 3, optimizer count 7) is refused...
  drifted = state.replace(opt_state=optimizer.with_step_count(state.opt_state, 7))
  with pytest.raises(ValueError, match=r"step is 3 but its optimizer counts \[7\] updates"):
    train.check_step_counters(drifted)
  # ...and even unchecked, the update follows state.step (warmup lr at step 3, not step 7).
  want, want_metrics = t.train_step(jax.tree.map(jnp.copy, state), batch, dropout_rng)
  got, got_metrics = t.train_step(drifted, batch, dropout_rng)
  assert_trees_close(jax.device_get(got.params), jax.device_get(want.params), atol=0)
  assert float(got_metrics["learning_rate"][0]) == pytest.approx(3e-3 / 4)
  assert [int(c) for c in optimizer.step_counts(got.opt_state)] == [int(got.step)] == [4]


def test_the_loop_reads_the_device_once_per_log_interval_and_still_guards_saves(
    monkeypatch, one_device_training):
  """Steps between logs are never waited for: a step's metrics stay on the device, summed there,
  and the host reads them at log and save steps only (implicit reads are refused outright)."""
  t = one_device_training  # its schedule ends at step 10: steps 11 and 12 run at rate 0
  rng = jax.random.PRNGKey(0)
  host_batches = [make_batch(seed=i) for i in range(12)]
  reads, real_get = [], jax.device_get

  def counted_get(x):
    reads.append(x)
    return real_get(x)

  def run(schedule, saved, bad_step=None):
    def step_fn(state, host_batch):
      steps.append(0)
      state, metrics = t.train_step(state, t.to_global(host_batch), rng)
      if len(steps) == bad_step:
        metrics = {**metrics, "grad_norm": (jnp.float32(jnp.inf), metrics["grad_norm"][1])}
      return state, metrics

    steps, logged = [], {}
    reads.clear()
    monkeypatch.setattr(jax, "device_get", counted_get)
    try:
      with jax.transfer_guard_device_to_host("disallow"):
        control.run_steps(step_fn, t.init_state(rng),
                          iter(host_batches), 0, schedule, _NoStop(),
                          save=lambda step, state: saved.append(step),
                          evaluate=lambda *a: {}, log=lambda step, s: logged.update({step: s}))
    finally:
      monkeypatch.setattr(jax, "device_get", real_get)
    return logged

  # Logs at 4, 8, 12; a save alone at 6: four reads for twelve steps, each read a whole interval.
  saved = []
  logged = run(control.Schedule(total_steps=12, log_every=4, save_every=6), saved)
  assert saved == [6, 12] and sorted(logged) == [4, 8, 12]
  assert len(reads) == 4

  # The interval's figures are the mean of its steps' own: the sums were not lost on the device.
  state = t.init_state(rng)
  per_step = []
  for host_batch in host_batches[:4]:
    state, metrics = t.train_step(state, t.to_global(host_batch), rng)
    per_step.append(real_get(metrics))
  losses = [m["loss"][0] for m in per_step]
  mlm = [m["mlm_loss"] for m in per_step]
  np.testing.assert_allclose(logged[4]["loss"], np.mean(losses), rtol=1e-5)
  np.testing.assert_allclose(logged[4]["mlm_loss"], sum(s for s, _ in mlm) / sum(d for _, d in mlm),
                             rtol=1e-5)

  # A bad step between reads (5, inside the interval 4-8, before the save at 6) is still named,
  # and the save after it never happens.
  saved = []
  with pytest.raises(errors.NonFiniteError, match="grad_norm at step 5"):
    run(control.Schedule(total_steps=12, log_every=4, save_every=6), saved, bad_step=5)
  assert saved == [] and len(reads) == 2  # read at the log (4) and before the save (6)


class _NoStop:
  def at_step(self, step):
    return False


def test_a_bfloat16_step_runs_and_stays_near_float32(single_device):
  """The accelerator configs' dtype through the whole step, including the MLM head's written-out
  backward pass (a bfloat16 x bfloat16 -> float32 product there is not supported on CPU)."""
  cfg = train.TrainConfig(batch_size=B, learning_rate=1e-3, warmup_steps=0, num_train_steps=10)
  rng = jax.random.PRNGKey(0)
  losses = [float(single_device[1]["loss"][0])]  # this step in float32
  t = train.build(dataclasses.replace(TINY, dtype="bfloat16"), cfg, mesh_config(),
                  devices=jax.devices()[:1])
  _, metrics = t.train_step(t.init_state(rng), t.to_global(make_batch()), rng)
  losses.append(float(jax.device_get(metrics["loss"][0])))
  assert np.isfinite(losses[1]) and abs(losses[1] - losses[0]) < 0.05 * losses[0], losses
