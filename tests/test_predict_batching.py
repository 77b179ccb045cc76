"""How bertjax.predict batches a chunk (bertjax/predict/predictor.py, bertjax/predict/rows.py): rows
grouped with their neighbours in length, padded little, every row once, outputs back in the input's
order and to the same bits as a row computed in the same group; sequence-level heads with several
texts packed into a row and the last layer at their [CLS] positions only, as a text computed
alone. The file-level check (1 and 8 devices write the same bytes) is tests/test_finetune_custom.py::test_predict_on_one_and_eight_devices_writes_the_same_file."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bertjax.finetune import families
from bertjax.formats import taskspec
from bertjax.model import attention
from bertjax.model.config import BertConfig
from bertjax.model.encoder import BertModel
from bertjax.predict import predictor as predict, rows as prediction_rows

# A ModernBERT-shaped encoder: pre-LN, RoPE, no segment table, a local last layer (global_every=2
# with 2 layers), its task head.
MODERN = dict(norm_position="pre", position_embedding="rope", pooler=False, type_vocab_size=0,
              global_every=2, local_window=4, task_head="modernbert")


def _drawn(model, *inputs, seed=0):
  """Parameters of the model's shapes drawn on the host: kernels, embeddings and biases
  N(0, 0.02), norm scales 1 + N(0, 0.02). Compiling the model's own init (or running it op by
  op) costs seconds of CPU a model, and nothing here tests it."""
  rng = np.random.default_rng(seed)
  abstract = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), *inputs)["params"])

  def one(path, leaf):
    base_value = 1.0 if jax.tree_util.keystr(path[-1:]) == "['scale']" else 0.0
    return jnp.asarray(base_value + 0.02 * rng.normal(size=leaf.shape), leaf.dtype)

  return jax.tree_util.tree_map_with_path(one, abstract)


def _lengths(n, seed=0):
  rng = np.random.default_rng(seed)
  return np.clip(np.round(rng.lognormal(np.log(24), 0.6, n)), 1, 128).astype(int)


def test_bucket_widths_pad_at_most_8_tokens_or_a_quarter():
  widths = sorted({prediction_rows.bucket_width(n, 512) for n in range(1, 513)})
  assert widths[:9] == [8, 16, 24, 32, 40, 48, 56, 64, 80]
  assert len([w for w in widths if w <= 128]) == 12 and len(widths) == 20
  for n in range(1, 513):
    w = prediction_rows.bucket_width(n, 512)
    assert n <= w <= max(n + 7, n * 1.25)
  assert prediction_rows.bucket_width(300, 256) == 256  # capped at the features' width


@pytest.mark.parametrize("tokens", [16, 256, 1024])
def test_groups_take_every_row_once_within_capacity(tokens):
  lengths = _lengths(1024)
  groups = prediction_rows.length_groups(lengths, 128, tokens)
  rows = np.concatenate([g[0] for g in groups])
  assert sorted(rows.tolist()) == list(range(len(lengths)))
  for rows, width, capacity in groups:
    assert lengths[rows].max() <= width == prediction_rows.bucket_width(lengths[rows].max(), 128)
    # Full groups hold tokens // width rows; one cut short, the power of two above its count.
    assert 1 <= len(rows) <= capacity == min(max(1, tokens // width),
                                             1 << (len(rows) - 1).bit_length())
  # Neighbours in length: each group's rows are all no longer than the next group's.
  for (a, _, _), (b, _, _) in zip(groups, groups[1:]):
    assert lengths[a].max() <= lengths[b].min()
  if tokens == predict.TOKENS_PER_DEVICE:  # near the padding of batches of 64 sorted by length
    # (1.17x here), below that of rows padded alone to powers of two (1.43x), empty rows counted
    computed = sum(width * capacity for _, width, capacity in groups)
    assert computed / lengths.sum() < 1.2


@pytest.mark.parametrize("width", [16, prediction_rows.PACK_WIDTH, 128])
def test_packed_rows_take_every_text_once_within_the_width(width):
  lengths = _lengths(1024, seed=width)
  rows = prediction_rows.pack(lengths, width)
  assert sorted(np.concatenate(rows).tolist()) == list(range(len(lengths)))
  for row in rows:
    assert 1 <= len(row) <= prediction_rows.MAX_PER_ROW
    assert lengths[row].sum() <= width or len(row) == 1  # a longer text is a row alone
  if width == prediction_rows.PACK_WIDTH:  # less than length_groups' 1.2x (above), empty rows in
    features = {"input_ids": np.zeros((len(lengths), 128), np.int32),
                "input_mask": (np.arange(128)[None] < lengths[:, None]).astype(np.int32)}
    features["segment_ids"] = features["input_ids"]
    calls = list(prediction_rows.packed_calls(features, predict.TOKENS_PER_DEVICE, 1))
    assert sum(arrays[0].size for arrays, _, _ in calls) / lengths.sum() < 1.12
    for arrays, texts, at_out in calls:  # each text's [CLS] slot holds its first token
      ids, mask, _, sequence_ids, cls = arrays
      row, slot = np.divmod(at_out, cls.shape[1])
      assert (mask[row, cls[row, slot]] == 1).all()
      assert (sequence_ids[row, cls[row, slot]] == slot + 1).all()


@pytest.mark.parametrize("kw", [{}, MODERN], ids=["bert", "modern"])
def test_the_last_layer_at_query_positions_is_every_position_then_picked(kw):
  cfg = BertConfig(vocab_size=50, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                   max_position_embeddings=64, **kw)
  model = BertModel(cfg)
  rng = np.random.default_rng(0)
  ids = rng.integers(5, 50, (3, 16))
  mask = np.ones((3, 16), np.int32)
  mask[2, 10:] = 0
  sequence_ids = np.array([[1] * 5 + [2] * 6 + [3] * 5, [1] * 16, [1] * 4 + [2] * 6 + [0] * 6])
  queries = np.array([[0, 5, 11], [0, 0, 0], [0, 4, 4]])
  params = _drawn(model, ids, mask)
  # Compiled as one program each (op by op, every operation would be a compile of its own).
  apply = jax.jit(model.apply, static_argnums=(6,))
  every, _ = apply({"params": params}, ids, mask, None, None, sequence_ids)
  picked, pooled = apply({"params": params}, ids, mask, None, None, sequence_ids, True, queries)
  assert picked.shape == pooled.shape == (3, 3, 32)
  np.testing.assert_allclose(picked, attention.gather_positions(every, jnp.asarray(queries)),
                             atol=1e-6)


@pytest.mark.parametrize("family,kw", [("classification", {}), ("regression", {}),
                                       ("classification", MODERN)],
                         ids=["classification", "regression", "modern"])
def test_run_restores_the_order_and_matches_a_row_alone(family, kw, monkeypatch):
  cfg = BertConfig(vocab_size=40, hidden_size=16, num_layers=2, num_heads=2,
                   intermediate_size=32, max_position_embeddings=64, hidden_dropout=0.0,
                   attention_dropout=0.0, **kw)
  spec = taskspec.TaskSpec("t", family, ("a", "b", "c") if family == "classification" else (),
                           64)
  model = families.get(family).objective(spec).make_model(cfg)
  z = jnp.zeros((1, 8), jnp.int32)
  params = _drawn(model, z, z, z)
  predictor = predict.Predictor(cfg, params, None, spec, tokens_per_device=64,
                                devices=jax.devices()[:2])
  rng = np.random.default_rng(1)
  lengths = rng.integers(1, 50, 37)
  mask = (np.arange(64)[None] < lengths[:, None]).astype(np.int32)
  # Pairs: a second segment from the middle of each row on (BERT's segment table reads it).
  segments = (np.arange(64)[None] >= lengths[:, None] // 2).astype(np.int32) * mask
  features = {"input_ids": rng.integers(1, 40, (37, 64)).astype(np.int32) * mask,
              "input_mask": mask, "segment_ids": segments if not kw else np.zeros_like(mask)}
  assert predictor.packs()
  out = "logits" if family == "classification" else "score"
  logits = predictor.run(features)[out]
  assert logits.shape == ((37, 3) if family == "classification" else (37,))
  assert predictor.sequences == 37
  # Calls waited for on two threads give the bits of calls made one at a time.
  monkeypatch.setattr(predict, "CONCURRENT_CALLS", 1)
  np.testing.assert_array_equal(predictor.run(features)[out], logits)
  # Each row's logits are its own: the model on that row alone, at its own length, agrees.
  apply = jax.jit(model.apply)
  for k in (0, 5, 36):
    n = int(lengths[k])
    alone = apply({"params": params}, *(features[key][k:k + 1, :n] for key in
                                        ("input_ids", "input_mask", "segment_ids")))
    np.testing.assert_allclose(logits[k], np.asarray(alone).reshape(logits[k].shape), atol=1e-5)
  # Shuffled input, shuffled output (the groups and packed rows depend on the lengths; the order
  # only breaks ties among texts of equal length, and a packed text taking its twin's place in a
  # row may round differently in the last bit: within 1e-6, not bit for bit).
  perm = rng.permutation(37)
  again = predictor.run({key: v[perm] for key, v in features.items()})[out]
  np.testing.assert_allclose(again, logits[perm], atol=1e-6)


def test_cls_vectors_are_packed_and_each_text_s_own():
  cfg = BertConfig(vocab_size=40, hidden_size=16, num_layers=2, num_heads=2,
                   intermediate_size=32, max_position_embeddings=64)
  model = BertModel(cfg)
  z = jnp.zeros((1, 8), jnp.int32)
  params = _drawn(model, z, z, z)
  predictor = predict.Predictor(cfg, params, None, None, tokens_per_device=64)
  rng = np.random.default_rng(2)
  lengths = rng.integers(1, 30, 21)
  mask = (np.arange(32)[None] < lengths[:, None]).astype(np.int32)
  features = {"input_ids": rng.integers(1, 40, (21, 32)).astype(np.int32) * mask,
              "input_mask": mask, "segment_ids": np.zeros_like(mask)}
  assert predictor.packs("cls") and not predictor.packs("mean")
  vectors = predictor.run(features, "cls")["vector"]
  assert vectors.shape == (21, 16)
  apply = jax.jit(model.apply)
  for k in (0, 7, 20):
    n = int(lengths[k])
    _, pooled = apply({"params": params}, *(features[key][k:k + 1, :n] for key in
                                            ("input_ids", "input_mask", "segment_ids")))
    np.testing.assert_allclose(vectors[k], np.asarray(pooled)[0], atol=1e-5)
