"""Google's TF1-layout checkpoints: the TensorFlow-free reader against TensorFlow's own writer and
reader, parity with Hugging Face's Flax BERT holding the same weights, round trips, refusals, casing,
the command line, and no TensorFlow where none is needed."""

import json
import logging
import os
import re
import struct
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
import transformers  # the `test` extra pins 4.57, the last release with Flax BERT
from flax.traverse_util import unflatten_dict

from bertjax import cli
from bertjax.convert import google as convert_google
from bertjax.formats import converted, google, tf_bundle, vocabulary
from bertjax.model.encoder import BertModel
from bertjax.model.heads import BertForPreTraining
from bertjax.weights import reader as weights
from google_fixtures import GOOGLE_CONFIG, google_folder, random_variables, save, shapes, slots
from parity_fixtures import parity_inputs

ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "2"}


def _hf_params(variables: dict) -> dict:
  """Hugging Face Flax parameters from Google's names, as its TF loader maps them: `layer_N` is
  module N of `layer`, gamma/beta are the LayerNorm's scale/bias, output_bias a bias,
  output_weights [2, H] the (transposed) kernel, `*_embeddings` an embedding table."""
  flat = {}
  for name, value in variables.items():
    path = []
    for part in name.split("/"):
      m = re.fullmatch(r"layer_(\d+)", part)
      path += ["layer", m.group(1)] if m else [part]
    leaf = path[-1]
    if leaf in ("gamma", "beta"):
      path[-1] = {"gamma": "scale", "beta": "bias"}[leaf]
    elif leaf == "output_bias":
      path[-1] = "bias"
    elif leaf == "output_weights":
      path[-1], value = "kernel", value.T
    elif leaf.endswith("_embeddings"):
      path.append("embedding")
    flat[tuple(path)] = value
  return unflatten_dict(flat)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
  """A Google folder of a training checkpoint (with optimizer slots) of random weights."""
  root = tmp_path_factory.mktemp("google")
  variables = random_variables(GOOGLE_CONFIG)
  return google_folder(root, variables=variables, extra=slots(variables)), variables


# The reader -------------------------------------------------------------------------------------

def _data_blocks(index_path: str) -> int:
  table = open(index_path, "rb").read()
  footer = table[-48:]
  pos = 0
  for _ in range(2):
    _, pos = tf_bundle._varint(footer, pos)  # pylint: disable=protected-access
  offset, pos = tf_bundle._varint(footer, pos)  # pylint: disable=protected-access
  size, _ = tf_bundle._varint(footer, pos)  # pylint: disable=protected-access
  index = tf_bundle._block(table, offset, size, "")  # pylint: disable=protected-access
  return len(list(tf_bundle._block_entries(index, "")))  # pylint: disable=protected-access


def test_reader_matches_tensorflow(tmp_path):
  rng = np.random.default_rng(1)
  values = {}
  # Enough names sharing long prefixes to fill several of the index's blocks (256 KiB each).
  for i in range(11000):
    base = f"bert/encoder/layer_{i}/attention/self/query"
    values[base + "/kernel"] = rng.normal(size=(i % 3 + 1, i % 4 + 1)).astype(np.float32)
    if i % 2:
      values[base + "/kernel/adam_m"] = rng.integers(-2**40, 2**40, size=(i % 5,))
  values.update({
      "global_step": np.int64(123456789012),
      "big": rng.normal(size=(300, 257)).astype(np.float32),  # long enough for chunked CRCs
      "scalar": np.float32(-2.5), "int32": np.arange(24, dtype=np.int32).reshape(2, 3, 4),
      "float64": rng.normal(size=(3, 1, 2)), "float16": rng.normal(size=(5,)).astype(np.float16),
      "bool": np.array([True, False, True]), "empty": np.zeros((0, 4), np.float32),
      "strings": np.array([b"", b"bert", b"x" * 300]),
  })
  prefix = str(tmp_path / "model.ckpt")
  save(prefix, values)
  assert _data_blocks(prefix + ".index") >= 3
  ours = tf_bundle.read_checkpoint(str(tmp_path))
  theirs = tf.train.load_checkpoint(prefix)
  assert sorted(ours) == sorted(theirs.get_variable_to_shape_map()) == sorted(values)
  for name, value in ours.items():
    expected = theirs.get_tensor(name)
    assert value.dtype == expected.dtype and value.shape == expected.shape, name
    np.testing.assert_array_equal(value, expected, err_msg=name)
  assert tf_bundle.CheckpointReader(prefix + ".index").shapes()["big"] == (300, 257)
  assert tf_bundle.crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value


def test_reader_refuses_damage(tmp_path):
  prefix = str(tmp_path / "m.ckpt")
  save(prefix, {"a": np.arange(5000, dtype=np.float32), "b": np.ones(3, np.float32)})
  data = bytearray(open(prefix + ".data-00000-of-00001", "rb").read())
  data[100] ^= 1
  open(prefix + ".data-00000-of-00001", "wb").write(bytes(data))
  reader = tf_bundle.CheckpointReader(prefix)
  with pytest.raises(tf_bundle.BundleError, match="a in .* fails its checksum"):
    reader.read("a")
  np.testing.assert_array_equal(reader.read("b"), np.ones(3))
  index = open(prefix + ".index", "rb").read()
  open(prefix + ".index", "wb").write(index[:5] + bytes([index[5] ^ 1]) + index[6:])
  with pytest.raises(tf_bundle.BundleError, match="fails its checksum: the file is damaged"):
    tf_bundle.CheckpointReader(prefix)
  open(prefix + ".index", "wb").write(index[:-10])
  with pytest.raises(tf_bundle.BundleError, match="not a TensorFlow checkpoint index"):
    tf_bundle.CheckpointReader(prefix)
  os.makedirs(tmp_path / "empty")
  with pytest.raises(FileNotFoundError, match="holds no TensorFlow checkpoint"):
    tf_bundle.CheckpointReader(str(tmp_path / "empty"))


def test_snappy_blocks(tmp_path):
  # Snappy elements written by hand: literals (short and with a length byte), a 1-byte-offset
  # copy, an overlapping 2-byte-offset copy (a run).
  stream = (bytes([17]) + bytes([4 << 2]) + b"abcde" + bytes([(1 << 2) | 1, 5])
            + bytes([60 << 2, 2]) + b"xyz" + bytes([(3 << 2) | 2, 1, 0]))
  assert tf_bundle.snappy_decompress(stream) == b"abcde" + b"abcde" + b"xyz" + b"zzzz"
  with pytest.raises(tf_bundle.BundleError, match="back-reference"):
    tf_bundle.snappy_decompress(bytes([5, (1 << 2) | 1, 9]))

  # A one-block table whose data block is snappy-compressed (as LevelDB may write it).
  def entry(key, value):
    return bytes([0, len(key), len(value)]) + key + value

  def block(contents, kind):
    return contents + bytes([kind]) + struct.pack(
        "<I", tf_bundle.masked_crc32c(contents + bytes([kind])))

  def table(contents, kind):
    data = block(contents, kind)
    index = block(entry(b"k3", bytes([0, len(contents)])) + struct.pack("<II", 0, 1), 0)
    footer = bytes([0, 0, len(data), len(index) - 5]).ljust(40, b"\0") + struct.pack(
        "<Q", 0xDB4775248B80FB57)
    return data + index + footer

  raw = entry(b"k1", b"hello") + entry(b"k2", b"world") + struct.pack("<II", 0, 1)
  compressed = bytes([len(raw), (len(raw) - 1) << 2]) + raw  # one literal
  assert list(tf_bundle.read_table(table(compressed, 1))) == [(b"k1", b"hello"),
                                                               (b"k2", b"world")]
  assert list(tf_bundle.read_table(table(raw, 0))) == [(b"k1", b"hello"), (b"k2", b"world")]
  with pytest.raises(tf_bundle.BundleError, match="compression 2 is unknown"):
    list(tf_bundle.read_table(table(raw, 2)))


# Parity, round trips, refusals -------------------------------------------------------------------

@pytest.mark.parametrize("scan", [False, True])
def test_outputs_match_hugging_face_holding_the_same_weights(folder, scan, tmp_path):
  path, variables = folder
  c = GOOGLE_CONFIG
  hf_config = transformers.BertConfig(**c, layer_norm_eps=1e-12)  # run deterministic
  model = transformers.FlaxBertForPreTraining(hf_config, seed=0, _do_init=False)
  ids, mask, seg, positions = parity_inputs(c["vocab_size"])
  out = model(ids, attention_mask=mask, token_type_ids=seg, params=_hf_params(variables))
  if scan:  # through the command's folder, as init_from reads it
    convert_google.import_folder(path, str(tmp_path / "ours"), scan_layers=True)
    config, params = converted.load_params(str(tmp_path / "ours"))
  else:  # straight from the Google folder
    config, params = google.load_folder(path)
  assert config.scan_layers == scan and config.hidden_act == "gelu"
  mlm, nsp = BertForPreTraining(config).apply({"params": params}, ids, mask, seg, positions)
  ref_mlm = np.take_along_axis(np.asarray(out.prediction_logits), positions[..., None], axis=1)
  np.testing.assert_allclose(mlm, ref_mlm, atol=1e-5)
  np.testing.assert_allclose(nsp, np.asarray(out.seq_relationship_logits), atol=1e-5)
  base = transformers.FlaxBertModel(hf_config, seed=0, _do_init=False)
  base_out = base(ids, attention_mask=mask, token_type_ids=seg,
                  params=_hf_params(variables)["bert"])
  sequence, pooled = BertModel(config).apply({"params": params["bert"]}, ids, mask, seg)
  real = mask.astype(bool)  # outputs at padding queries carry no meaning in either
  np.testing.assert_allclose(np.asarray(sequence)[real],
                             np.asarray(base_out.last_hidden_state)[real], atol=1e-5)
  np.testing.assert_allclose(pooled, base_out.pooler_output, atol=1e-5)


def test_import_export_import_is_exact(folder, tmp_path):
  path, variables = folder
  line = convert_google.import_folder(path, str(tmp_path / "ours"))
  assert f"ignored optimizer slots and step: adam_m {len(variables)}, adam_v {len(variables)}, " \
         "global_step 1" in line
  assert google.ignored_variables(tf_bundle.CheckpointReader(path).keys()) == {
      "adam_m": len(variables), "adam_v": len(variables), "global_step": 1}
  convert_google.export_folder(str(tmp_path / "ours"), str(tmp_path / "exported"))
  exported = str(tmp_path / "exported")
  assert sorted(os.listdir(exported)) == [
      "bert_config.json", "bert_model.ckpt.data-00000-of-00001", "bert_model.ckpt.index",
      "tokenizer.json", "vocab.txt"]
  # TensorFlow reads it back under the original names and shapes, values bit for bit.
  reader = tf.train.load_checkpoint(os.path.join(exported, "bert_model.ckpt"))
  assert reader.get_variable_to_shape_map() == {k: list(v.shape) for k, v in variables.items()}
  for name, value in variables.items():
    got = reader.get_tensor(name)
    assert got.dtype == np.float32 and np.array_equal(got, value), name
  assert json.load(open(os.path.join(exported, "bert_config.json"))) == GOOGLE_CONFIG
  assert open(os.path.join(exported, "vocab.txt")).read() == open(
      os.path.join(path, "vocab.txt")).read()
  _, first = converted.load_params(str(tmp_path / "ours"))
  _, again = google.load_folder(exported)
  flat_first = dict(_leaves(first))
  flat_again = dict(_leaves(again))
  assert flat_first.keys() == flat_again.keys() and len(flat_first) == len(variables)
  for key, value in flat_first.items():
    assert np.asarray(value).tobytes() == flat_again[key].tobytes(), key


def _leaves(tree, prefix=()):
  for key, value in tree.items():
    if isinstance(value, dict):
      yield from _leaves(value, prefix + (key,))
    else:
      yield prefix + (key,), value


def test_bad_checkpoint_lists_every_problem(folder):
  _, variables = folder
  config = google.config_from_google(GOOGLE_CONFIG)
  bad = dict(variables)
  del bad["bert/pooler/dense/bias"]
  del bad["bert/encoder/layer_1/output/dense/kernel"]
  bad["bert/encoder/layer_2/output/dense/kernel"] = np.zeros((512, 128), np.float32)
  bad["cls/seq_relationship/output_weights"] = np.zeros((128, 2), np.float32)  # a Flax kernel
  bad.update(slots({"bert/pooler/dense/kernel": variables["bert/pooler/dense/kernel"]}))
  with pytest.raises(ValueError) as err:
    google.params_from_google(bad, config)
  message = str(err.value)
  for text in ("missing variables (2)", "bert/pooler/dense/bias",
               "bert/encoder/layer_1/output/dense/kernel", "unexpected variables (1)",
               "bert/encoder/layer_2/output/dense/kernel", "mis-shaped variables (1)",
               "cls/seq_relationship/output_weights: (128, 2) (expected (2, 128))",
               "num_layers=2", "bert_config.json released with this checkpoint"):
    assert text in message, (text, message)
  assert "adam" not in message and "global_step" not in message


def test_config_mapping():
  released = {**GOOGLE_CONFIG, "directionality": "bidi", "pooler_fc_size": 768,
              "pooler_num_attention_heads": 12, "pooler_num_fc_layers": 3,
              "pooler_size_per_head": 128, "pooler_type": "first_token_transform"}
  config = google.config_from_google(released)
  assert (config.num_layers, config.num_heads, config.intermediate_size, config.hidden_act,
          config.layer_norm_eps) == (2, 2, 512, "gelu", 1e-12)
  assert google.config_to_google(config) == GOOGLE_CONFIG
  assert google.config_from_google({**GOOGLE_CONFIG, "hidden_act": "GELU"}).hidden_act == "gelu"
  # Hugging Face's name of the tanh GELU is bertjax's gelu_tanh (as convert.hf reads it).
  assert google.config_from_google({**GOOGLE_CONFIG, "hidden_act": "gelu_new"}).hidden_act == (
      "gelu_tanh")
  for act in ("relu", "tanh", "linear"):
    with pytest.raises(ValueError, match=f"hidden_act='{act}' has no bertjax equivalent"):
      google.config_from_google({**GOOGLE_CONFIG, "hidden_act": act})
  # The original's defaults for what a config leaves out: type_vocab_size 16 in its code.
  assert google.config_from_google({"vocab_size": 99}).type_vocab_size == 16
  with pytest.raises(ValueError, match="no vocab_size"):
    google.config_from_google({"hidden_size": 8})


# Casing ----------------------------------------------------------------------------------------

def test_do_lower_case_from_the_name_and_the_warning(tmp_path, caplog):
  for name, lower in (("uncased_L-12_H-768_A-12", True), ("uncased_L-2_H-128_A-2", True),
                      ("wwm_uncased_L-24_H-1024_A-16", True), ("multilingual_L-12_H-768_A-12", True),
                      ("chinese_L-12_H-768_A-12", True), ("cased_L-12_H-768_A-12", False),
                      ("wwm_cased_L-24_H-1024_A-16", False), ("multi_cased_L-12_H-768_A-12", False),
                      ("/models/cased_L-24_H-1024_A-16/", False), ("my_bert", None)):
    assert vocabulary.lower_case_from_name(name) == lower, name
  small = dict(GOOGLE_CONFIG, hidden_size=8, intermediate_size=8, num_hidden_layers=1)
  cased = google_folder(tmp_path, small, "multi_cased_L-12_H-768_A-12")
  assert convert_google.resolve_do_lower_case(cased, None) == (
      False, "the name multi_cased_L-12_H-768_A-12 says cased")
  with caplog.at_level(logging.WARNING):
    assert convert_google.resolve_do_lower_case(cased, True) == (True, "given")
  assert "do_lower_case=True, but multi_cased_L-12_H-768_A-12 seems to be a cased model" in (
      caplog.text)
  caplog.clear()
  with caplog.at_level(logging.WARNING):
    assert convert_google.resolve_do_lower_case(cased, False) == (False, "given")
  assert not caplog.text
  unnamed = google_folder(tmp_path, small, "my_bert")
  lower, why = convert_google.resolve_do_lower_case(unnamed, None)
  assert lower and "does not say" in why
  # The import records the casing beside the vocabulary, where init_from finds it.
  convert_google.import_folder(cased, str(tmp_path / "out"))
  record = json.load(open(tmp_path / "out" / "tokenizer.json"))
  assert (record["file"], record["kind"], record["do_lower_case"]) == (
      "vocab.txt", "wordpiece", False)
  source = weights.inspect(str(tmp_path / "out"))  # every init_from's view of the folder
  assert (source.kind, source.vocab_file, source.do_lower_case) == (
      "converted", str(tmp_path / "out" / "vocab.txt"), False)


# The command line, and no TensorFlow -----------------------------------------------------------

def _run(*args):
  return subprocess.run([sys.executable, "-m", "bertjax.convert.google", *args], env=ENV,
                        capture_output=True, text=True, check=False)


def test_command_line_import_then_export(folder, tmp_path):
  path, variables = folder
  done = _run("import", f"--weights={path}", f"--output={tmp_path / 'ours'}", "--scan_layers",
              "--do_lower_case=false")
  assert done.returncode == 0, done.stderr
  assert "do_lower_case=False: given" in done.stdout
  assert "seems to be an uncased model" in done.stderr
  config, params = converted.load_params(str(tmp_path / "ours"))
  assert config.scan_layers and config.num_layers == 2
  assert params["bert"]["encoder"]["layers"]["layer"]["mlp"]["output"]["kernel"].shape == (
      2, 512, 128)
  done = _run("export", f"--weights={tmp_path / 'ours'}", f"--output={tmp_path / 'back'}")
  assert done.returncode == 0, done.stderr
  reader = tf.train.load_checkpoint(str(tmp_path / "back" / "bert_model.ckpt"))
  for name, value in variables.items():
    np.testing.assert_array_equal(reader.get_tensor(name), value, err_msg=name)
  # Refused inputs: the message alone (no traceback), naming the problem and the fix, as the
  # command reports them (cli.explained: exit status 1 with the message on stderr).
  for run, args, text in (
      (convert_google.import_folder, (str(tmp_path / "nothing"), str(tmp_path / "x")),
       "bert_config.json not found: a Google BERT folder holds bert_config.json"),
      (convert_google.export_folder, (str(tmp_path), str(tmp_path / "x")),
       "holds no weights bertjax reads: expected a bertjax workdir")):
    with pytest.raises(SystemExit) as exited:
      cli.explained(run, *args)
    assert isinstance(exited.value.code, str) and text in exited.value.code, exited.value.code
  # A command line it cannot run: one line naming the flag, exit status 2.
  for args, text in (
      (["import", f"--weights={path}", f"--output={tmp_path / 'x'}", "--do_lower_case=maybe"],
       "flag --do_lower_case=maybe: value should be one of <true|false>"),
      (["export", f"--weights={path}", f"--output={tmp_path / 'x'}", "--scan_layers"],
       "Unknown command line flag 'scan_layers'")):
    done = _run(*args)
    assert done.returncode == 2 and text in done.stderr, done.stderr
    assert done.stderr.startswith("bertjax.convert.google: error: ") and done.stderr.count(
        "\n") == 1, done.stderr


def test_reading_imports_no_tensorflow(folder):
  path, _ = folder
  code = ("import sys\nfrom bertjax.convert import google as convert_google\n"
          "from bertjax.formats import google\n"
          f"values = google.read_checkpoint({path!r})\n"
          f"config, params = google.load_folder({path!r}, scan_layers=True)\n"
          "from bertjax.weights import reader as weights\n"
          f"assert weights.inspect({path!r}).kind == 'google'\n"
          f"assert len(values) == {3 * len(shapes(GOOGLE_CONFIG)) + 1}\n"
          "assert config.num_layers == 2\n"
          "print(sorted(m for m in sys.modules if m.split('.')[0] == 'tensorflow'))\n")
  done = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True,
                        check=True)
  assert done.stdout.strip() == "[]"
