"""The MLM scores kernel (bertjax/model/kernels/mlm_kernel.py: the logits made and read in VMEM,
never written) against XLA's logits and losses.scores. On a CPU it runs in Pallas' interpreter;
tests/test_aot.py compiles it into a TPU train step."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from bertjax.model import heads, losses
from bertjax.model.kernels import mlm_kernel


def _arrays(rows, vocab, width, dtype):
  # Logits of order one: every column's exp counts in log Z, a padded one's too if it leaked.
  keys = jax.random.split(jax.random.key(3), 4)
  return ((jax.random.normal(keys[0], (rows, width)) * width ** -0.5).astype(dtype),
          jax.random.normal(keys[1], (vocab, width)).astype(dtype),
          jax.random.normal(keys[2], (vocab,)) * 0.5,
          jax.random.randint(keys[3], (rows,), 0, vocab))


@pytest.mark.parametrize("dtype,vocab", [(jnp.float32, 1000), (jnp.bfloat16, 1000),
                                         (jnp.float32, 1024)])
def test_the_kernel_gives_the_scores_of_xlas_logits(dtype, vocab, monkeypatch):
  # Small blocks, so that 300 predictions and a vocabulary of 1,000 take several of each: the
  # running largest and sum carried over four vocabulary blocks, three read from W in place and
  # the tail's from a padded copy (its padded columns out of the count); 1,024: four whole
  # blocks, no tail. The rows, which no block divides, padded to three blocks of 128.
  monkeypatch.setattr(mlm_kernel, "VOCAB_BLOCK", 256)
  monkeypatch.setattr(mlm_kernel, "ROW_BLOCKS", (128, 8))
  x, w, bias, labels = _arrays(300, vocab, 64, dtype)
  logits = jnp.einsum("rd,vd->rv", x, w, preferred_element_type=jnp.float32) + bias
  # A third of the labels are the largest logit's column: those must count as correct.
  labels = jnp.where(jnp.arange(300) < 100, jnp.argmax(logits, axis=1), labels)
  log_z, label, top = mlm_kernel.scores(x, w, bias, labels, interpret=True)
  expected = losses.figures(logits, labels)
  for name, got, want in zip(("log Z", "label", "largest"), (log_z, label, top), expected):
    assert got.shape == (300,) and got.dtype == jnp.float32, name
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4, err_msg=name)
  # A padded column never wins the largest: the tail block's real columns alone count.
  assert float(jnp.min(top)) > -1e3
  (nll, correct), _ = losses.scores_of(log_z, label, top)
  (nll_x, correct_x), _ = losses.scores(logits, labels)
  np.testing.assert_allclose(nll, nll_x, rtol=1e-5, atol=1e-4)
  assert bool(jnp.all(correct[:100] == 1)) and bool(jnp.all(correct == correct_x))


def test_every_predictions_state_stays_in_vmem_where_it_fits_and_else_goes_in_blocks(
    monkeypatch):
  # Read once where it fits beside the call's other blocks; else a block of predictions at a
  # time (read again for each block of the vocabulary). The same scores either way.
  monkeypatch.setattr(mlm_kernel, "VOCAB_BLOCK", 256)
  monkeypatch.setattr(mlm_kernel, "ROW_BLOCKS", (128, 8))
  x, w, bias, labels = _arrays(300, 1000, 64, jnp.float32)
  blocked = int(mlm_kernel._need(384, 128, 256, 64, 4, True) * 1.25) + (2 << 20)
  results = {}
  for vmem in (1 << 30, blocked):
    run = lambda x: mlm_kernel.scores(x, w, bias, labels, interpret=True, vmem=vmem)
    call = next(e for e in jax.make_jaxpr(run)(x).jaxpr.eqns if e.primitive.name == "pallas_call")
    results[call.params["grid_mapping"].block_mappings[1].block_shape[0].block_size] = run(x)
  assert sorted(results) == [128, 384]  # a block of 128 predictions, or all 384 (300 padded)
  for got, want in zip(results[128], results[384]):
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_a_device_with_many_predictions_makes_a_call_for_each_group(monkeypatch):
  # Each call keeps its predictions' running figures in VMEM (1.5 KB a prediction): 29,184 in
  # one call overflowed v5p's 64 MiB. In groups of at most MAX_ROWS, the same scores.
  monkeypatch.setattr(mlm_kernel, "MAX_ROWS", 128)
  monkeypatch.setattr(mlm_kernel, "VOCAB_BLOCK", 256)
  x, w, bias, labels = _arrays(300, 600, 32, jnp.float32)
  run = lambda x: mlm_kernel.scores(x, w, bias, labels, interpret=True)
  calls = [e for e in jax.make_jaxpr(run)(x).jaxpr.eqns if e.primitive.name == "pallas_call"]
  assert [e.invars[1].aval.shape[0] for e in calls] == [104, 104, 96]  # 300 in three
  logits = jnp.einsum("rd,vd->rv", x, w, preferred_element_type=jnp.float32) + bias
  for got, want in zip(run(x), losses.figures(logits, labels)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_the_blocks_fit_a_core_s_vmem_on_every_tpu_and_are_halved_where_it_is_small(monkeypatch):
  # Every released step's predictions a chip (BERT-Base and -Large at 128 and 512, 64 rows a
  # chip on v4-8 and v5p-8, 32 on v5e-8 and v6e-8): with Mosaic's room, a call fits the core's
  # VMEM as jax gives it. The sizes that fit v5p's 64 MiB took 18.3 MiB of v4's 16 in
  # BERT-Base's step (the compile refused it); v5p, v5e and v6e keep them whole.
  whole = (mlm_kernel.MAX_ROWS, mlm_kernel.ROW_BLOCKS[0], mlm_kernel.VOCAB_BLOCK)
  for chip in ("v4", "v5p", "v5e", "v6e"):
    vmem = pltpu.get_tpu_info_for_chip(pltpu.ChipVersion(chip), 1).vmem_capacity_bytes
    for rows, predictions, width in ((64, 20, 768), (64, 20, 1024), (64, 76, 768),
                                     (64, 76, 1024), (32, 76, 1024)):
      calls, largest, block = sizes = mlm_kernel._sizes(rows * predictions, 30522, width, 2, vmem)
      need = mlm_kernel._need(min(calls, rows * predictions), largest, block, width, 2, True)
      assert int(need * 1.25) + (2 << 20) <= vmem, (chip, rows, predictions, width, sizes)
      assert (sizes == whole) == (chip != "v4"), (chip, sizes)
  # Halved, the same scores: a VMEM that holds a quarter of the test's sizes and no more takes
  # calls of at most 64 predictions, blocks of 32 and vocabulary blocks of 128 (their least).
  monkeypatch.setattr(mlm_kernel, "MAX_ROWS", 256)
  monkeypatch.setattr(mlm_kernel, "ROW_BLOCKS", (128, 64, 32, 8))
  monkeypatch.setattr(mlm_kernel, "VOCAB_BLOCK", 512)
  x, w, bias, labels = _arrays(150, 600, 32, jnp.float32)
  small = int(mlm_kernel._need(64, 32, 128, 32, 4, True) * 1.25) + (2 << 20)
  assert mlm_kernel._sizes(150, 600, 32, 4, 1 << 30) == (256, 128, 512)
  assert mlm_kernel._sizes(150, 600, 32, 4, small) == (64, 32, 128)
  run = lambda x: mlm_kernel.scores(x, w, bias, labels, interpret=True, vmem=small)
  calls = [e for e in jax.make_jaxpr(run)(x).jaxpr.eqns if e.primitive.name == "pallas_call"]
  # 150 in three calls of 56, 56 and 38 (the last padded to two blocks of 32).
  assert [e.invars[1].aval.shape[0] for e in calls] == [56, 56, 64]
  logits = jnp.einsum("rd,vd->rv", x, w, preferred_element_type=jnp.float32) + bias
  for got, want in zip(run(x), losses.figures(logits, labels)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_on_a_tpu_the_head_runs_the_kernel_and_elsewhere_xla():
  # decoded_scores' forward: the kernel in a program for a TPU, XLA's logits for a GPU or a CPU;
  # the same scores (the CPU runs XLA's path here).
  x, w, bias, labels = _arrays(24, 97, 32, jnp.float32)
  x, labels = x.reshape(2, 12, 32), labels.reshape(2, 12)
  scores = lambda x, w, b: heads.decoded_scores(x, w, b, labels, jnp.bfloat16)
  loss = lambda x, w, b: jnp.sum(scores(x, w, b).nll_BxM)
  shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (x, w, bias)]
  for platform, kernel in (("tpu", True), ("cuda", False), ("cpu", False)):
    text = jax.export.export(jax.jit(jax.grad(loss, argnums=(0, 1, 2))),
                             platforms=[platform])(*shapes).mlir_module()
    assert ("mlm_scores_fwd" in text) == kernel, platform
  # Too few predictions for their logits to outweigh the table's copy (24 against D / 2 = 32
  # at D 64): XLA's logits on a TPU too.
  assert mlm_kernel.worth_it(24, 32) and not mlm_kernel.worth_it(24, 64)
  wide = [jax.ShapeDtypeStruct((2, 12, 64), x.dtype), jax.ShapeDtypeStruct((97, 64), w.dtype),
          shapes[2]]
  text = jax.export.export(jax.jit(jax.grad(loss, argnums=(0, 1, 2))),
                           platforms=["tpu"])(*wide).mlir_module()
  assert "mlm_scores_fwd" not in text
  got = scores(x, w, bias)
  logits = heads.tied_decoder(x, w, bias, jnp.bfloat16)
  want, _ = losses.scores(logits, labels)
  np.testing.assert_allclose(got.nll_BxM, want.nll_BxM, rtol=1e-6)
  kernel = mlm_kernel.scores(x.reshape(24, 32).astype(jnp.bfloat16), w.astype(jnp.bfloat16),
                             bias, labels.reshape(24), interpret=True)
  np.testing.assert_allclose(losses.scores_of(*kernel)[0].nll_BxM, want.nll_BxM.reshape(24),
                             rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("vocab", [1000, 1024, 200])
def test_the_kept_logits_kernel_writes_xlas_logits_and_their_figures(vocab, monkeypatch):
  # Where the logits are kept (heads.kept_scores): the kernel writes them and makes their
  # figures in the same pass, a block of predictions at a time over the vocabulary's blocks.
  # Blocks of 256 columns: four over 1,000 (the tail's from a padded copy, its padded columns
  # written as the bias' padding and not counted), four whole over 1,024, one tail alone over
  # 200; the 300 rows, which no block divides, padded to three blocks of 128.
  monkeypatch.setattr(mlm_kernel, "KEPT_VOCAB_BLOCK", 256)
  monkeypatch.setattr(mlm_kernel, "KEPT_ROW_BLOCKS", (128, 8))
  x, w, bias, labels = _arrays(300, vocab, 64, jnp.float32)
  logits = jnp.einsum("rd,vd->rv", x, w, preferred_element_type=jnp.float32) + bias
  labels = jnp.where(jnp.arange(300) < 100, jnp.argmax(logits, axis=1), labels)
  got = mlm_kernel.kept_scores(x, w, bias, labels, interpret=True)
  assert got[0].shape == (300, mlm_kernel.kept_width(vocab)) == (300, -(-vocab // 256) * 256)
  np.testing.assert_allclose(got[0][:, :vocab], logits, rtol=1e-5, atol=1e-4)
  assert bool(jnp.all(got[0][:, vocab:] == mlm_kernel.PAD))
  for name, a, want in zip(("log Z", "label", "largest"), got[1:],
                           losses.figures(logits, labels)):
    np.testing.assert_allclose(a, want, rtol=1e-5, atol=1e-4, err_msg=name)
