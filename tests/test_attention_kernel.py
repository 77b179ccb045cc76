"""Attention with dropout in one Pallas kernel (bertjax/model/kernels/attention_kernel.py,
`attention_impl="fused"`) against XLA: the same values and gradients, the dropout's bits pinned
and the same on any mesh. On a CPU the kernels run in Pallas' interpreter; tests/test_aot.py
compiles them for a TPU."""

import dataclasses
import functools
import hashlib
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from bertjax.errors import Refusal
from bertjax.model import attention, dropout, rope
from bertjax.model.kernels import attention_blocks as blocks, attention_kernel as ak, attention_reference
from bertjax.model.config import BertConfig, chosen_qkv
from bertjax.model.encoder import BertModel
from bertjax.parallel import sharding

B, L, N, K = 4, 128, 4, 64  # two heads a block (128 lanes), two blocks a row
RATE = 0.1


def _inputs(seed=0):
  r = np.random.default_rng(seed)
  q, k, v, do = (jnp.asarray(r.normal(size=(B, L, N, K)), jnp.float32) for _ in range(4))
  # Packed rows: two sequences, then padding; the last row one sequence without padding.
  ids = np.zeros((B, L), np.int32)
  ids[:, :50], ids[:, 50:110] = 1, 2
  ids[-1] = 1
  seg = attention.splash_segment_ids(jnp.asarray(ids > 0, jnp.int32), jnp.asarray(ids))
  return q, k, v, do, seg


def _by_hand(q, k, v, seg, keep, rate, window=0):
  """Softmax attention within segments, dropped by `keep` [B, N, L, L]: written out."""
  s = jnp.einsum("bqnk,bsnk->bnqs", q, k) / np.sqrt(q.shape[-1])
  allowed = seg[:, None, :, None] == seg[:, None, None, :]
  if window:
    i = np.arange(q.shape[1])
    allowed = allowed & (np.abs(i[:, None] - i[None, :]) <= window // 2)
  p = jax.nn.softmax(jnp.where(allowed, s, -1e30), axis=-1)
  if keep is not None:
    p = jnp.where(keep, p / (1 - dropout.quantised_rate(rate)), 0.0)
  return jnp.einsum("bnqs,bsnk->bqnk", p, v)


def _keep(rng, rows=B, heads=N, length=L, rate=RATE):
  k1, k2 = (w.astype(jnp.uint32) for w in ak.key_words(rng))
  return ak.keep_decisions(k1, k2, jnp.arange(rows, dtype=jnp.uint32)[:, None, None, None],
                           jnp.arange(heads, dtype=jnp.uint32)[None, :, None, None], length,
                           rate)


def test_the_dropout_s_bits_are_pinned_and_drop_at_the_rate():
  keep = np.asarray(_keep(jax.random.key(1234), rows=8, heads=12))
  # A resumed run draws what it drew: these bits may never change silently.
  assert hashlib.sha256(np.packbits(keep).tobytes()).hexdigest()[:16] == "45c7c3357acda8e9"
  dropped = 1 - keep.mean()
  # 1.57M decisions: the standard error of the rate is 0.00024.
  assert abs(dropped - dropout.quantised_rate(RATE)) < 0.0012, dropped
  # Every (row, head) and every quarter of the queries has its own bits.
  flat = keep.reshape(8 * 12 * 4, -1)
  assert len({row.tobytes() for row in flat}) == len(flat)


@pytest.mark.parametrize("rate,window", [(0.0, 0), (RATE, 0), (RATE, 64)])
def test_the_kernels_give_attention_and_its_gradients(rate, window, monkeypatch):
  # One row and two of its four heads a grid step: the kernels find each row's and head's global
  # number from the step's indices, and each head its lanes of the block.
  monkeypatch.setattr(ak, "ROW_BYTES", 0)
  assert ak._block(B, L, 2 * K * 4, 7) == 1 and ak._heads_a_block(N, K) == 2
  q, k, v, do, seg = _inputs()
  rng = jax.random.key(5)
  keep = _keep(rng) if rate else None
  got, pull = jax.vjp(lambda *a: ak.fused_attention(*a, seg, rng, rate, local_window=window),
                      q, k, v)
  expected, pull_ref = jax.vjp(lambda *a: _by_hand(*a, seg, keep, rate, window), q, k, v)
  real = np.asarray(seg >= 0)  # padding queries are computed and never read
  np.testing.assert_allclose(np.asarray(got)[real], np.asarray(expected)[real], atol=2e-6)
  do = do * real[:, :, None, None]
  for name, g, e in zip("qkv", pull(do), pull_ref(do)):
    np.testing.assert_allclose(g, e, atol=2e-5, err_msg=f"d{name}")
  if rate:  # and the dropout did drop: without it the values differ
    assert float(jnp.abs(got - _by_hand(q, k, v, seg, None, 0.0, window))[real].max()) > 0.1


def test_in_bfloat16_within_its_rounding():
  q, k, v, do, seg = _inputs(1)
  rng = jax.random.key(6)
  bf = lambda x: x.astype(jnp.bfloat16)
  got = ak.fused_attention(bf(q), bf(k), bf(v), seg, rng, RATE)
  expected = _by_hand(bf(q).astype(jnp.float32), bf(k).astype(jnp.float32),
                      bf(v).astype(jnp.float32), seg, _keep(rng), RATE)
  real = np.asarray(seg >= 0)
  assert got.dtype == jnp.bfloat16
  err = np.abs(np.asarray(got, np.float32) - np.asarray(expected))[real]
  assert err.max() < 0.05 and err.mean() < 0.005, (err.max(), err.mean())


def _kernel_arguments():
  """(q, k, v, do, the segments, the key, the kernels' leading arguments, their options), the
  arrays [B, L, N * K] (the heads side by side), biases drawn."""
  q, k, v, do, seg = _inputs(2)
  rng = jax.random.key(7)
  bias = jnp.asarray(np.random.default_rng(8).normal(size=(3, N * K)), jnp.float32)
  args = (jnp.arange(B), jnp.zeros((1,), jnp.int32), ak.key_words(rng), seg[:, None, :], bias)
  q, k, v, do = (x.reshape(B, L, N * K) for x in (q, k, v, do))
  return q, k, v, do, seg, rng, args, dict(rate=RATE, local_window=0, size=K)


def test_q_k_and_v_packed_in_one_array_give_what_they_give_apart():
  # One product's [3, B, L, N * K] (qkv_product "one"): the kernels read q, k and v where they
  # lie and write dq, dk and dv as one array; the same values as apart, by the kernels and by
  # XLA's arithmetic, and through fused_attention's gradient.
  q, k, v, do, seg, rng, args, kw = _kernel_arguments()
  qkv = jnp.stack([q, k, v])
  np.testing.assert_array_equal(ak._forward(*args, qkv, **kw, interpret=True),
                                ak._forward(*args, q, k, v, **kw, interpret=True))
  (packed, sums), (*apart, apart_sums) = (ak._backward(*args, *a, do, **kw, interpret=True)
                                          for a in ((qkv,), (q, k, v)))
  assert packed.shape == (3, B, L, N * K)
  np.testing.assert_array_equal(packed, jnp.stack(apart))
  np.testing.assert_array_equal(sums, apart_sums)
  for got, want in zip(attention_reference.backward(*args, qkv, do, **kw), (packed, sums)):
    np.testing.assert_allclose(got, want, atol=2e-5)
  loss = lambda out: jnp.sum(out * do)
  grad = jax.grad(lambda qkv: loss(ak.fused_attention(qkv, None, None, seg, rng, RATE,
                                                      head_size=K)))(qkv)
  want = jax.grad(lambda q, k, v: loss(ak.fused_attention(q, k, v, seg, rng, RATE, head_size=K)),
                  argnums=(0, 1, 2))(q, k, v)
  np.testing.assert_allclose(grad, jnp.stack(want), atol=1e-6)


def test_without_mosaic_xla_computes_what_the_kernels_do():
  # A GPU has no Mosaic: there `reference` runs, with the same bits.
  q, k, v, do, seg, rng, args, kw = _kernel_arguments()
  # The forward kernel writes its output's bits (what remat keeps, with no copy between).
  bits = ak._forward(*args, q, k, v, **kw, interpret=True)
  assert bits.dtype == jnp.uint32
  np.testing.assert_allclose(attention_reference.reference(*args, q, k, v, **kw),
                             jax.lax.bitcast_convert_type(bits, q.dtype), atol=2e-6)
  for got, expected in zip(attention_reference.backward(*args, q, k, v, do, **kw),
                           ak._backward(*args, q, k, v, do, **kw, interpret=True)):
    np.testing.assert_allclose(got, expected, atol=2e-5)
  grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(ak.fused_attention(q, k, v, seg, rng, RATE,
                                                                     head_size=K)),
                          argnums=(0, 1, 2)))
  shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (q, k, v)]
  for platform, kernels in (("cuda", False), ("tpu", True)):
    text = jax.export.export(grad, platforms=[platform])(*shapes).mlir_module()
    assert ("tpu_custom_call" in text) == kernels, platform


@pytest.mark.parametrize("window", [None, 128, 0])
def test_under_a_mesh_each_device_draws_its_rows_and_heads_bits(window, monkeypatch):
  # data x fsdp x tensor = 2 x 2 x 2: rows over data x fsdp, heads over tensor. Each device
  # numbers its rows and heads globally, so the output and gradients are one device's. With a
  # `window`, 512 by blocks without dropout, RoPE inside (each device its heads' frequencies): a
  # local window by slabs, or (0) a global layer past whole rows (here 256).
  monkeypatch.setattr(ak, "MAX_LENGTH", 256)
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), sharding.MESH_AXES)
  # The biases' gradients too: each device sums its rows' and heads' share in the kernel.
  q, k, v, do, seg = _inputs(3)
  kw = dict(rng=jax.random.key(8), rate=RATE)
  if window is not None:
    q, k, v, do = (jnp.concatenate([x] * 4, axis=1) for x in (q, k, v, do))
    seg = jnp.concatenate([seg] * 4, axis=1)
    positions = jnp.broadcast_to(jnp.arange(4 * L), seg.shape)
    kw = dict(local_window=window, turn=(positions, rope.lane_frequencies(K, N, 500.0)))
    assert (blocks.by_slabs if window else blocks.by_flash)(4 * L, window, 0.0, 256)
  bias = jnp.asarray(np.random.default_rng(9).normal(size=(3, N * K)), jnp.float32)
  loss = lambda q, k, v, bias, seg: jnp.sum(
      ak.fused_attention(q, k, v, seg, biases=bias, **kw) * do)
  expected = jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(q, k, v, bias, seg)
  qkv = NamedSharding(mesh, PartitionSpec(sharding.BATCH_AXES, None, "tensor", None))
  rows = NamedSharding(mesh, PartitionSpec(sharding.BATCH_AXES, None))
  run = jax.jit(sharding.logical_context(mesh)(jax.value_and_grad(loss, argnums=(0, 1, 2, 3))))
  placed = ([jax.device_put(x, qkv) for x in (q, k, v)]
            + [jax.device_put(bias, NamedSharding(mesh, PartitionSpec(None, "tensor"))),
               jax.device_put(seg, rows)])
  assert 'manual_axes={"data", "fsdp", "tensor"}' in run.lower(*placed).as_text()
  value, grads = run(*placed)
  np.testing.assert_allclose(value, expected[0], rtol=1e-5)
  for g, e in zip(grads, expected[1]):
    np.testing.assert_allclose(g, e, atol=1e-5)


def test_a_model_trains_with_it_and_its_dropout():
  cfg = BertConfig(vocab_size=97, hidden_size=64, num_layers=2, num_heads=2,
                   intermediate_size=128, max_position_embeddings=L, hidden_dropout=0.0,
                   attention_dropout=RATE, scan_layers=True, remat_policy="dots")
  fused = dataclasses.replace(cfg, attention_impl="fused")
  ids = np.random.default_rng(0).integers(1, 97, (2, L))
  mask = np.ones_like(ids)
  mask[1, 100:] = 0
  params = nn.unbox(BertModel(cfg).init(jax.random.key(0), ids)["params"])
  assert jax.tree.structure(params) == jax.tree.structure(
      nn.unbox(BertModel(fused).init(jax.random.key(0), ids)["params"]))
  # Biases away from their zero start: the kernel adds q's, k's and v's itself.
  leaves, tree = jax.tree.flatten(params)
  noise = [0.1 * jax.random.normal(k, x.shape) for k, x in
           zip(jax.random.split(jax.random.key(1), len(leaves)), leaves)]
  params = jax.tree.unflatten(tree, [x + n for x, n in zip(leaves, noise)])

  def out(c, deterministic, seed=0):
    return BertModel(c).apply({"params": params}, ids, mask, deterministic=deterministic,
                              rngs={"dropout": jax.random.key(seed)})[0]
  real = mask.astype(bool)
  # Without dropout the XLA path's values; with it the dropout acts, the same for a key.
  np.testing.assert_allclose(np.asarray(out(fused, True))[real], np.asarray(out(cfg, True))[real],
                             atol=1e-5)
  # And the same gradients, the biases' among them.
  grad = lambda c: jax.grad(lambda p: jnp.sum(BertModel(c).apply(
      {"params": p}, ids, mask, deterministic=True)[0] * real[..., None]))(params)
  for (path, got), expected in zip(jax.tree_util.tree_leaves_with_path(grad(fused)),
                                   jax.tree.leaves(grad(cfg))):
    np.testing.assert_allclose(got, expected, atol=2e-4, rtol=1e-3,
                               err_msg=jax.tree_util.keystr(path))
  assert float(jnp.abs(out(fused, False) - out(fused, True))[real].max()) > 1e-3
  np.testing.assert_array_equal(out(fused, False), out(fused, False))
  assert float(jnp.abs(out(fused, False, 1) - out(fused, False))[real].max()) > 1e-3
  grads = jax.grad(lambda p: jnp.sum(BertModel(fused).apply(
      {"params": p}, ids, mask, deterministic=False, rngs={"dropout": jax.random.key(0)})[0]))(
          params)
  assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))


def test_a_length_the_kernel_cannot_hold_is_refused_with_the_fix():
  q = jnp.zeros((1, 100, 2, 8))
  with pytest.raises(Refusal, match="multiple of 128.*max_seq_length"):
    ak.fused_attention(q, q, q, jnp.zeros((1, 100), jnp.int32))
  with pytest.raises(Refusal, match="with attention dropout .* at most 1024.*attention_dropout=0"):
    ak.check_length(2048, rate=0.1)
  ak.check_length(2048)  # without dropout: block by block
  # It has dropout: the config takes a rate with it, as it refuses one with splash.
  BertConfig(attention_impl="fused", attention_dropout=0.1)
  with pytest.raises(Exception, match="attention_impl='fused'"):
    BertConfig(attention_impl="splash", attention_dropout=0.1)


@pytest.mark.parametrize("blockwise", [False, True])
def test_remat_dots_kernels_keeps_the_kernel_s_output_so_its_forward_runs_once(blockwise,
                                                                              monkeypatch):
  # Under remat "dots" the forward kernel runs again in the backward (its output is no matmul's);
  # "dots_kernels" keeps that output (and the fused MLP's), and the backward calls it no more;
  # "dots_outputs" keeps it too. `blockwise`: global layers past whole rows (here 256), whose
  # backward reads the output too.
  length, rate = (2 * L, 0.0) if blockwise else (L, RATE)
  if blockwise:
    monkeypatch.setattr(ak, "MAX_LENGTH", L)
  ids = np.random.default_rng(0).integers(1, 97, (2, length))
  config = BertConfig(vocab_size=97, hidden_size=64, num_layers=2, num_heads=2,
                      intermediate_size=128, max_position_embeddings=length, hidden_dropout=0.0,
                      attention_dropout=rate, scan_layers=True, attention_impl="fused")
  params = nn.unbox(BertModel(config).init(jax.random.key(0), ids)["params"])
  calls = {}
  for policy in ("none", "dots", "dots_kernels", "dots_outputs"):
    cfg = dataclasses.replace(config, remat_policy=policy)
    loss = lambda p, cfg=cfg: jnp.sum(BertModel(cfg).apply(
        {"params": p}, ids, deterministic=False, rngs={"dropout": jax.random.key(1)})[0])
    text = str(jax.make_jaxpr(jax.grad(loss))(params))
    calls[policy] = (text.count("fused_attention_fwd"), text.count("fused_attention_bwd"))
  assert calls["dots_kernels"] == calls["dots_outputs"] == calls["none"], calls
  assert calls["dots"][0] > calls["dots_kernels"][0], calls
  assert calls["dots"][1] == calls["dots_kernels"][1], calls


def test_blocks_hold_whole_lane_tiles_of_heads_and_as_many_rows_as_fit():
  # Heads side by side, as the projections lay them out: BERT's heads of 64 two to a 128-lane
  # tile; heads of 128 one; heads whose lanes never make whole tiles, all of them (full width).
  assert ak._heads_a_block(12, 64) == 2 and ak._heads_a_block(16, 64) == 2
  assert ak._heads_a_block(12, 128) == 1 and ak._heads_a_block(4, 32) == 4
  assert ak._heads_a_block(3, 96) == 3
  # BERT-Base's backward (7 blocks of 128 bfloat16 lanes) at 128: 16 rows of 32 a step; at 512,
  # 4; at 1,024, 2 (VMEM's [L, L] temporaries beside them: 40 MB).
  assert [ak._block(32, length, 256, 7) for length in (128, 512, 1024)] == [16, 4, 2]
  assert ak._block(32, 128, 256, 4) == 32  # the forward's 4 blocks


def test_auto_runs_the_kernel_s_arithmetic_by_xla_off_a_tpu_and_xla_s_attention_at_other_lengths():
  # The released configs' setting: on a CPU the same values and dropout bits as the kernel, by
  # XLA's operations (no interpreter: none of its loops over the grid, rows and heads; threefry's
  # own rounds are a loop on a CPU either way); a program lowered for a TPU holds the kernel.
  q, k, v, do, seg = _inputs(4)
  rng = jax.random.key(9)
  run = lambda interpret: jax.jit(lambda q, k, v: ak.fused_attention(
      q, k, v, seg, rng, RATE, interpret_on_cpu=interpret))
  np.testing.assert_allclose(run(False)(q, k, v), run(True)(q, k, v), atol=2e-6)
  shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (q, k, v)]
  lowered = {(interpret, platform): jax.export.export(run(interpret), platforms=[platform])(
      *shapes).mlir_module() for interpret in (True, False) for platform in ("cpu", "tpu")}
  loops = {interpret: lowered[interpret, "cpu"].count("stablehlo.while")
           for interpret in (True, False)}
  # The grid's loop (and the backward's rows; the forward's are unrolled: its inputs may be
  # slices of one product, computed inside its reads).
  assert loops[True] >= loops[False] + 1, loops
  assert "tpu_custom_call" in lowered[False, "tpu"]
  # In a model: "auto" is "fused" at a length the kernel holds, and XLA's attention at another.
  cfg = BertConfig(vocab_size=97, hidden_size=64, num_layers=1, num_heads=2,
                   intermediate_size=128, max_position_embeddings=L, hidden_dropout=0.0,
                   attention_dropout=RATE)
  ids = np.random.default_rng(0).integers(1, 97, (2, L))
  params = nn.unbox(BertModel(cfg).init(jax.random.key(0), ids)["params"])
  out = lambda impl, ids: BertModel(dataclasses.replace(cfg, attention_impl=impl)).apply(
      {"params": params}, ids, deterministic=False, rngs={"dropout": jax.random.key(2)})[0]
  np.testing.assert_allclose(out("auto", ids), out("fused", ids), atol=2e-5)
  loops = {impl: jax.export.export(jax.jit(lambda ids, impl=impl: out(impl, ids)),
                                  platforms=["cpu"])(jax.ShapeDtypeStruct(ids.shape, ids.dtype))
           .mlir_module().count("stablehlo.while") for impl in ("auto", "fused")}
  assert loops["auto"] < loops["fused"], loops  # the interpreter's loops are the fused one's
  short = ids[:, :100]
  np.testing.assert_array_equal(out("auto", short), out("xla", short))
  with pytest.raises(Refusal, match="multiple of 128"):
    out("fused", short)


def test_modern_layers_local_and_global_scanned_give_the_xla_path_s_values():
  # ModernBERT's alternation (a local window on every other layer, chosen per scanned layer by a
  # traced index) with RoPE: the kernel's values are XLA attention's without dropout.
  cfg = BertConfig(vocab_size=97, hidden_size=64, num_layers=2, num_heads=2,
                   intermediate_size=128, max_position_embeddings=L, hidden_dropout=0.0,
                   attention_dropout=0.0, scan_layers=True, global_every=2, local_window=32,
                   position_embedding="rope")
  ids = np.random.default_rng(3).integers(1, 97, (2, L))
  mask = np.ones_like(ids)
  mask[0, 90:] = 0
  params = nn.unbox(BertModel(cfg).init(jax.random.key(0), ids)["params"])
  out = {impl: BertModel(dataclasses.replace(cfg, attention_impl=impl)).apply(
      {"params": params}, ids, mask)[0] for impl in ("xla", "fused")}
  real = mask.astype(bool)
  np.testing.assert_allclose(np.asarray(out["fused"])[real], np.asarray(out["xla"])[real],
                             atol=2e-5)


def test_under_splash_straight_local_layers_past_a_slab_take_the_kernel_s_slabs(monkeypatch):
  # ModernBERT's phase 2: splash's global layers, and its local layers (straight, the window
  # within a block) by the fused kernel's slabs with RoPE inside; values those of XLA's path.
  length = 384
  cfg = BertConfig(vocab_size=97, hidden_size=128, num_layers=2, num_heads=2,
                   intermediate_size=128, max_position_embeddings=length, hidden_dropout=0.0,
                   attention_dropout=0.0, global_every=2, local_window=32,
                   position_embedding="rope", local_rope_theta=100.0)
  ids = np.random.default_rng(4).integers(1, 97, (1, length))
  mask = np.ones_like(ids)
  mask[0, 300:] = 0
  params = nn.unbox(BertModel(cfg).init(jax.random.key(0), ids)["params"])
  windows, fused = [], ak.fused_attention
  monkeypatch.setattr(ak, "fused_attention",
                      lambda *a, **kw: (windows.append(kw["local_window"]), fused(*a, **kw))[1])
  out = {impl: BertModel(dataclasses.replace(cfg, attention_impl=impl)).apply(
      {"params": params}, ids, mask)[0] for impl in ("xla", "splash")}
  assert windows == [32]  # layer 1 alone (layer 0 is global: splash)
  real = mask.astype(bool)
  np.testing.assert_allclose(np.asarray(out["splash"])[real], np.asarray(out["xla"])[real],
                             atol=2e-5)


def test_remat_auto_keeps_the_kernels_outputs_and_on_v6e_not_the_mlp_s_pre_activation():
  # "auto" at length 512 (the released configs keep everything since 2026-12-05, faster by the
  # roofline): "dots_kernels" where the steps are bound by FLOPs (v5p, v5e: 0.946 and 0.947
  # against "dots"' 0.920 and 0.921, BERT-Base, scanned), "dots_outputs" on v6e, bound by HBM
  # there (BERT-Base 0.842 against "dots"' 0.739 and "dots_kernels"' 0.633, whose kept
  # [tokens, F] pre-activation goes through the loop's stack); settled by train.build for the
  # mesh's chips.
  from bertjax.model.config import chosen_remat  # pylint: disable=import-outside-toplevel
  chip = lambda kind: types.SimpleNamespace(device_kind=kind, platform="tpu")
  assert chosen_remat("auto", chip("TPU v6 lite")) == "dots_outputs"
  assert chosen_remat("auto", chip("TPU v5")) == chosen_remat("auto", chip("TPU v5 lite")) \
      == "dots_kernels"
  assert chosen_remat("full", chip("TPU v6 lite")) == "full"
  from bertjax.configs import tiny  # pylint: disable=import-outside-toplevel
  from bertjax.training import train  # pylint: disable=import-outside-toplevel
  config = tiny.get_config()
  config.model.update(vocab_size=100, remat_policy="auto")
  assert train.from_config(config).model_config.remat_policy == "dots_kernels"  # this CPU
  with pytest.raises(ValueError, match="remat_policy='dot'; choose one of .*'auto'"):
    BertConfig(remat_policy="dot")


def test_under_a_mesh_the_model_leaves_the_kernel_s_inputs_to_its_shard_map():
  # A constraint on q with its heads apart ([B, L, N, K]) made XLA copy dq into a layout with
  # the length minor for the query product's backward, a [B, L, D] pass a layer on a TPU: the
  # kernel path places its [B, L, N * K] inputs by its shard_map alone, with the same values
  # and gradients as one device ("auto": on a CPU the kernel's arithmetic by XLA).
  cfg = BertConfig(vocab_size=97, hidden_size=32, num_layers=1, num_heads=4,
                   intermediate_size=64, max_position_embeddings=L, hidden_dropout=0.0,
                   attention_dropout=0.0, attention_impl="auto")
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), sharding.MESH_AXES)
  ids = np.random.default_rng(1).integers(1, 97, (8, L))
  mask = np.ones_like(ids)
  mask[1, 100:] = 0
  params = nn.unbox(BertModel(cfg).init(jax.random.key(0), ids)["params"])

  def loss(p, ids, mask):
    out = BertModel(cfg).apply({"params": p}, ids, mask)[0]
    return jnp.sum(out * jax.random.normal(jax.random.key(7), out.shape))
  expected = jax.value_and_grad(loss)(params, ids, mask)
  run = jax.jit(sharding.logical_context(mesh)(jax.value_and_grad(loss)))
  rows = NamedSharding(mesh, PartitionSpec(sharding.BATCH_AXES))
  placed = [jax.device_put(x, rows) for x in (ids, mask)]
  text = run.lower(params, *placed).as_text()
  assert 'manual_axes={"data", "fsdp", "tensor"}' in text  # the kernel path, heads over tensor
  heads_apart = f"tensor<8x{L}x4x8x"
  assert not [line for line in text.splitlines()
              if "sharding_constraint" in line and heads_apart in line]
  value, grads = run(params, *placed)
  np.testing.assert_allclose(value, expected[0], rtol=1e-5)
  scale = max(float(jnp.abs(e).max()) for e in jax.tree.leaves(expected[1]))
  for (path, g), e in zip(jax.tree_util.tree_leaves_with_path(grads),
                          jax.tree.leaves(expected[1])):
    assert float(jnp.abs(g - e).max()) / scale < 1e-4, jax.tree_util.keystr(path)


def test_the_kernel_s_path_makes_q_k_and_v_in_one_product_where_the_heads_are_whole():
  # qkv_product "one": x read once for the three, one weight gradient and one input gradient in
  # the backward; under a mesh that splits the heads, three products (the packed output's
  # thirds would have to be re-placed over the devices). Values and gradients as XLA's
  # attention, biases moved. "auto" is "one" on v6e and v5p alone.
  cfg = BertConfig(vocab_size=97, hidden_size=32, num_layers=1, num_heads=4,
                   intermediate_size=64, max_position_embeddings=L, hidden_dropout=0.0,
                   attention_dropout=0.0, attention_impl="auto", qkv_product="one")
  ids = np.random.default_rng(2).integers(1, 97, (8, L))
  mask = np.ones_like(ids)
  params = nn.unbox(BertModel(cfg).init(jax.random.key(0), ids)["params"])
  params = jax.tree.map(lambda x: x + 0.1, params)

  def grads(c, p):
    return jax.value_and_grad(lambda p: jnp.sum(BertModel(c).apply({"params": p}, ids, mask)[0]
                                                * jnp.linspace(-1, 1, 32)))(p)
  packed = f"tensor<8x{L}x3x32xf32>"  # the three side by side, the kernel's [3, B, L, N * K]
  products = lambda text: [line for line in text.splitlines()
                           if "dot_general" in line and packed in line]
  lowered = lambda c: jax.jit(functools.partial(grads, c)).lower(params).as_text()
  assert products(lowered(cfg))
  for setting in ("three", "auto"):  # "auto" on a CPU: three
    assert not products(lowered(dataclasses.replace(cfg, qkv_product=setting))), setting
  chips = {kind: chosen_qkv("auto", types.SimpleNamespace(device_kind=kind))
           for kind in ("TPU v6 lite", "TPU v5", "TPU v5 lite", "cpu")}
  assert chips == {"TPU v6 lite": "one", "TPU v5": "one", "TPU v5 lite": "three",
                   "cpu": "three"}, chips
  (value, got), (value_xla, expected) = grads(cfg, params), grads(
      dataclasses.replace(cfg, attention_impl="xla"), params)
  np.testing.assert_allclose(value, value_xla, rtol=1e-5)
  for (path, g), e in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(expected)):
    np.testing.assert_allclose(g, e, atol=2e-4, rtol=1e-3, err_msg=jax.tree_util.keystr(path))
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), sharding.MESH_AXES)
  split = jax.jit(sharding.logical_context(mesh)(functools.partial(grads, cfg)))
  assert not products(split.lower(params).as_text())
  # A key shared with the query starts as its weights, from the same parameters either way.
  shared = BertModel(dataclasses.replace(cfg, query_key_init="shared")).init(
      jax.random.key(0), ids)["params"]["encoder"]["layer_0"]["attention"]
  assert np.array_equal(nn.unbox(shared["key"]["kernel"]), nn.unbox(shared["query"]["kernel"]))


def _held_to_xla_with_rope(q, k, v, do, seg, first: int, window: int, seed: int):
  """The kernels with RoPE (`turn`) and biases, in Pallas' interpreter and by their XLA
  arithmetic: values, and the gradients of q, k, v and the biases, those of XLA's turn
  (rope.apply_rope, after the biases) and attention written out. Each row's positions restart
  at `first` (a second packed sequence). Returns what was expected."""
  rows, length = seg.shape
  biases = jnp.asarray(np.random.default_rng(seed).normal(size=(3, N * K)), jnp.float32)
  positions = jnp.asarray(np.where(np.arange(length) < first, np.arange(length),
                                   np.arange(length) - first)[None].repeat(rows, 0))
  cos, sin = rope.rope_tables(positions, K, 500.0)
  turn = (positions, rope.lane_frequencies(K, N, 500.0))

  def by_hand(q, k, v, biases):
    q, k, v = (x + b.reshape(N, K) for x, b in zip((q, k, v), biases))
    return _by_hand(rope.apply_rope(q, cos, sin), rope.apply_rope(k, cos, sin), v, seg, None,
                    0.0, window)

  real = np.asarray(seg >= 0)
  do = do * real[:, :, None, None]
  expected, pull_ref = jax.vjp(by_hand, q, k, v, biases)
  for xla in (False, True):
    got, pull = jax.vjp(lambda *a: ak.fused_attention(
        *a[:3], seg, local_window=window, biases=a[3], turn=turn, interpret_on_cpu=not xla),
                        q, k, v, biases)
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(expected)[real], atol=2e-5)
    for name, g, e in zip(("q", "k", "v", "biases"), pull(do), pull_ref(do)):
      np.testing.assert_allclose(g, e, atol=1e-4, err_msg=f"d{name}")
  return expected, biases


@pytest.mark.parametrize("window", [0, 64])
def test_rope_turns_q_and_k_inside_the_kernels_as_xla_does_before_them(window):
  # ModernBERT's RoPE in the kernel, whole rows.
  q, k, v, do, seg = _inputs(4)
  expected, biases = _held_to_xla_with_rope(q, k, v, do, seg, 50, window, 9)
  # and the turn did turn: without it the values differ
  plain = ak.fused_attention(q, k, v, seg, local_window=window, biases=biases)
  assert float(jnp.abs(plain - expected)[np.asarray(seg >= 0)].max()) > 0.1


@pytest.mark.parametrize("window", [128, 32])
def test_a_local_window_at_any_length_runs_by_slabs_as_attention_written_out(window,
                                                                            monkeypatch):
  # Past a block's worth, a local window runs by slabs (attention_blocks): 512 is four blocks of
  # 128 queries, each against its own and its neighbours' keys (clamped at both ends), its dk and
  # dv added up over three slabs; held to attention written out over the whole row.
  length, rows = 512, 2
  assert blocks.holds_window(length, window, 0.0) and not ak.fits(2048)
  assert not blocks.holds_window(length, window, RATE)  # dropout: whole rows only
  r = np.random.default_rng(11)
  q, k, v, do = (jnp.asarray(r.normal(size=(rows, length, N, K)), jnp.float32) for _ in range(4))
  ids = np.zeros((rows, length), np.int32)
  ids[0, :200], ids[0, 200:450], ids[1] = 1, 2, 1  # packed, then padding; one whole sequence
  seg = attention.splash_segment_ids(jnp.asarray(ids > 0, jnp.int32), jnp.asarray(ids))
  _held_to_xla_with_rope(q, k, v, do, seg, 200, window, 12)
  # The slabs' kernels are what ran (not the whole row's, which would give the same values).
  traced, forward = [], blocks.slab_forward_kernel
  monkeypatch.setattr(blocks, "slab_forward_kernel",
                      lambda *a, **kw: (traced.append(1), forward(*a, **kw))[1])
  ak.fused_attention(q, k, v, seg, local_window=window)
  assert traced
  with pytest.raises(Refusal, match="at most 1024"):
    ak.fused_attention(*(jnp.zeros((1, 2048, N, K)),) * 3, jnp.zeros((1, 2048), jnp.int32),
                       jax.random.key(0), RATE, local_window=window)


def test_a_global_layer_past_whole_rows_runs_block_by_block_as_attention_written_out(monkeypatch):
  # Past MAX_LENGTH (here 256, so 512 is four blocks) a global layer without dropout runs each
  # block of 128 queries against every block of keys with a running maximum, and its backward
  # makes the statistics again and reads the forward's output; held to attention written out.
  monkeypatch.setattr(ak, "MAX_LENGTH", 256)
  length, rows = 512, 2
  assert blocks.by_flash(length, 0, 0.0, 256) and not blocks.by_flash(length, 0, RATE, 256)
  assert not blocks.by_flash(length, 128, 0.0, 256) and not blocks.by_flash(256, 0, 0.0, 256)
  r = np.random.default_rng(13)
  q, k, v, do = (jnp.asarray(r.normal(size=(rows, length, N, K)), jnp.float32) for _ in range(4))
  ids = np.zeros((rows, length), np.int32)
  ids[0, :300], ids[0, 300:480], ids[1] = 1, 2, 1  # packed across a block, then padding
  seg = attention.splash_segment_ids(jnp.asarray(ids > 0, jnp.int32), jnp.asarray(ids))
  traced, forward = [], blocks.flash_forward_kernel
  monkeypatch.setattr(blocks, "flash_forward_kernel",
                      lambda *a, **kw: (traced.append(1), forward(*a, **kw))[1])
  _held_to_xla_with_rope(q, k, v, do, seg, 300, 0, 14)
  assert traced
