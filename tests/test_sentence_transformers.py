"""An export with sentence-transformers' files loads as SentenceTransformer(folder) and encodes as
bertjax's bi-encoder does: each pooling, normalised or not, BERT and ModernBERT, texts longer than
the limit cut alike. sentence-transformers is in the `test` extra; where it is not installed
these tests skip."""

import json
import os

import flax.linen as nn
import jax
import numpy as np
import pytest
import transformers

from bertjax.convert import hf as convert_hf, modernbert as convert_modernbert
from bertjax.data import tokenizer as tokenizer_lib, vocab_record
from bertjax.errors import Refusal
from bertjax.formats import converted, modernbert, outfolder
from bertjax.formats.sentence_transformers import SentenceVectors
from bertjax.model.config import BertConfig
from bertjax.model.contrastive import BiEncoder, ContrastiveConfig
from test_contrastive import random_params

sentence_transformers = pytest.importorskip("sentence_transformers")

WORDS = ["the", "parcel", "arrived", "late", "refund", "invoice", "please", "send", "a", "new",
         "one", "my", "order", "is", "missing", "where", "##s", "##ed", "##ing", ",", ".", "?"]
TEXTS = ["The parcel arrived late.", "Where is my order?", "please send a new one",
         "refunds", "invoice missing, order missing, parcel missing, refund please, send it",
         "zebra quokka"]
MAX_SEQ = 12  # the fifth text is longer: both sides cut it to 12 pieces


def _vocabulary(folder) -> str:
  path = os.path.join(folder, "vocab.in.txt")
  with open(path, "w") as f:
    f.write("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS) + "\n")
  return path


def _bert_config(vocab_size):
  return BertConfig(vocab_size=vocab_size, hidden_size=32, num_layers=2, num_heads=4,
                    intermediate_size=48, max_position_embeddings=32)


def _modern_config(vocab_size):
  hf_config = transformers.ModernBertConfig(
      vocab_size=vocab_size, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
      num_attention_heads=4, max_position_embeddings=32, global_attn_every_n_layers=2,
      local_attention=4, pad_token_id=0, cls_token_id=2, sep_token_id=3, bos_token_id=2,
      eos_token_id=3).to_dict()
  return modernbert.config_from_modernbert(hf_config)


def _workdir(tmp_path, config_of, settings):
  """A weights folder of a random bi-encoder (its encoder, as a retrieval run would export it)
  with its vocabulary; (folder, config, params, tokenizer)."""
  vocab = _vocabulary(tmp_path)
  tok = tokenizer_lib.load_vocabulary(vocab, "wordpiece", do_lower_case=True)
  config = config_of(tok.vocab_size)
  module = BiEncoder(config, settings)
  ids = np.zeros((1, 4, 4), np.int32)
  abstract = jax.eval_shape(lambda k: module.init({"params": k}, ids[:, 0], ids[:, 0], ids, ids),
                            jax.random.PRNGKey(1))["params"]
  params = random_params(nn.unbox(abstract), seed=1)
  folder = str(tmp_path / "run")
  converted.save_params(folder, {"bert": params["bert"]}, config)
  vocab_record.copy_to_workdir(vocab, "wordpiece", tok.fingerprint, folder, True)
  return folder, config, params, tok


def _ours(module, params, tok):
  rows = [[tok.cls_id, *tok.encode(t)[:MAX_SEQ - 2], tok.sep_id] for t in TEXTS]
  ids = np.zeros((len(rows), max(map(len, rows))), np.int32)
  for i, row in enumerate(rows):
    ids[i, :len(row)] = row
  fn = jax.jit(lambda p, i, m: module.apply({"params": p}, i, m, method=BiEncoder.embed))
  return np.asarray(fn(params, ids, (ids > 0).astype(np.int32)))


@pytest.mark.parametrize("family,pooling,normalize", [("bert", "mean", True),
                                                      ("bert", "cls", False),
                                                      ("modernbert", "mean", True)])
def test_sentence_transformers_loads_the_export_and_gives_our_vectors(tmp_path, family, pooling,
                                                                      normalize):
  settings = ContrastiveConfig(pooling=pooling, normalize=normalize)
  config_of, export = {"bert": (_bert_config, convert_hf.export_folder),
                       "modernbert": (_modern_config, convert_modernbert.export_folder)}[family]
  folder, config, params, tok = _workdir(tmp_path, config_of, settings)
  out = str(tmp_path / "export")
  said = export(folder, out, sentence=SentenceVectors(pooling, normalize, MAX_SEQ))
  assert "sentence-transformers" in said
  model = sentence_transformers.SentenceTransformer(out, device="cpu")
  theirs = model.encode(TEXTS, convert_to_numpy=True, batch_size=4)
  ours = _ours(BiEncoder(config, settings), params, tok)
  assert np.abs(ours).max() > 0.05 and np.std(ours[:, 0]) > 1e-3  # vectors of substance
  np.testing.assert_allclose(theirs, ours, atol=1e-5, rtol=0)
  assert model.max_seq_length == MAX_SEQ
  assert os.path.isdir(os.path.join(out, "2_Normalize")) == normalize
  similarity = json.load(open(os.path.join(out, "config_sentence_transformers.json")))
  assert similarity["similarity_fn_name"] == ("cosine" if normalize else "dot")


def test_a_later_export_replaces_the_module_folders(tmp_path):
  out = str(tmp_path / "export")
  with outfolder.ExportFolder(out) as folder:
    os.makedirs(folder.folder("2_Normalize"), exist_ok=True)
    with open(folder.path("1_Pooling/config.json"), "w") as f:
      f.write("{}")
  with outfolder.ExportFolder(out) as folder:  # no normalisation this time
    with open(folder.path("1_Pooling/config.json"), "w") as f:
      f.write('{"new": 1}')
  assert sorted(os.listdir(out)) == ["1_Pooling"]
  assert json.load(open(os.path.join(out, "1_Pooling", "config.json"))) == {"new": 1}
  with pytest.raises(Refusal, match="pooling"):
    SentenceVectors("max", True, 12)
