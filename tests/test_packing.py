"""Sequence packing: the packer, the pipeline's packed rows (the same sequences and masks as
unpacked, exact restart, disjoint hosts), and packed == unpacked training (losses, gradients)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bertjax.data import packing, pipeline, prepare, tokenizer
from bertjax.data.config import DataConfig
from bertjax.model import losses
from bertjax.model.config import BertConfig
from bertjax.model.heads import BertForPreTraining
from bertjax.training import train
from test_data_fixtures import data_config, data_section

L = 64


def test_best_fit_decreasing_places_every_sequence_once_within_the_limits():
  rng = np.random.default_rng(0)
  lengths = rng.integers(5, L + 1, 500)
  row, slot, offset, rows = packing.best_fit_decreasing(lengths, L, 3)
  used = np.zeros(rows, int)
  np.add.at(used, row, lengths)
  assert used.max() <= L and np.bincount(row, minlength=rows).max() <= 3
  for r in range(rows):  # the sequences of a row lie end to end from 0, slots numbered in order
    mine = np.flatnonzero(row == r)
    mine = mine[np.argsort(slot[mine])]
    assert list(slot[mine]) == list(range(len(mine)))
    assert list(offset[mine]) == list(np.concatenate([[0], np.cumsum(lengths[mine])[:-1]]))
  assert rows < 0.75 * len(lengths)  # packing: far fewer rows than sequences
  # Best fit: 40 goes with the 24 that fills its row exactly, not with the first row that fits.
  row, _, _, rows = packing.best_fit_decreasing(np.array([40, 30, 24, 20]), L, 3)
  assert rows == 2 and row[0] == row[2] and row[1] == row[3]
  assert packing.best_fit_decreasing(np.array([40, 30, 24, 20]), L, 1)[3] == 4


def test_bad_packing_settings_are_refused(tmp_path):
  c = data_config(tmp_path, n_docs=0, max_sequences_per_row=0)
  with pytest.raises(ValueError, match="max_sequences_per_row=0 must be an integer >= 1"):
    prepare.check_config(c)
  # A config built by hand (not type-checked against base.py's bool) is refused where it is typed.
  by_hand = {**data_section(tmp_path, n_docs=0), "packing": "on", "max_sequences_per_row": 2.0}
  with pytest.raises(ValueError, match=r"config.data.packing='on' must be bool; "
                                       r"config.data.max_sequences_per_row=2.0 must be int"):
    DataConfig.from_config(by_hand)


# --- packed == unpacked training (the model side) ------------------------------------------------

CFG = BertConfig(vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64,
                 max_position_embeddings=L, hidden_dropout=0.0, attention_dropout=0.0)
M, S = 6, 3


def _sequences(n, seed=0):
  """n masked sequences in the unpacked layout ([CLS] A [SEP] B [SEP], padded to L), lengths
  from 8 to L, 1 to M real predictions each, plus their example ids."""
  rng = np.random.default_rng(seed)
  lengths = rng.integers(8, L + 1, n)
  lengths[:3] = L  # rows that take one sequence whole
  ids = np.zeros((n, L), np.int32)
  seg = np.zeros((n, L), np.int32)
  pos = np.zeros((n, M), np.int32)
  lab = np.zeros((n, M), np.int32)
  w = np.zeros((n, M), np.float32)
  for i, length in enumerate(lengths):
    a = rng.integers(2, length - 3)
    ids[i, :length] = rng.integers(5, CFG.vocab_size, length)
    ids[i, [0, a, length - 1]] = [2, 3, 3]
    seg[i, a + 1:length] = 1
    k = rng.integers(1, M + 1)
    chosen = np.sort(rng.choice(np.setdiff1d(np.arange(1, length - 1), [a]), k, replace=False))
    pos[i, :k], lab[i, :k], w[i, :k] = chosen, ids[i, chosen], 1.0
    ids[i, chosen] = 4  # [MASK]
  return {"input_ids": ids, "input_mask": (np.arange(L)[None] < lengths[:, None]).astype(np.int32),
          "segment_ids": seg, "masked_lm_positions": pos, "masked_lm_ids": lab,
          "masked_lm_weights": w, "next_sentence_labels": rng.integers(0, 2, n).astype(np.int32),
          "example_ids": np.arange(n)}


def _model_inputs(batch):
  return {k: v for k, v in batch.items() if k != "example_ids"}


@jax.jit
def _forward(params, batch):
  return BertForPreTraining(CFG).apply({"params": params}, **train.model_inputs(batch))


@jax.jit
def _forward_and_grads(params, batch):
  """The model's logits, and the objective as training computes it with its gradients."""
  dens = train._pretraining_denominators(batch)  # pylint: disable=protected-access
  loss_fn = train.loss_fn
  (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(
      params, BertForPreTraining(CFG), batch, jax.random.key(0), dens)
  return _forward(params, batch), loss, grads


def _per_sequence_losses(batch, logits):
  """(MLM loss summed over each sequence's predictions, NSP loss) per example id."""
  mlm_BxMxV, nsp = logits
  logp = jax.nn.log_softmax(mlm_BxMxV.astype(jnp.float32))
  nll_BxM = -np.take_along_axis(np.asarray(logp), batch["masked_lm_ids"][..., None], -1)[..., 0]
  nll_BxM = nll_BxM * batch["masked_lm_weights"]
  nsp_nll = -np.take_along_axis(np.asarray(jax.nn.log_softmax(nsp)),
                                np.asarray(batch["next_sentence_labels"])[..., None], -1)[..., 0]
  ex = np.asarray(batch["example_ids"]).reshape(len(nsp_nll), -1)
  per_seq = nll_BxM.reshape(ex.shape[0], ex.shape[1], -1).sum(-1)
  nsp_nll = nsp_nll.reshape(ex.shape)
  keep = ex >= 0
  return dict(zip(ex[keep], zip(per_seq[keep], nsp_nll[keep])))


def test_packed_batch_equals_the_same_sequences_unpacked():
  unpacked = _sequences(24)
  packed = packing.pack(unpacked, max_per_row=S, rng=np.random.default_rng(1))
  rows = len(packed["input_ids"])
  assert rows < 20 and packed["masked_lm_positions"].shape == (rows, S * M)
  params = jax.jit(lambda batch: BertForPreTraining(CFG).init(
      jax.random.key(0), **train.model_inputs(batch))["params"])(_model_inputs(unpacked))
  logits_u, loss_u, grads_u = _forward_and_grads(params, _model_inputs(unpacked))
  logits_p, loss_p, grads_p = _forward_and_grads(params, _model_inputs(packed))
  want = _per_sequence_losses(unpacked, logits_u)
  got = _per_sequence_losses(packed, logits_p)
  assert sorted(got) == sorted(want) == list(range(24))
  for i in want:
    np.testing.assert_allclose(got[i], want[i], rtol=2e-5, atol=2e-5, err_msg=f"sequence {i}")
  # The objective (mean MLM over all predictions + mean NSP over all sequences: the same
  # denominators packed or not) and its gradients.
  np.testing.assert_allclose(loss_p, loss_u, rtol=1e-5)
  for (path, gu), gp in zip(jax.tree_util.tree_leaves_with_path(grads_u),
                            jax.tree_util.tree_leaves(grads_p)):
    np.testing.assert_allclose(gp, gu, rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))

  # The test can tell: without restarting positions, or with attention across the sequences of a
  # row, the packed losses differ.
  no_restart = {**packed, "position_ids": np.broadcast_to(np.arange(L), (rows, L))}
  crossing = {k: v for k, v in packed.items() if k != "sequence_ids"}
  for broken in (no_restart, crossing):
    bad = _per_sequence_losses(broken, _forward(params, _model_inputs(broken)))
    assert max(abs(bad[i][0] - want[i][0]) for i in want) > 1e-2


# --- the pipeline's packed rows -----------------------------------------------------------------

@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
  # Many short pairs (short_seq_prob 0.5), so that rows take two or three sequences.
  c = data_config(tmp_path_factory.mktemp("pack"), n_docs=60, sents_per_doc=25, short_seq_prob=0.5)
  prepare.ensure_prepared(c, tokenizer.load_tokenizer(c))
  return dataclasses.replace(c, packing=True)


def _pipeline(c, **kw):
  return pipeline.make_pipeline(c, tokenizer.load_tokenizer(c), **kw)


def _take(c, n, **kw):
  p = _pipeline(c, split="train", include_example_ids=True, **kw)
  return [next(p) for _ in range(n)]


def _epoch0_unpacked(c, seed):
  p = _pipeline(dataclasses.replace(c, packing=False), split="train", global_batch_size=1,
                seed=seed, include_example_ids=True)
  # One sequence per batch: every record of epoch 0 (none waits for a later epoch).
  return {int(b["example_ids"][0]): {k: v[0] for k, v in b.items()}
          for b in (next(p) for _ in range(p.steps_per_epoch))}


def test_packed_rows_hold_the_unpacked_sequences_and_masks(cfg):
  p = _pipeline(cfg, split="train", global_batch_size=16, seed=7, include_example_ids=True)
  rows = sum(r for _, _, r in p.epoch_rows(0))
  batches = [next(p) for _ in range(-(-rows // 16))]
  first = {k: np.concatenate([b[k] for b in batches])[:rows] for k in batches[0]}
  n = prepare.load_manifest(cfg, tokenizer.load_tokenizer(cfg))["splits"]["train"]["instances"]
  seqs = packing.unpack(first, L)
  # Epoch 0 packs every record exactly once; the rows after it begin epoch 1.
  assert sorted(s["example_ids"] for s in seqs) == list(range(n))
  assert first["masked_lm_positions"].shape[1] == 3 * 10  # S x M slots per row
  unpacked = _epoch0_unpacked(cfg, seed=7)
  for s in seqs:
    u = unpacked[s["example_ids"]]
    k = int(u["masked_lm_weights"].sum())
    # The same tokens (masked alike: masks are keyed by the sequence, not its row), segments,
    # predictions (the 15% rule per sequence) and label.
    np.testing.assert_array_equal(s["input_ids"], u["input_ids"][:u["input_mask"].sum()])
    np.testing.assert_array_equal(s["segment_ids"], u["segment_ids"][:u["input_mask"].sum()])
    np.testing.assert_array_equal(s["masked_lm_positions"], u["masked_lm_positions"][:k])
    np.testing.assert_array_equal(s["masked_lm_ids"], u["masked_lm_ids"][:k])
    assert s["next_sentence_labels"] == u["next_sentence_labels"]
  # 15% of each sequence's maskable tokens, over the packed rows as a whole too.
  maskable = ((first["input_mask"] == 1) & (first["input_ids"] != 2) & (first["input_ids"] != 3))
  assert abs(first["masked_lm_weights"].sum() / maskable.sum() - 0.15) < 0.01
  tokens = first["input_mask"].sum()
  # 94% of the positions hold tokens, against 70% with the same sequences one per row.
  assert tokens / first["input_mask"].size > 0.9 and tokens / (n * L) < 0.75
  assert len(seqs) / rows > 1.25 and first["sequence_ids"].max() == 3
  assert p.fill.sequences == n and p.fill.rows == rows and p.fill.tokens == tokens


@pytest.mark.parametrize("hosts", [1, 3])
def test_packed_restart_equals_uninterrupted(cfg, hosts):
  kw = dict(global_batch_size=6 * hosts, seed=5, process_index=hosts - 1, process_count=hosts)
  p = _pipeline(cfg, split="train", include_example_ids=True, **kw)
  per_epoch = sum(r for _, _, r in p.epoch_rows(0)) // 6  # steps in this host's epoch 0
  total = 2 * per_epoch + 4
  straight = [next(p) for _ in range(total)]
  # Inside the first window, inside the epoch, across the end of epoch 0, in epoch 1.
  for start in (1, per_epoch // 2 + 1, per_epoch - 1, per_epoch + 3):
    resumed = _take(cfg, 3, start_step=start, **kw)
    for a, b in zip(straight[start:], resumed):
      for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=f"start {start}, {k}")


def test_packed_hosts_read_disjoint_records(cfg):
  n = prepare.load_manifest(cfg, tokenizer.load_tokenizer(cfg))["splits"]["train"]["instances"]
  # Files mode (4 shards, 2 hosts): each host packs its own range of the epoch.
  seen = []
  for host in range(2):
    p = _pipeline(cfg, split="train", global_batch_size=8, process_index=host, process_count=2,
                  include_example_ids=True)
    rows = sum(r for _, _, r in p.epoch_rows(0))
    ids = np.concatenate([next(p)["example_ids"] for _ in range(-(-rows // 4))])[:rows]
    seen.append(ids[ids >= 0])
  assert len(seen[0]) == len(seen[1]) == n // 2
  assert not set(seen[0]) & set(seen[1])
  # Rows mode (4 shards, 5 hosts): all pack the same rows and keep their share of each batch.
  hosts = [_take(cfg, 6, global_batch_size=10, process_index=h, process_count=5)
           for h in range(5)]
  for step in range(6):
    ids = np.concatenate([h[step]["example_ids"] for h in hosts]).ravel()
    ids = ids[ids >= 0]
    assert len(ids) == len(set(ids)) > 10


def test_data_benchmark_figures(cfg, monkeypatch):
  from bertjax.benchmark import data as benchmark  # pylint: disable=import-outside-toplevel
  figures = {}
  for on in (False, True):
    figures[on] = benchmark.measure_pipeline(dataclasses.replace(cfg, packing=on),
                                             tokenizer.load_tokenizer(cfg), 16, seconds=0.5)
  assert figures[False]["sequences_per_row"] == 1 and 0.6 < figures[False]["fill"] < 0.75
  assert figures[True]["fill"] > 0.9 and figures[True]["sequences_per_row"] > 1.25
  for f in figures.values():
    assert f["tokens_per_s"] == pytest.approx(f["fill"] * L * f["rows_per_s"], rel=1e-6)
  table = benchmark.format_table([("test", L, "on", figures[True], 1.3)])
  assert "| test | 64 | on | 9" in table and "1.30x" in table
  # long_documents regroups the built-in corpus's sentences, in order, into documents of the size
  # asked for. Regrouping is held on a stand-in corpus (parsing the real one takes ~15 s; its size
  # and contents are tests/test_data_corpus.py's test_builtin_corpus).
  from bertjax.data.corpora import builtin_corpus  # pylint: disable=import-outside-toplevel
  stand_in = tuple(tuple(f"d{d} s{s}." for s in range(3 + d % 50)) for d in range(90))
  monkeypatch.setattr(builtin_corpus, "documents", lambda: stand_in)
  sentences = [s for d in stand_in for s in d]
  docs = benchmark.long_documents(200)
  assert len(docs[0]) == 200 and len(docs) == -(-len(sentences) // 200) > 10
  assert [s for d in docs for s in d] == sentences and all(len(d) == 200 for d in docs[:-1])
