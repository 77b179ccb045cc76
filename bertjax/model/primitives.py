"""What every layer of the model is built of: parameter initialisers that carry logical axis names
(bertjax/parallel/sharding.py maps them onto the mesh), the norm, and Dense. bertjax/model/encoder.py and
bertjax/model/heads.py build on them; the dtype policy and the shape letters are encoder.py's."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from bertjax.model.config import BertConfig


def normal_init(config: BertConfig, names):
  # The original's tf.truncated_normal_initializer(0.02): normal with stddev 0.02, re-drawn beyond
  # two standard deviations (so the sample stddev is ~0.0176). jax's initializer is the same one.
  init = nn.initializers.truncated_normal(stddev=config.initializer_range)
  return nn.with_logical_partitioning(init, names)


def sinusoidal_init(config: BertConfig):
  """A start for the learned position table: the Transformer's sines and cosines (Vaswani et al.,
  2017), scaled so that their root mean square over a period is `initializer_range`.

  With it the offset between two positions is a fixed rotation of their embeddings from step one,
  so attention can look at neighbouring tokens without first having to discover an order in a
  random table; the table is still trained as BERT's is.
  """
  def init(key, shape, dtype=jnp.float32):
    del key
    length, width = shape
    half = width // 2  # an odd width leaves its last column at zero
    angle_PxH = np.arange(length)[:, None] / 10000.0 ** (2 * np.arange(half)[None, :] / width)
    table_PxD = np.zeros(shape, np.float64)
    table_PxD[:, 0:2 * half:2], table_PxD[:, 1:2 * half:2] = np.sin(angle_PxH), np.cos(angle_PxH)
    return jnp.asarray(table_PxD * config.initializer_range * np.sqrt(2.0), dtype)
  return nn.with_logical_partitioning(init, (None, "embed"))


def zeros(names):
  """Zero init carrying logical axis names (public: the heads use it too)."""
  return nn.with_logical_partitioning(nn.initializers.zeros_init(), names)


def _ones(names):
  return nn.with_logical_partitioning(nn.initializers.ones_init(), names)


def layer_norm(config: BertConfig, name: str) -> nn.Module:
  """The config's norm (LayerNorm or RMSNorm). Names keep "layer_norm" so that the optimizer's
  decay mask (bertjax/training/optimizer.py) excludes them whatever the type."""
  # Statistics in float32 whatever the compute dtype (said explicitly: the dtype policy must not
  # hang on a library default); the output goes back to the compute dtype.
  if config.norm_type == "rmsnorm":
    return nn.RMSNorm(epsilon=config.layer_norm_eps, dtype=config.compute_dtype,
                      param_dtype=config.storage_dtype, scale_init=_ones(("embed",)),
                      force_float32_reductions=True, name=name)
  return nn.LayerNorm(epsilon=config.layer_norm_eps, dtype=config.compute_dtype,
                      param_dtype=config.storage_dtype, scale_init=_ones(("embed",)),
                      use_bias=config.norm_bias, bias_init=zeros(("embed",)),
                      force_float32_reductions=True, name=name)


class NormWeights(nn.Module):
  """The parameters `layer_norm(config, name)` keeps (the same names, shapes and initialisers),
  for a kernel that normalises its rows itself: float32 [2, D], the scale and the bias (zeros
  where the norm has none)."""

  config: BertConfig

  @nn.compact
  def __call__(self, width: int):
    cfg = self.config
    scale = self.param("scale", _ones(("embed",)), (width,), cfg.storage_dtype)
    bias = (self.param("bias", zeros(("embed",)), (width,), cfg.storage_dtype)
            if cfg.norm_type != "rmsnorm" and cfg.norm_bias else jnp.zeros((width,)))
    return jnp.stack([scale, bias]).astype(jnp.float32)


# Logical names of a D -> D kernel (pooler, MLM transform). Only one dimension may be "embed" (a
# mesh axis appears once in a PartitionSpec); the output takes it, as every other D output of the
# model does (attention output, MLP output), so the kernel, its bias and the LayerNorm after it
# are laid out alike. "mlp" would split D over `tensor` as if it were the F of the MLP.
EMBED_TO_EMBED = (None, "embed")


class Dense(nn.Module):
  """x @ kernel + bias, contracting `axis` of x with the leading axes of the kernel.

  Written out rather than nn.DenseGeneral because that one initialises a flattened 2-D kernel,
  whose logical names (one per real axis) then fail the sharding constraint under a mesh.
  """

  config: BertConfig
  features: int | tuple[int, ...]
  names: tuple[str | None, ...]  # logical axis names of the kernel
  axis: int | tuple[int, ...] = -1
  out_dtype: Any = None  # dtype of the result (and of the accumulation): the compute dtype if None
  kernel_init: Any = None  # the kernel initialiser (boxed with `names`); None: the config's normal
  use_bias: bool = True

  @nn.compact
  def __call__(self, x, weights_only: bool = False, flat: bool = False,
               bias_apart: bool = False):
    """x @ kernel + bias; with `weights_only`, (kernel, bias or None) as stored, for a caller that
    runs the product itself (a fused kernel: x need only have a shape then). `flat`: one 2-D
    product, x's contracted axes (its last ones) and the features each merged into one axis, so
    the result is [..., prod(features)] (the attention kernel's lane-dense layout: no copy comes
    between the product and the kernel); the same parameters. `bias_apart`: (x @ kernel, bias or
    None), for a kernel that adds the bias where it reads the product."""
    cfg = self.config
    features = tuple(np.atleast_1d(self.features).tolist())
    axes = tuple(a % x.ndim for a in np.atleast_1d(self.axis).tolist())
    init = (normal_init(cfg, self.names) if self.kernel_init is None
            else nn.with_logical_partitioning(self.kernel_init, self.names))
    kernel = self.param("kernel", init,
                        tuple(x.shape[a] for a in axes) + features, cfg.storage_dtype)
    bias = (self.param("bias", zeros(self.names[len(axes):]), features, cfg.storage_dtype)
            if self.use_bias else None)
    if weights_only:
      return kernel, bias
    out_dtype = cfg.compute_dtype if self.out_dtype is None else jnp.dtype(self.out_dtype)
    if flat:
      if axes != tuple(range(x.ndim - len(axes), x.ndim)):
        raise ValueError(f"Dense(flat=True) contracts x's last axes; got axis={self.axis}")
      lead = x.shape[:x.ndim - len(axes)]
      inner = int(np.prod(kernel.shape[:len(axes)]))
      x, kernel, axes = x.reshape(lead + (inner,)), kernel.reshape(inner, -1), (len(lead),)
      bias = None if bias is None else bias.reshape(-1)
    if bias_apart:
      return product(cfg, x, kernel, None, axes, out_dtype), bias
    return product(cfg, x, kernel, bias, axes, out_dtype)


def product(cfg: BertConfig, x, kernel, bias, axes, out_dtype):
  """Dense's x @ kernel + bias, contracting `axes` of x with the kernel's leading axes, in the
  compute dtype, accumulated and returned in `out_dtype`; for a caller holding the weights."""
  y = jax.lax.dot_general(x.astype(cfg.compute_dtype), kernel.astype(cfg.compute_dtype),
                          ((axes, tuple(range(len(axes)))), ((), ())),
                          preferred_element_type=out_dtype)
  return y if bias is None else y + bias.astype(out_dtype)


def dense(config: BertConfig, features, names, name: str, axis=-1, out_dtype=None,
          kernel_init=None, use_bias: bool = True) -> Dense:
  return Dense(config, features, tuple(names), axis, out_dtype, kernel_init, use_bias, name=name)


def stacked_product(cfg: BertConfig, x, kernels):
  """[x @ kernel for each of `kernels` ([D, C] each)] as one product, [len(kernels), ..., C]:
  x's last axis contracted, in the compute dtype."""
  w = jnp.stack(kernels).astype(cfg.compute_dtype)
  y = jax.lax.dot_general(x.astype(cfg.compute_dtype), w, (((x.ndim - 1,), (1,)), ((), ())),
                          preferred_element_type=cfg.compute_dtype)
  return jnp.moveaxis(y, -2, 0)
