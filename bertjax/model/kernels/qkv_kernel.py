"""A pre-norm layer's attention start, q, k and v = norm(x) [Wq Wk Wv], as Pallas kernels: the
LayerNorm or RMSNorm before the attention and its three projections in one pass over the tokens
(a pre-norm layer whose attention is the fused kernel and whose MLP the kernels: ModernBERT's;
without a norm, a post-norm layer's on v5p, whose end is the kernels' too: BERT's).

Written by XLA, the norm's statistics were a pass of their own, each projection read the rows
again (normalising them inside its read), and the backward took ~18 passes over [tokens, D] a
layer: three products for the rows' gradient, their sums, the norm's backward in passes of its
own, three weight gradients each reading the rows and a projection's gradient, and the residual's
gradient added to the rows' (docs/performance.md, "A pre-norm layer's q, k and v in one
kernel, and the kept MLM logits made with log Z"). Here a block of tokens at a time, the three
weights resident in VMEM:

  forward   the rows normalised in VMEM (row_norm), q, k and v written as their bits: one read
            of the rows, three writes, [3, N, C] (one array, as the attention kernel reads one
            product's) or three [N, C] arrays (for the kernels that read q, k and v apart);
  backward  from the rows and q, k and v's gradients, the norm's statistics made again, the
            rows' gradient through the norm with the residual's gradient added (the rows come
            out of the forward again, as the layer's residual), and dW and the norm's weights'
            gradients summed in float32 VMEM over the blocks, written once.

On a CPU Pallas' interpreter runs the kernels (tests), on a GPU XLA's arithmetic of the same
formula.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from bertjax.model import residuals
from bertjax.model.kernels import devices, row_norm
from bertjax.model.kernels.mlp_arithmetic import T as _T
from bertjax.parallel import platforms

_F32 = jnp.float32


def _normed(x, norm_2xD, norm):
  """(the rows as the products read them, the norm's statistics or None)."""
  if norm is None:
    return x, None
  return row_norm.normalised(x, norm_2xD, *norm)


def _thirds(refs, packed: bool) -> list:
  """The three [block, C] views of q, k and v's blocks: one [3, block, C] block or three."""
  return [refs[0].at[j] for j in range(3)] if packed else list(refs[:3])


def _forward_kernel(x_ref, w_ref, norm_ref, *out_refs, norm, packed):
  xn, _ = _normed(x_ref[...], norm_ref[...], norm)
  for j, out in enumerate(_thirds(out_refs, packed)):
    out[...] = jax.lax.bitcast_convert_type(
        jnp.dot(xn, w_ref[j], preferred_element_type=_F32).astype(xn.dtype), out.dtype)


def _backward_kernel(x_ref, *refs, norm, packed, chunk):
  grads = _thirds(refs, packed)
  refs = refs[1 if packed else 3:]
  dres_ref, w_ref, norm_ref, dx_ref = refs[:4]
  # The sums' outputs (in HBM), their float32 scratch, a staging block and its DMA's semaphore.
  outs, accs, (stage_ref, sem) = refs[4:6], refs[6:8], refs[8:]
  dw_ref, dnorm_ref = accs

  @pl.when(pl.program_id(1) == 0)  # each core's first block: its own sums
  def _():
    for ref in accs:
      ref[...] = jnp.zeros_like(ref)

  xn, stats = _normed(x_ref[...], norm_ref[...], norm)
  width = xn.shape[1]
  d_xn = None
  for j, g_ref in enumerate(grads):
    g = g_ref[...]
    dw_ref[pl.ds(j * width, width), :] += jnp.dot(xn.T, g, preferred_element_type=_F32)
    part = jax.lax.dot_general(g, w_ref[j], _T, preferred_element_type=_F32)
    d_xn = part if d_xn is None else d_xn + part
  if norm is not None:
    d_xn, d_weights = row_norm.pulled_back(d_xn, stats, norm_ref[...], norm[1])
    dnorm_ref[...] += d_weights
  dx_ref[...] = (d_xn + dres_ref[...].astype(_F32)).astype(dx_ref.dtype)
  devices.write_sums(outs, accs, stage_ref, sem, chunk)


def _block(tokens: int, width: int, inner: int) -> int:
  # BERT-Large's backward at 512 tokens (its weights, their float32 sums, the blocks and the
  # float32 temporaries) would hold over v5p's 64 MiB of VMEM a core; 256 holds.
  return devices.token_block(tokens, 512 if width * inner <= 768 * 768 else 256)


def _outputs(tokens: int, inner: int, dtype, packed: bool):
  """q, k and v's shapes and blocks: one [3, N, C] array or three [N, C]."""
  if packed:
    return ([jax.ShapeDtypeStruct((3, tokens, inner), dtype)],
            lambda block, at: [pl.BlockSpec((3, block, inner), lambda *i: (0, at(*i), 0))])
  return ([jax.ShapeDtypeStruct((tokens, inner), dtype)] * 3,
          lambda block, at: [pl.BlockSpec((block, inner), lambda *i: (at(*i), 0))] * 3)


def _forward(x_NxD, w_3xDxC, norm_2xD, norm, packed: bool, interpret: bool):
  """q, k and v of the tokens (`projections`' layout)."""
  (tokens, width), inner = x_NxD.shape, w_3xDxC.shape[2]
  block, item = _block(tokens, width, inner), x_NxD.dtype.itemsize
  need = 3 * width * inner * item + 2 * block * (width + 3 * inner) * item + 6 * block * width * 4
  shapes, specs = _outputs(tokens, inner, residuals.bits_type(x_NxD.dtype), packed)
  out = pl.pallas_call(
      functools.partial(_forward_kernel, norm=norm, packed=packed),
      out_shape=shapes, grid=(tokens // block,),
      in_specs=[pl.BlockSpec((block, width), lambda i: (i, 0)), devices.whole(w_3xDxC.shape),
                devices.whole(norm_2xD.shape)],
      out_specs=specs(block, lambda i: i),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",),
                                           vmem_limit_bytes=platforms.vmem_limit(need)),
      cost_estimate=pl.CostEstimate(
          flops=6 * tokens * width * inner, transcendentals=tokens,
          bytes_accessed=tokens * (width + 3 * inner) * item + 3 * width * inner * item),
      interpret=interpret, name="fused_qkv_fwd",
  )(x_NxD, w_3xDxC, norm_2xD)
  return tuple(out)


def _backward(x_NxD, grads, dres_NxD, w_3xDxC, norm_2xD, norm, packed: bool, interpret: bool,
              cores: int | None = None):
  """(dx, then [cores, ...] sums of dW [3 * D, C] and the norm's weights' gradients [2, D]) of
  `_forward` from q, k and v's gradients (its layout) and the residual's. `cores`: the sequences
  of blocks, the chip's TensorCores by default."""
  (tokens, width), inner = x_NxD.shape, w_3xDxC.shape[2]
  block, item = _block(tokens, width, inner), x_NxD.dtype.itemsize
  cores = devices.sequences(tokens // block) if cores is None else cores
  steps, chunk = tokens // block // cores, devices.chunk(inner)
  need = (3 * width * inner * (item + 4) + 2 * block * (3 * width + 3 * inner) * item
          + 10 * block * width * 4 + 3 * width * chunk * item)
  at = lambda c, i: c * steps + i
  tile = pl.BlockSpec((block, width), lambda c, i: (at(c, i), 0))
  sums = [((3 * width, inner), w_3xDxC.dtype), ((2, width), _F32)]
  return tuple(pl.pallas_call(
      functools.partial(_backward_kernel, norm=norm, packed=packed, chunk=chunk),
      out_shape=[jax.ShapeDtypeStruct((tokens, width), x_NxD.dtype)]
                + [jax.ShapeDtypeStruct((cores,) + shape, kind) for shape, kind in sums],
      scratch_shapes=[pltpu.VMEM(shape, _F32) for shape, _ in sums]
                     + [pltpu.VMEM((3 * width, chunk), w_3xDxC.dtype), pltpu.SemaphoreType.DMA],
      grid=(cores, steps),
      in_specs=[tile] + _outputs(tokens, inner, x_NxD.dtype, packed)[1](block, at)
               + [tile, devices.whole(w_3xDxC.shape), devices.whole(norm_2xD.shape)],
      out_specs=[tile] + [pl.BlockSpec(memory_space=pl.ANY)] * len(sums),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                           vmem_limit_bytes=platforms.vmem_limit(need)),
      cost_estimate=pl.CostEstimate(
          flops=12 * tokens * width * inner, transcendentals=tokens,
          bytes_accessed=(tokens * (3 * width + 3 * inner) * item
                          + (1 + cores) * 3 * width * inner * item)),
      interpret=interpret, name="fused_qkv_bwd",
  )(x_NxD, *grads, dres_NxD, w_3xDxC, norm_2xD))


def xla_forward(x_NxD, w_3xDxC, norm_2xD, norm, packed: bool):
  """`_forward`'s results by XLA from the same arithmetic (platforms without Mosaic)."""
  xn, _ = _normed(x_NxD, norm_2xD, norm)
  out = [jnp.dot(xn, w, preferred_element_type=_F32).astype(x_NxD.dtype) for w in w_3xDxC]
  out = [residuals.bits(a) for a in out]
  return (jnp.stack(out),) if packed else tuple(out)


def xla_backward(x_NxD, grads, dres_NxD, w_3xDxC, norm_2xD, norm, packed: bool, cores: int = 1):
  """`_backward`'s results by XLA from the same arithmetic, the sums with `cores` rows as the
  kernel's (the others zero)."""
  xn, stats = _normed(x_NxD, norm_2xD, norm)
  grads = list(grads[0]) if packed else grads
  dw = jnp.concatenate([jnp.dot(xn.T, g, preferred_element_type=_F32) for g in grads])
  d_xn = sum(jax.lax.dot_general(g, w, _T, preferred_element_type=_F32)
             for g, w in zip(grads, w_3xDxC))
  d_weights = jnp.zeros(norm_2xD.shape, _F32)
  if norm is not None:
    d_xn, d_weights = row_norm.pulled_back(d_xn, stats, norm_2xD, norm[1])
  pad = lambda a: jnp.pad(a[None], [(0, cores - 1)] + [(0, 0)] * a.ndim)
  return ((d_xn + dres_NxD.astype(_F32)).astype(x_NxD.dtype), pad(dw.astype(w_3xDxC.dtype)),
          pad(d_weights))


def _run_forward(x_NxD, w_3xDxC, norm_2xD, form):
  norm, packed = form
  fwd = lambda x, w, n: devices.on_platform(_forward, xla_forward, x, w, n, norm=norm,
                                            packed=packed)
  out = devices.per_device(fwd, (x_NxD,), (w_3xDxC, norm_2xD),
                           ("thirds",) if packed else ("tokens",) * 3)
  return out if isinstance(out, tuple) else (out,)


def _floats(outs, dtype, name: str | None = None) -> tuple:
  """q, k and v's bits as the floats they are, each first named `name` for remat. Named as
  bits: a float residual is rounded by a pass of its own (jax's reduce_precision on it), and the
  attention kernels read the bits (fused_attention's `bits`), so the bitcasts between fold."""
  named = (lambda a: a) if name is None else (
      lambda a: jax.ad_checkpoint.checkpoint_name(a, name))
  return tuple(jax.lax.bitcast_convert_type(named(a), dtype) for a in outs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _qkv(x_NxD, w_3xDxC, norm_2xD, form):
  return _floats(_run_forward(x_NxD, w_3xDxC, norm_2xD, form), x_NxD.dtype), x_NxD


def _qkv_fwd(x_NxD, w_3xDxC, norm_2xD, form):
  # Named for the remat policies that keep what the products wrote ("dots_kernels" among them):
  # without it the backward runs this forward again for the attention's backward.
  out = _floats(_run_forward(x_NxD, w_3xDxC, norm_2xD, form), x_NxD.dtype, "qkv")
  return (out, x_NxD), (x_NxD, w_3xDxC, norm_2xD)


def _qkv_bwd(form, saved, cotangents):
  x_NxD, w_3xDxC, norm_2xD = saved
  (grads, dres_NxD), (norm, packed) = cotangents, form
  tokens = x_NxD.shape[0]
  cores = devices.sequences(tokens // _block(tokens, *w_3xDxC.shape[1:]))
  def bwd(x, dres, *rest):
    dx, dw, d_norm = devices.on_platform(
        _backward, xla_backward, x, rest[:-2], dres, *rest[-2:], norm=norm, packed=packed,
        cores=cores)
    return dx, dw.reshape((cores,) + w_3xDxC.shape), d_norm  # a third's D axis apart

  dx, dw, d_norm = devices.per_device(
      bwd, (x_NxD, dres_NxD) + tuple(grads), (w_3xDxC, norm_2xD),
      ("tokens", devices.summed(1, w_3xDxC.shape), "sums"), ("tokens", "tokens") + (
          ("thirds",) if packed else ("tokens",) * 3))
  # W's gradient (the cores' and devices' sums) rounded once more.
  return dx, dw.astype(w_3xDxC.dtype), d_norm.sum(0)


_qkv.defvjp(_qkv_fwd, _qkv_bwd)


def projections(x_NxD: jax.Array, w_3xDxC: jax.Array, norm=None, packed: bool = False,
                xla: bool = False):
  """((q, k, v), x): norm(x) Wq, norm(x) Wk and norm(x) Wv over [N, D] tokens by the kernels,
  differentiable in x, W and the norm's weights. x and W ([3, D, C]: Wq, Wk, Wv) in the
  compute dtype. `packed`: q, k and v as one [3, N, C] array (a one-tuple), else three [N, C].
  `norm` (the norm's weights [2, D] float32, scale and bias; eps; centred) or None (the rows
  as they are). x comes back for the layer's residual sum: its gradient there is added to the
  rows' inside the backward kernel, not by a pass of its own. `xla`: the same arithmetic by XLA,
  not differentiated (a model's init, on dummy rows the kernels' blocks need not fit)."""
  if norm is None:
    norm_2xD, form = jnp.zeros((2, x_NxD.shape[1]), _F32), (None, bool(packed))
  else:
    norm_2xD, form = norm[0], ((float(norm[1]), bool(norm[2])), bool(packed))
  if xla:
    return _floats(xla_forward(x_NxD, w_3xDxC, norm_2xD, *form), x_NxD.dtype), x_NxD
  return _qkv(x_NxD, w_3xDxC, norm_2xD, form)
