"""The functional core of training: train state, `train_step`, `eval_step`, and their sharded jits.

`build(model_config, train_config, mesh_config)` (or `from_config(config)`) returns a `Training`:
the mesh, the model, the optimizer, the abstract state and its shardings, and three jitted
functions whose shardings are explicit:

    init_rng, dropout_rng = rng_streams(seed)       # two independent random streams
    state = training.init_state(init_rng)           # born sharded, never on one device
    batch = training.to_global(host_batch)          # this host's numpy rows -> jax.Array
    state, metrics = training.train_step(state, batch, dropout_rng)  # state donated
    metrics = training.eval_step(state, batch)

Every metric is a (sum, denominator) pair of float32 scalars: mlm_loss, mlm_accuracy, nsp_loss,
nsp_accuracy, and in training also loss (the objective), grad_norm (before clipping) and
learning_rate (the rate of this update), each with denominator 1; with packed rows (a batch with
`sequence_ids`) also sequences_per_step and tokens_per_step (real sequences and tokens). Add sums
and denominators over steps or hosts, divide once.

Gradient accumulation: with `num_microbatches` k the step splits the batch into k microbatches and
`lax.scan`s over them, so activations of one microbatch are live at a time. The loss is a mean
over masked tokens whose count differs between microbatches, so each microbatch's loss is divided
by the count of the WHOLE batch (known from `masked_lm_weights` before the scan); the summed
gradients are then exactly those of the whole batch.

Counters: `state.step` is the one count of updates. The optimizer keeps its own (the schedule and
bias correction read it); `train_step` sets it from `state.step` before every update, and
`check_step_counters` refuses a state (a restored one) whose counters disagree.

The loop (checkpoints, logging, evaluation schedule) is bertjax/training/loop.py; nothing here does I/O.
"""

from __future__ import annotations

import dataclasses
import functools
import zlib
from typing import Any, Callable, Mapping

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from bertjax.errors import Refusal
from bertjax.model import losses
from bertjax.model.kernels import mlp_choice
from bertjax.model.config import BertConfig, chosen_qkv, chosen_remat
from bertjax.model.heads import BertForPreTraining
from bertjax.parallel import layouts, sharding
from bertjax.training import optimizer as optimizer_lib

Batch = Mapping[str, jax.Array]
Metrics = dict[str, tuple[jax.Array, jax.Array]]

# Features the model reads; the optional ones enable packed rows when the data provides them.
MODEL_INPUTS = ("input_ids", "input_mask", "segment_ids", "masked_lm_positions")
# masked_lm_ids: the MLM head scores its logits where it makes them when the model's config says
# so (recompute_mlm_logits), and returns them otherwise.
OPTIONAL_MODEL_INPUTS = ("position_ids", "sequence_ids", "nsp_positions", "masked_lm_ids")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Typed form of `config.train` (see configs/base.py for the meaning of each key)."""

  batch_size: int = 256
  num_microbatches: int = 1
  num_train_steps: int = 1_000_000
  seed: int = 0
  optimizer: str = "adamw"
  learning_rate: float = 1e-4
  warmup_steps: int = 10_000
  weight_decay: float = 0.01
  adam_b1: float = 0.9
  adam_b2: float = 0.999
  adam_eps: float = 1e-6
  bias_correction: bool = False
  max_grad_norm: float = 1.0
  schedule: str = "linear"
  decay_steps: int = 0

  def __post_init__(self):
    problems = []
    if self.schedule not in optimizer_lib.SCHEDULES:
      problems.append(f"schedule={self.schedule!r}; choose one of {optimizer_lib.SCHEDULES}")
    elif self.schedule == "wsd" and not (
        1 <= self.decay_steps <= self.num_train_steps - self.warmup_steps):
      problems.append(f"schedule='wsd' needs 1 <= decay_steps ({self.decay_steps}) <= "
                      "num_train_steps - warmup_steps "
                      f"({self.num_train_steps - self.warmup_steps})")
    for name in ("batch_size", "num_microbatches", "num_train_steps"):
      if int(getattr(self, name)) < 1:
        problems.append(f"{name}={getattr(self, name)} must be >= 1")
    if self.batch_size % max(1, self.num_microbatches):
      problems.append(f"batch_size={self.batch_size} is not divisible by "
                      f"num_microbatches={self.num_microbatches}")
    if self.optimizer not in optimizer_lib.OPTIMIZERS:
      problems.append(f"optimizer={self.optimizer!r}; choose one of "
                      f"{sorted(optimizer_lib.OPTIMIZERS)}")
    if not 0 <= self.warmup_steps <= self.num_train_steps:
      problems.append(f"warmup_steps={self.warmup_steps} must be in [0, num_train_steps="
                      f"{self.num_train_steps}]")
    if problems:
      raise Refusal("Invalid train config: " + "; ".join(problems))

  @classmethod
  def from_dict(cls, values: Mapping[str, Any]) -> "TrainConfig":
    known = {f.name for f in dataclasses.fields(cls)}
    # Keys of the loop (checkpointing, logging, ...) live in the same section; ignore them here.
    return cls(**{k: v for k, v in dict(values).items() if k in known})


@flax.struct.dataclass
class TrainState:
  step: jax.Array  # int32 scalar: optimizer updates applied so far (the optimizer's count follows)
  params: Any
  opt_state: Any


# Fold-in constants of the named random streams: large, so no step number train_step folds into
# the dropout stream can land on another stream's key.
RNG_STREAMS = {"params": zlib.crc32(b"bertjax/params"), "dropout": zlib.crc32(b"bertjax/dropout")}


def rng_streams(seed: int) -> tuple[jax.Array, jax.Array]:
  """(init_rng, dropout_rng) from one seed: for `init_state` and for `train_step`.

  Both are the seed's key folded with their own stream constant, so neither is derived from the
  other: the dropout masks of step s (fold_in(dropout_rng, s)) never reuse the key that drew the
  initial weights, as they did when one key served both.
  """
  base = jax.random.PRNGKey(seed)
  return (jax.random.fold_in(base, RNG_STREAMS["params"]),
          jax.random.fold_in(base, RNG_STREAMS["dropout"]))


def check_step_counters(state: TrainState) -> None:
  """Raises if the optimizer's update counters disagree with `state.step`.

  They disagree when a state is put together from pieces of different steps (e.g. a restore that
  sets the step apart from the optimizer state): the moments then belong to another step than
  the learning rate. Reads the counters to the host; call it once, after restoring.
  """
  step = int(jax.device_get(state.step))
  # A state of several trials (bertjax/finetune/job/trials.py) holds a counter per trial.
  counts = [int(c) for stacked in jax.device_get(optimizer_lib.step_counts(state.opt_state))
            for c in np.ravel(stacked)]
  if any(c != step for c in counts):
    raise Refusal(
        f"The train state's step is {step} but its optimizer counts {counts} updates; the step "
        f"and the optimizer state come from different points of a run. Restore both from the "
        f"same checkpoint step, or keep only the parameters and start the optimizer fresh")


def model_inputs(batch: Batch) -> dict[str, jax.Array]:
  inputs = {name: batch[name] for name in MODEL_INPUTS}
  inputs.update({name: batch[name] for name in OPTIONAL_MODEL_INPUTS if name in batch})
  return inputs


def dummy_batch(batch_size: int, seq_len: int = 8, max_predictions: int = 1,
                sequences_per_row: int = 0) -> dict:
  """Zeros of the right dtypes: for init and shape inference. `sequences_per_row` S > 0 gives
  packed rows (bertjax/data/packing.py): `max_predictions` slots (S x M), `sequence_ids`, and the
  [B, S] next-sentence features."""
  ints = lambda *s: np.zeros(s, np.int32)
  batch = {"input_ids": ints(batch_size, seq_len), "input_mask": ints(batch_size, seq_len),
           "segment_ids": ints(batch_size, seq_len),
           "masked_lm_positions": ints(batch_size, max_predictions),
           "masked_lm_ids": ints(batch_size, max_predictions),
           "masked_lm_weights": np.zeros((batch_size, max_predictions), np.float32),
           "next_sentence_labels": ints(batch_size)}
  if sequences_per_row:
    batch.update(sequence_ids=ints(batch_size, seq_len),
                 next_sentence_labels=ints(batch_size, sequences_per_row),
                 nsp_positions=ints(batch_size, sequences_per_row),
                 nsp_weights=np.zeros((batch_size, sequences_per_row), np.float32))
  return batch


def _pretraining_denominators(batch: Batch) -> dict[str, jax.Array]:
  # The (sum, denominator) denominators of losses.pretraining_metrics, over the whole batch.
  den = {"mlm_loss": jnp.sum(batch["masked_lm_weights"].astype(jnp.float32))}
  if "next_sentence_labels" in batch:
    den["nsp_loss"] = (jnp.sum(batch["nsp_weights"].astype(jnp.float32)) if "nsp_weights" in batch
                       else jnp.asarray(batch["next_sentence_labels"].size, jnp.float32))
  return den


@dataclasses.dataclass(frozen=True)
class Objective:
  """What is trained: the model around the encoder, what it reads from a batch, what it scores.

  The objective is the sum, over the names `denominators` returns, of metric sum / denominator,
  each denominator taken over the whole batch (so microbatches add up exactly). Pre-training's
  terms are mlm_loss and nsp_loss; a fine-tuning head has one term (bertjax/finetune/kit/objectives.py).
  `outputs` are what a prediction returns to the host (fine-tuning's logits).
  """

  name: str
  make_model: Callable[[BertConfig], nn.Module]
  inputs: Callable[[Batch], dict]  # the model's keyword arguments from a batch
  metrics: Callable[[Any, Batch], Metrics]  # (model output, batch) -> {name: (sum, den)}
  denominators: Callable[[Batch], dict]  # loss term name -> its denominator over the batch
  dummy_batch: Callable[[int], dict]  # zeros of a batch of this many rows, for init
  outputs: Callable[[Any], dict] | None = None  # model output -> {name: array}, for predictions
  # With k > 1 microbatches, the gradient of an objective whose loss is not a sum over rows (a
  # contrastive loss: every query against every passage of the batch), in place of summing
  # microbatches' gradients: (params, model, batch, step_rng, denominators, k, mesh,
  # param_shardings) -> ((loss, metrics), grads) of the whole batch (bertjax/training/gradcache.py).
  chunked_gradient: Callable | None = None
  # Parameter subtrees (paths of names) the objective never reads, kept as they start: no update,
  # no weight decay (optimizer.frozen). The bi-encoder's: the encoder's tanh pooler.
  frozen: tuple[tuple[str, ...], ...] = ()


PRETRAINING = Objective(
    "pretraining", BertForPreTraining, model_inputs,
    lambda out, batch: losses.pretraining_metrics(out[0], out[1], batch),
    _pretraining_denominators, dummy_batch)


def init_state(model: nn.Module, tx: optax.GradientTransformation, rng,
               batch_size: int = 1, objective: Objective = PRETRAINING) -> TrainState:
  """The initial state with parameters still boxed in `nn.Partitioned` (their logical names)."""
  inputs = objective.inputs(objective.dummy_batch(batch_size))
  params = model.init({"params": rng}, **inputs, deterministic=True)["params"]
  return TrainState(step=jnp.zeros([], jnp.int32), params=params, opt_state=tx.init(params))


def loss_fn(params, model, batch, dropout_rng, denominators, objective=PRETRAINING):
  out = model.apply({"params": params}, **objective.inputs(batch), deterministic=False,
                    rngs={"dropout": dropout_rng})
  metrics = objective.metrics(out, batch)
  # This microbatch's share of the whole batch's objective (see the module docstring).
  share = {name: (metrics[name][0], den) for name, den in denominators.items()}
  return losses.total_loss(share), metrics


def split_microbatches(batch: Batch, k: int, mesh: Mesh | None) -> Batch:
  """[B, ...] -> [k, B/k, ...]; microbatch j takes rows j, j+k, ... so that every device holds a
  slice of every microbatch (a contiguous split would put microbatch 0 on the first devices)."""
  def split(x):
    x = x.reshape((x.shape[0] // k, k) + x.shape[1:]).swapaxes(0, 1)
    if mesh is not None:
      spec = PartitionSpec(None, sharding.BATCH_AXES)
      x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
    return x
  return jax.tree.map(split, dict(batch))


def train_step(state: TrainState, batch: Batch, rng, *, model: nn.Module,
               tx: optax.GradientTransformation, schedule: Callable, num_microbatches: int = 1,
               mesh: Mesh | None = None, param_shardings=None,
               objective: Objective = PRETRAINING) -> tuple[TrainState, Metrics]:
  """One optimizer update on `batch` (the global batch). Pure: jit it (see `build`)."""
  step_rng = jax.random.fold_in(rng, state.step)  # a new dropout mask each step, reproducibly
  denominators = objective.denominators(batch)
  grad_fn = jax.value_and_grad(functools.partial(loss_fn, objective=objective), has_aux=True)

  rows = jax.tree.leaves(batch)[0].shape[0]
  if rows % num_microbatches:  # at trace time, before anything compiles
    raise Refusal(f"Batch of {rows} rows does not split into {num_microbatches} microbatches")
  if num_microbatches == 1:
    (loss, metrics), grads = grad_fn(state.params, model, batch, jax.random.fold_in(step_rng, 0),
                                     denominators)
  elif objective.chunked_gradient is not None:
    (loss, metrics), grads = objective.chunked_gradient(
        state.params, model, batch, step_rng, denominators, num_microbatches, mesh,
        param_shardings)
  else:
    micro = split_microbatches(batch, num_microbatches, mesh)

    def accumulate(carry, xs):
      grads_acc, loss_acc, metrics_acc = carry
      i, microbatch = xs
      (loss_i, metrics_i), grads_i = grad_fn(state.params, model, microbatch,
                                             jax.random.fold_in(step_rng, i), denominators)
      grads_acc = jax.tree.map(lambda a, g: a + g.astype(a.dtype), grads_acc, grads_i)
      if param_shardings is not None:  # keep the accumulator laid out like the parameters
        grads_acc = jax.lax.with_sharding_constraint(grads_acc, param_shardings)
      metrics_acc = jax.tree.map(jnp.add, metrics_acc, metrics_i)
      return (grads_acc, loss_acc + loss_i, metrics_acc), None

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params)
    first = jax.tree.map(lambda x: x[0], micro)
    metrics_shape = jax.eval_shape(
        lambda: loss_fn(state.params, model, first, step_rng, denominators, objective)[1])
    zero_metrics = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), metrics_shape)
    carry = (zeros, jnp.zeros([], jnp.float32), zero_metrics)
    (grads, loss, metrics), _ = jax.lax.scan(
        accumulate, carry, (jnp.arange(num_microbatches), micro))

  # In the order each parameter's shard is stored (layouts.py): else XLA turns the parameter
  # and Adam's moments to the gradient's order and back for the update.
  grads = layouts.as_stored(grads, param_shardings)
  grad_norm = optax.tree.norm(grads)
  # state.step is the one counter (module docstring): the optimizer's counts are set from it.
  opt_state = optimizer_lib.with_step_count(state.opt_state, state.step)
  updates, opt_state = tx.update(grads, opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  one = jnp.ones([], jnp.float32)
  metrics = dict(metrics)
  metrics["loss"] = (loss, one)
  metrics["grad_norm"] = (grad_norm, one)
  metrics["learning_rate"] = (jnp.asarray(schedule(state.step), jnp.float32), one)
  if "sequence_ids" in batch:
    # Packed rows hold a varying number of sequences: what sequences/s and tokens/s count.
    metrics["sequences_per_step"] = (
        jnp.sum(jnp.max(batch["sequence_ids"], axis=1)).astype(jnp.float32), one)
    metrics["tokens_per_step"] = (jnp.sum(batch["input_mask"]).astype(jnp.float32), one)
  return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics


def eval_step(state: TrainState, batch: Batch, *, model: nn.Module,
              objective: Objective = PRETRAINING) -> Metrics:
  """Metrics of the batch without dropout, as (sum, denominator)."""
  out = model.apply({"params": state.params}, **objective.inputs(batch), deterministic=True)
  return objective.metrics(out, batch)


def predict_step(state: TrainState, batch: Batch, *, model: nn.Module,
                 objective: Objective) -> dict[str, jax.Array]:
  """The objective's outputs (logits) of the batch without dropout, for the host to score."""
  out = model.apply({"params": state.params}, **objective.inputs(batch), deterministic=True)
  return objective.outputs(out)


@dataclasses.dataclass(frozen=True)
class Training:
  """Everything a loop needs, built once: see the module docstring."""

  model_config: BertConfig
  train_config: TrainConfig
  mesh: Mesh
  rules: sharding.Rules
  model: nn.Module
  optimizer: optax.GradientTransformation
  schedule: Callable
  abstract_state: TrainState  # jax.ShapeDtypeStruct leaves (unboxed): for restoring checkpoints
  state_shardings: TrainState  # NamedSharding leaves
  batch_sharding: NamedSharding
  init_state: Callable  # (init_rng) -> TrainState, created directly in its shardings
  train_step: Callable  # (state, batch, dropout_rng) -> (state, metrics); state donated
  eval_step: Callable  # (state, batch) -> metrics
  predict_step: Callable | None = None  # (state, batch) -> outputs, on every host (fine-tuning)

  def to_global(self, host_batch: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
    """This process's rows of the global batch (numpy) -> global arrays sharded for the step."""
    return sharding.host_batch_to_global(host_batch, self.mesh)


def _in_mesh(fn, mesh: Mesh | None, rules: sharding.Rules):
  """`fn` traced inside `sharding.logical_context(mesh, rules)` (for the model's constraints).

  Init runs without the mesh (mesh=None): the constraints of its dummy forward pass serve no
  purpose there, and jit's out_shardings already create each parameter shard on its device.
  """
  return sharding.logical_context(mesh, rules)(fn)


def _placed(boxed: Any, mesh: Mesh, rules: sharding.Rules) -> tuple[Any, Any]:
  """(ShapeDtypeStructs with shardings, the NamedShardings) of a boxed abstract tree."""
  shardings = sharding.logical_shardings(boxed, mesh, rules)
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      nn.unbox(boxed), shardings), shardings


def abstract_params(model: nn.Module, mesh: Mesh, rules: sharding.Rules,
                    objective: Objective = PRETRAINING) -> Any:
  """The parameters `model` would have, as ShapeDtypeStructs sharded on `mesh` (for restoring)."""
  init_batch = sharding.batch_axis_size(mesh)

  def init(rng):
    return model.init({"params": rng}, **objective.inputs(objective.dummy_batch(init_batch)),
                      deterministic=True)["params"]

  return _placed(jax.eval_shape(_in_mesh(init, None, rules), jax.random.PRNGKey(0)), mesh,
                 rules)[0]


def build(model_config: BertConfig, train_config: TrainConfig,
          mesh_config: sharding.MeshConfig, devices=None,
          objective: Objective = PRETRAINING) -> Training:
  """Mesh, model, optimizer, shardings and the jitted functions. Checks sizes before compiling."""
  mesh = sharding.create_mesh(mesh_config, devices)
  model_config = mlp_choice.resolved(model_config, mesh)
  chip = mesh.devices.flat[0]
  model_config = dataclasses.replace(
      model_config, remat_policy=chosen_remat(model_config.remat_policy, chip),
      qkv_product=chosen_qkv(model_config.qkv_product, chip))
  sharding.check_model_fits(model_config, mesh)
  sharding.check_batch_size(train_config.batch_size, mesh, train_config.num_microbatches)
  rules = mesh_config.logical_axis_rules
  model = objective.make_model(model_config)
  tx, schedule = optimizer_lib.create_optimizer(train_config)
  tx = optimizer_lib.frozen(tx, objective.frozen)
  init_batch = sharding.batch_axis_size(mesh)

  boxed = jax.eval_shape(_in_mesh(
      lambda rng: init_state(model, tx, rng, init_batch, objective), None, rules),
      jax.random.PRNGKey(0))
  abstract_state, state_shardings = _placed(boxed, mesh, rules)
  replicated = sharding.replicated(mesh)
  batch_sh = sharding.batch_sharding(mesh)

  init = jax.jit(
      _in_mesh(lambda rng: nn.unbox(init_state(model, tx, rng, init_batch, objective)), None,
               rules),
      in_shardings=replicated, out_shardings=state_shardings)
  step = jax.jit(
      _in_mesh(lambda s, b, r: train_step(
          s, b, r, model=model, tx=tx, schedule=schedule,
          num_microbatches=train_config.num_microbatches, mesh=mesh,
          param_shardings=state_shardings.params, objective=objective), mesh, rules),
      in_shardings=(state_shardings, batch_sh, replicated),
      out_shardings=(state_shardings, replicated), donate_argnums=(0,))
  evaluate = jax.jit(
      _in_mesh(lambda s, b: eval_step(s, b, model=model, objective=objective), mesh, rules),
      in_shardings=(state_shardings, batch_sh), out_shardings=replicated)
  predict = None
  if objective.outputs is not None:
    # Replicated outputs: every host holds the whole batch's logits, to score or write them.
    predict = jax.jit(
        _in_mesh(lambda s, b: predict_step(s, b, model=model, objective=objective), mesh, rules),
        in_shardings=(state_shardings, batch_sh), out_shardings=replicated)
  return Training(model_config=model_config, train_config=train_config, mesh=mesh, rules=rules,
                  model=model, optimizer=tx, schedule=schedule, abstract_state=abstract_state,
                  state_shardings=state_shardings, batch_sharding=batch_sh, init_state=init,
                  train_step=step, eval_step=evaluate, predict_step=predict)


def from_config(config, devices=None, objective: Objective = PRETRAINING,
                **model_overrides) -> Training:
  """`build` from an ml_collections config (sections model, train, mesh); the ConfigDict stops here.

  `model_overrides` replace model keys, e.g. `vocab_size=` from the tokenizer.
  """
  return build(BertConfig.from_dict(config.model, **model_overrides),
               TrainConfig.from_dict(config.train),
               sharding.MeshConfig.from_dict(config.mesh), devices, objective)
