"""How bertjax.predict batches a chunk (bertjax/predict.py): rows grouped with their neighbours in
length, padded little, every row once, outputs back in the input's order and to the same bits
as a row computed in the same group. The file-level check (1 and 8 devices write the same bytes)
is tests/test_finetune_custom.py::test_predict_on_one_and_eight_devices_writes_the_same_file."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bertjax import predict, taskspec
from bertjax.finetune import families
from bertjax.model import BertConfig


def test_bucket_widths_pad_at_most_8_tokens_or_a_quarter():
  widths = sorted({predict.bucket_width(n, 512) for n in range(1, 513)})
  assert widths[:9] == [8, 16, 24, 32, 40, 48, 56, 64, 80]
  assert len([w for w in widths if w <= 128]) == 12 and len(widths) == 20
  for n in range(1, 513):
    w = predict.bucket_width(n, 512)
    assert n <= w <= max(n + 7, n * 1.25)
  assert predict.bucket_width(300, 256) == 256  # capped at the features' width


@pytest.mark.parametrize("tokens", [16, 256, 1024])
def test_groups_take_every_row_once_within_capacity(tokens):
  rng = np.random.default_rng(0)
  lengths = np.clip(np.round(rng.lognormal(np.log(24), 0.6, 1024)), 1, 128).astype(int)
  groups = predict.length_groups(lengths, 128, tokens)
  rows = np.concatenate([g[0] for g in groups])
  assert sorted(rows.tolist()) == list(range(len(lengths)))
  for rows, width, capacity in groups:
    assert lengths[rows].max() <= width == predict.bucket_width(lengths[rows].max(), 128)
    assert 1 <= len(rows) <= capacity == max(1, tokens // width)
  # Neighbours in length: each group's rows are all no longer than the next group's.
  for (a, _, _), (b, _, _) in zip(groups, groups[1:]):
    assert lengths[a].max() <= lengths[b].min()
  if tokens == predict.TOKENS_PER_DEVICE:  # near the padding of batches of 64 sorted by length
    # (1.17x here), below that of rows padded alone to powers of two (1.43x), empty rows counted
    computed = sum(width * capacity for _, width, capacity in groups)
    assert computed / lengths.sum() < 1.2


def test_run_restores_the_order_and_matches_a_row_alone():
  cfg = BertConfig(vocab_size=40, hidden_size=16, num_layers=1, num_heads=2,
                   intermediate_size=32, max_position_embeddings=64, hidden_dropout=0.0,
                   attention_dropout=0.0)
  spec = taskspec.TaskSpec("t", "classification", ("a", "b", "c"), 64)
  model = families.get("classification").objective(spec).make_model(cfg)
  z = jnp.zeros((1, 8), jnp.int32)
  params = model.init(jax.random.PRNGKey(0), z, z, z)["params"]
  predictor = predict.Predictor(cfg, params, None, spec, tokens_per_device=64,
                                devices=jax.devices()[:2])
  rng = np.random.default_rng(1)
  lengths = rng.integers(1, 50, 37)
  mask = (np.arange(64)[None] < lengths[:, None]).astype(np.int32)
  features = {"input_ids": rng.integers(1, 40, (37, 64)).astype(np.int32) * mask,
              "input_mask": mask, "segment_ids": np.zeros_like(mask)}
  logits = predictor.run(features)["logits"]
  assert logits.shape == (37, 3) and predictor.sequences == 37
  # Each row's logits are its own: the model on that row alone, at its own length, agrees.
  for k in (0, 5, 36):
    n = int(lengths[k])
    alone = model.apply({"params": params}, *(features[key][k:k + 1, :n] for key in
                                              ("input_ids", "input_mask", "segment_ids")))
    np.testing.assert_allclose(logits[k], np.asarray(alone)[0], atol=1e-5)
  # Shuffled input, shuffled output: the same bits, row for row (the groups depend on lengths
  # and the order only breaks ties among rows of equal length, which share a shape anyway).
  perm = rng.permutation(37)
  again = predictor.run({key: v[perm] for key, v in features.items()})["logits"]
  np.testing.assert_array_equal(again, logits[perm])
