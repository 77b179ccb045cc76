"""The MLP kernels' arithmetic that is not a kernel's: the activation and its derivative, the
gated form's product and its pull-back (read inside the kernels and by XLA alike), and the
kernels' forward and backward as XLA's products of the same arithmetic, which run where there is
no Mosaic (a GPU) and which the tests hold the kernels to.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from bertjax.model import dropout, residuals
from bertjax.model.kernels import row_norm

T = (((1,), (1,)), ((), ()))  # dot_general: contract the last axes of both (b's transpose)
_F32 = jnp.float32


def with_slope(act, pre):
  """act(pre) and its derivative, elementwise (one jvp: the activation's own formula)."""
  return jax.jvp(act, (pre,), (jnp.ones_like(pre),))


def activated(act, pres):
  """act(h), or act(h) * g for the gated form; float32 in, float32 out."""
  return act(pres[0]) if len(pres) == 1 else act(pres[0]) * pres[1]


def pulled(act, pres, g):
  """(`activated`'s value, the gradient of each pre-activation) given g, the gradient of that
  value; the activation's derivative is its own jvp."""
  a, slope = with_slope(act, pres[0])
  if len(pres) == 1:
    return a, [g * slope]
  return a * pres[1], [g * slope * pres[1], g * a]


def split(pre_NxF, hidden: int):
  """The pre-activation's F-wide parts: [h], or [h, g] for the gated form."""
  return [pre_NxF[:, at:at + hidden] for at in range(0, pre_NxF.shape[1], hidden)]


def _dropped(y, key_1x4, first, rate: float):
  """y [tokens, D] float32 with dropout's decisions for tokens first, first + 1, ... applied."""
  if rate <= 0:
    return y
  words = [key_1x4[0, i].astype(jnp.uint32) for i in range(3)]
  keep = dropout.token_decisions(words[0], words[1], words[2] + first, y.shape[0], y.shape[1],
                                 rate)
  return dropout.kept(y, keep, rate)


def tail(y, rows, post_2xD, key_1x4, first, post):
  """A post-norm layer's end, LN(rows + dropout(y)), from the MLP's output y (float32) for
  tokens first, first + 1, ... after the device's first (key_1x4: the dropout key's two words,
  the device's first token): (the norm's output, the sum it normalises), in the rows' dtype.
  `post`: (eps, centred, the dropout rate)."""
  eps, centred, rate = post
  s = (rows.astype(_F32) + _dropped(y, key_1x4, first, rate)).astype(rows.dtype)
  return row_norm.normalised(s, post_2xD, eps, centred)[0], s


def tail_pulled(d_out, s, post_2xD, key_1x4, first, post):
  """`tail`'s backward from the sum it kept: (the rows' gradient through the residual and the
  MLP output's, float32; the norm's weights' gradient [2, D] summed over the tokens)."""
  eps, centred, rate = post
  _, stats = row_norm.normalised(s, post_2xD, eps, centred)
  ds, d_post = row_norm.pulled_back(d_out.astype(_F32), stats, post_2xD, centred)
  return ds, _dropped(ds, key_1x4, first, rate), d_post


def products(x_NxD, w1_DxF, b1_1xF, w2_FxD, b2_1xD, norm_2xD, act, rounded: bool = False,
              kept: bool = False, norm=None, residual: bool = False, post=None, tail_in=None):
  """The forward kernel's results, by XLA from the same arithmetic (platforms without Mosaic)."""
  if residual:
    b2_1xD = b2_1xD + x_NxD.astype(_F32)
  if norm:
    x_NxD, _ = row_norm.normalised(x_NxD, norm_2xD, *norm)
  pre = jnp.dot(x_NxD, w1_DxF, preferred_element_type=_F32) + b1_1xF
  if rounded or kept:
    pre_NxF = pre.astype(x_NxD.dtype)
    pre = pre_NxF.astype(_F32)
  h_NxF = activated(act, split(pre, w2_FxD.shape[0])).astype(x_NxD.dtype)
  y = jnp.dot(h_NxF, w2_FxD, preferred_element_type=_F32) + b2_1xD
  if post:  # the norm's output and the sum it normalises, as its bits; tail_in: (weights, key)
    out, s = tail(y, x_NxD, *tail_in, 0, post)
    return (out, residuals.bits(s), pre_NxF) if kept else (out, residuals.bits(s))
  y = y.astype(x_NxD.dtype)
  return (y, pre_NxF) if kept else y


def xla_backward(x_NxD, dy_NxD, w1_DxF, b1_1xF, w2_FxD, kept_NxF, norm_2xD, act, norm=None,
                 residual: bool = False, cores: int = 1, post=None, tail_in=None,
                 w2_rows: bool = True):
  """The backward kernel's results, by XLA from the same arithmetic (platforms without Mosaic);
  the sums with `cores` rows as the kernel's (the others zero)."""
  dt = x_NxD.dtype
  if post:  # dy_NxD is the gradient of the norm's output; tail_in: (weights, key, the sum's bits)
    s = jax.lax.bitcast_convert_type(tail_in[2], dt)
    ds, dy, d_post = tail_pulled(dy_NxD, s, *tail_in[:2], 0, post)
    dy_NxD = dy.astype(dt)
  if norm:
    x_NxD, stats = row_norm.normalised(x_NxD, norm_2xD, *norm)
  if kept_NxF is None:
    pre = jnp.dot(x_NxD, w1_DxF, preferred_element_type=_F32) + b1_1xF
  else:
    pre = kept_NxF.astype(_F32)
  g = jax.lax.dot_general(dy_NxD, w2_FxD, T, preferred_element_type=_F32)
  h, dpres = pulled(act, split(pre, w2_FxD.shape[0]), g)
  dpre = jnp.concatenate(dpres, axis=1)
  dpre_c = dpre.astype(dt)
  dx = jax.lax.dot_general(dpre_c, w1_DxF, T, preferred_element_type=_F32)
  dw1 = jnp.dot(x_NxD.T, dpre_c, preferred_element_type=_F32).astype(w1_DxF.dtype)
  dw2 = jnp.dot(h.astype(dt).T, dy_NxD, preferred_element_type=_F32).astype(w2_FxD.dtype)
  sums = [dw1[None], jnp.sum(dpre, axis=0)[None, None], (dw2 if w2_rows else dw2.T)[None]]
  if norm:
    dx, d_norm = row_norm.pulled_back(dx, stats, norm_2xD, norm[1])
    sums.append(d_norm[None])
  if residual:
    dx = dx + dy_NxD.astype(_F32)
  if post:
    dx = dx + ds
    sums += [d_post[None], jnp.sum(dy, axis=0)[None, None]]
  pad = lambda a: jnp.pad(a, [(0, cores - 1)] + [(0, 0)] * (a.ndim - 1))
  return tuple([dx.astype(dt)] + [pad(a) for a in sums])
