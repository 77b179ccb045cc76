"""Parity with Hugging Face's ModernBERT (PyTorch, eager attention) and weight round trips.

The reference is transformers' own ModernBertForMaskedLM with random weights: bertjax's modern
options (pre-LN, RoPE with two bases, GeGLU, sliding windows, the MLM head) must reproduce it.
"""

import json

import jax
import numpy as np
import pytest
import torch
import transformers

from bertjax.convert import modernbert as convert_modernbert
from bertjax.formats import modernbert
from bertjax.model.config import BertConfig
from bertjax.model.encoder import BertModel
from bertjax.model.heads import MlmHead
from bertjax.weights import reader as weights

# 3 layers, a global one every 2nd: layers 0 and 2 global, layer 1 local with a window of 8
# (|i - j| <= 4) over 24 tokens, so the window cuts.
BASE = dict(vocab_size=120, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, max_position_embeddings=64, global_attn_every_n_layers=2,
            local_attention=8, global_rope_theta=160000.0, local_rope_theta=10000.0,
            pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2,
            reference_compile=False)
VARIANTS = {
    # ModernBERT-base's switches: no biases but the decoder's, decoder tied.
    "base": {},
    # Every bias on, an untied decoder, a tanh head activation, one RoPE base for all layers.
    "biases_untied": dict(attention_bias=True, mlp_bias=True, norm_bias=True, classifier_bias=True,
                          tie_word_embeddings=False, classifier_activation="gelu_pytorch_tanh",
                          local_rope_theta=None),
}
LENGTH = 24


def _torch_model(variant: str, seed: int = 0):
  torch.manual_seed(seed)
  config = transformers.ModernBertConfig(**{**BASE, **VARIANTS[variant]})
  return randomised(transformers.ModernBertForMaskedLM(config))


def randomised(model):
  """Weights large enough that every part of the computation shows in the logits (the init's
  0.02 leaves each layer near the identity); norm scales near 1. Draws from torch's generator."""
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name and name.endswith("weight"):
        p.copy_(1.0 + 0.1 * torch.randn_like(p))
      else:
        p.copy_(0.2 * torch.randn_like(p))
  return model.eval()


def _inputs():
  rng = np.random.default_rng(1)
  ids = rng.integers(3, BASE["vocab_size"], size=(3, LENGTH))
  padded = np.ones((3, LENGTH), np.int64)
  padded[1, 15:] = 0
  padded[2, 5:] = 0
  ids = np.where(padded == 1, ids, 0)
  return ids, padded


def _torch_logits(model, ids, mask):
  with torch.no_grad():
    return model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()


def _ours(config, params, ids, mask):
  """MLM logits at every position (the encoder and the MLM head; ModernBERT has no NSP head)."""
  sequence, _ = BertModel(config).apply({"params": params["bert"]}, ids, mask)
  table = params["bert"]["embeddings"]["word_embeddings"]["embedding"]
  return np.asarray(MlmHead(config).apply({"params": params["mlm"]}, sequence, table))


@pytest.fixture(scope="module", params=list(VARIANTS))
def saved(request, tmp_path_factory):
  model = _torch_model(request.param)
  folder = tmp_path_factory.mktemp(f"modernbert_{request.param}")
  model.save_pretrained(folder)
  return dict(variant=request.param, model=model, folder=str(folder))


def _assert_real_close(ours, theirs, mask, atol=1e-4):
  real = mask.astype(bool)  # logits at padding carry no meaning in either implementation
  np.testing.assert_allclose(ours[real], theirs[real], atol=atol, rtol=0)


@pytest.mark.parametrize("scan", [False, True])
def test_imported_logits_match_transformers(saved, scan):
  config, params = modernbert.load_dir(saved["folder"], scan_layers=scan)
  assert config.has_local_layers and config.is_local(1) and not config.is_local(2)
  ids, padded = _inputs()
  for mask in (np.ones_like(padded), padded):
    ours = _ours(config, params, ids, mask)
    theirs = _torch_logits(saved["model"], ids, mask)
    assert np.abs(theirs).max() > 1.0  # logits of substance, not a near-zero model
    _assert_real_close(ours, theirs, mask)


def test_export_loads_in_transformers_and_matches(saved, tmp_path):
  source = weights.inspect(saved["folder"])
  assert source.kind == "modernbert" and source.subtrees == ("bert", "mlm")
  params = weights.read(source)
  assert convert_modernbert.export_folder(saved["folder"], str(tmp_path)).startswith("Exported")
  model, info = transformers.ModernBertForMaskedLM.from_pretrained(
      tmp_path, attn_implementation="eager", output_loading_info=True)
  assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
  ids, padded = _inputs()
  reloaded = _torch_logits(model.eval(), ids, padded)
  _assert_real_close(reloaded, _torch_logits(saved["model"], ids, padded), padded)
  _assert_real_close(reloaded, _ours(source.config, params, ids, padded), padded)
  # The tensors themselves come back bit for bit.
  theirs = {k: v.detach().numpy() for k, v in saved["model"].state_dict().items()}
  back = modernbert.params_to_modernbert(params, source.config)
  for name, value in back.items():
    assert np.array_equal(value, theirs[name]), name
  tied = {"decoder.weight"} if source.config.tie_word_embeddings else set()
  assert set(theirs) - set(back) == tied


def test_unsupported_config_is_refused_by_name(tmp_path):
  with pytest.raises(ValueError, match="rope_scaling"):
    modernbert.config_from_modernbert({**BASE, "num_hidden_layers": 3,
                                       "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
  with pytest.raises(ValueError, match="hidden_activation='relu'"):
    modernbert.config_from_modernbert({**BASE, "hidden_activation": "relu"})
  config = modernbert.config_from_modernbert(BASE)
  with pytest.raises(ValueError, match="norm_position='post'"):
    modernbert.config_to_modernbert(BertConfig())
  # A state dict that does not fit its config names the tensors.
  model = _torch_model("base")
  sd = {k: v.numpy() for k, v in model.state_dict().items()}
  del sd["model.layers.1.attn_norm.weight"]
  with pytest.raises(ValueError, match=r"missing keys \(1\).*layers\.1\.attn_norm"):
    modernbert.params_from_modernbert(sd, config)
  # The folder is read as ModernBERT by the one reader, and a damaged config is named.
  model.save_pretrained(tmp_path)
  hf_config = json.loads((tmp_path / "config.json").read_text())
  (tmp_path / "config.json").write_text(json.dumps({**hf_config, "hidden_activation": "relu"}))
  with pytest.raises(ValueError, match="init_from=.*hidden_activation"):
    weights.inspect(str(tmp_path), what="init_from")


def test_fine_tuning_starts_from_a_modernbert_folder(tmp_path, monkeypatch):
  """init_from takes a ModernBERT folder as it is (a vocab.txt put beside it, as bertjax's data
  pipeline does not read its BPE tokenizer): the encoder the first step starts from is the
  imported one, leaf for leaf, and its architecture (RoPE, GeGLU, windows) comes with it."""
  import os  # pylint: disable=import-outside-toplevel
  from bertjax.data import tokenizer as tokenizer_lib  # pylint: disable=import-outside-toplevel
  from bertjax.finetune.job import run  # pylint: disable=import-outside-toplevel
  # pylint: disable-next=import-outside-toplevel
  from finetune_fixtures import Builds, tiny_next_config, write_tiny_next
  from test_data_fixtures import write_vocab  # pylint: disable=import-outside-toplevel
  folder = tmp_path / "modernbert"
  os.makedirs(folder)
  size = tokenizer_lib.load_tokenizer(write_vocab(str(folder / "vocab.txt"))).vocab_size
  torch.manual_seed(0)
  transformers.ModernBertForMaskedLM(transformers.ModernBertConfig(**{
      **BASE, "vocab_size": size, "hidden_size": 32, "intermediate_size": 48,
      "num_attention_heads": 2, "num_hidden_layers": 2})).save_pretrained(folder)
  write_tiny_next(tmp_path / "task")
  config = tiny_next_config(str(folder), str(tmp_path / "task"))
  builds = Builds(monkeypatch, devices=jax.devices()[:1])
  assert run.finetune(config, str(tmp_path / "ft"))["evaluations"]
  _, params = modernbert.load_dir(str(folder))
  want = jax.tree_util.tree_leaves_with_path(params["bert"])
  got = dict(jax.tree_util.tree_leaves_with_path(builds.first_params["bert"]))
  assert len(want) == len(got) > 10
  for path, value in want:
    np.testing.assert_array_equal(np.asarray(got[path]), value, err_msg=str(path))


def test_the_bert_exporter_refuses_a_modern_model_naming_the_other():
  from bertjax.formats import hf  # pylint: disable=import-outside-toplevel
  config = modernbert.config_from_modernbert(BASE)
  with pytest.raises(ValueError, match=r"norm_position='pre'.*convert\.modernbert export"):
    hf.config_to_hf(config)
  from bertjax.formats import google  # pylint: disable=import-outside-toplevel
  with pytest.raises(ValueError, match=r"mlp_type='gated'.*convert\.modernbert export"):
    google.config_to_google(config)
  assert not BertConfig().modern_options()
