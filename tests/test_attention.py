"""Fused attention (bertjax/model/attention.py) against the XLA path: splash in its interpreter on CPU,
cuDNN's arguments through the XLA implementation (no GPU here), padding and packing."""

import dataclasses
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.tpu import splash_attention as splash
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from bertjax.model import attention
from bertjax.model.config import BertConfig
from bertjax.model.encoder import BertModel
from bertjax.parallel import sharding

# L = 128, the kernel's smallest block; K = 16.
CFG = BertConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                 max_position_embeddings=128, hidden_dropout=0.0, attention_dropout=0.0,
                 scan_layers=True)
LENGTH = 128


def _batch():
  """Two rows: three packed sequences then padding; two sequences then padding."""
  rng = np.random.default_rng(0)
  ids = rng.integers(5, 64, (2, LENGTH)).astype(np.int32)
  seq = np.zeros((2, LENGTH), np.int32)
  seq[0, :40], seq[0, 40:90], seq[0, 90:117] = 1, 2, 3
  seq[1, :70], seq[1, 70:100] = 1, 2
  mask = (seq > 0).astype(np.int32)
  seg = np.zeros_like(ids)
  seg[:, 20:] = 1
  return ids, mask, seg, seq


@pytest.mark.parametrize("packed", [True, False])
def test_splash_matches_the_xla_path_on_real_tokens(packed):
  # Outputs at real queries, and the gradients of a loss on them (which reach padding keys and
  # values in neither path), in the kernel's interpreter.
  _, mask, _, seq = _batch()
  mask, seq = jnp.asarray(mask), (jnp.asarray(seq) if packed else None)
  rng = np.random.default_rng(2)
  q, k, v = (jnp.asarray(rng.normal(size=(2, LENGTH, 2, 16)), jnp.float32) for _ in range(3))
  weights = jnp.asarray(rng.normal(size=(2, LENGTH, 2, 16)), jnp.float32)
  real = mask.astype(bool)[:, :, None, None]
  splash_masks = attention.attention_masks("splash", mask, seq)
  xla_masks = attention.attention_masks("xla", mask, seq)

  def loss(fn):
    return lambda q, k, v: jnp.sum(jnp.where(real, fn(q, k, v), 0.0) * weights)

  def run(fn):
    out = jnp.where(real, jax.jit(fn)(q, k, v), 0.0)
    return out, jax.jit(jax.grad(loss(fn), argnums=(0, 1, 2)))(q, k, v)

  out_s, grads_s = run(lambda q, k, v: attention.splash_attention(q, k, v, splash_masks["segment_ids"]))
  out_x, grads_x = run(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, **xla_masks))
  np.testing.assert_allclose(out_s, out_x, atol=1e-5)
  for name, got, expected in zip("qkv", grads_s, grads_x):
    np.testing.assert_allclose(got, expected, atol=1e-5, err_msg=f"d loss / d {name}")


def test_a_splash_model_under_a_mesh_matches_the_xla_path_with_packing():
  # The whole encoder, two layers: from the second on, the hidden states at padding positions
  # differ between the two paths (bertjax/model/attention.py); real tokens must not see them. Under a
  # 2 x 2 x 2 mesh the kernel runs in shard_map: data x fsdp split the rows, tensor the heads.
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), sharding.MESH_AXES)
  ids, mask, seg, seq = (np.concatenate([x, x[::-1]]) for x in _batch())
  params = nn.unbox(BertModel(CFG).init(jax.random.key(0), ids)["params"])
  expected, pooled_x = BertModel(CFG).apply({"params": params}, ids, mask, seg, sequence_ids=seq)
  cfg = dataclasses.replace(CFG, attention_impl="splash")

  @jax.jit
  @sharding.logical_context(mesh)
  def forward(p, *batch):
    return BertModel(cfg).apply({"params": p}, *batch[:3], sequence_ids=batch[3])

  rows = NamedSharding(mesh, PartitionSpec(sharding.BATCH_AXES))
  batch = [jax.device_put(x, rows) for x in (ids, mask, seg, seq)]
  # The kernel's program is one device's: 1 row and 1 head each.
  text = forward.lower(params, *batch).as_text()
  assert 'manual_axes={"data", "fsdp", "tensor"}' in text
  assert "tensor<1x128x1x16xf32>" in text
  got, pooled = forward(params, *batch)
  real = mask.astype(bool)[:, :, None]
  np.testing.assert_allclose(np.where(real, got, 0.0), np.where(real, expected, 0.0), atol=2e-5)
  np.testing.assert_allclose(pooled, pooled_x, atol=2e-5)


@pytest.mark.parametrize("packed", [True, False])
def test_cudnn_arguments_mask_like_the_xla_path(packed):
  # What SelfAttention hands cuDNN, run by the XLA implementation (no GPU here), against the
  # boolean mask of the XLA path, at every position (padding queries included).
  _, mask, _, seq = _batch()
  seq = jnp.asarray(seq) if packed else None
  rng = np.random.default_rng(2)
  q, k, v = (jnp.asarray(rng.normal(size=(2, LENGTH, 2, 16)), jnp.float32) for _ in range(3))
  args = attention.attention_masks("cudnn", jnp.asarray(mask), seq)
  assert set(args) == ({"mask"} if packed else {"key_value_seq_lengths"})
  got = jax.nn.dot_product_attention(q, k, v, **args, implementation="xla")
  expected = jax.nn.dot_product_attention(
      q, k, v, mask=attention.attention_mask(jnp.asarray(mask), seq), implementation="xla")
  np.testing.assert_allclose(got, expected, atol=1e-6)


def test_cudnn_segments_are_the_rows_sequences_in_cudnns_packed_layout():
  # Row 0: sequences of 40, 50 and 27 tokens, then 11 of padding (a segment of its own); row 1:
  # 70, 30, then 28 of padding. M = L // 2 + 1 columns, -1 past a row's last segment.
  _, mask, _, seq = _batch()
  segments = attention.cudnn_segments(jnp.asarray(mask), jnp.asarray(seq))
  m = LENGTH // 2 + 1
  lengths, offsets = np.full((2, m), -1), np.full((2, m + 1), -1)
  lengths[0, :4], offsets[0, :4] = [40, 50, 27, 11], [0, 40, 90, 117]
  lengths[1, :3], offsets[1, :3] = [70, 30, 28], [0, 70, 100]
  np.testing.assert_array_equal(segments["q_seqlen"], lengths)
  np.testing.assert_array_equal(segments["kv_seqlen"], lengths)
  np.testing.assert_array_equal(segments["q_offsets"], offsets)
  np.testing.assert_array_equal(segments["kv_offsets"], offsets)


def test_cudnn_segments_attend_as_the_xla_path_on_real_tokens():
  # What cuDNN's packed layout lets a query see (segments_mask), run by the XLA implementation
  # (no GPU here): the outputs at real tokens equal those of the XLA path's boolean mask.
  _, mask, _, seq = _batch()
  rng = np.random.default_rng(3)
  q, k, v = (jnp.asarray(rng.normal(size=(2, LENGTH, 2, 16)), jnp.float32) for _ in range(3))
  args = attention.attention_masks("cudnn", jnp.asarray(mask), jnp.asarray(seq), "segments")
  assert set(args) == {"segments"}
  allowed = attention.segments_mask(args["segments"], LENGTH)
  expected_mask = attention.attention_mask(jnp.asarray(mask), jnp.asarray(seq))
  real = mask.astype(bool)
  np.testing.assert_array_equal(np.asarray(allowed)[:, 0][real],
                                np.asarray(expected_mask)[:, 0][real])
  got = jax.nn.dot_product_attention(q, k, v, mask=allowed, implementation="xla")
  expected = jax.nn.dot_product_attention(q, k, v, mask=expected_mask, implementation="xla")
  np.testing.assert_allclose(np.asarray(got)[real], np.asarray(expected)[real], atol=1e-6)
  # A local layer (ModernBERT's) takes the segments as its mask, with the band.
  band = attention.cudnn_local_arguments(args, LENGTH, 8)["mask"]
  band_of_mask = attention.cudnn_local_arguments({"mask": expected_mask}, LENGTH, 8)["mask"]
  np.testing.assert_array_equal(np.asarray(band)[:, 0][real], np.asarray(band_of_mask)[:, 0][real])


def test_cudnn_packed_attention_passes_segments_to_jaxs_packed_layout_or_falls_back(monkeypatch):
  # jax 0.10.2 has the packed layout in a private function only (attention.py says why); a jax
  # without it gets the public path and the mask. Both calls recorded here (no GPU).
  _, mask, _, seq = _batch()
  segments = attention.cudnn_segments(jnp.asarray(mask), jnp.asarray(seq))
  q = k = v = jnp.zeros((2, LENGTH, 2, 16), jnp.bfloat16)
  private = attention._private_cudnn_attention()  # pylint: disable=protected-access
  assert private is not None, "jax's cuDNN packed layout is gone: update attention.py"
  calls = {}
  fake = lambda *a, **kw: calls.setdefault("private", kw) and a[0]
  monkeypatch.setattr(attention, "_private_cudnn_attention", lambda: (fake, private[1]))
  attention.cudnn_packed_attention(q, k, v, segments)
  assert set(calls["private"]) == {"q_seqlen", "kv_seqlen", "q_offsets", "kv_offsets", "scale",
                                   "mask_type"}
  assert calls["private"]["mask_type"].name == "PADDING" and calls["private"]["scale"] == 0.25
  monkeypatch.setattr(attention, "_private_cudnn_attention", lambda: None)
  monkeypatch.setattr(jax.nn, "dot_product_attention",
                      lambda *a, **kw: calls.setdefault("public", kw) and a[0])
  attention.cudnn_packed_attention(q, k, v, segments)
  assert set(calls["public"]) == {"mask", "implementation"}
  np.testing.assert_array_equal(calls["public"]["mask"],
                                attention.segments_mask(segments, LENGTH))


def test_splash_segment_ids_keep_real_tokens_off_padding():
  mask = jnp.asarray([[1, 1, 1, 0], [1, 1, 1, 1]])
  seq = jnp.asarray([[1, 2, 2, 0], [0, 0, 1, 1]])  # row 1 numbers a real sequence 0
  ids = attention.splash_segment_ids(mask, seq)
  np.testing.assert_array_equal(ids, [[1, 2, 2, -1], [0, 0, 1, 1]])
  allowed = np.asarray(ids[:, :, None] == ids[:, None, :])
  expected = np.asarray(attention.attention_mask(mask, seq))[:, 0]
  real = np.asarray(mask, bool)
  np.testing.assert_array_equal(allowed[real], expected[real])  # every real query's row
  np.testing.assert_array_equal(attention.splash_segment_ids(mask), [[1, 1, 1, -1], [1] * 4])


def test_splash_refuses_lengths_off_its_blocks_and_attention_dropout():
  cfg = dataclasses.replace(CFG, attention_impl="splash")
  with pytest.raises(ValueError, match=r"multiple of 128 .*; got 96\. Set data.max_seq_length to "
                                       r"a multiple of 128 \(e\.g\. 128\)"):
    x = jnp.zeros((1, 96, 2, 16))
    attention.splash_attention(x, x, x, jnp.ones((1, 96), jnp.int32))
  assert [attention.splash_block_size(n) for n in (128, 256, 384, 512, 1024)] == [
      128, 256, 128, 512, 512]
  with pytest.raises(ValueError, match=r"attention_impl='splash' has no dropout on attention "
                                       r"probabilities \(attention_dropout=0.1\); set "
                                       r"attention_dropout=0.0 or use attention_impl='fused' "
                                       r"\(TPU\) or 'xla'"):
    dataclasses.replace(cfg, attention_dropout=0.1)
  with pytest.raises(ValueError, match=r"attention_impl='flash'; choose one of \('xla', 'cudnn', "
                                       r"'splash', 'fused', 'auto'\)"):
    BertConfig(attention_impl="flash")


def test_a_jax_without_the_private_packed_layout_is_detected_so_the_public_path_serves(
    monkeypatch):
  # attention.py reaches jax._src (jax 0.10.2's packed layout has no public name); a jax where
  # that module is gone, or its function takes other arguments, must read as "none here".
  from jax._src import cudnn  # pylint: disable=import-outside-toplevel
  from jax._src.cudnn import fused_attention_stablehlo as fused  # pylint: disable=import-outside-toplevel
  assert attention._private_cudnn_attention() is not None  # pylint: disable=protected-access
  with monkeypatch.context() as m:
    m.setattr(fused, "dot_product_attention", lambda query, key, value, mask=None: query)
    assert attention._private_cudnn_attention() is None  # pylint: disable=protected-access
  monkeypatch.delattr(cudnn, "fused_attention_stablehlo")
  monkeypatch.setitem(sys.modules, "jax._src.cudnn.fused_attention_stablehlo", None)
  assert attention._private_cudnn_attention() is None  # pylint: disable=protected-access
  assert not attention.cudnn_packed_layout()


def test_the_count_of_splash_s_flops_takes_the_blocks_a_local_window_computes():
  # A window of 128 touches 10 of 16 [L, L] blocks of 512 at length 2,048 (each query block its
  # own and its neighbours'), as the kernel's block map says; the kernel computes those alone,
  # and names them in its call's scope for the roofline (attention.splash_flops), since the
  # compiled program holds the map as an elided constant. A local window takes blocks no wider
  # than itself: 46 of 256 blocks of 128, 18% of the scores where blocks of 512 computed 62%.
  # A full mask computes all 16 of 512.
  for size, window in ((2048, 128), (8192, 128), (8192, 0), (1024, 256)):
    mask = (splash.LocalMask((size, size), window_size=(window // 2,) * 2, offset=0) if window
            else splash.FullMask((size, size)))
    blocks = splash.BlockSizes(block_q=512, block_kv=512, block_kv_compute=512,
                               block_q_dkv=512, block_kv_dkv=512, block_kv_dkv_compute=512,
                               use_fused_bwd_kernel=True)
    kernel = splash.make_splash_mha(splash.MultiHeadMask([mask]), block_sizes=blocks,
                                    head_shards=1, q_seq_shards=1)
    assert attention.splash_blocks(size, 512, window) == np.count_nonzero(
        kernel.fwd_mask_info.block_mask) == np.count_nonzero(kernel.dkv_mask_info.block_mask)
  length, shape = 2048, (1, 2048, 2, 64)
  arrays = [jax.ShapeDtypeStruct(shape, jnp.bfloat16)] * 3 + [
      jax.ShapeDtypeStruct((1, length), jnp.int32)]
  assert attention.splash_block_size(length, 128) == 128
  assert attention.splash_block_size(length, 0) == attention.splash_block_size(length, 1024) == 512
  for window, walked, blocks in ((128, 46, 256), (0, 16, 16)):
    run = lambda q, k, v, ids, window=window: attention._splash_local(
        q, k, v, ids, interpret=True, local_window=window)
    text = jax.jit(run).trace(*arrays).lower(lowering_platforms=("tpu",)).as_text(
        debug_info=True)
    assert f"splash_blocks_{walked}_of_{blocks}" in text, window
    line = (f'%splash_mha_fwd_segmented_residuals.5 = custom-call(), metadata={{op_name='
            f'"jit(f)/splash_blocks_{walked}_of_{blocks}/vmap/splash_mha_fwd/pallas_call"}}')
    operands = ["bf16[2,2048,64]{2,1,0}"] * 3
    assert attention.splash_flops(line, operands, "bf16[2,2048,64]") == 4 * 2 * 2048 * 2048 * 64 \
        * walked / blocks
  # Without the scope (a program compiled before it), every block: an upper bound.
  assert attention.splash_flops("%splash_mha_fwd.1 = custom-call()", operands, "") == \
      4 * 2 * 2048 * 2048 * 64
