"""The MLP, dense(F) -> activation -> dense(D), or the gated act(x W1) * (x G) -> dense(D), as
Pallas kernels whose F-wide intermediate never leaves the chip's VMEM (`model.mlp_impl="pallas"`).

Written by XLA, the MLP makes eight passes over F-wide tensors in HBM a layer, BERT-Base's
largest bytes at length 512 on v6e (docs/performance.md, "The MLP in one kernel"). Here a block
of tokens at a time, both weight matrices resident in VMEM:

  forward   y = act(x W1 + b1) W2 + b2, the intermediate made and consumed F-chunk by F-chunk;
  backward  the intermediate recomputed from x (one product more), then dx, and dW1, db1 and dW2
            accumulated in VMEM over the token blocks and written once.

The gated form (GeGLU, SwiGLU: ModernBERT's) is the same with W1 and G side by side, [D, 2F]: a
chunk of F columns takes its columns of both, and the kept pre-activation is [tokens, 2F]. In
a pre-norm layer the kernels also make the LayerNorm or RMSNorm before the MLP from the rows
before it (row_norm.py), and where no dropout comes between, the layer's sum x + MLP(norm(x));
in a post-norm layer (BERT's), the layer's end LN(x + dropout(MLP(x))) (mlp_arithmetic.tail,
the keep decisions drawn inside: dropout.token_decisions), its sum kept for the backward. So
the step reads and writes only D-wide tensors and the weights, for more of the MLP's FLOPs:
seven products where autodiff of the XLA path does six, nine under remat "dots", which runs the
forward kernel again in the backward (its output is no matmul's for the policy to keep; remat
"dots_mlp" keeps it, mlp.Mlp names it).

`mlp_impl="pallas_kept"` trades the other way: the forward also writes the pre-activation
x W1 + b1 (rounded to the compute dtype, as XLA's product is), named "mlp_hidden" for the remat
policies that keep it, and the backward reads it in place of the product that makes it again:
the XLA path's six products, and two passes over the [tokens, F] intermediate a layer where
XLA's MLP makes six to fourteen (more where a scanned loop copies it in and out of its stack).
What `mlp_impl="auto"` takes where: `mlp_choice.chosen`. The values are the XLA path's but for
rounding ("pallas" keeps the pre-activation in float32; tests/test_mlp_kernel.py says how close).

A kernel is one device's program: under a mesh the kernels run on each device's rows
(devices.per_device), the weights whole on each device (fsdp gathers them; with a tensor axis
each of its devices computes the same rows' whole MLP), the weights' gradients summed outside.
On a CPU Pallas' interpreter runs them (tests), on a GPU XLA's products of the same arithmetic.
VMEM holds the weights in the compute dtype and, in the backward, their float32 sums: BERT-Base
~30 MB, BERT-Large ~55 MB, ModernBERT-base ~16 MB (v5e and v6e have 128 MiB a core, v5p 64).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from bertjax.errors import Refusal
from bertjax.model import residuals
from bertjax.model.kernels import devices, mlp_arithmetic, row_norm
from bertjax.model.kernels.devices import chunk as _chunk, token_block
from bertjax.model.kernels.mlp_arithmetic import T as _T
from bertjax.parallel import platforms

_F32 = jnp.float32


def _backward_block(tokens: int) -> int:
  # Blocks of 256 tokens: beside the weights and their float32 sums (BERT-Large: 50 MB), 512
  # overflowed v5p's 64 MiB of VMEM; the weights are read once either way.
  return token_block(tokens, 256)


def _columns(start: int, chunk: int, hidden: int, inner: int) -> list[slice]:
  """The columns of W1 (inner = F) or of W1 and G side by side (inner = 2F) a chunk reads."""
  return [slice(at + start, at + start + chunk) for at in range(0, inner, hidden)]


def _forward_kernel(x_ref, w1_ref, b1_ref, w2_ref, b2_ref, *refs, act, chunk, rounded, norm,
                    residual, post):
  """y for a block of tokens. `rounded` (mlp_impl "pallas_kept"): the pre-activation rounded to
  the compute dtype, as XLA's product is, before the activation reads it; with a second output
  that rounded value is also written, for the backward to read. `norm` ((eps, centred), its
  weights the first of `refs`): the rows are normalised first (row_norm). `residual`: y is
  added to the rows read (the layer's residual sum, in one rounding). `post` (its weights and
  key after the norm's): y is LN(rows + dropout(y)), the sum's bits second (mlp_arithmetic.tail)."""
  refs = list(refs)
  norm_ref = refs.pop(0) if norm else None
  post_ref, key_ref = (refs.pop(0), refs.pop(0)) if post else (None, None)
  y_ref, *kept_ref = refs  # then the sum's bits (post), the pre-activation (kept)
  s_ref = kept_ref.pop(0) if post else None
  first = (pl.program_id(0) * x_ref.shape[0]).astype(jnp.uint32)  # the block's first token
  x = rows = x_ref[...]
  if norm:
    x, _ = row_norm.normalised(x, norm_ref[...], *norm)
  hidden = w2_ref.shape[0]
  acc = jnp.zeros((x.shape[0], w2_ref.shape[1]), _F32)
  for start in range(0, hidden, chunk):
    pres = []
    for cols in _columns(start, chunk, hidden, w1_ref.shape[1]):
      pre = jnp.dot(x, w1_ref[:, cols], preferred_element_type=_F32) + b1_ref[:, cols]
      if rounded:
        kept = pre.astype(x.dtype)
        if kept_ref:
          kept_ref[0][:, cols] = kept
        pre = kept.astype(_F32)
      pres.append(pre)
    a = mlp_arithmetic.activated(act, pres).astype(x.dtype)
    acc += jnp.dot(a, w2_ref[start:start + chunk, :], preferred_element_type=_F32)
  if residual:
    acc += rows.astype(_F32)
  if post:
    y_ref[...], summed = mlp_arithmetic.tail(acc + b2_ref[...], rows, post_ref[...], key_ref,
                                             first, post)
    s_ref[...] = jax.lax.bitcast_convert_type(summed, s_ref.dtype)
  else:
    y_ref[...] = (acc + b2_ref[...]).astype(y_ref.dtype)


def _backward_kernel(x_ref, dy_ref, w1_ref, b1_ref, w2_ref, *refs, act, chunk, kept, norm,
                     residual, post, w2_rows):
  """dx of a block of tokens, and dW1, db1, dW2 ([F, D] with `w2_rows`, else its transpose)
  summed over the blocks (and the norm's
  weights' with `norm`, whose weights come after the pre-activation): in float32 scratch, each
  sum written once at the core's last block. The pre-activation is made again from x (`kept`
  False), or read where the forward wrote it (`kept`: the first of `refs`; then b1_ref is not
  read). `post`: dy_ref is the gradient of the norm's output, the weights, key and kept sum
  after the norm's; the norm's and the output bias' gradients are summed last."""
  refs = list(refs)
  kept_ref = refs.pop(0) if kept else None
  norm_ref = refs.pop(0) if norm else None
  post_ref, key_ref, s_ref = [refs.pop(0) for _ in range(3)] if post else (None,) * 3
  first = ((pl.program_id(0) * pl.num_programs(1) + pl.program_id(1))
           * x_ref.shape[0]).astype(jnp.uint32)
  dx_ref, *refs = refs
  # The sums' outputs (in HBM), their float32 scratch, staging blocks (for [D, F] sums, and
  # with `w2_rows` [F, D]) and their DMA's semaphore.
  sums = (len(refs) - 2 - w2_rows) // 2
  outs, accs, (*stages, sem) = refs[:sums], refs[sums:2 * sums], refs[2 * sums:]

  @pl.when(pl.program_id(1) == 0)  # each core's first block: its own sums
  def _():
    for ref in accs:
      ref[...] = jnp.zeros_like(ref)

  dw1_ref, db1_ref, dw2_ref = accs[:3]
  x, dy = x_ref[...], dy_ref[...]
  if post:
    summed = jax.lax.bitcast_convert_type(s_ref[...], x_ref.dtype)
    ds, dy, d_post = mlp_arithmetic.tail_pulled(dy, summed, post_ref[...], key_ref, first, post)
    accs[3][...] += d_post
    accs[4][...] += jnp.sum(dy, axis=0, keepdims=True)
    dy = dy.astype(x.dtype)
  if norm:
    x, stats = row_norm.normalised(x, norm_ref[...], *norm)
  x_t = x.T  # [D, tokens]: the weights' gradients contract the tokens
  hidden = w2_ref.shape[0]
  dx = jnp.zeros(x.shape, _F32)
  for start in range(0, hidden, chunk):
    rows = slice(start, start + chunk)
    columns = _columns(start, chunk, hidden, w1_ref.shape[1])
    if kept:
      pres = [kept_ref[:, cols].astype(_F32) for cols in columns]
    else:
      pres = [jnp.dot(x, w1_ref[:, cols], preferred_element_type=_F32) + b1_ref[:, cols]
              for cols in columns]
    g = jax.lax.dot_general(dy, w2_ref[rows, :], _T, preferred_element_type=_F32)
    h, dpres = mlp_arithmetic.pulled(act, pres, g)
    for cols, dpre in zip(columns, dpres):
      dpre_c = dpre.astype(x.dtype)
      dx += jax.lax.dot_general(dpre_c, w1_ref[:, cols], _T, preferred_element_type=_F32)
      dw1_ref[:, cols] += jnp.dot(x_t, dpre_c, preferred_element_type=_F32)
      db1_ref[:, cols] += jnp.sum(dpre, axis=0, keepdims=True)
    if w2_rows:
      dw2_ref[rows, :] += jnp.dot(h.astype(x.dtype).T, dy, preferred_element_type=_F32)
    else:
      dw2_ref[:, rows] += jnp.dot(dy.T, h.astype(x.dtype), preferred_element_type=_F32)
  if norm:
    dx, d_norm = row_norm.pulled_back(dx, stats, norm_ref[...], norm[1])
    accs[3][...] += d_norm
  if residual:
    dx += dy.astype(_F32)
  if post:
    dx += ds
  dx_ref[...] = dx.astype(dx_ref.dtype)

  devices.write_sums(outs, accs, stages, sem, chunk)  # each core's last block: written once


def _vmem_limit(need: int, interpret: bool) -> int:
  # Weights over a core's VMEM are said here, at trace time, not by libtpu's refusal minutes
  # into a compile.
  vmem = platforms.vmem_bytes()
  if need > vmem and not interpret:
    raise Refusal(
        f"mlp_impl='pallas' and 'pallas_kept' hold both of the MLP's weight matrices (and, in "
        f"the backward, their float32 gradients) in a core's VMEM: this MLP needs "
        f"{need / 2**20:.1f} MiB, the chips compiled for have {vmem / 2**20:.0f} MiB a core; use "
        f"mlp_impl='auto' or 'xla'")
  return platforms.vmem_limit(need, vmem)


def _sizes(x_NxD, w1_DxF, w2_FxD, block_of):
  """(tokens, D, F, W1's columns (F, or 2F gated), the token block, bytes an element, the
  weights' bytes) of a kernel's call."""
  tokens, width = x_NxD.shape
  hidden, inner = w2_FxD.shape[0], w1_DxF.shape[1]
  item = x_NxD.dtype.itemsize
  return tokens, width, hidden, inner, block_of(tokens), item, width * (inner + hidden) * item


def _forward(x_NxD, w1_DxF, b1_1xF, w2_FxD, b2_1xD, norm_2xD, act, interpret: bool,
             rounded: bool = False, kept: bool = False, norm=None, residual: bool = False,
             post=None, tail_in=None):
  """y, or (y, the pre-activation [tokens, F or 2F]) with `kept` (which implies `rounded`);
  with `norm` (eps, centred) x is first normalised by the weights norm_2xD (row_norm); with
  `residual` x is added to y; with `post` ((eps, centred, rate); tail_in: the norm's weights
  [2, D] and the key [1, 4]) y is LN(x + dropout(y)), the sum normalised the second result."""
  rounded = rounded or kept
  tokens, width, hidden, inner, block, item, weights = _sizes(x_NxD, w1_DxF, w2_FxD, token_block)
  chunk = _chunk(hidden)
  need = (weights + 4 * block * width * item + (1 + 3 * bool(norm)) * block * width * 4
          + 4 * block * chunk * 4 * inner // hidden + kept * 2 * block * inner * item
          + bool(post) * (2 * block * width * item + 6 * block * width * 4))
  tile = lambda width: pl.BlockSpec((block, width), lambda i: (i, 0))
  outs = ([(width, x_NxD.dtype)] + [(width, residuals.bits_type(x_NxD.dtype))] * bool(post)
          + [(inner, x_NxD.dtype)] * kept)
  out = pl.pallas_call(
      functools.partial(_forward_kernel, act=act, chunk=chunk, rounded=rounded, norm=norm,
                        residual=residual, post=post),
      out_shape=[jax.ShapeDtypeStruct((tokens, w), t) for w, t in outs],
      grid=(tokens // block,),
      in_specs=[tile(width), devices.whole(w1_DxF.shape), devices.whole(b1_1xF.shape),
                devices.whole(w2_FxD.shape), devices.whole(b2_1xD.shape)]
               + ([devices.whole((2, width))] if norm else []) + _tail_specs(post, width),
      out_specs=[tile(w) for w, _ in outs],
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",),
                                           vmem_limit_bytes=_vmem_limit(need, interpret)),
      cost_estimate=pl.CostEstimate(
          flops=2 * tokens * width * (inner + hidden), transcendentals=tokens * hidden,
          bytes_accessed=((2 + bool(post)) * tokens * width * item + weights
                          + 4 * (inner + width) + kept * tokens * inner * item)),
      interpret=interpret, name="fused_mlp_fwd",
  )(x_NxD, w1_DxF, b1_1xF, w2_FxD, b2_1xD, *([norm_2xD] if norm else []), *(tail_in or ()))
  return out[0] if len(out) == 1 else tuple(out)


def _tail_specs(post, width: int) -> list:
  """Where `post`: the tail's weights (whole) and key (int32 [1, 4], in SMEM: mlp's)."""
  return [devices.whole((2, width)), pl.BlockSpec(memory_space=pltpu.SMEM)] if post else []


def _backward(x_NxD, dy_NxD, w1_DxF, b1_1xF, w2_FxD, kept_NxF, norm_2xD, act, interpret: bool,
              norm=None, residual: bool = False, cores: int | None = None, post=None,
              tail_in=None, w2_rows: bool = True):
  """dx and the weights' gradient sums, [cores, ...] (dW2 [F, D] with `w2_rows`, else [D, F]),
  (and the norm's, [cores, 2, D], with
  `norm`; with `post` the tail's norm's and the output bias', dy_NxD the gradient of the norm's
  output, tail_in its weights, key and kept sum); `kept_NxF` the forward's pre-activation, or
  None to make it again from x (one product more). `cores`: the sequences of blocks, the chip's
  TensorCores by default."""
  tokens, width, hidden, inner, block, item, weights = _sizes(x_NxD, w1_DxF, w2_FxD,
                                                              _backward_block)
  kept = kept_NxF is not None
  grads = width * (inner + hidden) * 4
  # The sums stay in float32 VMEM over the token blocks and are written once, a leading axis of
  # one a sequence of blocks (the devices' stack along it for the caller to add); v5p runs a
  # sequence on each of a chip's two TensorCores (the parallel axis). dW1 and dW2 go out in the
  # weights' dtype, as XLA's product gives them. dW2 as [F, D], W2's layout, where the chips'
  # reduce-scatter splits its D in whole tiles (devices.splits): as [D, F] XLA turned W2's
  # float32 state to it and back for the update (0.7 GB of BERT-Large L 128's step on v5p-8).
  # Else as [D, F], for XLA's sum: as float32 [F, D] XLA relaid them, 112 MB a layer on v5p-8.
  cores = _sequences(tokens) if cores is None else cores
  chunk = _chunk(hidden)
  need = lambda block: (weights + grads + (1 + w2_rows) * width * chunk * item
                        + 6 * block * width * item
                        + 3 * block * width * 4 + 6 * block * chunk * 4 * inner // hidden
                        + kept * 2 * block * inner * item + bool(norm) * 4 * block * width * 4
                        + bool(post) * (2 * block * width * item + 6 * block * width * 4))
  block //= 1 + bool(block > 8 and need(block) > platforms.vmem_bytes())  # BERT-L post-norm, v5p
  steps = tokens // block // cores
  tile = lambda width: pl.BlockSpec((block, width), lambda c, i: (c * steps + i, 0))
  need = need(block)
  sums = ([(width, inner), (1, inner), (hidden, width) if w2_rows else (width, hidden)]
          + ([(2, width)] if norm else [])
          + ([(2, width), (1, width)] if post else []))
  kinds = [w1_DxF.dtype, _F32, w2_FxD.dtype] + [_F32] * (len(sums) - 3)
  return tuple(pl.pallas_call(
      functools.partial(_backward_kernel, act=act, chunk=chunk, kept=kept, norm=norm,
                        residual=residual, post=post, w2_rows=w2_rows),
      out_shape=[jax.ShapeDtypeStruct(x_NxD.shape, x_NxD.dtype)]
                + [jax.ShapeDtypeStruct((cores,) + shape, k) for shape, k in zip(sums, kinds)],
      scratch_shapes=[pltpu.VMEM(shape, _F32) for shape in sums]
                     + [pltpu.VMEM((width, chunk), w1_DxF.dtype)]
                     + [pltpu.VMEM((chunk, width), w2_FxD.dtype)] * w2_rows
                     + [pltpu.SemaphoreType.DMA],
      grid=(cores, steps),
      in_specs=[tile(width), tile(width), devices.whole(w1_DxF.shape),
                devices.whole(b1_1xF.shape), devices.whole(w2_FxD.shape)]
               + ([tile(inner)] if kept else []) + ([devices.whole((2, width))] if norm else [])
               + _tail_specs(post, width) + ([tile(width)] if post else []),
      out_specs=[tile(width)] + [pl.BlockSpec(memory_space=pl.ANY)] * len(sums),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                           vmem_limit_bytes=_vmem_limit(need, interpret)),
      cost_estimate=pl.CostEstimate(
          # dW2 and dy W2^T; dx and dW1 over W1's columns; x W1 again where it is not kept.
          flops=2 * tokens * width * (2 * hidden + (2 if kept else 3) * inner),
          transcendentals=2 * tokens * hidden,
          bytes_accessed=((3 + bool(post)) * tokens * width * item + weights
                          + cores * (weights + 4 * inner) + 4 * inner
                          + kept * tokens * inner * item)),
      interpret=interpret, name="fused_mlp_bwd",
  )(x_NxD, dy_NxD, w1_DxF, b1_1xF, w2_FxD, *([kept_NxF] if kept else []),
    *([norm_2xD] if norm else []), *(tail_in or ())))


def _sequences(tokens: int) -> int:
  """The backward's sequences of blocks: the chip's TensorCores where its blocks divide."""
  return devices.sequences(tokens // _backward_block(tokens))


def _on_platform(fn, *args, **kwargs):
  """`fn` with the Mosaic kernel on a TPU (also a TPU program compiled on a CPU host), Pallas'
  interpreter on a CPU (tests), and elsewhere (a GPU) XLA's products of the same arithmetic, so
  a config that asks for the kernels still runs there."""
  fallback = {_forward: mlp_arithmetic.products, _backward: mlp_arithmetic.xla_backward}[fn]
  if fn is _backward:  # every branch's sums alike: [cores, ...]
    kwargs["cores"] = _sequences(args[0].shape[0])
  return devices.on_platform(fn, fallback, *args, **kwargs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _mlp(x_NxD, w1_DxF, b1_F, w2_FxD, b2_D, extra, act, keep, form):
  # Not differentiated (prediction): nothing written for a backward but the tail's sum. `extra`:
  # (the pre-norm's, the tail's weights, its key), None where absent; `form`: mlp's (norm,
  # residual, post).
  return _run_forward(x_NxD, w1_DxF, b1_F, w2_FxD, b2_D, extra, act, keep, form, write=False)[0]


def _whole(w1_DxF, b1_F, w2_FxD, extra, form) -> tuple:
  """The arrays every device gets whole: the weights, the biases as float32 rows, the norms'."""
  norm_2xD, post_2xD, key_1x4 = extra
  return ((w1_DxF, b1_F.astype(_F32)[None, :], w2_FxD) + ((norm_2xD,) if form[0] else ())
          + ((post_2xD, key_1x4) if form[2] else ()))


def _norms(rest: list, form, tokens: int, *kept):
  """(the pre-norm's weights, (the tail's weights, its key with the device's first token,
  *kept)) from a device's arguments after the MLP's weights; None where absent."""
  norm_2xD = rest.pop(0) if form[0] else None
  if not form[2]:
    return norm_2xD, None
  return norm_2xD, (rest[0], devices.with_first_token(rest[1], tokens), *kept)


def _run_forward(x_NxD, w1_DxF, b1_F, w2_FxD, b2_D, extra, act, keep, form, write=True):
  """The forward's results: y, the tail's sum (`post`), the pre-activation (`keep`)."""
  kept = keep and write
  norm, residual, post = form

  def fwd(x, w1, b1, w2, b2, *rest):
    norm_2xD, tail_in = _norms(list(rest), form, x.shape[0])
    return _on_platform(_forward, x, w1, b1, w2, b2, norm_2xD, act=act, rounded=keep, kept=kept,
                        norm=norm, residual=residual, post=post, tail_in=tail_in)

  w1, b1, w2, *rest = _whole(w1_DxF, b1_F, w2_FxD, extra, form)
  out = devices.per_device(fwd, (x_NxD,), (w1, b1, w2, b2_D.astype(_F32)[None, :], *rest),
                           ("tokens",) * (1 + bool(post) + kept))
  return out if isinstance(out, tuple) else (out,)


def _mlp_fwd(x_NxD, w1_DxF, b1_F, w2_FxD, b2_D, extra, act, keep, form):
  # The inputs are kept, and with `keep` the pre-activation, named for the remat policies that
  # keep it ("dots_mlp", "dots_kernels": as a float, as bits the step moved more); without it the
  # backward makes it again. The tail's sum (its bits: no rounding pass) as "mlp_output".
  out = _run_forward(x_NxD, w1_DxF, b1_F, w2_FxD, b2_D, extra, act, keep, form)
  s_NxD = jax.ad_checkpoint.checkpoint_name(out[1], "mlp_output") if form[2] else None
  pre_NxF = jax.ad_checkpoint.checkpoint_name(out[-1], "mlp_hidden") if keep else None
  return out[0], (x_NxD, pre_NxF, s_NxD, w1_DxF, b1_F, w2_FxD, b2_D, extra)


def _mlp_bwd(act, keep, form, saved, dy_NxD):
  x_NxD, pre_NxF, s_NxD, w1_DxF, b1_F, w2_FxD, b2_D, extra = saved
  norm, residual, post = form
  # dW2 written as W2 is, [F, D], where the chips' sum splits its D in whole tiles; else [D, F].
  w2_rows = devices.splits(devices.summed(1, w2_FxD.shape))

  def bwd(x, dy, *rest):  # the kept pre-activation and sum, the weights, the norms'
    rest = list(rest)
    pre = rest.pop(0) if keep else None
    s = [rest.pop(0)] if post else []
    norm_2xD, tail_in = _norms(rest[3:], form, x.shape[0], *s)
    return _on_platform(_backward, x, dy, *rest[:3], pre, norm_2xD, act=act, norm=norm,
                        residual=residual, post=post, tail_in=tail_in, w2_rows=w2_rows)

  dx, dw1, db1, dw2, *rest = devices.per_device(
      bwd, (x_NxD, dy_NxD) + ((pre_NxF,) if keep else ()) + ((s_NxD,) if post else ()),
      _whole(w1_DxF, b1_F, w2_FxD, extra, form),
      ("tokens", devices.summed(0, w1_DxF.shape), "sums",
       devices.summed(1, w2_FxD.shape) if w2_rows else devices.summed(0, w2_FxD.shape[::-1]))
      + ("sums",) * (bool(norm) + 2 * bool(post)))
  d_norm, d_post = rest.pop(0).sum(0) if norm else None, rest[0].sum(0) if post else None
  db2 = rest[1].sum((0, 1)) if post else jnp.sum(dy_NxD.astype(_F32), axis=0)
  # The weights' gradients (the cores' and devices' sums) rounded once more.
  return (dx, dw1.astype(w1_DxF.dtype), db1.sum((0, 1)).astype(b1_F.dtype),
          (dw2 if w2_rows else dw2.T).astype(w2_FxD.dtype), db2.astype(b2_D.dtype),
          (d_norm, d_post, None))


_mlp.defvjp(_mlp_fwd, _mlp_bwd)


def mlp(x_NxD: jax.Array, w1_DxF: jax.Array, b1_F: jax.Array, w2_FxD: jax.Array,
        b2_D: jax.Array, act, keep: bool = False, norm=None, residual: bool = False,
        post=None) -> jax.Array:
  """act(x W1 + b1) W2 + b2 over [N, D] tokens by the fused kernels, differentiable in every
  argument; `act` an elementwise function (its derivative is its jvp). The arrays in the dtype
  the products run in (the biases any float type). The gated form act(x W1 + b1) * (x G + c) W2
  + b2 where w1_DxF is [D, 2F], [W1 G] side by side (b1_F [2F], [b1 c]), w2_FxD [F, D].

  `keep` (mlp_impl "pallas_kept"): the forward also writes the pre-activation x W1 + b1, rounded
  to the compute dtype, and the backward reads it instead of making it again: the XLA path's six
  products and two passes over the [N, F] intermediate. Kept through remat by the policies that
  keep "mlp_hidden".

  `norm` (weights [2, D] float32: scale and bias; eps; centred): x is the rows before a
  LayerNorm (centred) or RMSNorm, normalised inside the kernels (row_norm). `residual`: x is
  added to the result (a pre-norm layer's x + MLP(norm(x)), without dropout between).

  `post` (weights [2, D]; eps; centred; the dropout rate; the dropout key's words, int32 [2],
  or None for none): a post-norm layer's end, LN(x + dropout(y)), made inside the kernels (no
  mask, dropped sum or norm written apart; the backward makes the norm's statistics and the
  keep decisions again, dropout.token_decisions), x's rows in the global batch's order."""
  norm_2xD, norm_form = (None, None) if norm is None else (norm[0], (float(norm[1]),
                                                                     bool(norm[2])))
  post_2xD = key_1x4 = post_form = None
  if post is not None:
    if norm is not None or residual:
      raise ValueError("mlp(post=...) ends a post-norm layer: no `norm` or `residual` beside it")
    post_2xD, eps, centred, rate, words = post
    words = jnp.zeros((2,), jnp.int32) if words is None else words.astype(jnp.int32)
    key_1x4 = jnp.concatenate([words, jnp.zeros((2,), jnp.int32)])[None]
    post_form = (float(eps), bool(centred), float(rate) if post[4] is not None else 0.0)
  return _mlp(x_NxD, w1_DxF, b1_F, w2_FxD, b2_D, (norm_2xD, post_2xD, key_1x4), act, keep,
              (norm_form, bool(residual), post_form))
