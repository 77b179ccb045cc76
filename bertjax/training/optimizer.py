"""The optimizers of the original BERT as optax transformations, the schedule, and the chain.

AdamW as google-research/bert `optimization.py` (Loshchilov & Hutter's decoupled decay, but with
NO bias correction, which the original omits):
    m <- b1 m + (1 - b1) g          v <- b2 v + (1 - b2) g^2
    u  = m / (sqrt(v) + eps) + wd * w      (wd only where the decay mask is True)
    w <- w - lr * u

LAMB (You et al. 2019, the large-batch recipe of MLPerf and NVIDIA) uses the same u, then scales
it per layer by the trust ratio ||w|| / ||u|| (1 when either norm is 0). Parameters excluded from
weight decay (LayerNorm, biases) are also excluded from the trust ratio, as the MLPerf reference.
With `scan_layers` one array holds every layer's weights on its leading axis; the trust ratio is
then computed per layer (per slice of that axis), so it means the same as in the unrolled model.

`bias_correction=True` divides m and v by (1 - b^t) as in Adam / NVIDIA's LAMB.

Learning rate (the original's `create_optimizer`): linear warmup from 0 over `warmup_steps`, then
`peak * (1 - step / total_steps)`: the decay is measured from step 0, so it starts just below the
peak, exactly as the original. `step` counts the updates already applied (the first update uses
lr 0 when there is warmup, as the original).

`schedule="wsd"` (warmup-stable-decay, ModernBERT's): the same warmup, the peak held, then the
last `decay_steps` take it to 0 as peak * (1 - sqrt(progress)) (the 1-sqrt shape ModernBERT
used). A stable phase can be resumed and extended; only the decay depends on the end.

The chain: global-norm clipping (1.0), then AdamW or LAMB with the schedule.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Union

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from bertjax.errors import Refusal


MaskOrFn = Union[Any, Callable[[Any], Any]]

# Substrings of a parameter's path that exclude it from weight decay (and from LAMB's trust ratio).
NO_DECAY_MODULES = ("layer_norm", "layernorm")
# Parameters that do not decay by name: a contrastive loss's learned log temperature
# (bertjax/model/contrastive.py), which decay would pull towards a scale of 1 (a temperature of 1).
NO_DECAY_PARAMS = ("log_scale",)


def _key_name(key) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def _path_names(path) -> list[str]:
  names = [_key_name(k).lower() for k in path]
  # An NNX variable (the leaves of `nnx.state(model)`) ends its path in `.value`.
  if len(path) > 1 and isinstance(path[-1], jax.tree_util.GetAttrKey) and names[-1] == "value":
    names = names[:-1]
  return names


def _map_names(fn: Callable[[list[str]], bool], params) -> Any:
  """fn(names of a parameter's path) at every parameter, seeing through `nn.Partitioned` boxes.

  A boxed parameter (what `Module.init` returns) would otherwise end its path in `.value`; the
  mask keeps the box, with the bool inside, so that it has the structure of `params`.
  """
  is_box = lambda x: isinstance(x, nn.meta.AxisMetadata)

  def one(path, leaf):
    value = fn(_path_names(path))
    return leaf.replace_boxed(value) if is_box(leaf) else value

  return jax.tree_util.tree_map_with_path(one, params, is_leaf=is_box)


def default_decay_mask(params) -> Any:
  """True where weight decay applies: everything but LayerNorm parameters, biases and
  NO_DECAY_PARAMS.

  Like the original's regex ("LayerNorm", "layer_norm", "bias"), embeddings and kernels decay.
  Works on bertjax's names and on Hugging Face Flax names (`LayerNorm`, `bias`), boxed or not,
  and on an NNX state (`nnx.state(model, nnx.Param)`).
  """
  def decays(names):
    in_norm = any(n in part for part in names[:-1] for n in NO_DECAY_MODULES)
    return not (in_norm or names[-1].endswith("bias") or names[-1] in NO_DECAY_PARAMS)

  return _map_names(decays, params)


def default_stacked_mask(params) -> Any:
  """True for arrays stacked over layers by `nn.scan` (bertjax's scanned module is `layers`)."""
  return _map_names(lambda names: "layers" in names[:-1], params)


def _resolve(mask: MaskOrFn, params):
  return mask(params) if callable(mask) else mask


class BertAdamState(NamedTuple):
  count: jax.Array  # updates applied so far (int32): drives the schedule and bias correction
  mu: Any  # first moment, like the parameters
  nu: Any  # second moment, like the parameters


def _scale_by_bert_adam(learning_rate, b1, b2, eps, weight_decay, decay_mask, bias_correction,
                        trust_ratio: bool, stacked_mask) -> optax.GradientTransformation:
  """AdamW (trust_ratio=False) or LAMB (True) of the module docstring, learning rate included."""

  def init(params):
    return BertAdamState(count=jnp.zeros([], jnp.int32),
                         mu=jax.tree.map(jnp.zeros_like, params),
                         nu=jax.tree.map(jnp.zeros_like, params))

  def update(grads, state, params=None):
    if params is None:
      raise ValueError("AdamW / LAMB need the parameters for weight decay: pass params to update")
    count = state.count
    lr = learning_rate(count) if callable(learning_rate) else learning_rate
    mu = jax.tree.map(lambda m, g: b1 * m + (1.0 - b1) * g, state.mu, grads)
    nu = jax.tree.map(lambda v, g: b2 * v + (1.0 - b2) * jnp.square(g), state.nu, grads)
    if bias_correction:
      # 1 - b^t as -expm1(t log b): 1 - 0.999 in float32 would lose four digits.
      t = (count + 1).astype(jnp.float32)
      m_scale = -1.0 / jnp.expm1(t * math.log(b1))
      v_scale = -1.0 / jnp.expm1(t * math.log(b2))
    else:
      m_scale = v_scale = 1.0
    decay = _resolve(decay_mask, params)
    stacked = _resolve(stacked_mask, params)

    def step(m, v, w, decays, is_stacked):
      u = (m * m_scale) / (jnp.sqrt(v * v_scale) + eps)
      if decays:
        u = u + weight_decay * w
      if trust_ratio and decays:
        # Norm per layer: over everything but the leading layer axis of a scanned array.
        axes = tuple(range(1, w.ndim)) if is_stacked else None
        w_norm = jnp.sqrt(jnp.sum(jnp.square(w), axis=axes, keepdims=True))
        u_norm = jnp.sqrt(jnp.sum(jnp.square(u), axis=axes, keepdims=True))
        ratio = jnp.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, 1.0)
        u = ratio * u
      return (-lr * u).astype(w.dtype)

    updates = jax.tree.map(step, mu, nu, params, decay, stacked)
    return updates, BertAdamState(count=count + 1, mu=mu, nu=nu)

  return optax.GradientTransformation(init, update)


def adamw(learning_rate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-6,
          weight_decay: float = 0.01, decay_mask: MaskOrFn = default_decay_mask,
          bias_correction: bool = False) -> optax.GradientTransformation:
  """The original BERT AdamW (no bias correction by default). `learning_rate`: float or schedule."""
  return _scale_by_bert_adam(learning_rate, b1, b2, eps, weight_decay, decay_mask,
                             bias_correction, trust_ratio=False,
                             stacked_mask=lambda p: jax.tree.map(lambda _: False, p))


def lamb(learning_rate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-6,
         weight_decay: float = 0.01, decay_mask: MaskOrFn = default_decay_mask,
         bias_correction: bool = False,
         stacked_mask: MaskOrFn = default_stacked_mask) -> optax.GradientTransformation:
  """LAMB: AdamW's direction scaled per layer by ||w|| / ||u||; excluded params get ratio 1."""
  return _scale_by_bert_adam(learning_rate, b1, b2, eps, weight_decay, decay_mask,
                             bias_correction, trust_ratio=True, stacked_mask=stacked_mask)


def _holds_count(x) -> bool:
  # BertAdamState and optax's states (ScaleByAdamState, ScaleByScheduleState, ...) name their
  # update counter `count`.
  return isinstance(x, tuple) and "count" in getattr(x, "_fields", ())


def step_counts(opt_state) -> list[jax.Array]:
  """Every update counter in an optimizer state, outermost first."""
  return [x.count for x in jax.tree.leaves(opt_state, is_leaf=_holds_count) if _holds_count(x)]


def with_step_count(opt_state, step) -> Any:
  """The state with every update counter set to `step` (train.train_step makes its step the one
  counter that counts: the schedule and bias correction read these)."""
  def set_count(x):
    return x._replace(count=jnp.asarray(step, x.count.dtype)) if _holds_count(x) else x
  return jax.tree.map(set_count, opt_state, is_leaf=_holds_count)


def learning_rate_schedule(peak: float, warmup_steps: int, total_steps: int) -> optax.Schedule:
  """Linear warmup to `peak`, then linear decay to 0 at `total_steps`, as the original.

  The three may be traced scalars (fine-tuning's trials, bertjax/finetune/job/trials.py, give each
  trial its own inside one program): the same operations run on them, so a trial's rates are
  those of the same run alone. Only Python numbers are checked here."""
  numbers = all(isinstance(x, (int, float)) for x in (warmup_steps, total_steps))
  if numbers and (total_steps < 1 or warmup_steps < 0 or warmup_steps > total_steps):
    raise Refusal(f"Need 0 <= warmup_steps ({warmup_steps}) <= total_steps ({total_steps}) "
                  "and total_steps >= 1")

  def schedule(count):
    step = jnp.asarray(count, jnp.float32)
    # The numbers pass a barrier, so the rate is computed from them at run time whether they are
    # Python's or traced. Python numbers were constants, and XLA rewrote `peak * step / warmup`
    # as `step * (peak * (1 / warmup))`, folded; a traced rate (a trial's: its program slices it
    # per trial) kept the order, 1 ulp apart at some warmup steps, which a high rate amplified
    # into other dev scores after a few epochs. The operations are written in the rewritten
    # order, so a run's rates are the bits they were.
    p, w, t = jax.lax.optimization_barrier(tuple(
        jnp.asarray(x, jnp.float32) for x in (peak, warmup_steps, total_steps)))
    # From the end on, t * (1/t) may round above 1 (150 does): 0 there, not -1e-11.
    decayed = jnp.maximum(p * (1.0 - jnp.minimum(step, t) * (1.0 / t)), 0.0)
    if numbers and warmup_steps == 0:
      return decayed
    # A traced warmup of 0 takes `decayed` at every step (step < 0 never holds).
    return jnp.where(step < w, step * (p * (1.0 / w)), decayed)

  return schedule


def wsd_schedule(peak: float, warmup_steps: int, decay_steps: int,
                 total_steps: int) -> optax.Schedule:
  """Warmup to `peak` (linear), hold, then 1 - sqrt decay to 0 over the last `decay_steps`."""
  if not (decay_steps >= 1 and warmup_steps >= 0 and warmup_steps + decay_steps <= total_steps):
    raise Refusal(f"schedule='wsd' needs decay_steps >= 1 and warmup_steps ({warmup_steps}) + "
                  f"decay_steps ({decay_steps}) <= num_train_steps ({total_steps}); set "
                  "train.decay_steps (ModernBERT's decay was about 3% of its steps)")
  decay_start = total_steps - decay_steps

  def schedule(count):
    step = jnp.asarray(count, jnp.float32)
    progress = jnp.clip((step - decay_start) / decay_steps, 0.0, 1.0)
    lr = peak * (1.0 - jnp.sqrt(progress))
    if warmup_steps == 0:
      return lr
    return jnp.where(step < warmup_steps, peak * step / warmup_steps, lr)

  return schedule


SCHEDULES = ("linear", "wsd")
OPTIMIZERS = {"adamw": adamw, "lamb": lamb}


def frozen(tx: optax.GradientTransformation,
           subtrees: tuple[tuple[str, ...], ...]) -> optax.GradientTransformation:
  """`tx` with no update at all for the parameters under `subtrees` (paths of names, e.g.
  ("bert", "pooler")): a weight an objective never reads has no gradient, but AdamW's decay would
  still shrink it every step. The state is `tx`'s own (its moments stay 0 there)."""
  if not subtrees:
    return tx
  prefixes = [tuple(n.lower() for n in path) for path in subtrees]

  def update(grads, state, params=None):
    updates, state = tx.update(grads, state, params)
    keep = _map_names(lambda names: any(tuple(names[:len(p)]) == p for p in prefixes), updates)
    return jax.tree.map(lambda u, k: jnp.zeros_like(u) if k else u, updates, keep), state

  return optax.GradientTransformation(tx.init, update)


def create_optimizer(train_config, *, learning_rate=None, warmup_steps=None, total_steps=None,
                     weight_decay=None) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """clip_by_global_norm(max_grad_norm) -> AdamW or LAMB with the warmup/decay schedule.

  `train_config` is a `bertjax.training.train.TrainConfig` (any object with the same attributes). The
  keyword arguments replace its values, traced scalars allowed (a trial's own, in a program of
  several trials: bertjax/finetune/job/trials.py); the linear schedule only.
  """
  c = train_config
  if c.optimizer not in OPTIMIZERS:
    raise Refusal(f"optimizer={c.optimizer!r}; choose one of {sorted(OPTIMIZERS)}")
  peak = c.learning_rate if learning_rate is None else learning_rate
  warmup = c.warmup_steps if warmup_steps is None else warmup_steps
  total = c.num_train_steps if total_steps is None else total_steps
  if getattr(c, "schedule", "linear") == "wsd":
    schedule = wsd_schedule(peak, warmup, c.decay_steps, total)
  else:
    schedule = learning_rate_schedule(peak, warmup, total)
  main = OPTIMIZERS[c.optimizer](schedule, b1=c.adam_b1, b2=c.adam_b2, eps=c.adam_eps,
                                 weight_decay=c.weight_decay if weight_decay is None
                                 else weight_decay, bias_correction=c.bias_correction)
  parts = [main]
  if c.max_grad_norm and c.max_grad_norm > 0:
    parts.insert(0, optax.clip_by_global_norm(c.max_grad_norm))
  return optax.chain(*parts), schedule
