"""ModernBERT's task heads in and out, against transformers' own classes with random weights.

ModernBertForSequenceClassification (pooling "cls" and "mean"; a regression head),
ModernBertForTokenClassification and ModernBertForQuestionAnswering saved by transformers are read
by bertjax as they are: their logits (padded and unpadded rows, single texts and pairs) equal
PyTorch's within 1e-4, `bertjax.predict` takes the folder as a workdir, a fine-tuning run starts
from a ModernBERT folder with the prediction head transformers would start with, and the export
of a fine-tuned modern workdir loads in transformers, without a warning, to the same logits.
Inputs longer than 512 tokens go through the local/global layers alike (fine-tuning and
prediction at 1,024 tokens, local window 128).
"""

import dataclasses
import json
import logging
import os

import flax.linen as nn
import jax
import numpy as np
import pytest
import torch
import transformers

from bertjax.convert import modernbert as convert_modernbert
from bertjax.data import tokenizer as tokenizer_lib
from bertjax.finetune import families
from bertjax.formats import modernbert, modernbert_tasks, taskspec
from bertjax.inputs import pairs, textfiles
from bertjax.model import heads
from bertjax.predict import predictor as predict
from bertjax.weights import reader as weights
from test_convert_modernbert import randomised
from test_data_fixtures import WORDS, write_vocab

VOCAB = 5 + 2 + len(WORDS) + 3  # test_data_fixtures.write_vocab's pieces
# 3 layers, layer 1 local with a window of 8 over rows of 24: the window cuts.
BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
            num_attention_heads=2, max_position_embeddings=64, global_attn_every_n_layers=2,
            local_attention=8, global_rope_theta=160000.0, local_rope_theta=10000.0,
            pad_token_id=0, bos_token_id=2, eos_token_id=3, cls_token_id=2, sep_token_id=3,
            reference_compile=False)
# Every bias on and another activation: the head's dense bias and its norm's bias are read too.
BIASES = dict(attention_bias=True, mlp_bias=True, norm_bias=True, classifier_bias=True,
              classifier_activation="gelu_pytorch_tanh")
LABELS = ("neg", "pos", "mixed")
TAGS = ("O", "B-PER", "I-PER")
HEADS = {
    "cls": ("ModernBertForSequenceClassification",
            dict(classifier_pooling="cls", id2label=dict(enumerate(LABELS)))),
    "mean": ("ModernBertForSequenceClassification",
             dict(classifier_pooling="mean", id2label=dict(enumerate(LABELS)), **BIASES)),
    "regression": ("ModernBertForSequenceClassification",
                   dict(num_labels=1, problem_type="regression")),
    "tagging": ("ModernBertForTokenClassification", dict(id2label=dict(enumerate(TAGS)), **BIASES)),
    "span": ("ModernBertForQuestionAnswering", {}),
}
FAMILY = {"cls": "classification", "mean": "classification", "regression": "regression",
          "tagging": "tagging", "span": "span"}


def _randomised(model, seed=0):
  torch.manual_seed(seed)
  return randomised(model)


def _torch_model(cls_name, extra, **base):
  config = transformers.ModernBertConfig(**{**BASE, **base, **extra})
  config._attn_implementation = "eager"  # pylint: disable=protected-access
  return _randomised(getattr(transformers, cls_name)(config))


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
  return write_vocab(str(tmp_path_factory.mktemp("vocab") / "vocab.txt"))


@pytest.fixture(scope="module")
def folders(tmp_path_factory, vocab):
  """Each task class saved by transformers, with the test's vocab.txt beside it."""
  out = {}
  for name, (cls_name, extra) in HEADS.items():
    folder = tmp_path_factory.mktemp(f"modernbert_{name}")
    model = _torch_model(cls_name, extra)
    model.save_pretrained(folder)
    (folder / "vocab.txt").write_text(open(vocab).read())
    out[name] = (model, str(folder))
  return out


def _texts(tokenizer, pair: bool, length=24):
  rng = np.random.default_rng(3)
  a = [" ".join(rng.choice(WORDS, n)) for n in (3, 9, 30)]
  b = [" ".join(rng.choice(WORDS, n)) for n in (4, 2, 12)] if pair else None
  features, _ = pairs.encode_pairs(a, b, tokenizer, length)
  return features


def _batches(tokenizer):
  """(ids, mask, segments) of one batch: three single texts and three pairs, padded (rows of 5
  to 24 tokens), and three rows without padding (every row full)."""
  singles, doubles = _texts(tokenizer, False), _texts(tokenizer, True)
  full = np.random.default_rng(4).integers(7, VOCAB, size=(3, 24)).astype(np.int32)
  return tuple(np.concatenate([singles[k], doubles[k], v]) for k, v in (
      ("input_ids", full), ("input_mask", np.ones_like(full)),
      ("segment_ids", np.zeros_like(full))))


def _theirs(model, ids, mask):
  with torch.no_grad():
    out = model(input_ids=torch.tensor(ids, dtype=torch.long),
                attention_mask=torch.tensor(mask, dtype=torch.long))
  if hasattr(out, "start_logits"):
    return out.start_logits.numpy(), out.end_logits.numpy()
  return out.logits.numpy()


def _ours(source, params, ids, mask, segments):
  spec = families.spec_of(source)
  model = families.get(spec.family).objective(spec).make_model(source.config)
  out = model.apply({"params": params}, ids, mask, segments)
  return tuple(np.asarray(o) for o in out) if isinstance(out, tuple) else np.asarray(out)


def _assert_close(ours, theirs, mask, per_token, substance=0.5):
  if isinstance(ours, tuple):
    for o, t in zip(ours, theirs):
      _assert_close(o, t, mask, per_token, substance)
    return
  real = mask.astype(bool) if per_token else slice(None)  # padding's logits mean nothing
  assert np.abs(theirs[real]).max() > substance  # logits of substance
  np.testing.assert_allclose(ours[real], theirs[real], atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", list(HEADS))
def test_imported_heads_match_transformers(folders, vocab, name):
  model, folder = folders[name]
  source = weights.inspect(folder)
  spec = families.spec_of(source)
  assert source.kind == "modernbert" and spec.family == FAMILY[name]
  assert source.subtrees == ("bert", heads.PREDICTION_HEAD, families.get(spec.family).head)
  assert source.config.task_head == "modernbert"
  if spec.family in ("classification", "tagging"):
    assert spec.labels == (LABELS if spec.family == "classification" else TAGS)
  params = weights.read(source)
  ids, mask, segments = _batches(tokenizer_lib.load_vocabulary(vocab, "wordpiece", True))
  assert segments.any() and not mask.all() and mask[-3:].all()
  ours = _ours(source, params, ids, mask, segments)
  _assert_close(ours, _theirs(model, ids, mask), mask, per_token=spec.family in ("tagging", "span"))
  if name == "mean":  # and transformers' other attention on a CPU, on the folder as saved
    sdpa = getattr(transformers, HEADS[name][0]).from_pretrained(folder, attn_implementation="sdpa")
    assert sdpa.config._attn_implementation == "sdpa"  # pylint: disable=protected-access
    _assert_close(ours, _theirs(sdpa.eval(), ids, mask), mask, per_token=False)


def test_pooling_and_the_head_norm_each_count(folders):
  """cls and mean pooling give other logits, and the prediction head's norm is in the path: the
  parity above could not hold with either swapped or skipped."""
  _, folder = folders["cls"]
  source = weights.inspect(folder)
  params = weights.read(source)
  ids, mask, segments = _batches(tokenizer_lib.load_vocabulary(
      os.path.join(folder, "vocab.txt"), "wordpiece", True))
  cls = _ours(source, params, ids, mask, segments)
  mean = _ours(dataclasses.replace(source, config=dataclasses.replace(
      source.config, classifier_pooling="mean")), params, ids, mask, segments)
  assert np.abs(cls - mean).max() > 1e-2
  scaled = jax.tree.map(np.copy, params)
  scaled[heads.PREDICTION_HEAD]["transform_layer_norm"]["scale"] *= 2.0
  assert np.abs(_ours(source, scaled, ids, mask, segments) - cls).max() > 1e-2


def _row(values):
  row = textfiles.Row(values)
  row.where = "a test's row"
  return row


def test_predict_takes_the_folder_as_a_workdir(folders, vocab):
  """`bertjax.predict` on the Hugging Face folder as it is: its labels, and probabilities equal
  to the softmax of transformers' logits on the same ids (single texts and pairs)."""
  model, folder = folders["cls"]
  predictor = predict.Predictor.from_workdir(folder, tokens_per_device=64,
                                             devices=jax.devices()[:1])
  tokenizer = predictor.tokenizer
  texts = [" ".join(WORDS[i:i + n]) for i, n in ((0, 3), (10, 12))]
  seconds = [" ".join(WORDS[i:i + n]) for i, n in ((40, 5), (60, 2))]
  for b in (None, seconds):
    records = predictor(texts if b is None else list(zip(texts, b)))
    if b is not None:  # a pair reads its second text from the column --text_b names
      records = list(predictor.predict_rows(
          [_row({"text": x, "second": y}) for x, y in zip(texts, b)], {"text_b": "second"}))
    f, _ = pairs.encode_pairs(texts, b, tokenizer, 64)
    logits = _theirs(model, f["input_ids"], f["input_mask"])
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    for record, p in zip(records, probs):
      assert record["label"] == LABELS[int(np.argmax(p))]
      np.testing.assert_allclose([record["probabilities"][n] for n in LABELS], p, atol=1e-4)


def test_span_windows_shorter_than_the_context(folders, vocab):
  """A context longer than the window is read in windows (doc_stride): each window's logits are
  transformers' on the same ids, and the answer is a span of the context."""
  model, folder = folders["span"]
  predictor = predict.Predictor.from_workdir(folder, tokens_per_device=128,
                                             devices=jax.devices()[:1])
  context = " ".join(WORDS[100:150])
  row = {"question": " ".join(WORDS[:3]), "context": context}
  spec = taskspec.TaskSpec(**{**predictor.spec.to_dict(), "labels": (), "max_seq_length": 24,
                              "doc_stride": 8, "max_query_length": 6})
  got = []

  def run(features):
    got.append(features)
    return predictor.run(features)

  records = families.get("span").records([_row(row)], spec, predictor.tokenizer, run)
  f = got[0]
  assert len(f["input_ids"]) > 3  # several windows
  ours = predictor.run(f)
  start, end = _theirs(model, f["input_ids"], f["input_mask"])
  real = f["input_mask"].astype(bool)
  np.testing.assert_allclose(ours["start_logits"][real], start[real], atol=1e-4, rtol=0)
  np.testing.assert_allclose(ours["end_logits"][real], end[real], atol=1e-4, rtol=0)
  assert records[0]["answer"] in context


def test_exported_task_folder_round_trips(folders, tmp_path):
  """A task class imported (with its labels, as task.json) exports as the same class: its
  tensors bit for bit, its labels."""
  model, folder = folders["tagging"]
  convert_modernbert.import_folder(folder, str(tmp_path / "imported"), scan_layers=True)
  said = convert_modernbert.export_folder(str(tmp_path / "imported"), str(tmp_path / "out"))
  assert "ModernBertForTokenClassification, 3 labels" in said
  back = json.loads((tmp_path / "out" / "config.json").read_text())
  assert back["id2label"] == {str(i): t for i, t in enumerate(TAGS)}
  theirs = {k: v.numpy() for k, v in model.state_dict().items()}
  from safetensors.numpy import load_file  # pylint: disable=import-outside-toplevel
  ours = load_file(str(tmp_path / "out" / "model.safetensors"))
  assert set(ours) == set(theirs)
  for k, v in ours.items():
    assert np.array_equal(v, theirs[k]), k


# Fine-tuning from a ModernBERT folder, prediction and export -----------------------------------

def _write_csv(path, rows):
  import csv  # pylint: disable=import-outside-toplevel
  with open(path, "w", newline="", encoding="utf-8") as f:
    w = csv.writer(f)
    w.writerow(["text", "label"])
    w.writerows(rows)
  return str(path)


def _classification_rows(n, seed, words):
  """label "pos" iff the text holds WORDS[0]; texts of about `words` words."""
  rng = np.random.default_rng(seed)
  rows = []
  for i in range(n):
    text = list(rng.choice(WORDS[10:], words))
    if i % 2 == 0:
      text[int(rng.integers(len(text)))] = WORDS[0]
    rows.append((" ".join(text), "pos" if i % 2 == 0 else "neg"))
  return rows


def _mlm_folder(root, vocab, **base):
  folder = root / "modernbert_mlm"
  model = _randomised(transformers.ModernBertForMaskedLM(
      transformers.ModernBertConfig(**{**BASE, **base})), seed=5)
  model.save_pretrained(folder)
  (folder / "vocab.txt").write_text(open(vocab).read())
  return str(folder)


def _finetune(tmp_path, monkeypatch, init_from, words, length, **model):
  from bertjax.finetune.job import run  # pylint: disable=import-outside-toplevel
  from finetune_fixtures import Builds  # pylint: disable=import-outside-toplevel
  from bertjax.configs import finetune as finetune_config  # pylint: disable=import-outside-toplevel
  config = finetune_config.get_config("classification")
  config.checkpoint.init_from = init_from
  d = config.data
  d.train_file = _write_csv(tmp_path / "train.csv", _classification_rows(8, 0, words))
  d.dev_file = _write_csv(tmp_path / "dev.csv", _classification_rows(4, 1, words))
  d.max_seq_length = length
  t = config.train
  t.batch_size, t.num_epochs, t.learning_rate, t.log_every_steps = 4, 1, 1e-3, 1
  for k, v in model.items():
    config.model[k] = v
  builds = Builds(monkeypatch, devices=jax.devices()[:1])
  workdir = str(tmp_path / "ft")
  assert run.finetune(config, workdir)["evaluations"]
  return workdir, builds


def _export_and_load(workdir, out):
  """The workdir exported as ModernBertForSequenceClassification and loaded by transformers,
  with what transformers logged at WARNING or above while loading it."""
  said = convert_modernbert.export_folder(workdir, str(out))
  assert "ModernBertForSequenceClassification, 2 labels" in said
  records = []
  handler = logging.Handler()
  handler.emit = records.append
  hf_logger = logging.getLogger("transformers")
  hf_logger.addHandler(handler)
  try:
    model, info = transformers.ModernBertForSequenceClassification.from_pretrained(
        out, attn_implementation="eager", output_loading_info=True)
  finally:
    hf_logger.removeHandler(handler)
  assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
  return model.eval(), [r.getMessage() for r in records if r.levelno >= logging.WARNING]


def test_finetune_long_inputs_from_a_modernbert_folder_then_export(tmp_path, monkeypatch, vocab):
  """A classification run from a ModernBERT masked LM at 1,024 tokens (beyond BERT's 512), its
  local layers' window 128: the prediction head starts as the MLM transform (as transformers
  starts it), mean pooling as asked; predictions at that length (nothing truncated under it);
  the workdir exports as ModernBertForSequenceClassification, which transformers loads without a
  warning to the logits bertjax computes at 1,024 tokens (padded and not)."""
  long = dict(max_position_embeddings=2048, local_attention=128, num_hidden_layers=2,
              hidden_size=16, intermediate_size=24)
  folder = _mlm_folder(tmp_path, vocab, **long)
  workdir, builds = _finetune(tmp_path, monkeypatch, folder, 1000, 1024, classifier_pooling="mean")
  mlm = modernbert.load_dir(folder)[1]["mlm"]
  first = builds.first_params[heads.PREDICTION_HEAD]
  for part in ("transform", "transform_layer_norm"):
    for k, v in mlm[part].items():
      np.testing.assert_array_equal(first[part][k], v)

  predictor = predict.Predictor.from_workdir(workdir, tokens_per_device=2048,
                                             devices=jax.devices()[:1])
  assert predictor.spec.max_seq_length == 1024 and predictor.config.local_window == 128
  texts = [text for text, _ in _classification_rows(2, 2, 1000)]
  records = predictor(texts + [texts[0] + " " + texts[1]])  # 1,002 tokens, 1,002, 2,002
  assert [bool(r.get("truncated")) for r in records] == [False, False, True]

  model, warned = _export_and_load(workdir, tmp_path / "export")
  assert not warned, warned
  hf_config = json.loads((tmp_path / "export" / "config.json").read_text())
  assert hf_config["classifier_pooling"] == "mean" and hf_config["local_attention"] == 128
  assert hf_config["problem_type"] == "single_label_classification"
  assert hf_config["label2id"] == {"neg": 0, "pos": 1}
  source = weights.inspect_trained(workdir)
  assert source.config.task_head == "modernbert"
  params = weights.read(source)
  ids = np.random.default_rng(6).integers(7, VOCAB, size=(2, 1024)).astype(np.int32)
  mask = np.ones_like(ids)
  mask[1, 700:] = 0
  # A new classifier starts at 0.02: small logits, still 100 times the tolerance.
  _assert_close(_ours(source, params, ids, mask, np.zeros_like(ids)), _theirs(model, ids, mask),
                mask, per_token=False, substance=0.01)


def test_what_has_no_form_is_refused_naming_the_fix():
  from bertjax.formats import hf  # pylint: disable=import-outside-toplevel
  from bertjax.model.config import BertConfig  # pylint: disable=import-outside-toplevel
  with pytest.raises(ValueError, match="classifier_pooling='mean' is the ModernBERT head's"):
    BertConfig(classifier_pooling="mean")
  modern = modernbert.config_from_modernbert(BASE)
  assert modern.task_head == "modernbert" and modern.classifier_pooling == "cls"
  with pytest.raises(ValueError, match="task_head=modernbert to export"):
    modernbert_tasks.task_config(dataclasses.replace(modern, task_head="bert"), cls=HEADS["cls"][0],
                           outputs=len(LABELS), labels=LABELS)
  with pytest.raises(ValueError, match="convert.modernbert export"):
    hf.task_to_hf({}, dataclasses.replace(BertConfig(), task_head="modernbert"),
                  head="classifier", hf_class="BertForSequenceClassification",
                  hf_head="classifier", outputs=len(LABELS), labels=LABELS)
  # A class's task is the folder's to say and fine-tuning's to read: a multi-label head has no
  # family (its encoder is still taken).
  multi_label = hf.task_class({**BASE, "problem_type": "multi_label_classification",
                               "id2label": {"0": "a", "1": "b"}}, HEADS["cls"][0])
  with pytest.raises(ValueError, match="multi_label_classification"):
    families.spec_of(weights.Weights("/nowhere", "modernbert", modern, ("bert",),
                                     task_class=multi_label))
  with pytest.raises(ValueError, match="names none of"):
    modernbert_tasks.heads_in(["classifier.weight"], {"architectures": ["ModernBertForMaskedLM"]})
  with pytest.raises(ValueError, match="id2label has ids"):
    hf.task_class({"architectures": [HEADS["tagging"][0]], "id2label": {"0": "O", "2": "B-X"}},
                  HEADS["tagging"][0])


@pytest.mark.parametrize("family", ["tagging", "span"])
def test_every_family_starts_from_a_modernbert_folder_as_transformers(tmp_path, vocab, family):
  """What a tagging or span run starts from (the classification run above trains): the folder's
  encoder, the prediction head from its MLM transform, a new classifier of the family's width."""
  from bertjax.finetune.job import init_from  # pylint: disable=import-outside-toplevel
  folder = _mlm_folder(tmp_path, vocab)
  source = weights.inspect(folder)
  spec = taskspec.TaskSpec(family, family, TAGS if family == "tagging" else ())
  fam = families.get(family)
  model = fam.objective(spec).make_model(source.config)
  ids = np.zeros((1, 8), np.int32)
  # What a run's init hands the loader, its values aside (each is replaced or is the new head,
  # whose shape alone is checked): the model's init traced for shapes, neither run nor compiled.
  shapes = nn.meta.unbox(jax.eval_shape(model.init, jax.random.PRNGKey(0), ids, ids, ids)["params"])
  fresh = jax.tree.map(lambda s: np.full(s.shape, 0.5, s.dtype), shapes)
  start = init_from._encoder_loader(source)(fresh)  # pylint: disable=protected-access
  stored = weights.read(source)
  for part in ("bert", heads.PREDICTION_HEAD):
    want = stored["bert"] if part == "bert" else {k: stored["mlm"][k] for k in start[part]}
    assert len(jax.tree.leaves(want)) == len(jax.tree.leaves(start[part])) > 1
    for (path, value), got in zip(jax.tree_util.tree_leaves_with_path(want),
                                  jax.tree.leaves(start[part])):
      np.testing.assert_array_equal(np.asarray(got), value, err_msg=f"{part}{path}")
  assert start[fam.head]["kernel"].shape == (BASE["hidden_size"], fam.num_outputs(spec))
