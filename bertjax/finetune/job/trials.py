"""Several fine-tuning trials of one batch size as ONE compiled program.

Each trial has its own learning rate, epochs, warmup, weight decay and seed (bertjax/finetune/
search.py lists them). Their parameters and optimizer states are stacked on a leading trial axis
T, and one jitted step updates every trial, each with its own schedule (the rates computed by the
same operations as a run alone: optimizer.py takes traced hyperparameters), its own dropout key
(the seed's stream, folded with the step as alone), and its own example order (the seed's
permutation of each epoch, as alone). A trial whose epochs are done keeps its weights while the
others go on (its update is masked). The evaluation after each epoch runs every trial's head on
the same dev batch, one program too.

Inside the program the trials run side by side (`jax.vmap`: batched matmuls that fill an
accelerator) or one after another (`lax.map`: each trial's matmuls as a run alone has them). A CPU
gets the second: with 12 trials of configs/tiny.py's encoder `vmap` took 3.6-6.6 s a step against
1.6-2.5 s for `lax.map` and 2.2-3.0 s for 12 steps of the single run (interleaved rounds on 2
shared cores), and `lax.map` gives each trial the single run's parameters bit for bit. An
accelerator gets `vmap` (not measured yet: no device here); `build(vectorize=...)` chooses.

So a trial computes what the same settings compute alone (bit for bit on a CPU; to XLA's
reordering of a batched matmul side by side: tests/test_finetune_search.py), while the host pays
one process, one input pipeline and one compile for all of them.

Placement: the trial axis over the mesh's data axes when T divides among the devices (a trial per
device group: no communication inside a trial), else the batch over them (data parallel inside
each trial), else replicated. Memory: `per_trial_bytes` estimates one trial's state and
activations; search.py splits a grid into groups that fit (or refuses a set trials_per_program
that does not, naming the largest that fits).

The program runs through the pre-training loop (`loop.execute`): checkpoints of the stacked state,
resume, SIGTERM, the metrics log (means over the trials still training).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from bertjax.model.config import BertConfig
from bertjax.parallel import sharding
from bertjax.training import optimizer as optimizer_lib, train


@dataclasses.dataclass(frozen=True)
class Trial:
  """One combination of a search's settings."""

  index: int
  learning_rate: float
  num_epochs: float
  warmup_proportion: float
  weight_decay: float
  seed: int
  batch_size: int

  def settings(self) -> dict:
    """Everything but the seed: the trials a restart repeats."""
    return {k: v for k, v in dataclasses.asdict(self).items() if k not in ("index", "seed")}

  def total_steps(self, per_epoch: int) -> int:
    return max(1, int(round(self.num_epochs * per_epoch)))  # as a run alone (run.finetune)

  def warmup_steps(self, per_epoch: int) -> int:
    return int(self.warmup_proportion * self.total_steps(per_epoch))

  def label(self) -> str:
    return (f"lr {self.learning_rate:g}, {self.num_epochs:g} epochs, warmup "
            f"{self.warmup_proportion:g}, wd {self.weight_decay:g}, batch {self.batch_size}, "
            f"seed {self.seed}")


def _mean_over(live_T: jax.Array, metrics: Mapping[str, tuple]) -> dict:
  """[T] (sum, denominator) pairs -> scalars over the trials still training whose figures are
  finite: a trial that diverged (a rate too high) is left out of the log, not a reason to stop
  the others (its dev score is NaN, so it never wins)."""
  ok_T = live_T
  for s, d in metrics.values():
    ok_T = ok_T & jnp.isfinite(s) & jnp.isfinite(d)
  return {k: (jnp.sum(jnp.where(ok_T, s, 0.0)), jnp.sum(jnp.where(ok_T, d, 0.0)))
          for k, (s, d) in metrics.items()}


@dataclasses.dataclass(frozen=True)
class TrialsTraining(train.Training):
  """A `train.Training` whose state holds T trials (step shared, parameters and optimizer states
  stacked), for `loop.execute`; `predict_step` returns [T, rows, ...] outputs."""

  trials: tuple = ()
  single: train.Training | None = None  # one trial's, on one device: init and shapes
  host_to_global: Callable | None = None

  def to_global(self, host_batch):
    return self.host_to_global(host_batch)


def _placement(mesh: Mesh, num_trials: int, batch_size: int) -> tuple[P, P]:
  """(the stacked state's spec on its trial axis, a batch's spec on [T, B, ...])."""
  n = mesh.devices.size
  axes = tuple(a for a in mesh.axis_names if mesh.shape[a] > 1) or None
  if n > 1 and num_trials % n == 0:
    return P(axes), P(axes)
  if n > 1 and batch_size % n == 0:
    return P(), P(None, axes)
  return P(), P()


def _stacked(abstract_one: train.TrainState, T: int, stacked: NamedSharding,
             replicated: NamedSharding) -> tuple[train.TrainState, train.TrainState]:
  """The abstract state of `T` trials (each array of one trial's with a leading trial axis,
  placed `stacked`; the step shared, `replicated`) and its shardings."""
  def stack_spec(tree):
    return jax.tree.map(lambda _: stacked, tree)

  def stack_shape(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct((T,) + x.shape, x.dtype, sharding=stacked),
                        tree)

  abstract_state = train.TrainState(
      step=jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated),
      params=stack_shape(abstract_one.params), opt_state=stack_shape(abstract_one.opt_state))
  state_shardings = train.TrainState(step=replicated, params=stack_spec(abstract_one.params),
                                     opt_state=stack_spec(abstract_one.opt_state))
  return abstract_state, state_shardings


def _one_trial_step(base: train.TrainConfig, model, objective: train.Objective, params, opt_state,
                    step, batch, rng, hp):
  """One trial's train step under its own settings `hp`; a trial past its total steps keeps its
  parameters and optimizer state (its metrics are left out by `live`)."""
  tx, schedule = optimizer_lib.create_optimizer(
      base, learning_rate=hp["learning_rate"], warmup_steps=hp["warmup"],
      total_steps=hp["total"], weight_decay=hp["weight_decay"])
  tx = optimizer_lib.frozen(tx, objective.frozen)
  state = train.TrainState(step=step, params=params, opt_state=opt_state)
  new, metrics = train.train_step(state, batch, rng, model=model, tx=tx, schedule=schedule,
                                  num_microbatches=base.num_microbatches, objective=objective)
  live = step < hp["total"]
  keep = functools.partial(jax.tree.map, lambda a, b: jnp.where(live, a, b))
  return keep(new.params, params), keep(new.opt_state, opt_state), metrics, live


def build(model_config: BertConfig, base: train.TrainConfig, trials: Sequence[Trial],
          per_epoch: int, mesh: Mesh, objective: train.Objective,
          vectorize: bool | None = None) -> TrialsTraining:
  """The jitted program of `trials` (one batch size) on `mesh`. `vectorize`: the trials side by
  side (`jax.vmap`: batched matmuls, for accelerators) or one after another inside the program
  (`lax.map`: each trial's matmuls as a run alone has them, which a CPU runs faster); None
  chooses by the mesh's devices (the module docstring)."""
  T = len(trials)
  batch_size = trials[0].batch_size
  # By the mesh's devices, not the default backend: a CPU host compiling for a TPU slice ahead of
  # time (search_aot) must get the TPU's program.
  side_by_side = vectorize if vectorize is not None else mesh.devices.flat[0].platform != "cpu"
  if any(t.batch_size != batch_size for t in trials):
    raise ValueError("trials of one program share a batch size")
  single = train.build(model_config, base, sharding.MeshConfig(ici_data=1, dcn_data=1),
                       devices=[jax.devices()[0]], objective=objective)
  model = single.model
  hp_T = {"learning_rate": np.array([t.learning_rate for t in trials], np.float32),
          "warmup": np.array([t.warmup_steps(per_epoch) for t in trials], np.float32),
          "total": np.array([t.total_steps(per_epoch) for t in trials], np.int32),
          "weight_decay": np.array([t.weight_decay for t in trials], np.float32)}
  rngs_T = jnp.stack([train.rng_streams(t.seed)[1] for t in trials])  # dropout
  state_spec, batch_spec = _placement(mesh, T, batch_size)
  stacked = NamedSharding(mesh, state_spec)
  replicated = NamedSharding(mesh, P())
  batch_sh = NamedSharding(mesh, batch_spec)

  abstract_state, state_shardings = _stacked(single.abstract_state, T, stacked, replicated)

  def init_state(_rng):
    # Each trial's head from its own seed's init stream, as alone; the step shared.
    ones = [single.init_state(train.rng_streams(t.seed)[0]) for t in trials]
    params = jax.tree.map(lambda *x: jnp.stack(x), *[o.params for o in ones])
    opt_state = jax.tree.map(lambda *x: jnp.stack(x), *[o.opt_state for o in ones])
    return jax.device_put(train.TrainState(step=jnp.zeros([], jnp.int32), params=params,
                                           opt_state=opt_state), state_shardings)

  one_trial = functools.partial(_one_trial_step, base, model, objective)

  def step_fn(state, batch, _rng):
    if side_by_side:
      params, opt_state, metrics_T, live_T = jax.vmap(
          one_trial, in_axes=(0, 0, None, 0, 0, 0))(state.params, state.opt_state, state.step,
                                                    batch, rngs_T, hp_T)
    else:
      params, opt_state, metrics_T, live_T = jax.lax.map(
          lambda x: one_trial(x[0], x[1], state.step, *x[2:]),
          (state.params, state.opt_state, batch, rngs_T, hp_T))
    metrics = _mean_over(live_T, metrics_T)
    one = jnp.ones([], jnp.float32)
    metrics["trials_training"] = (jnp.sum(live_T).astype(jnp.float32), one)
    return train.TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

  def predict_fn(state, batch):
    def one(params):
      out = model.apply({"params": params}, **objective.inputs(batch), deterministic=True)
      return objective.outputs(out)
    return jax.vmap(one)(state.params) if side_by_side else jax.lax.map(one, state.params)

  step = jax.jit(step_fn, in_shardings=(state_shardings, batch_sh, replicated),
                 out_shardings=(state_shardings, replicated), donate_argnums=(0,))
  eval_batch_sh = NamedSharding(mesh, P(*batch_spec[1:]) if len(batch_spec) > 1 else P())
  predict = jax.jit(predict_fn, in_shardings=(state_shardings, eval_batch_sh),
                    out_shardings=replicated)

  def host_to_global(host_batch):
    return {k: jax.device_put(np.asarray(v), batch_sh) for k, v in host_batch.items()}

  def global_eval(host_batch):
    return {k: jax.device_put(np.asarray(v), eval_batch_sh) for k, v in host_batch.items()}

  return TrialsTraining(
      model_config=model_config, train_config=base, mesh=mesh, rules=single.rules, model=model,
      optimizer=single.optimizer, schedule=single.schedule, abstract_state=abstract_state,
      state_shardings=state_shardings, batch_sharding=batch_sh, init_state=init_state,
      train_step=step, eval_step=None, predict_step=lambda s, b: predict(s, global_eval(b)),
      trials=tuple(trials), single=single, host_to_global=host_to_global)


def broadcast_loader(read_encoder: Callable[[Any], Any], key: str) -> Callable[[Any], Any]:
  """An init_from loader for stacked parameters: `read_encoder(like)` reads the encoder once, in
  one trial's shapes, and every trial starts from it (their heads stay their seeds' own)."""
  def load(fresh_T):
    like = jax.tree.map(lambda f: jax.ShapeDtypeStruct(f.shape[1:], f.dtype), fresh_T[key])
    encoder = read_encoder(like)
    stacked = jax.tree.map(
        lambda x, f: jax.device_put(jnp.broadcast_to(jnp.asarray(x), f.shape), f.sharding),
        encoder, fresh_T[key])
    return {**fresh_T, key: stacked}
  return load


def stacked_batches(per_trial: Sequence[Iterator[Mapping[str, np.ndarray]]]
                    ) -> Iterator[dict[str, np.ndarray]]:
  """Each trial's own batches (its seed's order), stacked: [T, B, ...]."""
  for batches in zip(*per_trial):
    yield {k: np.stack([b[k] for b in batches]) for k in batches[0]}


def trial_params(params_T: Any, k: int) -> Any:
  """Trial k's parameters, on the host (numpy): to save, or to compare."""
  return jax.tree.map(lambda x: np.asarray(jax.device_get(x[k])), params_T)


def per_trial_bytes(model_config: BertConfig, batch_size: int, seq_len: int,
                    num_params: int) -> int:
  """One trial's memory in a step, estimated: float32 parameters, gradients, Adam's two moments
  and the donated copy (5 x 4 bytes a parameter), and the activations kept for the backward pass
  (per layer about 34 x rows x length x hidden values and 5 x rows x heads x length^2 for the
  attention's scores, each 4 bytes here: Korthikanti et al.'s count for 16-bit activations,
  doubled for float32)."""
  c = model_config
  rows_tokens = batch_size * seq_len
  per_layer = 34 * rows_tokens * c.hidden_size + 5 * batch_size * c.num_heads * seq_len ** 2
  activations = 4 * c.num_layers * per_layer
  return 20 * num_params + activations
