"""The BERT encoder as Flax linen modules: embeddings, attention, layers, BertModel (its config:
config.py; its MLP: mlp.py; the initialisers, norm and Dense it is built of: primitives.py).

Semantics follow the original release (arXiv:1810.04805, google-research/bert): post-LN layers,
learned absolute positions, segment embeddings, LayerNorm eps 1e-12, exact-erf GELU by default,
tanh pooler on [CLS].

Shape letters used in names: B batch, L sequence length, D hidden size, N attention heads,
K head size (D / N), F feed-forward size, V vocabulary size, M masked predictions per sequence.

Dtype policy: parameters are stored in `param_dtype` (float32); matmuls run in `dtype` (bfloat16 on
accelerators); attention softmax, LayerNorm statistics, logits and losses are float32.

Every parameter carries logical axis names (see `bertjax.sharding` for the rules that map them to
mesh axes): "vocab", "embed" (D), "heads" (N), "kv" (K), "mlp" (F), "layers" (scan), None.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from bertjax.model import attention, dropout, mlp, primitives, residuals
from bertjax.model.kernels import attention_blocks, attention_kernel
from bertjax.model.rope import apply_rope, lane_frequencies, rope_tables
from bertjax.model.config import BertConfig, chosen_qkv, rematted
from bertjax.model.primitives import EMBED_TO_EMBED, dense, layer_norm, normal_init, sinusoidal_init
from bertjax.parallel import sharding


def positions_from_sequence_ids(sequence_ids_BxL: jax.Array) -> jax.Array:
  """Position of each token inside its packed sequence: restarts at 0 where the id changes."""
  idx_BxL = jnp.broadcast_to(jnp.arange(sequence_ids_BxL.shape[1]), sequence_ids_BxL.shape)
  changed_BxL = jnp.concatenate(
      [jnp.ones_like(sequence_ids_BxL[:, :1], dtype=bool),
       sequence_ids_BxL[:, 1:] != sequence_ids_BxL[:, :-1]], axis=1)
  start_BxL = jax.lax.cummax(jnp.where(changed_BxL, idx_BxL, 0), axis=1)
  return idx_BxL - start_BxL


class Embeddings(nn.Module):
  """Word + position + segment embeddings, then LayerNorm and dropout.

  With RoPE there is no position table (positions rotate q and k in every layer instead), with
  type_vocab_size=0 no segment table, and embedding_norm=False drops the norm.
  """

  config: BertConfig

  def setup(self):
    cfg = self.config
    self.word_embeddings = nn.Embed(
        cfg.vocab_size, cfg.hidden_size, dtype=cfg.compute_dtype, param_dtype=cfg.storage_dtype,
        embedding_init=normal_init(cfg, ("vocab", "embed")))
    if cfg.position_embedding == "learned":
      self.position_embeddings = nn.Embed(
          cfg.max_position_embeddings, cfg.hidden_size, dtype=cfg.compute_dtype,
          param_dtype=cfg.storage_dtype,
          embedding_init=(sinusoidal_init(cfg) if cfg.position_init == "sinusoidal"
                          else normal_init(cfg, (None, "embed"))))
    if cfg.type_vocab_size:
      self.token_type_embeddings = nn.Embed(
          cfg.type_vocab_size, cfg.hidden_size, dtype=cfg.compute_dtype,
          param_dtype=cfg.storage_dtype, embedding_init=normal_init(cfg, (None, "embed")))
    if cfg.embedding_norm:
      self.layer_norm = layer_norm(cfg, "layer_norm")
    self.dropout = dropout.Dropout(cfg.hidden_dropout)

  def __call__(self, input_ids_BxL, segment_ids_BxL, position_ids_BxL, deterministic: bool):
    cfg = self.config
    x_BxLxD = self.word_embeddings(input_ids_BxL)
    if cfg.position_embedding == "learned":
      x_BxLxD = x_BxLxD + self.position_embeddings(position_ids_BxL)
    if cfg.type_vocab_size:
      x_BxLxD = x_BxLxD + self.token_type_embeddings(segment_ids_BxL)
    if cfg.embedding_norm:
      x_BxLxD = self.layer_norm(x_BxLxD)
    return self.dropout(x_BxLxD, deterministic=deterministic)

  def word_embedding_table(self) -> jax.Array:
    """The [V, D] table, for the MLM decoder tied to it."""
    return self.word_embeddings.embedding


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
               query_positions=None, end=None):
    cfg = self.config
    shape = (cfg.num_heads, cfg.head_size)
    is_local = cfg.is_local(layer_id)
    window = cfg.local_window if cfg.has_local_layers else 0
    kernel, from_splash, packed = self._route(x_BxLxD.shape[1], masks, is_local, window,
                                              query_positions)
    apart = dict(flat=True, bias_apart=True) if kernel else {}
    at_queries = ((lambda a: a) if query_positions is None
                  else lambda a: attention.gather_positions(a, query_positions))
    q_BxLxNxK, k_BxLxNxK, v_BxLxNxK = self._projections(x_BxLxD, apart, at_queries, packed)
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
                                 is_local, window, biases, deterministic, turn)
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
      return end(out_BxLxNxK, *output(out_BxLxNxK, weights_only=True))
    return output(out_BxLxNxK, flat=kernel)

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

  def _projections(self, x_BxLxD, apart: dict, at_queries, packed: bool):
    """q, k and v by Dense's `apart` options (L: S for q with query positions); with `packed`
    the thirds of one product, each with its bias apart. The parameters are the same."""
    cfg = self.config
    shape, names = (cfg.num_heads, cfg.head_size), ("embed", "heads", "kv")
    bias = cfg.attention_bias
    query = dense(cfg, shape, names, "query", use_bias=bias)
    # Called first: a key shared with the query starts as the query's initialised weights.
    q = query(x_BxLxD, weights_only=True) if packed else query(at_queries(x_BxLxD), **apart)
    key_init = None
    if cfg.query_key_init == "shared" and self.is_initializing():
      # A copy (not the same array): the train step donates every buffer of the state once.
      w_DxNxK = nn.meta.unbox(query.variables["params"]["kernel"])
      key_init = lambda rng, shape, dtype: jnp.array(w_DxNxK, dtype=dtype, copy=True)
    key = dense(cfg, shape, names, "key", kernel_init=key_init, use_bias=bias)
    value = dense(cfg, shape, names, "value", use_bias=bias)
    if not packed:
      return q, key(x_BxLxD, **apart), value(x_BxLxD, **apart)
    ws, bs = zip(q, *(m(x_BxLxD, weights_only=True) for m in (key, value)))
    # [3, B, L, N * K]: the kernel reads each third where it lies (sliced, each was copied).
    qkv = primitives.stacked_product(cfg, x_BxLxD, [w.reshape(w.shape[0], -1) for w in ws])
    return tuple((a, None if b is None else b.reshape(-1)) for a, b in zip((qkv, None, None), bs))

  def _kernel(self, q_BxLxNxK, k_BxLxNxK, v_BxLxNxK, segment_ids_BxL, is_local, window: int,
              biases, deterministic: bool, turn=None):
    """The fused kernel, on the heads side by side ([B, L, N * K]), or its XLA equivalent at init.

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
            interpret_on_cpu=cfg.attention_impl == "fused", turn=turn))
    out_BxLxNK = attention.choose_local(is_local, fused(window), fused(0), *qkv, segment_ids_BxL)
    # Named for remat "dots_kernels", which keeps it (no matmul's output: "dots" does not).
    return heads(residuals.named(out_BxLxNK, "attention_output"))


class EncoderLayer(nn.Module):
  """Post-LN: h = LN(x + drop(attn(x))); out = LN(h + drop(mlp(h))).

  Pre-LN (norm_position="pre"): h = x + drop(attn(LN(x))); out = h + drop(mlp(LN(h))), with
  BertModel's final norm after the last layer.

  `query_positions` [B, S]: the layer's output at those positions only, [B, S, D] (the last
  layer when only a few positions are read, e.g. each sequence's [CLS]): every position is still
  a key and a value, but the queries, the output projection and the MLP run on S rows, not L.
  """

  config: BertConfig
  deterministic: bool = True
  layer_id: int | None = None  # set when unrolled; None under nn.scan (the index comes traced)

  @nn.compact
  def __call__(self, x_BxLxD, masks, rope=None, layer_id=None, query_positions=None):
    cfg = self.config
    layer_id = self.layer_id if layer_id is None else layer_id
    drop = dropout.Dropout(cfg.hidden_dropout)
    self_attention = SelfAttention(cfg, name="attention")
    attention_fn = lambda x, *a, **k: self_attention(x, *a, query_positions=query_positions, **k)
    # The residual stream at the positions computed (all of them, or the queries').
    res_BxLxD = (x_BxLxD if query_positions is None
                 else attention.gather_positions(x_BxLxD, query_positions))
    if cfg.norm_position == "pre":
      if cfg.skips_first_attention_norm and isinstance(layer_id, int):
        in_BxLxD = (x_BxLxD if layer_id == 0
                    else layer_norm(cfg, "attention_layer_norm")(x_BxLxD))
      elif cfg.skips_first_attention_norm:
        # Scanned layers share one structure: layer 0 has the norm's parameters but bypasses it.
        in_BxLxD = jnp.where(layer_id == 0, x_BxLxD,
                             layer_norm(cfg, "attention_layer_norm")(x_BxLxD))
      else:
        in_BxLxD = layer_norm(cfg, "attention_layer_norm")(x_BxLxD)
      attn_BxLxD = attention_fn(in_BxLxD, masks, self.deterministic, rope, layer_id)
      h_BxLxD = res_BxLxD + drop(attn_BxLxD, deterministic=self.deterministic)
      dropped = (None if self.deterministic or cfg.hidden_dropout <= 0
                 else lambda y: drop(y, deterministic=False))
      out_BxLxD = mlp.residual_normed(cfg, h_BxLxD, "output_layer_norm", dropped)
    else:
      ends = (query_positions is None and mlp.ends_in_kernels(cfg)
              and self_attention.takes_kernel(x_BxLxD.shape[1], masks, layer_id))
      attn_BxLxD = attention_fn(x_BxLxD, masks, self.deterministic, rope, layer_id, end=(
          mlp.attention_end(cfg, res_BxLxD, "attention_layer_norm", drop, self.deterministic)
          if ends else None))
      h_BxLxD = attn_BxLxD if ends else layer_norm(cfg, "attention_layer_norm")(
          res_BxLxD + drop(attn_BxLxD, deterministic=self.deterministic))
      out_BxLxD = mlp.post_normed(
          cfg, h_BxLxD, "output_layer_norm", lambda y: drop(y, deterministic=self.deterministic),
          0.0 if self.deterministic else cfg.hidden_dropout, lambda: self.make_rng("dropout"))
    return nn.with_logical_constraint(
        out_BxLxD, ("activation_batch", "activation_length", "activation_embed"))


class _ScanBody(nn.Module):
  """EncoderLayer in the (carry, x) -> (carry, y) form nn.scan needs; x is the layer's index.
  Its saved residuals are kept as bits (bertjax/model/residuals.py: XLA's CPU backend rewrote every
  bfloat16 one as a whole-buffer conversion at each layer)."""

  config: BertConfig
  deterministic: bool = True

  @nn.compact
  def __call__(self, x_BxLxD, masks, rope, layer_id):
    cfg = self.config
    layer_cls = rematted(EncoderLayer, cfg, scanned=True)
    draws = not self.deterministic and max(cfg.hidden_dropout, cfg.attention_dropout) > 0
    out_BxLxD = residuals.scanned_call(self, layer_cls, (cfg, self.deterministic), "layer",
                                       (x_BxLxD, masks, rope, layer_id), draws)
    return out_BxLxD, None


class Encoder(nn.Module):
  """The stack of layers: unrolled (`layer_0`, `layer_1`, ...) or one scanned `layers` module.

  With `scan_layers`, parameters gain a leading [num_layers] axis named "layers" and XLA compiles
  one layer instead of num_layers (compile time independent of depth). `query_positions`: the
  last layer computes those positions only (BertModel says when).
  """

  config: BertConfig

  @nn.compact
  def __call__(self, x_BxLxD, masks, deterministic: bool, rope=None, query_positions=None):
    cfg = self.config
    if cfg.scan_layers:
      scanned = nn.scan(
          _ScanBody,
          variable_axes={"params": 0},
          split_rngs={"params": True, "dropout": True},
          in_axes=(nn.broadcast, nn.broadcast, 0),
          length=cfg.num_layers,
          unroll=cfg.scan_unroll,
          metadata_params={nn.PARTITION_NAME: "layers"},
      )
      x_BxLxD, _ = scanned(cfg, deterministic, name="layers")(
          x_BxLxD, masks, rope, jnp.arange(cfg.num_layers))
      return x_BxLxD
    layer_cls = rematted(EncoderLayer, cfg, scanned=False)
    for i in range(cfg.num_layers):
      last = i == cfg.num_layers - 1
      x_BxLxD = layer_cls(cfg, deterministic, i, name=f"layer_{i}")(
          x_BxLxD, masks, rope, None, query_positions if last else None)
    return x_BxLxD


class Pooler(nn.Module):
  """tanh(dense(sequence_output[:, 0])): the [CLS] representation."""

  config: BertConfig

  @nn.compact
  def __call__(self, x_BxLxD):
    cfg = self.config
    return jnp.tanh(dense(cfg, cfg.hidden_size, EMBED_TO_EMBED, "dense")(x_BxLxD[:, 0]))


class BertModel(nn.Module):
  """The encoder. Returns (sequence_output [B, L, D], pooled_output [B, D]) in the compute dtype.

  Inputs use the original feature names. `sequence_ids` (optional) packs several sequences into a
  row: tokens attend only within their sequence id and, unless `position_ids` are given, positions
  restart at 0 at each new id (for learned positions and RoPE alike).

  `query_positions` [B, S]: only those positions are read (each packed sequence's [CLS], for a
  sequence-level head): the output is theirs, ([B, S, D], pooled [B, S, D]), and the last layer
  computes them alone (with attention_impl="xla" and unrolled layers; otherwise every position,
  then those picked).
  """

  config: BertConfig

  def setup(self):
    self.embeddings = Embeddings(self.config)
    self.encoder = Encoder(self.config)
    if self.config.norm_position == "pre":
      self.final_layer_norm = layer_norm(self.config, "final_layer_norm")
    if self.config.pooler:
      self.pooler = Pooler(self.config)

  def pool(self, x_BxLxD):
    """The pooled output of rows whose [CLS] is at position 0."""
    return self.pooler(x_BxLxD) if self.config.pooler else x_BxLxD[:, 0]

  def __call__(self, input_ids, input_mask=None, segment_ids=None, position_ids=None,
               sequence_ids=None, deterministic: bool = True, query_positions=None):
    cfg = self.config
    input_ids_BxL = jnp.asarray(input_ids)
    # Refused here, at trace time, rather than as a ShardingTypeError inside the embedding gather.
    sharding.check_auto_axes(jax.sharding.get_abstract_mesh(), "The mesh in scope")
    sharding.check_auto_axes(getattr(jax.typeof(input_ids_BxL).sharding, "mesh", None),
                             "The mesh input_ids are sharded on")
    batch, length = input_ids_BxL.shape
    if length > cfg.max_position_embeddings:
      raise ValueError(
          f"Sequence length {length} exceeds max_position_embeddings="
          f"{cfg.max_position_embeddings}; shorten the inputs (data max_seq_length) or build the "
          f"model with a larger position table")
    input_mask_BxL = (jnp.ones_like(input_ids_BxL) if input_mask is None
                      else jnp.asarray(input_mask))
    segment_ids_BxL = (jnp.zeros_like(input_ids_BxL) if segment_ids is None
                       else jnp.asarray(segment_ids))
    if position_ids is not None:
      position_ids_BxL = jnp.asarray(position_ids)
    elif sequence_ids is not None:
      position_ids_BxL = positions_from_sequence_ids(jnp.asarray(sequence_ids))
    else:
      position_ids_BxL = jnp.broadcast_to(jnp.arange(length), (batch, length))
    masks = attention.attention_masks(
        cfg.attention_impl, input_mask_BxL,
        None if sequence_ids is None else jnp.asarray(sequence_ids), cfg.cudnn_packing)
    rope = None
    if cfg.position_embedding == "rope":
      rope = {"global": rope_tables(position_ids_BxL, cfg.head_size, cfg.rope_theta),
              "positions": position_ids_BxL}
      local_theta = cfg.local_rope_theta or cfg.rope_theta
      if cfg.has_local_layers and local_theta != cfg.rope_theta:
        rope["local"] = rope_tables(position_ids_BxL, cfg.head_size, local_theta)
    x_BxLxD = self.embeddings(input_ids_BxL, segment_ids_BxL, position_ids_BxL, deterministic)
    x_BxLxD = nn.with_logical_constraint(
        x_BxLxD, ("activation_batch", "activation_length", "activation_embed"))
    narrow = (query_positions is not None and cfg.attention_impl == "xla"
              and not cfg.scan_layers)
    qp_BxS = None if query_positions is None else jnp.asarray(query_positions, jnp.int32)
    x_BxLxD = self.encoder(x_BxLxD, masks, deterministic, rope, qp_BxS if narrow else None)
    if qp_BxS is not None and not narrow:
      x_BxLxD = attention.gather_positions(x_BxLxD, qp_BxS)
    if cfg.norm_position == "pre":
      x_BxLxD = self.final_layer_norm(x_BxLxD)
    if qp_BxS is None:
      return x_BxLxD, self.pool(x_BxLxD)
    # Each picked state as a length-1 row of its own: the pooler reads position 0.
    b, s, d = x_BxLxD.shape
    return x_BxLxD, self.pool(x_BxLxD.reshape(b * s, 1, d)).reshape(b, s, d)

  def word_embedding_table(self) -> jax.Array:
    return self.embeddings.word_embedding_table()
