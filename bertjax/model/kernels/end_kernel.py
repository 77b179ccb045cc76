"""A post-norm layer's attention end, LN(r + dropout(c W + b)), as Pallas kernels: the output
projection of the attention's heads c, its bias, the hidden dropout, the residual sum with the
layer's input r and the LayerNorm, in one pass over the tokens (`mlp_impl` "pallas" and
"pallas_kept" in a post-norm layer whose attention is the fused kernel; BERT's).

Written by XLA, this end is a product, a dropout whose keep decisions are laid out apart, a sum
and a norm, each an operation of its own; on v5p, whose XLA schedule keeps few [tokens, D]
tensors in VMEM between operations, they moved ~280 MB a layer at BERT-Base L 128's 64 rows a
chip, against ~120 for the kernels' reads and writes (docs/performance.md, "BERT's attention end
in one kernel"). Here a block of tokens at a time, W resident in VMEM:

  forward   y = LN(r + dropout(c W + b)), and the sum it normalises (kept for the backward, as
            its bits: "attention_output", with the attention kernel's output);
  backward  from the sum and y's gradient, the norm's statistics and the keep decisions made
            again (mlp_arithmetic.tail_pulled): dc, dr (the residual's), and dW, db and the
            norm's weights' gradients summed in float32 VMEM over the blocks, written once.

The keep decisions are the MLP kernels' (dropout.token_decisions: each token's index in the
global batch, the same on any mesh), keyed by the layer's first dropout draw, the one XLA's path
masks this sum with (its bits are not XLA's; docs/reliability.md). On a CPU Pallas' interpreter
runs the kernels (tests), on a GPU XLA's arithmetic of the same formula.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from bertjax.model import residuals
from bertjax.model.kernels import devices, mlp_arithmetic
from bertjax.model.kernels.mlp_arithmetic import T as _T
from bertjax.parallel import platforms

_F32 = jnp.float32


def _forward_kernel(c_ref, r_ref, w_ref, b_ref, post_ref, key_ref, y_ref, s_ref, *, post):
  first = (pl.program_id(0) * c_ref.shape[0]).astype(jnp.uint32)  # the block's first token
  c = jax.lax.bitcast_convert_type(c_ref[...], w_ref.dtype)
  z = jnp.dot(c, w_ref[...], preferred_element_type=_F32) + b_ref[...]
  y_ref[...], summed = mlp_arithmetic.tail(z, r_ref[...], post_ref[...], key_ref, first, post)
  s_ref[...] = jax.lax.bitcast_convert_type(summed, s_ref.dtype)


def _backward_kernel(c_ref, dy_ref, s_ref, w_ref, post_ref, key_ref, dc_ref, dr_ref, *refs,
                     post, chunk):
  # The sums' outputs (in HBM), their float32 scratch, a staging block and its DMA's semaphore.
  outs, accs, (stage_ref, sem) = refs[:3], refs[3:6], refs[6:]
  first = ((pl.program_id(0) * pl.num_programs(1) + pl.program_id(1))
           * c_ref.shape[0]).astype(jnp.uint32)

  @pl.when(pl.program_id(1) == 0)  # each core's first block: its own sums
  def _():
    for ref in accs:
      ref[...] = jnp.zeros_like(ref)

  dw_ref, db_ref, dpost_ref = accs
  c = jax.lax.bitcast_convert_type(c_ref[...], w_ref.dtype)
  summed = jax.lax.bitcast_convert_type(s_ref[...], c.dtype)
  ds, dz, d_post = mlp_arithmetic.tail_pulled(dy_ref[...], summed, post_ref[...], key_ref, first,
                                              post)
  dpost_ref[...] += d_post
  db_ref[...] += jnp.sum(dz, axis=0, keepdims=True)
  dz = dz.astype(c.dtype)
  dw_ref[...] += jnp.dot(c.T, dz, preferred_element_type=_F32)
  dc_ref[...] = jax.lax.dot_general(dz, w_ref[...], _T,
                                    preferred_element_type=_F32).astype(dc_ref.dtype)
  dr_ref[...] = ds.astype(dr_ref.dtype)
  devices.write_sums(outs, accs, stage_ref, sem, chunk)


def _tail_specs(width: int) -> list:
  """The norm's weights (whole) and the key (int32 [1, 4], in SMEM)."""
  return [devices.whole((2, width)), pl.BlockSpec(memory_space=pltpu.SMEM)]


def _forward(c_NxC, r_NxD, w_CxD, b_1xD, post_2xD, key_1x4, post, interpret: bool):
  """(y, the sum's bits) of the tokens' end; `post`: (eps, centred, rate). c comes as its bits
  (the kernels' own: the attention kernel writes its output so, and a bitcast between two
  kernels ran as an op of its own, a read and a write of c)."""
  (tokens, inner), width = c_NxC.shape, w_CxD.shape[1]
  block, item = devices.token_block(tokens), c_NxC.dtype.itemsize
  need = inner * width * item + 2 * block * (inner + 3 * width) * item + 8 * block * width * 4
  tile = lambda w: pl.BlockSpec((block, w), lambda i: (i, 0))
  return tuple(pl.pallas_call(
      functools.partial(_forward_kernel, post=post),
      out_shape=[jax.ShapeDtypeStruct((tokens, width), r_NxD.dtype),
                 jax.ShapeDtypeStruct((tokens, width), residuals.bits_type(r_NxD.dtype))],
      grid=(tokens // block,),
      in_specs=[tile(inner), tile(width), devices.whole(w_CxD.shape),
                devices.whole(b_1xD.shape)] + _tail_specs(width),
      out_specs=[tile(width), tile(width)],
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",),
                                           vmem_limit_bytes=platforms.vmem_limit(need)),
      cost_estimate=pl.CostEstimate(
          flops=2 * tokens * inner * width, transcendentals=tokens,
          bytes_accessed=tokens * (inner + 3 * width) * item + inner * width * item),
      interpret=interpret, name="fused_end_fwd",
  )(c_NxC, r_NxD, w_CxD, b_1xD, post_2xD, key_1x4))


def _backward(c_NxC, dy_NxD, s_NxD, w_CxD, post_2xD, key_1x4, post, interpret: bool,
              cores: int | None = None):
  """(dc, dr, then [cores, ...] sums of dW, db and the norm's weights' gradients) of `_forward`
  from y's gradient and the kept sum's bits. `cores`: the sequences of blocks, the chip's
  TensorCores by default."""
  (tokens, inner), width = c_NxC.shape, w_CxD.shape[1]
  block, item = devices.token_block(tokens), c_NxC.dtype.itemsize
  cores = devices.sequences(tokens // block) if cores is None else cores
  steps, chunk = tokens // block // cores, devices.chunk(width)
  need = (inner * width * (item + 4) + 2 * block * (2 * inner + 3 * width) * item
          + 10 * block * width * 4 + inner * chunk * item)
  tile = lambda w: pl.BlockSpec((block, w), lambda c, i: (c * steps + i, 0))
  sums = [((inner, width), w_CxD.dtype), ((1, width), _F32), ((2, width), _F32)]
  return tuple(pl.pallas_call(
      functools.partial(_backward_kernel, post=post, chunk=chunk),
      out_shape=[jax.ShapeDtypeStruct((tokens, inner), w_CxD.dtype),
                 jax.ShapeDtypeStruct((tokens, width), dy_NxD.dtype)]
                + [jax.ShapeDtypeStruct((cores,) + shape, kind) for shape, kind in sums],
      scratch_shapes=[pltpu.VMEM(shape, _F32) for shape, _ in sums]
                     + [pltpu.VMEM((inner, chunk), w_CxD.dtype), pltpu.SemaphoreType.DMA],
      grid=(cores, steps),
      in_specs=[tile(inner), tile(width), tile(width), devices.whole(w_CxD.shape)]
               + _tail_specs(width),
      out_specs=[tile(inner), tile(width)] + [pl.BlockSpec(memory_space=pl.ANY)] * len(sums),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                           vmem_limit_bytes=platforms.vmem_limit(need)),
      cost_estimate=pl.CostEstimate(
          flops=4 * tokens * inner * width, transcendentals=tokens,
          bytes_accessed=(2 * tokens * (inner + 2 * width) * item
                          + (1 + cores) * inner * width * item)),
      interpret=interpret, name="fused_end_bwd",
  )(c_NxC, dy_NxD, s_NxD, w_CxD, post_2xD, key_1x4))


def xla_forward(c_NxC, r_NxD, w_CxD, b_1xD, post_2xD, key_1x4, post):
  """`_forward`'s results by XLA from the same arithmetic (platforms without Mosaic)."""
  c_NxC = jax.lax.bitcast_convert_type(c_NxC, w_CxD.dtype)
  z = jnp.dot(c_NxC, w_CxD, preferred_element_type=_F32) + b_1xD
  y, s = mlp_arithmetic.tail(z, r_NxD, post_2xD, key_1x4, 0, post)
  return y, residuals.bits(s)


def xla_backward(c_NxC, dy_NxD, s_NxD, w_CxD, post_2xD, key_1x4, post, cores: int = 1):
  """`_backward`'s results by XLA from the same arithmetic, the sums with `cores` rows as the
  kernel's (the others zero)."""
  c_NxC = jax.lax.bitcast_convert_type(c_NxC, w_CxD.dtype)
  s = jax.lax.bitcast_convert_type(s_NxD, c_NxC.dtype)
  ds, dz, d_post = mlp_arithmetic.tail_pulled(dy_NxD, s, post_2xD, key_1x4, 0, post)
  dz_c = dz.astype(c_NxC.dtype)
  dw = jnp.dot(c_NxC.T, dz_c, preferred_element_type=_F32).astype(w_CxD.dtype)
  dc = jax.lax.dot_general(dz_c, w_CxD, _T, preferred_element_type=_F32).astype(c_NxC.dtype)
  pad = lambda a: jnp.pad(a[None], [(0, cores - 1)] + [(0, 0)] * a.ndim)
  return (dc, ds.astype(dy_NxD.dtype), pad(dw), pad(jnp.sum(dz, axis=0, keepdims=True)),
          pad(d_post))


def _on_platform(fn, *args, **kwargs):
  """`fn` by Mosaic on a TPU (also compiled on a CPU host), by Pallas' interpreter on a CPU, by
  XLA's arithmetic elsewhere (a GPU)."""
  fallback = {_forward: xla_forward, _backward: xla_backward}[fn]
  if fn is _backward:  # every branch's sums alike: [cores, ...]
    tokens = args[0].shape[0]
    kwargs["cores"] = devices.sequences(tokens // devices.token_block(tokens))
  return devices.on_platform(fn, fallback, *args, **kwargs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _end(c_NxC, r_NxD, w_CxD, b_D, post_2xD, key_1x4, post):
  return _run_forward(c_NxC, r_NxD, w_CxD, b_D, post_2xD, key_1x4, post)[0]


def _run_forward(c_NxC, r_NxD, w_CxD, b_D, post_2xD, key_1x4, post):
  fwd = lambda c, r, w, b, n, k: _on_platform(
      _forward, c, r, w, b, n, devices.with_first_token(k, c.shape[0]), post=post)
  return devices.per_device(fwd, (residuals.bits(c_NxC), r_NxD),
                            (w_CxD, b_D.astype(_F32)[None, :], post_2xD, key_1x4),
                            ("tokens", "tokens"))


def _end_fwd(c_NxC, r_NxD, w_CxD, b_D, post_2xD, key_1x4, post):
  y, s = _run_forward(c_NxC, r_NxD, w_CxD, b_D, post_2xD, key_1x4, post)
  # Kept by the policies that keep the attention kernel's output ("dots_kernels"): with it, the
  # backward needs neither kernel's forward again.
  s = jax.ad_checkpoint.checkpoint_name(s, "attention_output")
  return y, (c_NxC, s, w_CxD, b_D, post_2xD, key_1x4)


def _end_bwd(post, saved, dy_NxD):
  c_NxC, s_NxD, w_CxD, b_D, post_2xD, key_1x4 = saved
  bwd = lambda c, dy, s, w, n, k: _on_platform(
      _backward, c, dy, s, w, n, devices.with_first_token(k, c.shape[0]), post=post)
  dc, dr, dw, db, d_post = devices.per_device(
      bwd, (residuals.bits(c_NxC), dy_NxD, s_NxD), (w_CxD, post_2xD, key_1x4),
      ("tokens", "tokens", devices.summed(1, w_CxD.shape), "sums", "sums"))
  # W's gradient (the cores' and devices' sums) rounded once more.
  return (dc, dr, dw.astype(w_CxD.dtype), db.sum((0, 1)).astype(b_D.dtype),
          d_post.sum(0), None)


_end.defvjp(_end_fwd, _end_bwd)


def end(c_NxC: jax.Array, r_NxD: jax.Array, w_CxD: jax.Array, b_D: jax.Array,
        post) -> jax.Array:
  """LN(r + dropout(c W + b)) over [N, ...] tokens by the kernels, differentiable in c, r, W, b
  and the norm's weights: c the attention's heads side by side [N, C], r the layer's input
  [N, D], both and W in the compute dtype (b any float type). `post` (the norm's weights [2, D]
  float32, scale and bias; eps; centred; the dropout rate; the dropout key's words, int32 [2],
  or None for none): mlp_kernel.mlp's, the rows in the global batch's order."""
  post_2xD, eps, centred, rate, words = post
  words = jnp.zeros((2,), jnp.int32) if words is None else words.astype(jnp.int32)
  key_1x4 = jnp.concatenate([words, jnp.zeros((2,), jnp.int32)])[None]
  form = (float(eps), bool(centred), float(rate) if post[4] is not None else 0.0)
  return _end(c_NxC, r_NxD, w_CxD, b_D, post_2xD, key_1x4, form)
