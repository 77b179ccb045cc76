"""The modern encoder options of BertConfig (bertjax/model/encoder.py): properties, not shapes.

RoPE makes attention depend on offsets only; local layers see exactly their window, on the XLA
path and in splash's interpreter, and never another packed sequence; scanned == unrolled with
global and local layers; configs/modern_base.py has ModernBERT-base's parameter count.
"""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bertjax.model import attention
from bertjax.model.rope import apply_rope, rope_tables
from bertjax.model.config import BertConfig
from bertjax.model.encoder import BertModel
from bertjax.model.self_attention import SelfAttention
from bertjax.model.heads import BertForPreTraining
from bertjax.weights import reader as weights

# Every option on: a local layer (1) between global ones (0, 2), RoPE with two bases.
MODERN = BertConfig(
    vocab_size=64, hidden_size=32, num_layers=3, num_heads=2, intermediate_size=48,
    max_position_embeddings=128, type_vocab_size=0, hidden_dropout=0.0, attention_dropout=0.0,
    layer_norm_eps=1e-5, norm_position="pre", norm_bias=False, attention_bias=False,
    mlp_bias=False, mlp_type="gated", position_embedding="rope", rope_theta=160000.0,
    local_rope_theta=10000.0, global_every=2, local_window=8, pooler=False, head_bias=False,
    # Weights large enough that attention is far from uniform: positions and windows show.
    initializer_range=0.3)


@functools.partial(jax.jit, static_argnums=0)
def _apply(config, params, *args, **kwargs):
  """BertModel(config).apply as one compiled program (not each operation dispatched alone)."""
  return BertModel(config).apply({"params": params}, *args, **kwargs)


def _init(config, length=16):
  ids = jnp.zeros((1, length), jnp.int32)
  return nn.unbox(jax.jit(BertModel(config).init)(jax.random.key(0), ids)["params"])


def test_rope_scores_depend_on_offsets_only():
  rng = np.random.default_rng(0)
  k_size, length = 16, 12
  q = jnp.asarray(rng.normal(size=(1, 1, 1, k_size)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(1, 1, 1, k_size)), jnp.float32)

  def scores(start):
    pos = jnp.arange(start, start + length)[None]
    cos, sin = rope_tables(pos, k_size, 10000.0)
    q_L = apply_rope(jnp.broadcast_to(q, (1, length, 1, k_size)), cos, sin)[0, :, 0]
    k_L = apply_rope(jnp.broadcast_to(k, (1, length, 1, k_size)), cos, sin)[0, :, 0]
    return np.asarray(q_L @ k_L.T)

  s = scores(0)
  # The same vectors at positions (i, j) score alike for every pair with the same i - j ...
  for offset in range(-length + 1, length):
    diagonal = np.diagonal(s, offset)
    np.testing.assert_allclose(diagonal, diagonal[0], rtol=1e-5, atol=1e-5)
  # ... wherever the sequence starts, and differently for different offsets.
  np.testing.assert_allclose(scores(1000), s, rtol=1e-4, atol=1e-4)
  assert np.ptp(s[0]) > 0.1


def test_a_rope_model_does_not_see_absolute_positions():
  """With RoPE the only position signal: shifting every position id changes nothing."""
  params = _init(MODERN)
  ids = jnp.asarray(np.random.default_rng(1).integers(0, 64, (2, 16)), jnp.int32)
  base, _ = _apply(MODERN, params, ids)
  shifted, _ = _apply(MODERN, params, ids, position_ids=jnp.arange(16)[None] + 57)
  np.testing.assert_allclose(shifted, base, atol=2e-5)
  # Permuting positions does change the output: the positions are read.
  moved, _ = _apply(MODERN, params, ids, position_ids=jnp.arange(16)[None] * 3)
  assert np.abs(np.asarray(moved) - np.asarray(base)).max() > 1e-2


def _reference_attention(q, k, v, allowed):
  """softmax(q k^T / sqrt(K)) v over the allowed keys, one query at a time, in numpy."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  b, length, n, k_size = q.shape
  out = np.zeros_like(q)
  for bi in range(b):
    for h in range(n):
      for i in range(length):
        keys = np.flatnonzero(allowed[bi, i])
        if not keys.size:  # a padding query of a packed row: nothing reads it
          continue
        s = k[bi, keys, h] @ q[bi, i, h] / np.sqrt(k_size)
        p = np.exp(s - s.max())
        out[bi, i, h] = (p / p.sum()) @ v[bi, keys, h]
  return out


def _explicit_allowed(input_mask, sequence_ids, window):
  """[B, L, L] written out from the definitions: same sequence, real key, |i - j| <= w // 2."""
  b, length = input_mask.shape
  allowed = np.zeros((b, length, length), bool)
  for bi in range(b):
    for i in range(length):
      for j in range(length):
        same = sequence_ids is None or sequence_ids[bi, i] == sequence_ids[bi, j]
        allowed[bi, i, j] = same and input_mask[bi, j] and abs(i - j) <= window // 2
  return allowed


def test_local_layer_attention_matches_an_explicit_window():
  length = 20
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.normal(size=(2, length, MODERN.hidden_size)), jnp.float32)
  mask = np.ones((2, length), np.int32)
  mask[1, 13:] = 0
  masks = attention.attention_masks("xla", jnp.asarray(mask))
  cfg = dataclasses.replace(MODERN, position_embedding="learned")  # q, k straight from x
  module = SelfAttention(cfg)
  params = nn.unbox(module.init(jax.random.key(0), x, masks, True, None, 1)["params"])
  got = module.apply({"params": params}, x, masks, True, None, 1)
  q, k, v = (np.einsum("bld,dnk->blnk", x, params[p]["kernel"]) for p in ("query", "key",
                                                                          "value"))
  ref = _reference_attention(q, k, v, _explicit_allowed(mask, None, cfg.local_window))
  want = np.einsum("blnk,nkd->bld", ref, params["output"]["kernel"])
  real = mask.astype(bool)
  np.testing.assert_allclose(np.asarray(got)[real], want[real], atol=1e-5)
  # Layer 2 of the same module is global: not the window's result.
  glob = module.apply({"params": params}, x, masks, True, None, 2)
  assert np.abs(np.asarray(glob) - np.asarray(got))[real].max() > 1e-3


@pytest.mark.parametrize("length,window", [(128, 16), (512, 128)])
def test_splash_local_window_matches_an_explicit_reference_with_packing(length, window):
  """Splash's LocalMask (interpreted on CPU) and its XLA equivalent, packed rows, padding; at
  512 in four blocks of 128 (a local window's blocks are no wider than it), some skipped."""
  rng = np.random.default_rng(3)
  q, k, v = (jnp.asarray(rng.normal(size=(2, length, 2, 16)), jnp.float32) for _ in range(3))
  seq = np.zeros((2, length), np.int32)
  at = length // 128  # the same packing, stretched over the length
  seq[0, :40 * at], seq[0, 40 * at:90 * at], seq[0, 90 * at:117 * at] = 1, 2, 3
  seq[1, :100 * at] = 1
  mask = (seq > 0).astype(np.int32)
  ids = attention.splash_segment_ids(jnp.asarray(mask), jnp.asarray(seq))
  got = attention.splash_attention(q, k, v, ids, local_window=window)
  equivalent = attention.splash_equivalent(q, k, v, ids, local_window=window)
  ref = _reference_attention(q, k, v, _explicit_allowed(mask, seq, window))
  real = mask.astype(bool)
  np.testing.assert_allclose(np.asarray(got)[real], ref[real], atol=2e-5)
  np.testing.assert_allclose(np.asarray(equivalent)[real], ref[real], atol=2e-5)


@pytest.mark.parametrize("scan", [False, True])
def test_packed_rows_with_local_layers_never_attend_across_sequences(scan):
  """Each packed sequence comes out as it does alone, the window reaching over its borders."""
  cfg = dataclasses.replace(MODERN, scan_layers=scan, local_window=12)
  params = _init(cfg)
  rng = np.random.default_rng(4)
  lengths = (7, 9, 5)
  ids = rng.integers(0, 64, sum(lengths)).astype(np.int32)
  seq = np.repeat(np.arange(1, 4), lengths).astype(np.int32)
  row = np.zeros((1, 24), np.int32)
  row[0, :21] = ids
  seq_row = np.zeros((1, 24), np.int32)
  seq_row[0, :21] = seq
  packed, _ = _apply(cfg, params, row, (seq_row > 0).astype(np.int32), sequence_ids=seq_row)
  start = 0
  for n in lengths:
    alone, _ = _apply(cfg, params, ids[None, start:start + n])
    np.testing.assert_allclose(np.asarray(packed)[0, start:start + n], np.asarray(alone)[0],
                               atol=2e-5)
    start += n


def test_scanned_layers_equal_unrolled_ones():
  """Scan picks global/local attention, RoPE base and layer 0's bypassed norm from a traced
  index; the unrolled stack decides them in Python. Same parameters, same outputs."""
  params = _init(MODERN)
  scanned = dataclasses.replace(MODERN, scan_layers=True)
  stacked = weights.restack(jax.device_get(params), MODERN.num_layers, True,
                            MODERN.skips_first_attention_norm)
  assert jax.tree.map(jnp.shape, stacked) == jax.tree.map(jnp.shape, _init(scanned))
  ids = jnp.asarray(np.random.default_rng(5).integers(0, 64, (2, 16)), jnp.int32)
  mask = jnp.asarray(np.arange(16)[None] < np.array([[16], [11]]), jnp.int32)
  a, _ = _apply(MODERN, params, ids, mask)
  b, _ = _apply(scanned, stacked, ids, mask)
  np.testing.assert_allclose(b, a, atol=1e-5)
  back = weights.restack(stacked, MODERN.num_layers, False, True)
  assert jax.tree.structure(back) == jax.tree.structure(jax.device_get(params))


def test_options_make_and_drop_the_right_parameters():
  names = {"/".join(k.key for k in path)
           for path, _ in jax.tree_util.tree_flatten_with_path(_init(MODERN))[0]}
  assert not any(n.endswith("bias") for n in names)  # no biases anywhere
  assert "encoder/layer_1/mlp/gate/kernel" in names  # GeGLU's second projection
  assert "final_layer_norm/scale" in names and "encoder/layer_0/attention_layer_norm/scale" \
      not in names and "encoder/layer_1/attention_layer_norm/scale" in names
  assert not any(k in n for n in names for k in ("position_embeddings", "token_type", "pooler"))
  rms = _init(dataclasses.replace(MODERN, norm_type="rmsnorm", norm_bias=True))
  assert set(rms["final_layer_norm"]) == {"scale"}  # RMSNorm has no bias to drop


def test_every_new_weight_has_logical_axes():
  """Sharding reads logical names: each parameter of a modern model, its MLM head (untied
  decoder) included, carries one name per dimension."""
  cfg = dataclasses.replace(MODERN, tie_word_embeddings=False, scan_layers=True)
  boxed = jax.eval_shape(lambda: BertForPreTraining(cfg).init(
      jax.random.key(0), jnp.zeros((1, 16), jnp.int32))["params"])
  leaves = jax.tree.leaves(boxed, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
  assert leaves and all(isinstance(x, nn.LogicallyPartitioned) for x in leaves)
  assert all(len(x.names) == len(x.value.shape) for x in leaves)
  assert boxed["mlm"]["decoder"].names == ("vocab", "embed")


def test_bad_options_are_refused_naming_the_fix():
  with pytest.raises(ValueError, match="global_every=3 makes local layers but local_window=0"):
    BertConfig(global_every=3)
  with pytest.raises(ValueError, match="local_window=128 has no local layer"):
    BertConfig(local_window=128)
  with pytest.raises(ValueError, match="mlp_type='geglu'; choose one of"):
    BertConfig(mlp_type="geglu")


def test_modern_base_has_modernbert_base_parameter_count():
  """149M with embeddings, as published; counted from shapes (nothing allocated) and against
  transformers' own classes built on the meta device."""
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  from bertjax.configs import modern_base  # pylint: disable=import-outside-toplevel
  config = modern_base.get_config()
  cfg = BertConfig.from_dict(config.model.to_dict())
  shapes = jax.eval_shape(lambda: BertForPreTraining(cfg).init(
      jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"])
  count = lambda tree: sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))
  # Scanned, layer 0 carries the 768 scales of the norm it bypasses (model.py); the config's
  # layers are straight.
  assert not cfg.scan_layers
  encoder = count(shapes["bert"])
  with torch.device("meta"):
    theirs = transformers.ModernBertForMaskedLM(transformers.ModernBertConfig())
  assert transformers.ModernBertConfig().num_hidden_layers == cfg.num_layers
  assert encoder == sum(p.numel() for p in theirs.model.parameters()) == 149_014_272
  assert encoder + count(shapes["mlm"]) == sum(p.numel() for p in theirs.parameters())
  assert round(encoder / 1e6) == 149


def test_flop_model_counts_the_gate_and_the_windows():
  from bertjax.training import flops  # pylint: disable=import-outside-toplevel
  length, per_seq = 64, lambda cfg: flops.forward_flops_per_sequence(cfg, length, 10)
  d, f = MODERN.hidden_size, MODERN.intermediate_size
  dense = dataclasses.replace(MODERN, mlp_type="dense")
  assert per_seq(MODERN) - per_seq(dense) == MODERN.num_layers * length * 2 * d * f
  # One local layer (of 3) reads 9 keys per query instead of 64; a window over all is global.
  wide = dataclasses.replace(MODERN, local_window=2 * length)
  assert per_seq(wide) - per_seq(MODERN) == length * 4 * (length - 9) * d
  assert per_seq(wide) == per_seq(dataclasses.replace(MODERN, global_every=1, local_window=0))


def test_a_sharded_scanned_remat_step_equals_one_device():
  """The new weights' logical axes under a data x fsdp x tensor mesh, with nn.scan and remat
  over global and local layers: one train step as on one device."""
  from bertjax.configs import base  # pylint: disable=import-outside-toplevel
  from bertjax.parallel import sharding  # pylint: disable=import-outside-toplevel
  from bertjax.training import train  # pylint: disable=import-outside-toplevel
  cfg = dataclasses.replace(MODERN, scan_layers=True, remat_policy="full",
                            tie_word_embeddings=False)
  rng = np.random.default_rng(6)
  b, length, m = 8, 16, 3
  mask = (np.arange(length)[None] < rng.integers(8, length + 1, (b, 1))).astype(np.int32)
  batch = {"input_ids": (rng.integers(1, 64, (b, length)) * mask).astype(np.int32),
           "input_mask": mask, "segment_ids": np.zeros((b, length), np.int32),
           "masked_lm_positions": rng.integers(1, 8, (b, m)).astype(np.int32),
           "masked_lm_ids": rng.integers(0, 64, (b, m)).astype(np.int32),
           "masked_lm_weights": np.ones((b, m), np.float32),
           "next_sentence_labels": np.zeros(b, np.int32)}
  train_cfg = train.TrainConfig(batch_size=b, learning_rate=1e-3, warmup_steps=0,
                                num_train_steps=10)

  def step(sizes, devices=None):
    mesh = sharding.MeshConfig.from_dict({**base.get_config().mesh, **sizes})
    t = train.build(cfg, train_cfg, mesh, devices=devices)
    key = jax.random.PRNGKey(0)
    state, metrics = t.train_step(t.init_state(key), t.to_global(batch), key)
    return jax.device_get((state.params, metrics))

  (one, one_m), (many, many_m) = step({}, jax.devices()[:1]), step(
      {"ici_data": 2, "ici_fsdp": 2, "ici_tensor": 2})
  assert float(one_m["grad_norm"][0]) > 0
  for x, y in zip(jax.tree.leaves((one, one_m)), jax.tree.leaves((many, many_m))):
    np.testing.assert_allclose(x, y, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("packed", [True, False])
def test_cudnn_window_arguments_match_the_explicit_reference(packed):
  """What SelfAttention hands cuDNN for a local layer (its padding/packing arguments and the
  sliding window, as one mask), run by the XLA implementation: no GPU here."""
  length, window = 24, 6
  rng = np.random.default_rng(7)
  q, k, v = (jnp.asarray(rng.normal(size=(2, length, 2, 8)), jnp.float32) for _ in range(3))
  seq = np.zeros((2, length), np.int32)
  seq[0, :9], seq[0, 9:20] = 1, 2
  seq[1, :15] = 1
  mask = (seq > 0).astype(np.int32)
  args = attention.cudnn_local_arguments(
      attention.attention_masks("cudnn", jnp.asarray(mask), jnp.asarray(seq) if packed else None),
      length, window)
  assert set(args) == {"mask"}  # cuDNN's own window is causal only: the band is in the mask
  got = jax.nn.dot_product_attention(q, k, v, **args, implementation="xla")
  ref = _reference_attention(q, k, v, _explicit_allowed(mask, seq if packed else None, window))
  real = mask.astype(bool)
  np.testing.assert_allclose(np.asarray(got)[real], ref[real], atol=2e-5)


def test_swiglu_and_rmsnorm_compute_their_definitions():
  """mlp_type="gated" with silu is SwiGLU, silu(x W) * (x G) W_o; RMSNorm is
  x / sqrt(mean(x^2) + eps) * scale, with no centring and no bias."""
  from bertjax.model.mlp import Mlp  # pylint: disable=import-outside-toplevel
  from bertjax.model.primitives import layer_norm  # pylint: disable=import-outside-toplevel
  cfg = dataclasses.replace(MODERN, hidden_act="silu", norm_type="rmsnorm")
  x = jnp.asarray(np.random.default_rng(8).normal(size=(2, 5, 32)) + 0.5, jnp.float32)
  mlp = Mlp(cfg)
  p = nn.unbox(mlp.init(jax.random.key(1), x)["params"])
  h = np.asarray(x) @ np.asarray(p["intermediate"]["kernel"])
  g = np.asarray(x) @ np.asarray(p["gate"]["kernel"])
  want = (h / (1 + np.exp(-h)) * g) @ np.asarray(p["output"]["kernel"])
  np.testing.assert_allclose(mlp.apply({"params": p}, x), want, atol=1e-4, rtol=1e-4)
  norm = layer_norm(cfg, "norm")
  scale = np.random.default_rng(9).normal(size=32).astype(np.float32)
  got = norm.apply({"params": {"scale": scale}}, x)
  xs = np.asarray(x, np.float64)
  want = xs / np.sqrt((xs ** 2).mean(-1, keepdims=True) + cfg.layer_norm_eps) * scale
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
