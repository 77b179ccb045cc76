"""Parity with Hugging Face's BERT (an implementation nobody here wrote) and weight round trips."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
import transformers  # the `test` extra pins 4.57, the last release with Flax BERT

from bertjax.convert import hf as convert_hf
from bertjax.formats import converted, hf, outfolder
from bertjax.model.config import BertConfig
from bertjax.model.encoder import BertModel
from bertjax.model.heads import BertForPreTraining
from parity_fixtures import parity_inputs

HF_CONFIG = dict(vocab_size=101, hidden_size=48, num_hidden_layers=3, num_attention_heads=4,
                 intermediate_size=80, max_position_embeddings=64, type_vocab_size=2,
                 hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, hidden_act="gelu",
                 layer_norm_eps=1e-12)


def _random_state_dict(config: BertConfig, seed=0):
  """Random weights under Hugging Face's names; scale 0.2 keeps activations in a useful range."""
  rng = np.random.default_rng(seed)
  return {name: (rng.normal(size=shape) * 0.2).astype(np.float32)
          for name, shape in hf.expected_shapes(config).items()}


@pytest.fixture(scope="module")
def reference():
  """Hugging Face FlaxBertForPreTraining outputs for random weights given by a state dict."""
  from transformers.modeling_flax_pytorch_utils import convert_pytorch_state_dict_to_flax
  hf_config = transformers.BertConfig(**HF_CONFIG)
  config = hf.config_from_hf(hf_config.to_dict())
  state_dict = _random_state_dict(config)
  model = transformers.FlaxBertForPreTraining(hf_config, seed=0)
  # Hugging Face's own converter from PyTorch names: independent of bertjax's mapping.
  hf_params = convert_pytorch_state_dict_to_flax(dict(state_dict), model)
  ids, mask, seg, _ = parity_inputs(101)
  out = model(ids, attention_mask=mask, token_type_ids=seg, params=hf_params,
              output_hidden_states=True)
  base = transformers.FlaxBertModel(hf_config, seed=0, add_pooling_layer=True)
  base_out = base(ids, attention_mask=mask, token_type_ids=seg, params=hf_params["bert"])
  return dict(config=config, state_dict=state_dict, mlm=np.asarray(out.prediction_logits),
              nsp=np.asarray(out.seq_relationship_logits),
              sequence=np.asarray(base_out.last_hidden_state),
              pooled=np.asarray(base_out.pooler_output))


@pytest.mark.parametrize("scan", [False, True])
def test_outputs_match_hugging_face(reference, scan):
  config = hf.config_from_hf(HF_CONFIG, scan_layers=scan)
  params = hf.params_from_hf(reference["state_dict"], config)
  ids, mask, seg, positions = parity_inputs(101)
  sequence, pooled = BertModel(config).apply({"params": params["bert"]}, ids, mask, seg)
  mlm, nsp = BertForPreTraining(config).apply({"params": params}, ids, mask, seg, positions)
  real = mask.astype(bool)  # Hugging Face's outputs at padding queries carry no meaning either
  np.testing.assert_allclose(np.asarray(sequence)[real], reference["sequence"][real], atol=1e-5)
  np.testing.assert_allclose(pooled, reference["pooled"], atol=1e-5)
  ref_mlm = np.take_along_axis(reference["mlm"], positions[..., None], axis=1)
  np.testing.assert_allclose(mlm, ref_mlm, atol=1e-5)
  np.testing.assert_allclose(nsp, reference["nsp"], atol=1e-5)


@pytest.mark.parametrize("scan", [False, True])
def test_round_trip_is_exact(reference, scan):
  config = hf.config_from_hf(HF_CONFIG, scan_layers=scan)
  state_dict = reference["state_dict"]
  back = hf.params_to_hf(hf.params_from_hf(state_dict, config), config)
  assert back.keys() == state_dict.keys()
  for name, value in state_dict.items():
    assert back[name].dtype == value.dtype and np.array_equal(back[name], value), name


def test_config_round_trip_and_activation_names():
  config = hf.config_from_hf(HF_CONFIG)
  assert (config.num_layers, config.num_heads, config.hidden_act) == (3, 4, "gelu")
  assert hf.config_from_hf(hf.config_to_hf(config)) == config
  assert hf.config_from_hf({**HF_CONFIG, "hidden_act": "gelu_new"}).hidden_act == "gelu_tanh"
  with pytest.raises(ValueError, match="hidden_act='relu'"):
    hf.config_from_hf({**HF_CONFIG, "hidden_act": "relu"})
  with pytest.raises(ValueError, match="position_embedding_type='relative_key'"):
    hf.config_from_hf({**HF_CONFIG, "position_embedding_type": "relative_key"})


def test_optional_tied_and_legacy_keys_are_accepted(reference):
  config = reference["config"]
  sd = dict(reference["state_dict"])
  sd["cls.predictions.decoder.weight"] = sd["bert.embeddings.word_embeddings.weight"]
  sd["cls.predictions.decoder.bias"] = sd["cls.predictions.bias"]
  sd["bert.embeddings.position_ids"] = np.arange(64)[None]
  sd["bert.embeddings.LayerNorm.gamma"] = sd.pop("bert.embeddings.LayerNorm.weight")
  params = hf.params_from_hf(sd, config)
  np.testing.assert_array_equal(params["bert"]["embeddings"]["layer_norm"]["scale"],
                                reference["state_dict"]["bert.embeddings.LayerNorm.weight"])
  sd["cls.predictions.decoder.weight"] = sd["cls.predictions.decoder.weight"] + 1
  with pytest.raises(ValueError, match="cls.predictions.decoder.weight"):
    hf.params_from_hf(sd, config)


def test_bad_state_dict_lists_every_problem(reference):
  config = reference["config"]
  sd = dict(reference["state_dict"])
  del sd["bert.pooler.dense.bias"]
  del sd["bert.encoder.layer.2.output.dense.weight"]
  sd["bert.encoder.layer.3.output.dense.weight"] = np.zeros((48, 80), np.float32)
  sd["cls.seq_relationship.weight"] = np.zeros((3, 48), np.float32)
  with pytest.raises(ValueError) as err:
    hf.params_from_hf(sd, config)
  message = str(err.value)
  for text in ("missing keys (2)", "bert.pooler.dense.bias",
               "bert.encoder.layer.2.output.dense.weight", "unexpected keys (1)",
               "bert.encoder.layer.3.output.dense.weight", "mis-shaped keys (1)",
               "cls.seq_relationship.weight: (3, 48) (expected (2, 48))"):
    assert text in message, (text, message)
  # A checkpoint of another model size is refused, naming the mismatch.
  other = hf.config_from_hf({**HF_CONFIG, "num_hidden_layers": 2})
  with pytest.raises(ValueError, match="unexpected keys"):
    hf.params_from_hf(reference["state_dict"], other)


def test_command_line_import_then_export(reference, tmp_path):
  from safetensors.numpy import load_file, save_file
  hf_dir = tmp_path / "hf"
  hf_dir.mkdir()
  (hf_dir / "config.json").write_text(json.dumps(HF_CONFIG))
  save_file(reference["state_dict"], str(hf_dir / "model.safetensors"))
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  # --weights names the folder read; the export runs under its old name, which says the new one.
  for args in (["import", f"--weights={hf_dir}", f"--output={tmp_path / 'ours'}", "--scan_layers"],
               ["export", f"--params={tmp_path / 'ours'}", f"--output={tmp_path / 'back'}"]):
    done = subprocess.run([sys.executable, "-m", "bertjax.convert.hf", *args], check=True, env=env,
                          capture_output=True, text=True)
    renamed = "bertjax: --params is now --weights" in done.stderr
    assert renamed == (args[1].startswith("--params")), done.stderr
  config, params = converted.load_params(str(tmp_path / "ours"))
  assert config.scan_layers and config.num_layers == 3
  assert params["bert"]["encoder"]["layers"]["layer"]["mlp"]["output"]["kernel"].shape == (3, 80,
                                                                                             48)
  back = load_file(str(tmp_path / "back" / "model.safetensors"))
  assert back.keys() == reference["state_dict"].keys()
  assert all(np.array_equal(back[k], v) for k, v in reference["state_dict"].items())
  exported = json.loads((tmp_path / "back" / "config.json").read_text())
  assert hf.config_from_hf(exported) == hf.config_from_hf(HF_CONFIG)
  with pytest.raises(FileNotFoundError, match="model.safetensors"):
    hf.load_hf_dir(str(tmp_path))


@pytest.mark.parametrize("lower", [True, False])
def test_a_sentencepiece_vocabulary_exports_as_a_fast_tokenizer_with_the_same_ids(tmp_path, lower):
  """tokenizer.json written from a SentencePiece model (what configs/tiny.py trains) encodes as
  bertjax does: single texts and pairs, with [CLS]/[SEP] and segment ids, over prose with
  accents, full-width forms, runs of spaces, tabs, digits and CJK."""
  import random  # pylint: disable=import-outside-toplevel
  from transformers import PreTrainedTokenizerFast  # pylint: disable=import-outside-toplevel
  from bertjax.data import tokenizer as tokenizer_lib  # pylint: disable=import-outside-toplevel
  rng = random.Random(0)
  words = ["the", "Parcel", "ARRIVED", "late", "naïve", "café", "Straße", "ＡＢＣ", "½", "2026",
           "refund", "invoice", "東京", "über", "e-mail", "don't", "Ölfeld", "x²"]
  sentences = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12)))
               for _ in range(400)]
  model = tokenizer_lib.train_sentencepiece(sentences, vocab_size=120, do_lower_case=lower,
                                            output=str(tmp_path / "spm"))
  ours = tokenizer_lib.load_vocabulary(model, "sentencepiece")
  convert_hf.sentencepiece_to_tokenizer_json(model, str(tmp_path / "tokenizer.json"))
  theirs = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
  probes = sentences[:100] + ["  two  spaces\tand a tab ", "UPPER lower MiXeD", "ﬁ ligature",
                              "１２３ full-width digits", "unseen qzj words"]
  cls, sep = ours.cls_id, ours.sep_id
  for a, b in zip(probes, probes[1:] + probes[:1]):
    assert theirs(a)["input_ids"] == [cls, *ours.encode(a), sep], a
    pair = theirs(a, b)
    ids_a, ids_b = ours.encode(a), ours.encode(b)
    assert pair["input_ids"] == [cls, *ids_a, sep, *ids_b, sep]
    assert pair["token_type_ids"] == [0] * (len(ids_a) + 2) + [1] * (len(ids_b) + 1)


@pytest.mark.parametrize("family", ["classification", "regression", "tagging", "span"])
def test_a_fine_tuned_export_reads_back_as_its_encoder(reference, family, tmp_path):
  """A task class's folder (as `export` writes it) is a weights folder too: every reader takes its
  encoder, tensor for tensor; its task head is read past, and where the class has no pooler
  (token classification, question answering) neither has the encoder read."""
  from bertjax.finetune import families  # pylint: disable=import-outside-toplevel
  from bertjax.formats import taskspec as spec_lib  # pylint: disable=import-outside-toplevel
  from bertjax.weights import reader as weights  # pylint: disable=import-outside-toplevel
  config = reference["config"]
  params = hf.params_from_hf(reference["state_dict"], config, heads=())
  spec = spec_lib.TaskSpec("t", family, () if family in ("regression", "span") else ("a", "b", "c"))
  fam = families.get(family)
  rng = np.random.default_rng(1)
  params[fam.head] = {
      "kernel": rng.normal(size=(config.hidden_size, fam.num_outputs(spec))).astype(np.float32),
      "bias": rng.normal(size=(fam.num_outputs(spec),)).astype(np.float32)}
  sd, extra = hf.task_to_hf(params, config, head=fam.head, hf_class=fam.hf_class,
                            hf_head=fam.hf_head, outputs=fam.num_outputs(spec), labels=spec.labels)
  with outfolder.ExportFolder(str(tmp_path)) as folder:
    hf.write_hf_dir(folder, sd, {**hf.config_to_hf(config), **extra})
  source = weights.inspect(str(tmp_path))
  back = weights.read(source)
  assert source.kind == "huggingface" and source.subtrees == ("bert",) and list(back) == ["bert"]
  # What the folder says of its head is recorded as it says it: class, labels, problem_type.
  assert source.task_class == hf.TaskClass(fam.hf_class, spec.labels,
                                           extra.get("problem_type", ""))

  def flat(tree):
    return {jax.tree_util.keystr(p): np.asarray(x)
            for p, x in jax.tree_util.tree_leaves_with_path(tree)}
  before, after = flat(params["bert"]), flat(back["bert"])
  pooler = {k for k in before if k.startswith("['pooler']")}
  assert set(before) - set(after) == (set() if family in ("classification", "regression")
                                      else pooler)
  for key, value in after.items():
    np.testing.assert_array_equal(value, before[key], err_msg=key)
  # Into an encoder with a pooler: taken where the class has one; else the model's new pooler
  # where it is given (as init_from gives it), refused by name without one (not a pytree error
  # deep in the placement).
  like = {"bert": jax.device_put(params["bert"])}
  if family in ("classification", "regression"):
    placed = flat(weights.read(source, like=like)["bert"])
    assert all(np.array_equal(placed[k], v) for k, v in before.items()) and not source.lacks
  else:
    assert source.lacks == ("pooler",)
    with pytest.raises(ValueError, match="has no pooler .* pass its new pooler as `fresh`"):
      weights.read(source, like=like)
    fresh = jax.tree.map(np.zeros_like, params)
    placed = flat(weights.read(source, like=like, fresh=fresh)["bert"])
    assert all(np.array_equal(placed[k], 0 * v if k in pooler else v) for k, v in before.items())
