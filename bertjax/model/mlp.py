"""The MLP block of an encoder layer: dense(F) -> activation -> dense(D), or the gated form; by
XLA's products or by the fused kernels of mlp_kernel.py (`BertConfig.mlp_impl`); and with those
kernels a post-norm layer's attention end (end_kernel.py).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from bertjax.model import dropout, residuals
from bertjax.model.kernels import end_kernel, mlp_choice, mlp_kernel
from bertjax.model.config import ACTIVATIONS, BertConfig
from bertjax.model.primitives import NormWeights, dense, layer_norm, product
from bertjax.parallel import platforms


def _impl(cfg: BertConfig) -> str:
  if cfg.mlp_impl == "auto":  # train.build settles it for its mesh's chips; outside it, here
    return mlp_choice.chosen(cfg, jax.devices()[0],
                             dict(jax.sharding.get_abstract_mesh().shape).get("tensor", 1))
  return cfg.mlp_impl


def residual_normed(cfg: BertConfig, x_BxLxD, norm_name: str, dropped=None):
  """x + dropped(Mlp(layer_norm(x))), a pre-norm layer's second half, inside the calling module:
  the norm's parameters at `norm_name`, the MLP's at "mlp", either way. By the kernels the norm
  is made inside them (its output and its backward's passes never written: kernels/row_norm.py),
  and where `dropped` is None (no dropout) the sum too."""
  mlp = Mlp(cfg, name="mlp")
  if _impl(cfg) not in ("pallas", "pallas_kept"):
    y_BxLxD = mlp(layer_norm(cfg, norm_name)(x_BxLxD))
  else:
    weights = NormWeights(cfg, name=norm_name)(x_BxLxD.shape[-1])
    norm = (weights, cfg.layer_norm_eps, cfg.norm_type != "rmsnorm")
    if dropped is None:
      return mlp(x_BxLxD, norm=norm, residual=True)
    y_BxLxD = mlp(x_BxLxD, norm=norm)
  return x_BxLxD + (y_BxLxD if dropped is None else dropped(y_BxLxD))


def post_normed(cfg: BertConfig, x_BxLxD, norm_name: str, dropped, rate: float, draw):
  """layer_norm(x + dropped(Mlp(x))), a post-norm layer's second half, inside the calling module:
  the norm's parameters at `norm_name`, the MLP's at "mlp", either way. By the kernels the
  dropout (at `rate`, its key `draw()`), the sum and the norm are made inside them, and their
  backward too (mlp_kernel.mlp's `post`; the keep decisions are the kernels' own)."""
  mlp = Mlp(cfg, name="mlp")
  if _impl(cfg) not in ("pallas", "pallas_kept"):
    return layer_norm(cfg, norm_name)(x_BxLxD + dropped(mlp(x_BxLxD)))
  weights = NormWeights(cfg, name=norm_name)(x_BxLxD.shape[-1])
  words = dropout.key_words(draw()) if rate > 0 else None
  return mlp(x_BxLxD, post=(weights, cfg.layer_norm_eps, cfg.norm_type != "rmsnorm", rate,
                            words))


def ends_in_kernels(cfg: BertConfig) -> bool:
  """Whether a post-norm layer's attention end is made by end_kernel.py (where the attention
  kernel gives it the heads): with the MLP's kernels, whose dropout decisions it shares."""
  return cfg.norm_position == "post" and _impl(cfg) in ("pallas", "pallas_kept")


# The chips (platforms.tpu_chip) where a post-norm layer's q, k and v are qkv_kernel's: v5p,
# where XLA's products read their gradients twice from HBM (BERT-Base L 128 on v5p-8: 11.67 ->
# 11.42 GB a chip a step, BERT-Large 29.24 -> 28.67); on v6e XLA keeps more of them in VMEM and
# the kernel moved more (BERT-Base 3.64 -> 3.86). docs/performance.md, "The MLM head's backward
# in one kernel, and the weights' gradients reduce-scattered as written".
POST_NORM_START_ON = ("TPU_V5P",)


def attention_start(cfg: BertConfig, x_BxLxD, norm_name: str, layer_id):
  """A layer's attention start for qkv_kernel, which makes q, k and v's products (a pre-norm
  layer's norm with them) with the MLP's kernels (the attention the fused kernel, and a
  post-norm layer's end the kernels': the caller's to check): a one-tuple of the norm ((its
  weights, at `norm_name` in the calling module; eps; centred), None for a post-norm layer or
  one that skips it), or None where XLA's path makes them (a post-norm layer's off
  POST_NORM_START_ON's chips; a scanned layer's skipped norm is a traced choice)."""
  if _impl(cfg) not in ("pallas", "pallas_kept"):
    return None
  if cfg.norm_position != "pre":
    return (None,) if platforms.tpu_chip() in POST_NORM_START_ON else None
  if cfg.skips_first_attention_norm and not isinstance(layer_id, int):
    return None
  if cfg.skips_first_attention_norm and layer_id == 0:
    return (None,)
  weights = NormWeights(cfg, name=norm_name)(x_BxLxD.shape[-1])
  return ((weights, cfg.layer_norm_eps, cfg.norm_type != "rmsnorm"),)


def attention_end(cfg: BertConfig, r_BxLxD, norm_name: str, drop, deterministic: bool):
  """LN(r + dropout(c W + b)) as a function of the attention's heads c [B, L, C] and the output
  projection's (W [.., D], b or None), by end_kernel.end: the norm's parameters at `norm_name`
  and the key (`drop`'s first draw, which XLA's path masks this sum with) taken here, in the
  calling module."""
  weights = NormWeights(cfg, name=norm_name)(r_BxLxD.shape[-1])
  rate = 0.0 if deterministic else cfg.hidden_dropout
  words = dropout.key_words(drop.draw()) if rate > 0 else None
  post = (weights, cfg.layer_norm_eps, cfg.norm_type != "rmsnorm", rate, words)
  dt, width = cfg.compute_dtype, r_BxLxD.shape[-1]

  def ended(c_BxLxC, w, b, r=None):  # `r`: the residual's rows where qkv_kernel gave them
    r = r_BxLxD if r is None else r
    y_NxD = end_kernel.end(
        c_BxLxC.reshape(-1, w.size // width).astype(dt),
        r.reshape(-1, width).astype(dt), w.reshape(-1, width).astype(dt),
        jnp.zeros((width,), cfg.storage_dtype) if b is None else b, post)
    return y_NxD.reshape(r_BxLxD.shape)

  return ended


class Mlp(nn.Module):
  """dense(F) -> activation -> dense(D); gated: act(dense(F)) * dense_gate(F) -> dense(D).

  The gated form keeps its two F-wide projections as two kernels (not one [D, 2F]) so that each
  is split over the `tensor` axis alike and the product needs no communication.
  """

  config: BertConfig

  @nn.compact
  def __call__(self, x_BxLxD, norm=None, residual: bool = False, post=None):
    """`norm` and `residual` (the kernels alone: `residual_normed`): x is the rows before the
    norm they describe, and is added to the result. `post` (the kernels alone: `post_normed`):
    mlp_kernel.mlp's."""
    cfg = self.config
    bias = cfg.mlp_bias
    impl = _impl(cfg)
    if impl in ("pallas", "pallas_kept"):
      return self._fused(x_BxLxD, keep=impl == "pallas_kept", norm=norm, residual=residual,
                         post=post)
    if norm is not None or residual or post is not None:
      raise ValueError(f"Mlp(norm=..., residual=...) is the kernels' (mlp_impl='pallas' or "
                       f"'pallas_kept'), not mlp_impl={impl!r}'s: call residual_normed")
    constrain = lambda h: nn.with_logical_constraint(
        h, ("activation_batch", "activation_length", "activation_mlp"))
    h_BxLxF = constrain(
        dense(cfg, cfg.intermediate_size, ("embed", "mlp"), "intermediate", use_bias=bias)(
            x_BxLxD))
    g_BxLxF = None
    if cfg.mlp_type == "gated":
      g_BxLxF = constrain(
          dense(cfg, cfg.intermediate_size, ("embed", "mlp"), "gate", use_bias=bias)(x_BxLxD))
    output = dense(cfg, cfg.hidden_size, ("mlp", "embed"), "output", use_bias=bias)
    act = ACTIVATIONS[cfg.hidden_act]
    activated = lambda h, g: act(h) if g is None else act(h) * g
    if impl != "xla_remade" or cfg.remat_policy != "none":
      # "xla": differentiated as written. Under a remat policy "xla_remade" is the same: the
      # layer's remat keeps h (a matmul's output) and makes the activation again already.
      return output(activated(h_BxLxF, g_BxLxF))

    # Nothing rematerialised: differentiated as written, the backward keeps the activation's
    # own intermediates beside h, and XLA writes two F-wide tensors for an erf GELU and reads
    # both in two backward products. Here it keeps h alone, and the activation is made again
    # inside the products that read it (docs/performance.md, "The MLP's activation made again").
    w2_FxD, b2_D = output(h_BxLxF, weights_only=True)

    def act_and_output(h_BxLxF, g_BxLxF, w2_FxD, b2_D):
      return product(cfg, activated(h_BxLxF, g_BxLxF), w2_FxD, b2_D, (h_BxLxF.ndim - 1,),
                     cfg.compute_dtype)
    return jax.checkpoint(act_and_output, policy=jax.checkpoint_policies.nothing_saveable)(
        h_BxLxF, g_BxLxF, w2_FxD, b2_D)

  def _fused(self, x_BxLxD, keep: bool, norm=None, residual: bool = False, post=None):
    """The same parameters (names, shapes, initialisers) through mlp_kernel's kernels; `keep`:
    the backward reads the pre-activation the forward wrote (mlp_kernel.mlp). The gated form's
    two projections go in side by side, [D, 2F]."""
    cfg = self.config
    dt, bias = cfg.compute_dtype, cfg.mlp_bias
    hidden, width = cfg.intermediate_size, x_BxLxD.shape[-1]
    no_bias = lambda n: jnp.zeros((n,), cfg.storage_dtype)
    w1s, b1s = [], []
    for name in ("intermediate",) + (("gate",) if cfg.mlp_type == "gated" else ()):
      w_DxF, b_F = dense(cfg, hidden, ("embed", "mlp"), name, use_bias=bias)(
          x_BxLxD, weights_only=True)
      w1s.append(w_DxF.astype(dt))
      b1s.append(no_bias(hidden) if b_F is None else b_F)
    w2_FxD, b2_D = dense(cfg, width, ("mlp", "embed"), "output", use_bias=bias)(
        jax.ShapeDtypeStruct((hidden,), dt), weights_only=True)
    y_NxD = mlp_kernel.mlp(
        x_BxLxD.reshape(-1, width).astype(dt), jnp.concatenate(w1s, axis=1),
        jnp.concatenate(b1s), w2_FxD.astype(dt),
        no_bias(width) if b2_D is None else b2_D, ACTIVATIONS[cfg.hidden_act], keep=keep,
        norm=norm, residual=residual, post=post)
    if post is not None:  # the layer's output: the sum the backward reads is kept, named inside
      return y_NxD.reshape(x_BxLxD.shape)
    # Named for remat "dots_mlp" and "dots_kernels", which keep it.
    return residuals.named(y_NxD.reshape(x_BxLxD.shape), "mlp_output")
