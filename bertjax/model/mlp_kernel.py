"""The MLP, dense(F) -> activation -> dense(D), as Pallas kernels whose F-wide intermediate never
leaves the chip's VMEM (`model.mlp_impl="pallas"`).

Written by XLA, the MLP writes its [tokens, F] intermediate to HBM and reads it back in the
forward (the saved matmul output and the activation are two buffers), and in the backward reads
it twice more and writes and reads its gradient: eight passes over F-wide tensors a layer,
BERT-Base's largest bytes at length 512 on v6e (docs/performance.md, "The MLP in one kernel").
Here a block of tokens at a time, both weight matrices resident in VMEM:

  forward   y = act(x W1 + b1) W2 + b2, the intermediate made and consumed F-chunk by F-chunk;
  backward  the intermediate recomputed from x (one product more), then dx, and dW1, db1 and dW2
            accumulated in VMEM over the token blocks and written once.

So the step reads and writes only D-wide tensors and the weights, for more of the MLP's FLOPs:
seven products where autodiff of the XLA path does six, nine under remat "dots", which runs the
forward kernel again in the backward (its output is no matmul's for the policy to keep; remat
"dots_mlp" keeps it, encoder.Mlp names it). Where
a step is bound by HBM that pays, where it is bound by FLOPs it does not: `mlp_impl="auto"`
takes the kernels on the chips in FASTER_ON alone. The values are those of the XLA path but for
rounding: the kernel keeps the pre-activation in float32 where the XLA path rounds the product
to the compute dtype first (tests/test_mlp_kernel.py says how close).

A kernel is one device's program: under a mesh `mlp` runs the kernels in shard_map over the
activations' batch axes, the weights whole on each device (fsdp gathers them, as it does for
XLA's matmuls; with a tensor axis each of its devices computes the same rows' whole MLP), and
sums the weights' per-device gradients outside it. On a CPU it runs Pallas' interpreter (slow:
tests only), on a GPU XLA's products of the same arithmetic. VMEM holds W1 and W2 in the compute
dtype and, in the backward, their float32 sums: BERT-Base ~30 MB, BERT-Large ~55 MB (v5e and
v6e have 128 MiB a core, v5p 64).
"""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec

# The chips where the kernels made the released configs' steps faster by the compile's roofline
# (device_kind as jax names them): v6e, whose steps XLA's MLP left bound by HBM. On v5p and v5e
# the steps are bound by their FLOPs, and the kernels' extra products (the intermediate made
# again) cost more than the bytes they save (docs/performance.md, "The MLP in one kernel").
FASTER_ON = ("TPU v6 lite",)
TOKEN_BLOCKS = (512, 256, 128, 64, 32, 16, 8)  # tokens a grid step, the largest that divides
CHUNKS = (512, 256, 128)  # F columns made at a time inside a step
_T = (((1,), (1,)), ((), ()))  # dot_general: contract the last axes of both (b's transpose)
_F32 = jnp.float32


def chosen(config, device, tensor_parallel: int = 1) -> str:
  """What `mlp_impl="auto"` means on `device`: "pallas" on FASTER_ON's chips for a dense MLP
  whose F is not split over a tensor axis (the kernels would compute every split's whole MLP),
  "xla" elsewhere; another setting as it is."""
  if config.mlp_impl != "auto":
    return config.mlp_impl
  fits = (config.mlp_type == "dense" and tensor_parallel == 1
          and getattr(device, "platform", "") == "tpu")
  return "pallas" if fits and getattr(device, "device_kind", "") in FASTER_ON else "xla"


def resolved(config, mesh):
  """`config` with mlp_impl "auto" made the setting `mesh`'s chips get (`chosen`)."""
  impl = chosen(config, mesh.devices.flat[0], dict(mesh.shape).get("tensor", 1))
  return config if impl == config.mlp_impl else dataclasses.replace(config, mlp_impl=impl)


def token_block(tokens: int, largest: int = TOKEN_BLOCKS[0]) -> int:
  return next((b for b in TOKEN_BLOCKS if b <= largest and tokens % b == 0), tokens)


def _backward_block(tokens: int) -> int:
  # Blocks of 256 tokens: beside the weights and their float32 sums (BERT-Large: 50 MB), 512
  # overflowed v5p's 64 MiB of VMEM; the weights are read once either way.
  return token_block(tokens, 256)


def _chunk(width: int) -> int:
  return next((c for c in CHUNKS if width % c == 0), width)


def _slope(act, pre):
  """act(pre) and its derivative, elementwise (one jvp: the activation's own formula)."""
  return jax.jvp(act, (pre,), (jnp.ones_like(pre),))


def _forward_kernel(x_ref, w1_ref, b1_ref, w2_ref, b2_ref, y_ref, *, act, chunk):
  x = x_ref[...]
  acc = jnp.zeros((x.shape[0], w2_ref.shape[1]), _F32)
  for start in range(0, w1_ref.shape[1], chunk):
    cols = slice(start, start + chunk)
    pre = jnp.dot(x, w1_ref[:, cols], preferred_element_type=_F32) + b1_ref[:, cols]
    acc += jnp.dot(act(pre).astype(x.dtype), w2_ref[cols, :], preferred_element_type=_F32)
  y_ref[...] = (acc + b2_ref[...]).astype(y_ref.dtype)


def _backward_kernel(x_ref, dy_ref, w1_ref, b1_ref, w2_ref, dx_ref, dw1_ref, db1_ref, dw2_ref,
                     *, act, chunk):
  @pl.when(pl.program_id(0) == 0)
  def _():
    dw1_ref[...] = jnp.zeros_like(dw1_ref)
    db1_ref[...] = jnp.zeros_like(db1_ref)
    dw2_ref[...] = jnp.zeros_like(dw2_ref)

  x, dy = x_ref[...], dy_ref[...]
  x_t = x.T  # [D, tokens]: the weights' gradients contract the tokens
  dx = jnp.zeros(x.shape, _F32)
  for start in range(0, w1_ref.shape[1], chunk):
    cols = slice(start, start + chunk)
    w1 = w1_ref[:, cols]
    pre = jnp.dot(x, w1, preferred_element_type=_F32) + b1_ref[:, cols]
    h, slope = _slope(act, pre)
    g = jax.lax.dot_general(dy, w2_ref[cols, :], _T, preferred_element_type=_F32)
    dpre = g * slope
    dpre_c = dpre.astype(x.dtype)
    dx += jax.lax.dot_general(dpre_c, w1, _T, preferred_element_type=_F32)
    dw1_ref[0, :, cols] += jnp.dot(x_t, dpre_c, preferred_element_type=_F32)
    dw2_ref[0, cols, :] += jnp.dot(h.astype(x.dtype).T, dy, preferred_element_type=_F32)
    db1_ref[0, :, cols] += jnp.sum(dpre, axis=0, keepdims=True)
  dx_ref[...] = dx.astype(dx_ref.dtype)


def _whole(shape):
  """A block that is the whole array, fetched once (its index never changes) and not double
  buffered (nothing to overlap it with)."""
  return pl.BlockSpec(shape, lambda *_: (0,) * len(shape), pipeline_mode=pl.Buffered(1))


def _vmem_limit(need: int) -> int:
  # Mosaic's default scoped limit (16-32 MiB) is below what the weights take; ask for what the
  # blocks and the step's temporaries need, with room for Mosaic's own.
  return int(need * 1.25) + (16 << 20)


def _sizes(x_NxD, w1_DxF, block_of):
  """(tokens, D, F, the token block, bytes an element, the weights' bytes) of a kernel's call."""
  tokens, width = x_NxD.shape
  hidden = w1_DxF.shape[1]
  item = x_NxD.dtype.itemsize
  return tokens, width, hidden, block_of(tokens), item, 2 * width * hidden * item


def _forward(x_NxD, w1_DxF, b1_1xF, w2_FxD, b2_1xD, act, interpret: bool):
  tokens, width, hidden, block, item, weights = _sizes(x_NxD, w1_DxF, token_block)
  need = weights + 4 * block * width * item + block * width * 4 + 4 * block * _chunk(hidden) * 4
  return pl.pallas_call(
      functools.partial(_forward_kernel, act=act, chunk=_chunk(hidden)),
      out_shape=jax.ShapeDtypeStruct(x_NxD.shape, x_NxD.dtype),
      grid=(tokens // block,),
      in_specs=[pl.BlockSpec((block, width), lambda i: (i, 0)),
                _whole(w1_DxF.shape), _whole(b1_1xF.shape),
                _whole(w2_FxD.shape), _whole(b2_1xD.shape)],
      out_specs=pl.BlockSpec((block, width), lambda i: (i, 0)),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",),
                                           vmem_limit_bytes=_vmem_limit(need)),
      cost_estimate=pl.CostEstimate(
          flops=4 * tokens * width * hidden, transcendentals=tokens * hidden,
          bytes_accessed=2 * tokens * width * item + weights + 4 * (hidden + width)),
      interpret=interpret, name="fused_mlp_fwd",
  )(x_NxD, w1_DxF, b1_1xF, w2_FxD, b2_1xD)


def _backward(x_NxD, dy_NxD, w1_DxF, b1_1xF, w2_FxD, act, interpret: bool):
  tokens, width, hidden, block, item, weights = _sizes(x_NxD, w1_DxF, _backward_block)
  grads = 2 * width * hidden * 4
  tile = lambda: pl.BlockSpec((block, width), lambda i: (i, 0))
  # The gradients' sums stay in VMEM over the token blocks (their index never changes) and are
  # written once, float32 with a leading axis of one: under a mesh, the devices' sums stack
  # along it for the caller to add. One sequence of blocks: a chip of two TensorCores (v5p)
  # would split a parallel axis over them, at the price of a second set of float32 sums to
  # write, more than BERT-Large's MLP saves at length 128.
  acc = lambda shape: pl.BlockSpec((1,) + shape, lambda i: (0, 0, 0),
                                   pipeline_mode=pl.Buffered(1))
  need = (weights + grads + 6 * block * width * item + 3 * block * width * 4
          + 6 * block * _chunk(hidden) * 4)
  dx, dw1, db1, dw2 = pl.pallas_call(
      functools.partial(_backward_kernel, act=act, chunk=_chunk(hidden)),
      out_shape=(jax.ShapeDtypeStruct(x_NxD.shape, x_NxD.dtype),
                 jax.ShapeDtypeStruct((1, width, hidden), _F32),
                 jax.ShapeDtypeStruct((1, 1, hidden), _F32),
                 jax.ShapeDtypeStruct((1, hidden, width), _F32)),
      grid=(tokens // block,),
      in_specs=[tile(), tile(), _whole(w1_DxF.shape), _whole(b1_1xF.shape),
                _whole(w2_FxD.shape)],
      out_specs=(tile(), acc((width, hidden)), acc((1, hidden)), acc((hidden, width))),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",),
                                           vmem_limit_bytes=_vmem_limit(need)),
      cost_estimate=pl.CostEstimate(
          flops=10 * tokens * width * hidden, transcendentals=2 * tokens * hidden,
          bytes_accessed=3 * tokens * width * item + weights + grads + 4 * hidden),
      interpret=interpret, name="fused_mlp_bwd",
  )(x_NxD, dy_NxD, w1_DxF, b1_1xF, w2_FxD)
  return dx, dw1, db1, dw2


def _products(x_NxD, w1_DxF, b1_1xF, w2_FxD, b2_1xD, act):
  h_NxF = act(jnp.dot(x_NxD, w1_DxF, preferred_element_type=_F32) + b1_1xF).astype(x_NxD.dtype)
  return (jnp.dot(h_NxF, w2_FxD, preferred_element_type=_F32) + b2_1xD).astype(x_NxD.dtype)


def _xla_backward(x_NxD, dy_NxD, w1_DxF, b1_1xF, w2_FxD, act):
  """The backward kernel's results, by XLA from the same arithmetic (platforms without Mosaic)."""
  zero = jnp.zeros((1, w2_FxD.shape[1]), _F32)
  _, pull = jax.vjp(lambda x, w1, b1, w2: _products(x, w1, b1, w2, zero, act),
                    x_NxD, w1_DxF, b1_1xF, w2_FxD)
  dx, dw1, db1, dw2 = pull(dy_NxD)
  return dx, dw1.astype(_F32)[None], db1[None], dw2.astype(_F32)[None]


def _on_platform(fn, *args, **kwargs):
  """`fn` with the Mosaic kernel on a TPU (also a TPU program compiled on a CPU host), Pallas'
  interpreter on a CPU (tests), and elsewhere (a GPU) XLA's products of the same arithmetic, so
  a config that asks for the kernels still runs there."""
  fallback = {_forward: _products, _backward: _xla_backward}[fn]
  return jax.lax.platform_dependent(
      *args, tpu=functools.partial(fn, **kwargs, interpret=False),
      cpu=functools.partial(fn, **kwargs, interpret=True),
      default=functools.partial(fallback, **kwargs))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _mlp(x_NxD, w1_DxF, b1_F, w2_FxD, b2_D, act):
  return _run_forward(x_NxD, w1_DxF, b1_F, w2_FxD, b2_D, act)


def _per_device(fn, tokens: tuple, whole: tuple, outputs: tuple):
  """fn(*tokens, *whole) on each device's rows under the mesh in scope (shard_map over the
  activations' batch axes), or once without one. `tokens`: [N, ...] arrays split by rows;
  `whole`: arrays every device gets whole; `outputs`: each result's kind, "tokens" (split by
  rows) or "sums" ([1, ...] per device, stacked over the devices for the caller to add)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return fn(*tokens, *whole)
  batch = nn.logical_to_mesh_axes(("activation_batch",))[0]
  spec = {"tokens": PartitionSpec(batch, None), "sums": PartitionSpec(batch, None, None)}
  out_specs = tuple(spec[kind] for kind in outputs)
  return jax.shard_map(
      fn, mesh=mesh,
      in_specs=(spec["tokens"],) * len(tokens) + tuple(PartitionSpec(None, None) for _ in whole),
      out_specs=out_specs[0] if len(out_specs) == 1 else out_specs,
      # pallas_call's outputs carry no varying-manual-axes type for shard_map to check.
      check_vma=False)(*tokens, *whole)


def _run_forward(x_NxD, w1_DxF, b1_F, w2_FxD, b2_D, act):
  fwd = lambda x, w1, b1, w2, b2: _on_platform(_forward, x, w1, b1, w2, b2, act=act)
  return _per_device(fwd, (x_NxD,),
                     (w1_DxF, b1_F.astype(_F32)[None, :], w2_FxD, b2_D.astype(_F32)[None, :]),
                     ("tokens",))


def _mlp_fwd(x_NxD, w1_DxF, b1_F, w2_FxD, b2_D, act):
  # Only the inputs are kept: the backward makes the intermediate again.
  return _run_forward(x_NxD, w1_DxF, b1_F, w2_FxD, b2_D, act), (x_NxD, w1_DxF, b1_F, w2_FxD, b2_D)


def _mlp_bwd(act, saved, dy_NxD):
  x_NxD, w1_DxF, b1_F, w2_FxD, b2_D = saved
  bwd = lambda x, dy, w1, b1, w2: _on_platform(_backward, x, dy, w1, b1, w2, act=act)
  dx, dw1, db1, dw2 = _per_device(bwd, (x_NxD, dy_NxD),
                                  (w1_DxF, b1_F.astype(_F32)[None, :], w2_FxD),
                                  ("tokens", "sums", "sums", "sums"))
  db2 = jnp.sum(dy_NxD.astype(_F32), axis=0)
  return (dx, dw1.sum(0).astype(w1_DxF.dtype), db1.sum((0, 1)).astype(b1_F.dtype),
          dw2.sum(0).astype(w2_FxD.dtype), db2.astype(b2_D.dtype))


_mlp.defvjp(_mlp_fwd, _mlp_bwd)


def mlp(x_NxD: jax.Array, w1_DxF: jax.Array, b1_F: jax.Array, w2_FxD: jax.Array,
        b2_D: jax.Array, act) -> jax.Array:
  """act(x W1 + b1) W2 + b2 over [N, D] tokens by the fused kernels, differentiable in every
  argument; `act` an elementwise function (its derivative is its jvp). The arrays in the dtype
  the products run in (the biases any float type)."""
  return _mlp(x_NxD, w1_DxF, b1_F, w2_FxD, b2_D, act)
