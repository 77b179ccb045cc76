"""The BERT encoder as Flax linen modules: embeddings, layers, BertModel (its config: config.py;
its attention: self_attention.py; its MLP: mlp.py; the initialisers, norm and Dense it is built
of: primitives.py).

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

from bertjax.model import attention, dropout, mlp, residuals
from bertjax.model.rope import rope_tables
from bertjax.model.config import BertConfig, rematted
from bertjax.model.primitives import EMBED_TO_EMBED, dense, layer_norm, normal_init, sinusoidal_init
from bertjax.model.self_attention import SelfAttention
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
      start = (None if query_positions is not None
               or not self_attention.takes_kernel(x_BxLxD.shape[1], masks, layer_id)
               else mlp.attention_start(cfg, x_BxLxD, "attention_layer_norm", layer_id))
      if start is not None:  # the norm and q, k and v by the kernels, which give x back
        attn_BxLxD, res_BxLxD = attention_fn(x_BxLxD, masks, self.deterministic, rope,
                                             layer_id, start=start)
      else:
        norm = layer_norm(cfg, "attention_layer_norm")
        if not cfg.skips_first_attention_norm:
          in_BxLxD = norm(x_BxLxD)
        elif isinstance(layer_id, int):
          in_BxLxD = x_BxLxD if layer_id == 0 else norm(x_BxLxD)
        else:
          # Scanned layers share one structure: layer 0 has the norm's parameters but bypasses it.
          in_BxLxD = jnp.where(layer_id == 0, x_BxLxD, norm(x_BxLxD))
        attn_BxLxD = attention_fn(in_BxLxD, masks, self.deterministic, rope, layer_id)
      h_BxLxD = res_BxLxD + drop(attn_BxLxD, deterministic=self.deterministic)
      if start is not None:
        # Kept where the kernels' outputs are ("dots_kernels"): the MLP kernels' backward reads
        # it, and XLA made it again from x and the output product's kept result.
        h_BxLxD = jax.ad_checkpoint.checkpoint_name(h_BxLxD, "attention_output")
      dropped = (None if self.deterministic or cfg.hidden_dropout <= 0
                 else lambda y: drop(y, deterministic=False))
      out_BxLxD = mlp.residual_normed(cfg, h_BxLxD, "output_layer_norm", dropped)
    else:
      ends = (query_positions is None and mlp.ends_in_kernels(cfg)
              and self_attention.takes_kernel(x_BxLxD.shape[1], masks, layer_id))
      # With the MLP's kernels, q, k and v by qkv_kernel too: its backward reads their
      # gradients once for dx and dW, and adds the end's residual gradient to dx.
      attn_BxLxD = attention_fn(x_BxLxD, masks, self.deterministic, rope, layer_id, end=(
          mlp.attention_end(cfg, res_BxLxD, "attention_layer_norm", drop, self.deterministic)
          if ends else None), start=mlp.attention_start(cfg, x_BxLxD, "", layer_id)
                                    if ends else None)
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
