"""The MLP, dense(F) -> activation -> dense(D), or the gated act(x W1) * (x G) -> dense(D), as
Pallas kernels whose F-wide intermediate never leaves the chip's VMEM (`model.mlp_impl="pallas"`).

Written by XLA, the MLP writes its [tokens, F] intermediate to HBM and reads it back in the
forward (the saved matmul output and the activation are two buffers), and in the backward reads
it twice more and writes and reads its gradient: eight passes over F-wide tensors a layer,
BERT-Base's largest bytes at length 512 on v6e (docs/performance.md, "The MLP in one kernel").
Here a block of tokens at a time, both weight matrices resident in VMEM:

  forward   y = act(x W1 + b1) W2 + b2, the intermediate made and consumed F-chunk by F-chunk;
  backward  the intermediate recomputed from x (one product more), then dx, and dW1, db1 and dW2
            accumulated in VMEM over the token blocks and written once.

The gated form (GeGLU, SwiGLU: ModernBERT's) is the same with W1 and G side by side, [D, 2F]: a
chunk of F columns takes its columns of both, and the kept pre-activation is [tokens, 2F]. In
a pre-norm layer the kernels also make the LayerNorm or RMSNorm before the MLP from the rows
before it (row_norm.py), and where no dropout comes between, the layer's sum x + MLP(norm(x)).
So the step reads and writes only D-wide tensors and the weights, for more of the MLP's FLOPs:
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
from bertjax.model.kernels import devices, mlp_arithmetic, row_norm
from bertjax.model.kernels.mlp_arithmetic import T as _T
from bertjax.parallel import platforms

TOKEN_BLOCKS = (512, 256, 128, 64, 32, 16, 8)  # tokens a grid step, the largest that divides
CHUNKS = (512, 256, 128)  # F columns made at a time inside a step
_F32 = jnp.float32


def token_block(tokens: int, largest: int = TOKEN_BLOCKS[0]) -> int:
  return next((b for b in TOKEN_BLOCKS if b <= largest and tokens % b == 0), tokens)


def _backward_block(tokens: int) -> int:
  # Blocks of 256 tokens: beside the weights and their float32 sums (BERT-Large: 50 MB), 512
  # overflowed v5p's 64 MiB of VMEM; the weights are read once either way.
  return token_block(tokens, 256)


def _chunk(width: int) -> int:
  return next((c for c in CHUNKS if width % c == 0), width)


def _columns(start: int, chunk: int, hidden: int, inner: int) -> list[slice]:
  """The columns of W1 (inner = F) or of W1 and G side by side (inner = 2F) a chunk reads."""
  return [slice(at + start, at + start + chunk) for at in range(0, inner, hidden)]


def _forward_kernel(x_ref, w1_ref, b1_ref, w2_ref, b2_ref, *refs, act, chunk, rounded, norm,
                    residual):
  """y for a block of tokens. `rounded` (mlp_impl "pallas_kept"): the pre-activation rounded to
  the compute dtype, as XLA's product is, before the activation reads it; with a second output
  that rounded value is also written, for the backward to read. `norm` ((eps, centred), its
  weights the first of `refs`): the rows are normalised first (row_norm). `residual`: y is
  added to the rows read (the layer's residual sum, in one rounding)."""
  norm_ref, (y_ref, *kept_ref) = (refs[0], refs[1:]) if norm else (None, refs)
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
  y_ref[...] = (acc + b2_ref[...]).astype(y_ref.dtype)


def _backward_kernel(x_ref, dy_ref, w1_ref, b1_ref, w2_ref, *refs, act, chunk, kept, norm,
                     residual):
  """dx of a block of tokens, and dW1, db1, dW2^T summed over the blocks (and the norm's
  weights' with `norm`, whose weights come after the pre-activation): in float32 scratch, each
  sum written once at the core's last block. The pre-activation is made again from x (`kept`
  False), or read where the forward wrote it (`kept`: the first of `refs`; then b1_ref is not
  read)."""
  refs = list(refs)
  kept_ref = refs.pop(0) if kept else None
  norm_ref = refs.pop(0) if norm else None
  dx_ref, *refs = refs
  # The sums' outputs (in HBM), their float32 scratch, a staging block and its DMA's semaphore.
  sums = (len(refs) - 2) // 2
  outs, accs, (stage_ref, sem) = refs[:sums], refs[sums:2 * sums], refs[2 * sums:]

  @pl.when(pl.program_id(1) == 0)  # each core's first block: its own sums
  def _():
    for ref in accs:
      ref[...] = jnp.zeros_like(ref)

  dw1_ref, db1_ref, dw2t_ref = accs[:3]
  x, dy = x_ref[...], dy_ref[...]
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
    dw2t_ref[:, rows] += jnp.dot(dy.T, h.astype(x.dtype), preferred_element_type=_F32)
  if norm:
    dx, d_norm = row_norm.pulled_back(dx, stats, norm_ref[...], norm[1])
    accs[3][...] += d_norm
  if residual:
    dx += dy.astype(_F32)
  dx_ref[...] = dx.astype(dx_ref.dtype)

  core = pl.program_id(0)  # read outside the branch: Pallas' interpreter finds it only here

  @pl.when(pl.program_id(1) == pl.num_programs(1) - 1)  # each core's last block: written once
  def _():
    for out, acc in zip(outs, accs):
      if out.dtype == acc.dtype:
        _copied(acc, out.at[core], sem)
        continue
      # Rounded a chunk of columns at a time through the staging block: an output block of the
      # whole sum would hold another copy of the weights in VMEM (BERT-Large's over v5p's 64 MiB).
      for start in range(0, acc.shape[1], chunk):
        stage_ref[...] = acc[:, pl.ds(start, chunk)].astype(stage_ref.dtype)
        _copied(stage_ref, out.at[core, :, pl.ds(start, chunk)], sem)


def _copied(src_ref, dst_ref, sem):
  copy = pltpu.make_async_copy(src_ref, dst_ref, sem)
  copy.start()
  copy.wait()


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
             rounded: bool = False, kept: bool = False, norm=None, residual: bool = False):
  """y, or (y, the pre-activation [tokens, F or 2F]) with `kept` (which implies `rounded`);
  with `norm` (eps, centred) x is first normalised by the weights norm_2xD (row_norm); with
  `residual` x is added to y."""
  rounded = rounded or kept
  tokens, width, hidden, inner, block, item, weights = _sizes(x_NxD, w1_DxF, w2_FxD, token_block)
  chunk = _chunk(hidden)
  need = (weights + 4 * block * width * item + (1 + 3 * bool(norm)) * block * width * 4
          + 4 * block * chunk * 4 * inner // hidden)
  y = jax.ShapeDtypeStruct(x_NxD.shape, x_NxD.dtype)
  y_spec = pl.BlockSpec((block, width), lambda i: (i, 0))
  if kept:
    need += 2 * block * inner * item
  return pl.pallas_call(
      functools.partial(_forward_kernel, act=act, chunk=chunk, rounded=rounded, norm=norm,
                        residual=residual),
      out_shape=(y, jax.ShapeDtypeStruct((tokens, inner), x_NxD.dtype)) if kept else y,
      grid=(tokens // block,),
      in_specs=[pl.BlockSpec((block, width), lambda i: (i, 0)),
                devices.whole(w1_DxF.shape), devices.whole(b1_1xF.shape),
                devices.whole(w2_FxD.shape), devices.whole(b2_1xD.shape)]
               + ([devices.whole((2, width))] if norm else []),
      out_specs=(y_spec, pl.BlockSpec((block, inner), lambda i: (i, 0))) if kept else y_spec,
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",),
                                           vmem_limit_bytes=_vmem_limit(need, interpret)),
      cost_estimate=pl.CostEstimate(
          flops=2 * tokens * width * (inner + hidden), transcendentals=tokens * hidden,
          bytes_accessed=(2 * tokens * width * item + weights + 4 * (inner + width)
                          + kept * tokens * inner * item)),
      interpret=interpret, name="fused_mlp_fwd",
  )(x_NxD, w1_DxF, b1_1xF, w2_FxD, b2_1xD, *([norm_2xD] if norm else []))


def _backward(x_NxD, dy_NxD, w1_DxF, b1_1xF, w2_FxD, kept_NxF, norm_2xD, act, interpret: bool,
              norm=None, residual: bool = False, cores: int | None = None):
  """dx and the weights' gradient sums, [cores, ...] (and the norm's, [cores, 2, D], with
  `norm`); `kept_NxF` the forward's pre-activation, or None to make it again from x (one product
  more). `cores`: the sequences of blocks, the chip's TensorCores by default."""
  tokens, width, hidden, inner, block, item, weights = _sizes(x_NxD, w1_DxF, w2_FxD,
                                                              _backward_block)
  kept = kept_NxF is not None
  grads = width * (inner + hidden) * 4
  # The gradients' sums stay in float32 VMEM over the token blocks and are written once with a
  # leading axis of one a sequence of blocks: under a mesh, the devices' sums stack along it for
  # the caller to add. A chip of two TensorCores (v5p) runs a sequence on each (the parallel
  # axis), each with its sums, where one sequence left a core idle. dW1 and dW2 are written in
  # the weights' dtype, as XLA's product gives a weight's gradient, and dW2 as its transpose
  # [D, F], the layout fsdp's sum over the devices takes it in (its "embed" axis major): written
  # float32 [F, D], XLA copied and relaid them, 112 MB a layer on v5p-8 (docs/performance.md).
  cores = _sequences(tokens) if cores is None else cores
  steps = tokens // block // cores
  tile = lambda width: pl.BlockSpec((block, width), lambda c, i: (c * steps + i, 0))
  chunk = _chunk(hidden)
  need = (weights + grads + width * chunk * item + 6 * block * width * item + 3 * block * width * 4
          + 6 * block * chunk * 4 * inner // hidden + kept * 2 * block * inner * item
          + bool(norm) * 4 * block * width * 4)
  sums = [(width, inner), (1, inner), (width, hidden)] + ([(2, width)] if norm else [])
  kinds = [w1_DxF.dtype, _F32, w2_FxD.dtype, _F32][:len(sums)]
  return tuple(pl.pallas_call(
      functools.partial(_backward_kernel, act=act, chunk=chunk, kept=kept, norm=norm,
                        residual=residual),
      out_shape=[jax.ShapeDtypeStruct(x_NxD.shape, x_NxD.dtype)]
                + [jax.ShapeDtypeStruct((cores,) + shape, k) for shape, k in zip(sums, kinds)],
      scratch_shapes=[pltpu.VMEM(shape, _F32) for shape in sums]
                     + [pltpu.VMEM((width, chunk), w1_DxF.dtype), pltpu.SemaphoreType.DMA],
      grid=(cores, steps),
      in_specs=[tile(width), tile(width), devices.whole(w1_DxF.shape),
                devices.whole(b1_1xF.shape), devices.whole(w2_FxD.shape)]
               + ([tile(inner)] if kept else []) + ([devices.whole((2, width))] if norm else []),
      out_specs=[tile(width)] + [pl.BlockSpec(memory_space=pl.ANY)] * len(sums),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                           vmem_limit_bytes=_vmem_limit(need, interpret)),
      cost_estimate=pl.CostEstimate(
          # dW2 and dy W2^T; dx and dW1 over W1's columns; x W1 again where it is not kept.
          flops=2 * tokens * width * (2 * hidden + (2 if kept else 3) * inner),
          transcendentals=2 * tokens * hidden,
          bytes_accessed=(3 * tokens * width * item + weights + cores * (weights + 4 * inner)
                          + 4 * inner + kept * tokens * inner * item)),
      interpret=interpret, name="fused_mlp_bwd",
  )(x_NxD, dy_NxD, w1_DxF, b1_1xF, w2_FxD, *([kept_NxF] if kept else []),
    *([norm_2xD] if norm else [])))


def _sequences(tokens: int) -> int:
  """The backward's sequences of blocks: the chip's TensorCores where its blocks divide."""
  cores = platforms.tpu_cores()
  return cores if (tokens // _backward_block(tokens)) % cores == 0 else 1


def _on_platform(fn, *args, **kwargs):
  """`fn` with the Mosaic kernel on a TPU (also a TPU program compiled on a CPU host), Pallas'
  interpreter on a CPU (tests), and elsewhere (a GPU) XLA's products of the same arithmetic, so
  a config that asks for the kernels still runs there."""
  fallback = {_forward: mlp_arithmetic.products, _backward: mlp_arithmetic.xla_backward}[fn]
  if fn is _backward:  # every branch's sums alike: [cores, ...]
    kwargs["cores"] = _sequences(args[0].shape[0])
  return jax.lax.platform_dependent(
      *args, tpu=functools.partial(fn, **kwargs, interpret=False),
      cpu=functools.partial(fn, **kwargs, interpret=True),
      default=functools.partial(fallback, **kwargs))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _mlp(x_NxD, w1_DxF, b1_F, w2_FxD, b2_D, norm_2xD, act, keep, form):
  # Not differentiated (prediction): nothing is written for a backward, the values the same.
  # `form`: (norm, residual), mlp's.
  return _run_forward(x_NxD, w1_DxF, b1_F, w2_FxD, b2_D, norm_2xD, act, keep, form, write=False)


def _run_forward(x_NxD, w1_DxF, b1_F, w2_FxD, b2_D, norm_2xD, act, keep, form, write=True):
  kept = keep and write
  norm, residual = form
  fwd = lambda x, w1, b1, w2, b2, *n: _on_platform(
      _forward, x, w1, b1, w2, b2, n[0] if n else None, act=act, rounded=keep, kept=kept,
      norm=norm, residual=residual)
  return devices.per_device(fwd, (x_NxD,),
                     (w1_DxF, b1_F.astype(_F32)[None, :], w2_FxD, b2_D.astype(_F32)[None, :])
                     + ((norm_2xD,) if norm else ()), ("tokens",) * (1 + kept))


def _mlp_fwd(x_NxD, w1_DxF, b1_F, w2_FxD, b2_D, norm_2xD, act, keep, form):
  # The inputs are kept, and with `keep` the pre-activation, named for the remat policies that
  # keep it ("dots_mlp", "dots_kernels"); without it the backward makes it again.
  out = _run_forward(x_NxD, w1_DxF, b1_F, w2_FxD, b2_D, norm_2xD, act, keep, form)
  y_NxD, pre_NxF = out if keep else (out, None)
  if keep:
    # Kept as a float: as bits (residuals.named) the step moved more, BERT-Base L 512 on v5e-8
    # 24.48 -> 29.47 GB by the count (docs/performance.md).
    pre_NxF = jax.ad_checkpoint.checkpoint_name(pre_NxF, "mlp_hidden")
  return y_NxD, (x_NxD, pre_NxF, w1_DxF, b1_F, w2_FxD, b2_D, norm_2xD)


def _mlp_bwd(act, keep, form, saved, dy_NxD):
  x_NxD, pre_NxF, w1_DxF, b1_F, w2_FxD, b2_D, norm_2xD = saved
  norm, residual = form
  def bwd(x, dy, *rest):  # the pre-activation's rows where it was kept, the weights, the norm's
    rest = list(rest)
    pre = rest.pop(0) if keep else None
    return _on_platform(_backward, x, dy, *rest[:3], pre, rest[3] if norm else None, act=act,
                        norm=norm, residual=residual)

  dx, dw1, db1, dw2t, *d_norm = devices.per_device(
      bwd, (x_NxD, dy_NxD) + ((pre_NxF,) if keep else ()),
      (w1_DxF, b1_F.astype(_F32)[None, :], w2_FxD) + ((norm_2xD,) if norm else ()),
      ("tokens",) + ("sums",) * (3 + bool(norm)))
  db2 = jnp.sum(dy_NxD.astype(_F32), axis=0)
  # The cores' and devices' sums added in float32, the weights' gradients rounded once more.
  total = lambda sums: sums.astype(_F32).sum(0)
  return (dx, total(dw1).astype(w1_DxF.dtype), db1.sum((0, 1)).astype(b1_F.dtype),
          total(dw2t).T.astype(w2_FxD.dtype), db2.astype(b2_D.dtype),
          d_norm[0].sum(0) if norm else None)


_mlp.defvjp(_mlp_fwd, _mlp_bwd)


def mlp(x_NxD: jax.Array, w1_DxF: jax.Array, b1_F: jax.Array, w2_FxD: jax.Array,
        b2_D: jax.Array, act, keep: bool = False, norm=None, residual: bool = False) -> jax.Array:
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
  added to the result (a pre-norm layer's x + MLP(norm(x)), without dropout between)."""
  if norm is None:
    return _mlp(x_NxD, w1_DxF, b1_F, w2_FxD, b2_D, None, act, keep, (None, bool(residual)))
  weights_2xD, eps, centred = norm
  return _mlp(x_NxD, w1_DxF, b1_F, w2_FxD, b2_D, weights_2xD, act, keep,
              ((float(eps), bool(centred)), bool(residual)))
