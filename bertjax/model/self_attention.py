"""Multi-head self-attention with its output projection, an encoder layer's first half (its
layers: encoder.py; the attention implementations it routes to: attention.py and kernels/).

Shape letters as in encoder.py: B batch, L length, D hidden size, N heads, K head size.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from bertjax.model import attention, primitives, residuals
from bertjax.model.kernels import attention_blocks, attention_kernel, qkv_kernel
from bertjax.model.rope import apply_rope, lane_frequencies
from bertjax.model.config import BertConfig, chosen_qkv
from bertjax.model.primitives import dense
from bertjax.parallel import sharding


class SelfAttention(nn.Module):
  """Multi-head self-attention with its output projection (before the residual).

  `query_key_init="shared"` starts the key projection as a copy of the query's (both are then
  trained apart, as in the original). Each head's score q_i . k_j is then x_i^T W W^T x_j, a
  positive semi-definite form: from step one a token attends most to itself and to tokens whose
  representation is close to its own, which with a sinusoidal position table means its
  neighbours. With independent random W_Q, W_K the scores carry no such order and a small model
  must first find one, on a plateau whose length varies from run to run (configs/tiny.py).

  `layer_id` (an int, or a traced index under nn.scan) picks global or local attention and the
  RoPE table; `rope` holds the tables BertModel built once per batch. `query_positions` [B, S]
  (XLA path): only those positions ask (keys and values are every position's); the output is
  theirs, [B, S, D].
  """

  config: BertConfig

  @nn.compact
  def __call__(self, x_BxLxD, masks, deterministic: bool, rope=None, layer_id=0,
               query_positions=None, end=None, start=None):
    """The attention's output [B, L, D]; with `start` (mlp.attention_start's: the pre-norm layer's
    norm, or (None,)), x is the rows before that norm, q, k and v come from qkv_kernel, and the
    result is (the output, the rows for the layer's residual sum), or with `end` too (a
    post-norm layer's) the end's, of those rows."""
    cfg = self.config
    shape = (cfg.num_heads, cfg.head_size)
    is_local = cfg.is_local(layer_id)
    window = cfg.local_window if cfg.has_local_layers else 0
    kernel, from_splash, packed = self._route(x_BxLxD.shape[1], masks, is_local, window,
                                              query_positions)
    apart = dict(flat=True, bias_apart=True) if kernel else {}
    at_queries = ((lambda a: a) if query_positions is None
                  else lambda a: attention.gather_positions(a, query_positions))
    q_BxLxNxK, k_BxLxNxK, v_BxLxNxK, res_BxLxD = self._projections(x_BxLxD, apart, at_queries,
                                                                   packed, start)
    heads = lambda x: x.reshape(x.shape[:2] + shape)  # [B, L, N * K] -> [B, L, N, K]
    biases = None
    if apart.get("bias_apart"):
      (q_BxLxNxK, bq), (k_BxLxNxK, bk), (v_BxLxNxK, bv) = q_BxLxNxK, k_BxLxNxK, v_BxLxNxK
      biases = None if bq is None else (bq, bk, bv)
    if kernel and not packed:
      q_BxLxNxK, k_BxLxNxK, v_BxLxNxK = map(heads, (q_BxLxNxK, k_BxLxNxK, v_BxLxNxK))
    turn = None
    if rope is not None and kernel:
      # RoPE in the kernel (rope.py): XLA's float32 turns and their relayouts were most of
      # ModernBERT's bytes.
      frequencies = lambda theta: lane_frequencies(cfg.head_size, cfg.num_heads, theta)
      turn = (rope["positions"], attention.select_local(
          is_local, frequencies(cfg.local_rope_theta or cfg.rope_theta),
          frequencies(cfg.rope_theta)))
    elif rope is not None:
      cos_BxLxK, sin_BxLxK = rope["global"]
      if cfg.has_local_layers and "local" in rope:
        pick = attention.select_local
        cos_BxLxK, sin_BxLxK = (pick(is_local, rope["local"][0], cos_BxLxK),
                                pick(is_local, rope["local"][1], sin_BxLxK))
      q_BxLxNxK = apply_rope(q_BxLxNxK, at_queries(cos_BxLxK), at_queries(sin_BxLxK))
      k_BxLxNxK = apply_rope(k_BxLxNxK, cos_BxLxK, sin_BxLxK)
    if not kernel:
      # The kernel's shard_map places its [B, L, N * K] inputs itself. There, this constraint on
      # the heads apart made XLA copy dq into a layout with the length minor for its products:
      # a [B, L, D] pass a layer (docs/performance.md).
      q_BxLxNxK = nn.with_logical_constraint(q_BxLxNxK, ("activation_batch", "activation_length",
                                                         "activation_heads", "activation_kv"))
    # `masks`: attention.attention_masks(cfg.attention_impl, ...), built once for all layers.
    if cfg.attention_impl == "splash" and not from_splash:
      # Init runs the kernel's XLA equivalent: the parameters do not depend on it, and callers
      # initialise on dummy batches (length 8) that the kernel's blocks do not fit.
      splash = (attention.splash_equivalent if self.is_initializing()
                else attention.splash_attention)
      run = lambda w: lambda q, k, v, ids: splash(q, k, v, ids, local_window=w)
      out_BxLxNxK = attention.choose_local(is_local, run(window), run(0), q_BxLxNxK, k_BxLxNxK,
                                           v_BxLxNxK, masks["segment_ids"])
    elif kernel:
      out_BxLxNxK = self._kernel(q_BxLxNxK, k_BxLxNxK, v_BxLxNxK, masks["segment_ids"],
                                 is_local, window, biases, deterministic, turn,
                                 bits=start is not None)
    elif cfg.attention_impl == "cudnn":
      run = lambda w: lambda q, k, v, m: attention.cudnn_attention(q, k, v, m, w)
      out_BxLxNxK = attention.choose_local(is_local, run(window), run(0), q_BxLxNxK, k_BxLxNxK,
                                           v_BxLxNxK, masks)
    else:
      rng = (self.make_rng("dropout") if not deterministic and cfg.attention_dropout > 0
             else None)
      out_BxLxNxK = attention.masked_attention(
          q_BxLxNxK, k_BxLxNxK, v_BxLxNxK, masks["mask"], is_local, window, query_positions,
          cfg.attention_dropout, rng)
    output = dense(cfg, cfg.hidden_size, ("heads", "kv", "embed"), "output", axis=(-2, -1),
                   use_bias=cfg.attention_bias)
    if end is not None:  # mlp.attention_end's: the layer's end by the kernels, from the heads
      # With `start`, the residual is the rows qkv_kernel gave back (their gradient added there).
      return end(out_BxLxNxK, *output(out_BxLxNxK, weights_only=True),
                 *(() if start is None else (res_BxLxD,)))
    out_BxLxD = output(out_BxLxNxK, flat=kernel)
    return out_BxLxD if start is None else (out_BxLxD, res_BxLxD)

  def takes_kernel(self, length: int, masks, layer_id) -> bool:
    """Whether a layer of all positions takes the fused kernel (`_route`)."""
    window = self.config.local_window if self.config.has_local_layers else 0
    return self._route(length, masks, self.config.is_local(layer_id), window, None)[0]

  def _route(self, length: int, masks, is_local, window: int, query_positions):
    """(the fused kernel, by it a splash layer, one product for q, k and v).
    The fused kernel reads the heads side by side, [B, L, N * K], as one 2-D product writes
    them (`flat`: no copy between), and their biases apart (added, then q and k turned by RoPE,
    as it reads them: no biased copy written, or made again under remat). Under "splash", an
    unrolled layer the kernel holds block by block runs by it (a local window by slabs, a global
    layer past its whole rows online: attention_blocks.py): splash's path turned q and k by XLA
    and copied them heads first (docs/performance.md, "ModernBERT-base: RoPE inside the
    attention kernel"). One product (qkv_product "one"; "auto" settled by train.build) where
    the heads are whole on each device, not into blocks of queries (they read q, k and v whole)."""
    cfg, blocks = self.config, attention_blocks
    static = isinstance(is_local, (bool, np.bool_))
    window = window if static and is_local else 0
    rate, longest = cfg.attention_dropout, attention_kernel.MAX_LENGTH
    way = blocks.way(length, window, rate, longest) if static else "whole"
    from_splash = cfg.attention_impl == "splash" and "segment_ids" in masks and (
        way == "flash" or static and blocks.holds_window(length, window, rate))
    kernel = (cfg.attention_impl in ("fused", "auto") and "segment_ids" in masks) or from_splash
    packed = (kernel and query_positions is None and way == "whole"
              and sharding.logical_shards("activation_heads") == 1
              and chosen_qkv(cfg.qkv_product, jax.devices()[0]) == "one")
    return kernel, from_splash, packed

  def _projections(self, x_BxLxD, apart: dict, at_queries, packed: bool, start=None):
    """(q, k, v, the residual rows): by Dense's `apart` options (L: S for q with query
    positions); with `packed` the thirds of one product, each with its bias apart; with `start`
    by qkv_kernel (`__call__`). The parameters are the same."""
    cfg = self.config
    shape, names = (cfg.num_heads, cfg.head_size), ("embed", "heads", "kv")
    bias = cfg.attention_bias
    query = dense(cfg, shape, names, "query", use_bias=bias)
    # Called first: a key shared with the query starts as the query's initialised weights.
    q = (query(x_BxLxD, weights_only=True) if packed or start is not None
         else query(at_queries(x_BxLxD), **apart))
    key_init = None
    if cfg.query_key_init == "shared" and self.is_initializing():
      # A copy (not the same array): the train step donates every buffer of the state once.
      w_DxNxK = nn.meta.unbox(query.variables["params"]["kernel"])
      key_init = lambda rng, shape, dtype: jnp.array(w_DxNxK, dtype=dtype, copy=True)
    key = dense(cfg, shape, names, "key", kernel_init=key_init, use_bias=bias)
    value = dense(cfg, shape, names, "value", use_bias=bias)
    if not packed and start is None:
      return q, key(x_BxLxD, **apart), value(x_BxLxD, **apart), x_BxLxD
    ws, bs = zip(q, *(m(x_BxLxD, weights_only=True) for m in (key, value)))
    ws = [w.reshape(w.shape[0], -1) for w in ws]
    bs = [None if b is None else b.reshape(-1) for b in bs]
    res_BxLxD = x_BxLxD
    if start is None:
      # [3, B, L, N * K]: the kernel reads each third where it lies (sliced, each was copied).
      qkv = (primitives.stacked_product(cfg, x_BxLxD, ws), None, None)
    else:
      dt, rows = cfg.compute_dtype, x_BxLxD.shape[:2]
      qkv, res_NxD = qkv_kernel.projections(
          x_BxLxD.reshape(-1, x_BxLxD.shape[-1]).astype(dt), jnp.stack(ws).astype(dt), start[0],
          packed, xla=self.is_initializing())
      qkv = ((qkv[0].reshape((3,) + rows + (-1,)), None, None) if packed
             else tuple(a.reshape(rows + (-1,)) for a in qkv))
      if x_BxLxD.dtype == dt:  # the kernel's own rows: their gradient added inside its backward
        res_BxLxD = res_NxD.reshape(x_BxLxD.shape)
    return (*zip(qkv, bs), res_BxLxD)

  def _kernel(self, q_BxLxNxK, k_BxLxNxK, v_BxLxNxK, segment_ids_BxL, is_local, window: int,
              biases, deterministic: bool, turn=None, bits: bool = False):
    """The fused kernel, on the heads side by side ([B, L, N * K]), or its XLA equivalent at init;
    `bits`: it reads q, k and v as their bits (qkv_kernel wrote them so).

    "auto": the kernel's arithmetic by XLA on a CPU, not its interpreter; at lengths the kernel
    does not hold, attention_masks gave XLA's mask and __call__ does not come here.
    """
    cfg = self.config
    rate = 0.0 if deterministic else cfg.attention_dropout
    rng = self.make_rng("dropout") if rate > 0 and not self.is_initializing() else None
    heads = lambda x: x.reshape(x.shape[-3:-1] + (cfg.num_heads, cfg.head_size))
    flat = lambda x: x.reshape(x.shape[:2] + (-1,))
    qkv = ((q_BxLxNxK, None, None) if k_BxLxNxK is None  # packed: [3, B, L, N * K]
           else tuple(map(flat, (q_BxLxNxK, k_BxLxNxK, v_BxLxNxK))))
    apart = lambda q, k, v: tuple(q) if k is None else (q, k, v)
    fused = lambda w: lambda q, k, v, ids: (
        flat(attention.splash_equivalent(*map(heads, apart(q, k, v)), ids, local_window=w))
        if self.is_initializing()
        else attention_kernel.fused_attention(
            q, k, v, ids, rng, rate, local_window=w, head_size=cfg.head_size, biases=biases,
            interpret_on_cpu=cfg.attention_impl == "fused", turn=turn, bits=bits))
    out_BxLxNK = attention.choose_local(is_local, fused(window), fused(0), *qkv, segment_ids_BxL)
    # Named for remat "dots_kernels", which keeps it (no matmul's output: "dots" does not).
    return heads(residuals.named(out_BxLxNK, "attention_output"))
