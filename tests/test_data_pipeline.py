"""The online pipeline: features, host sharding, exact restart, eval determinism."""

import numpy as np
import pytest

from bertjax.data import pipeline, prepare, tokenizer
from test_data_fixtures import data_config

KEYS = {"input_ids": np.int32, "input_mask": np.int32, "segment_ids": np.int32,
        "masked_lm_positions": np.int32, "masked_lm_ids": np.int32,
        "masked_lm_weights": np.float32, "next_sentence_labels": np.int32}


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
  c = data_config(tmp_path_factory.mktemp("pipe"), n_docs=60, sents_per_doc=25)
  prepare.ensure_prepared(c, tokenizer.load_tokenizer(c))
  return c


def _pipeline(c, **kw):
  return pipeline.make_pipeline(c, tokenizer.load_tokenizer(c), **kw)


def _take(c, n, **kw):
  kw.setdefault("split", "train")
  kw.setdefault("global_batch_size", 16)
  p = _pipeline(c, include_example_ids=True, **kw)
  return [next(p) for _ in range(n)] if n else list(p)


def test_features_shapes_segments_padding(cfg):
  tok = tokenizer.load_tokenizer(cfg)
  p = _pipeline(cfg, split="train", global_batch_size=32)
  b = next(p)
  assert set(b) == set(KEYS)
  for k, dt in KEYS.items():
    assert b[k].dtype == dt, k
  assert b["input_ids"].shape == (32, 64) and b["masked_lm_ids"].shape == (32, 10)
  assert b["next_sentence_labels"].shape == (32,)
  for r in range(32):
    ids, mask, seg = b["input_ids"][r], b["input_mask"][r], b["segment_ids"][r]
    n = int(mask.sum())
    assert mask[:n].all() and not mask[n:].any() and not ids[n:].any() and not seg[n:].any()
    seps = np.flatnonzero(ids[:n] == tok.sep_id)
    assert ids[0] == tok.cls_id and ids[n - 1] == tok.sep_id and len(seps) == 2
    assert not seg[:seps[0] + 1].any() and seg[seps[0] + 1:n].all()
  assert set(np.unique(b["next_sentence_labels"])) <= {0, 1}


def _rows(batches):
  return np.concatenate([b["example_ids"] for b in batches])


def test_host_slices_disjoint_and_complete_rows_mode(cfg):
  # One eval shard, two hosts: each reads everything and keeps its rows of each global batch.
  single = _take(cfg, 0, split="eval", global_batch_size=8)
  hosts = [_take(cfg, 0, split="eval", global_batch_size=8, process_index=p, process_count=2)
           for p in range(2)]
  assert len(hosts[0]) == len(hosts[1]) == len(single) > 3
  for s, h0, h1 in zip(single, hosts[0], hosts[1]):
    for k in KEYS:
      assert np.array_equal(np.concatenate([h0[k], h1[k]]), s[k]), k
  n = prepare.load_manifest(cfg, tokenizer.load_tokenizer(cfg))["splits"]["eval"]["instances"]
  ids0, ids1 = _rows(hosts[0]), _rows(hosts[1])
  assert not set(ids0) & set(ids1)
  assert sorted(np.concatenate([ids0, ids1])) == list(range(len(single) * 8))
  assert n - len(single) * 8 < 8  # only the last partial global batch is left out


@pytest.mark.parametrize("hosts", [2, 3])
def test_host_slices_disjoint_and_complete_files_mode(cfg, hosts):
  m = prepare.load_manifest(cfg, tokenizer.load_tokenizer(cfg))
  n = m["splits"]["train"]["instances"]
  G = 4 * hosts
  per_host = []
  for p in range(hosts):
    pipe = _pipeline(cfg, split="train", global_batch_size=G, process_index=p,
                     process_count=hosts, include_example_ids=True)
    per_host.append(_rows([next(pipe) for _ in range(pipe.steps_per_epoch)]))
  assert len({len(h) for h in per_host}) == 1
  union = set(np.concatenate(per_host))
  assert len(union) == sum(map(len, per_host)) and union <= set(range(n))  # disjoint
  # Equal record ranges: less than one global batch (plus rounding) waits for a later epoch,
  # however the 4 shards divide among the hosts.
  assert n - len(union) < G + hosts, (n, len(union))


def test_uneven_shards_on_many_hosts_leave_at_most_a_batch_per_epoch():
  # 16 shards on 12 hosts: whole files per host would leave about a quarter of each epoch unread.
  counts = [1000 + 37 * k for k in range(16)]
  manifest = {"dir": "/d", "splits": {"train": {"files": [f"s{k}" for k in range(16)],
                                                "counts": counts}}}
  n, G = sum(counts), 12 * 32
  plans = [pipeline.epoch_plan(manifest, "train", epoch=3, seed=0, shuffle=True,
                               global_batch_size=G, process_index=p, process_count=12)
           for p in range(12)]
  assert len({pl.steps for pl in plans}) == 1
  assert n - plans[0].steps * G < G and (n - plans[0].steps * G) / n < 0.01
  # The ranges tile the stream: each host's first record follows the previous host's range.
  starts = [pl.bases[0] + pl.skip for pl in plans]
  assert len(set(starts)) == 12


def test_restart_of_one_host_among_three(cfg):
  kw = dict(split="train", global_batch_size=12, process_index=1, process_count=3, seed=5)
  p = _pipeline(cfg, include_example_ids=True, **kw)
  straight = [next(p) for _ in range(p.steps_per_epoch + 3)]
  resumed = _take(cfg, 5, start_step=p.steps_per_epoch - 2, **kw)
  for a, b in zip(straight[p.steps_per_epoch - 2:], resumed):
    for k in b:
      assert np.array_equal(a[k], b[k]), k


def test_restart_at_step_n_equals_uninterrupted(cfg):
  p = _pipeline(cfg, split="train", global_batch_size=16, seed=7, include_example_ids=True)
  steps = p.steps_per_epoch
  straight = [next(p) for _ in range(2 * steps + 5)]
  for start in (3, steps // 2 + 1, steps + 2, 2 * steps):
    resumed = _take(cfg, 2 * steps + 5 - start, global_batch_size=16, seed=7, start_step=start)
    for a, b in zip(straight[start:], resumed):
      for k in b:
        assert np.array_equal(a[k], b[k]), (start, k)
  # A second epoch reorders and re-masks.
  e0, e1 = straight[:steps], straight[steps:2 * steps]
  assert not np.array_equal(_rows(e0), _rows(e1))
  masks = {}
  for epoch, batches in enumerate((e0, e1)):
    for b in batches:
      for i, ex in enumerate(b["example_ids"]):
        masks[(epoch, ex)] = tuple(b["masked_lm_positions"][i])
  common = [ex for (e, ex) in masks if e == 0 and (1, ex) in masks]
  assert len(common) > 50
  assert np.mean([masks[(0, ex)] == masks[(1, ex)] for ex in common]) < 0.1
  # Another seed, another order.
  other = _take(cfg, 2, global_batch_size=16, seed=8)
  assert not np.array_equal(_rows(other), _rows(straight[:2]))


def test_eval_is_deterministic_and_finite(cfg):
  a = _take(cfg, 0, split="eval", global_batch_size=8, seed=3)
  b = _take(cfg, 0, split="eval", global_batch_size=8, seed=3)
  p = _pipeline(cfg, split="eval", global_batch_size=8, seed=3)
  assert len(a) == p.steps_per_epoch > 0
  for x, y in zip(a, b):
    for k in x:
      assert np.array_equal(x[k], y[k])


def test_masking_rate_through_the_pipeline(cfg):
  tok = tokenizer.load_tokenizer(cfg)
  batches = _take(cfg, 20, global_batch_size=32)
  picked = sum(b["masked_lm_weights"].sum() for b in batches)
  maskable = sum(((b["input_mask"] == 1) & (b["input_ids"] != tok.cls_id) &
                  (b["input_ids"] != tok.sep_id)).sum() for b in batches)
  assert abs(picked / maskable - 0.15) < 0.01


def test_bad_batch_and_split(cfg):
  with pytest.raises(ValueError, match="global_batch_size 10 must be a positive multiple of "
                                       "process_count 4"):
    _pipeline(cfg, split="train", global_batch_size=10, process_count=4)
  with pytest.raises(ValueError, match="split must be"):
    _pipeline(cfg, split="test", global_batch_size=8)
  with pytest.raises(ValueError, match="not one batch"):
    _pipeline(cfg, split="eval", global_batch_size=1 << 16)


def test_mlm_only_mode(tmp_path):
  c = data_config(tmp_path, nsp=False)
  prepare.ensure_prepared(c, tokenizer.load_tokenizer(c))
  b = next(_pipeline(c, split="train", global_batch_size=16))
  assert not b["next_sentence_labels"].any() and not b["segment_ids"].any()
  assert b["input_mask"].mean() > 0.9
