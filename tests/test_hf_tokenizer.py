"""A Hugging Face tokenizer.json as a tokenizer kind (bertjax/data/hf_tokenizer.py): the ids and
type ids of transformers' fast tokenizer for the same file, exact character offsets, whole-word
masking by the byte-level pre-tokenizer's words, and a ModernBERT folder as a complete init_from
(fine-tuning, prediction, export). The reference tokenizer is trained here: byte-level BPE with
ModernBERT's special tokens after the pieces ([PAD] not at 0) and its template."""

import csv
import json
import os
import re
import shutil

import numpy as np
import pytest

from bertjax.data import hf_tokenizer, masking, prepare, tokenizer as tokenizer_lib, vocab_record
from bertjax.finetune.job import run
from bertjax.formats import vocabulary
from bertjax.inputs import pairs, questions, tagged, word_windows
from bertjax.predict import predictor as predict_lib
from bertjax.weights import reader as weights
import finetune_fixtures as fx

SPECIALS = ("[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]")  # ModernBERT's order, after the pieces
CORPUS = ["The quick brown fox jumps over the lazy dog.", "Café naïve résumé, déjà vu!",
          "Don't stop believing: 123 roads and 4.5 miles.", "Ünïcödé tëxt with àccents façade",
          "Tabs\tand\nnew lines  and   runs of spaces",
          "日本語のテキスト and emoji 🙂 here"] * 20
TEXTS = ["Hello  world, Café!", "  leading and trailing  ", "déjà\tvu\n\nnewline",
         "x[CLS]y [SEP]", "🙂 emoji, 日本語", "Ünïcödé façade résumé", "", "a"]
PAIRS = [("Who is here?", "The quick fox is here."), ("Café", "naïve  résumé"), ("🙂", "日本"),
         ("", "b"), ("[MASK] token", "and [PAD]")]


def train_tokenizer(path, single="[CLS]:0 $A:0 [SEP]:0",
                    pair="[CLS]:0 $A:0 [SEP]:0 $B:1 [SEP]:1", post=True):
  from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
  from tokenizers import trainers
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
      vocab_size=420, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
  tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS])
  tok.add_tokens([AddedToken(f"[unused{k}]", special=True) for k in range(3)])
  if post:
    ids = {t: tok.token_to_id(t) for t in SPECIALS}
    tok.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=[(t, ids[t]) for t in ("[CLS]", "[SEP]")])
  tok.save(str(path))
  return str(path)


@pytest.fixture(scope="module")
def tok_file(tmp_path_factory):
  return train_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")


def fast(path):
  from transformers import PreTrainedTokenizerFast
  return PreTrainedTokenizerFast(tokenizer_file=path)


def rows_equal_transformers(tok, ref, texts_a, texts_b=None):
  features, _ = pairs.encode_pairs(texts_a, texts_b, tok, 64)
  want = ref(list(texts_a), list(texts_b) if texts_b else None)
  for i in range(len(texts_a)):
    n = int(features["input_mask"][i].sum())
    assert features["input_ids"][i, :n].tolist() == want["input_ids"][i], (texts_a[i], i)
    assert features["segment_ids"][i, :n].tolist() == want["token_type_ids"][i]
    assert n == sum(want["attention_mask"][i])


def test_ids_and_type_ids_equal_transformers_singles_and_pairs(tok_file):
  tok = tokenizer_lib.load_vocabulary(tok_file)
  assert tok.kind == "huggingface" and tok.pad_id == tok.vocab_size - 5 and tok.vocab_size > 400
  assert tok.pieces[0] == "!"  # id 0 is a real piece; [PAD] far from it
  ref = fast(tok_file)
  rows_equal_transformers(tok, ref, TEXTS)
  rows_equal_transformers(tok, ref, [a for a, _ in PAIRS], [b for _, b in PAIRS])
  # A special token's surface form in a text is that token, as transformers reads it.
  assert tok.encode("x[CLS]y") == [ref.convert_tokens_to_ids(t) for t in ("x", "[CLS]", "y")]


def test_the_files_template_decides_the_frame_and_a_file_without_one_frames_berts(tmp_path):
  # No final [SEP]: the file's frame, not BERT's (red when bertjax framed rows as BERT does).
  path = train_tokenizer(tmp_path / "short.json", single="[CLS] $A", pair="[CLS] $A [SEP] $B:1")
  tok = tokenizer_lib.load_vocabulary(path)
  rows_equal_transformers(tok, fast(path), TEXTS)
  rows_equal_transformers(tok, fast(path), [a for a, _ in PAIRS], [b for _, b in PAIRS])
  assert tok.template.specials(False) == 1 and tok.template.specials(True) == 2
  # No post-processor: BERT's frame, as pre-training's rows (transformers would frame a text
  # bare and refuse a pair).
  tok = tokenizer_lib.load_vocabulary(train_tokenizer(tmp_path / "bare.json", post=False))
  features, _ = pairs.encode_pairs(["Who is here?"], ["The fox."], tok, 32)
  a, b = tok.encode("Who is here?"), tok.encode("The fox.")
  n = len(a) + len(b) + 3
  assert features["input_ids"][0, :n].tolist() == [tok.cls_id, *a, tok.sep_id, *b, tok.sep_id]
  assert features["segment_ids"][0, :n].tolist() == [0] * (len(a) + 2) + [1] * (len(b) + 1)
  features, _ = pairs.encode_pairs(["Who is here?"], None, tok, 32)
  assert features["input_ids"][0, :len(a) + 2].tolist() == [tok.cls_id, *a, tok.sep_id]


def test_a_pair_is_framed_alike_in_pre_training_and_fine_tuning_without_a_post_processor(
    tmp_path):
  """A tokenizer.json without a post-processor: a pre-training row (prepared with NSP, read by
  the input pipeline, its masked ids put back), the fine-tuning row of its two texts, and
  transformers' on an export's tokenizer.json have the same ids and segment ids. Red when such a
  file framed pairs only in preparation (fine-tuning refused them, and framed a single text
  without [CLS]; the export's copy, as trained, framed none)."""
  from bertjax.data import pipeline
  from test_data_fixtures import WORDS, data_config, write_corpus
  bare = train_tokenizer(tmp_path / "bare.json", post=False)
  # Two sentences a document: an IsNext pair is (first, second); a NotNext one, (first, one or
  # both of another document's). Short, so no pair is cut.
  sentences = [" ".join(WORDS[3 * k:3 * k + 3]).capitalize() + "." for k in range(24)]
  docs = [sentences[2 * d:2 * d + 2] for d in range(12)]
  c = data_config(tmp_path, n_docs=0, tokenizer="huggingface", vocab_path=bare,
                  source=write_corpus(str(tmp_path / "corpus.txt"), docs), nsp=True,
                  short_seq_prob=0.0, eval_fraction=0.0, max_seq_length=64)
  tok = tokenizer_lib.load_tokenizer(c)
  prepare.ensure_prepared(c, tok)
  text_of = {tuple(tok.encode(s)): s for s in sentences}
  batch = next(pipeline.make_pipeline(c, tok, split="train", global_batch_size=16))
  compared = 0
  for r in range(16):
    ids = batch["input_ids"][r].copy()
    weights = batch["masked_lm_weights"][r] > 0
    ids[batch["masked_lm_positions"][r][weights]] = batch["masked_lm_ids"][r][weights]
    n = int(batch["input_mask"][r].sum())
    segments = batch["segment_ids"][r][:n].tolist()
    num_a = segments.index(1)
    a, b = text_of.get(tuple(ids[1:num_a - 1])), text_of.get(tuple(ids[num_a:n - 1]))
    if a is None or b is None:
      continue  # B holds two sentences: no one text of the corpus to fine-tune on
    features, _ = pairs.encode_pairs([a], [b], tok, 64)
    assert features["input_ids"][0, :n].tolist() == ids[:n].tolist(), (a, b)
    assert features["segment_ids"][0, :n].tolist() == segments, (a, b)
    assert int(features["input_mask"][0].sum()) == n
    compared += 1
    pair, row = (a, b), (ids[:n].tolist(), segments)
  assert compared >= 8, compared
  # An export writes the file with BERT's layout: transformers frames the pair alike too.
  from types import SimpleNamespace  # pylint: disable=import-outside-toplevel
  from transformers import AutoTokenizer  # pylint: disable=import-outside-toplevel
  from bertjax.convert import hf as convert_hf  # pylint: disable=import-outside-toplevel
  out = tmp_path / "export"
  out.mkdir()
  said = convert_hf.write_tokenizer_files(
      SimpleNamespace(vocab_file=bare, tokenizer_kind="huggingface", lower=False),
      SimpleNamespace(path=lambda name: str(out / name)), SimpleNamespace(
          max_position_embeddings=64))
  assert "layout added" in said
  loaded = AutoTokenizer.from_pretrained(str(out))(*pair)
  assert (loaded["input_ids"], loaded["token_type_ids"]) == row


def test_preparation_refuses_a_post_processor_framing_otherwise_than_berts(tmp_path):
  """Preparation builds BERT's rows; a file whose post-processor frames its texts otherwise would
  be fine-tuned on rows unlike pre-training's (red when it was prepared without a word)."""
  from test_data_fixtures import data_config
  short = train_tokenizer(tmp_path / "short.json", single="[CLS] $A", pair="[CLS] $A [SEP] $B:1")
  for nsp, said in ((True, "a pair as '[CLS] $A [SEP] $B:1'"), (False, "a text as '[CLS] $A'")):
    c = data_config(tmp_path, tokenizer="huggingface", vocab_path=short, nsp=nsp)
    with pytest.raises(ValueError, match=re.escape(
        f"short.json frames {said} (its post-processor), pre-training's rows as BERT's '[CLS] "
        f"$A [SEP]{' $B:1 [SEP]:1' if nsp else ''}'")):
      prepare.ensure_prepared(c, tokenizer_lib.load_tokenizer(c))
  assert not os.path.exists(c.cache_dir)  # refused before any work


def test_a_tokenizer_json_given_as_another_kind_names_the_kind_and_a_record_its_file(
    tok_file, tmp_path):
  """tokenizer=wordpiece with a tokenizer.json said it "lacks [UNK]" (its lines read as pieces);
  bertjax's own record of a run's vocabulary, given as a tokenizer.json, was "not a tokenizer.json
  the tokenizers library reads"."""
  for kind in ("wordpiece", "sentencepiece"):
    with pytest.raises(ValueError, match=re.escape(
        f"is a Hugging Face tokenizer.json, given as a {kind} vocabulary (config.data.tokenizer="
        f"'{kind}'): set config.data.tokenizer=huggingface.")):
      tokenizer_lib.load_vocabulary(tok_file, kind)
  record = tmp_path / "run" / "tokenizer.json"
  record.parent.mkdir()
  record.write_text(json.dumps({"file": "vocab.txt", "kind": "wordpiece", "do_lower_case": True,
                                "fingerprint": "wordpiece-412-0", "copied_from": "v.txt"}))
  for kind in ("huggingface", "wordpiece", None):
    with pytest.raises(ValueError, match=re.escape(
        f"is bertjax's record of a run's vocabulary, not a vocabulary: give the file it names, "
        f"config.data.vocab_path={tmp_path / 'run' / 'vocab.txt'} with "
        f"config.data.tokenizer=wordpiece.")):
      tokenizer_lib.load_vocabulary(str(record), kind)


def test_offsets_are_exact_substrings_and_squad_answers_too(tok_file):
  tok = tokenizer_lib.load_vocabulary(tok_file)
  chars = hf_tokenizer.byte_of_char()
  texts = TEXTS + [a + " " + b for a, b in PAIRS]
  for text, (ids, start_N, end_N) in zip(texts, tok.encode_with_offsets(texts)):
    assert ids.tolist() == tok.encode(text)
    for i, s, e in zip(ids, start_N, end_N):
      piece = tok.pieces[i]
      if i in tok.special_ids:
        assert text[s:e] == piece
        continue
      data = bytes(chars[c] for c in piece)
      try:
        assert text[s:e] == data.decode("utf-8").strip(), (text, piece, s, e)
      except UnicodeDecodeError:  # part of a character at an end: the whole character
        span = text[s:e].encode("utf-8")
        assert data.strip() in span and len(span) - len(data.strip()) < 6, (text, piece, s, e)
        assert span == span.strip()
  context = "Ünïcödé façade:  déjà vu at 123 roads, then Café 🙂 naïve."
  answers = ["façade", "déjà vu", "123", "Café 🙂", "naïve"]
  examples = [questions.SquadExample(str(k), "Where?", context, (a,), (context.index(a),),
                                     answer_span=(context.index(a), context.index(a) + len(a)))
              for k, a in enumerate(answers)]
  features = questions.make_features(examples, tok, max_seq_length=64, doc_stride=16,
                                     max_query_length=8)
  for f, ex in enumerate(examples):
    s, e = features["start_positions"][f], features["end_positions"][f]
    got = context[features["token_start_char"][f, s]:features["token_end_char"][f, e]]
    assert got == ex.answers[0]


def test_whole_words_are_the_pre_tokenizers(tok_file):
  tok = tokenizer_lib.load_vocabulary(tok_file)
  ref = fast(tok_file)._tokenizer
  texts = ["Hello world, Café naïve résumé!", "Don't stop: 123abc roads 4.5 miles.",
           "日本語のテキスト and emoji 🙂 here", "quick-brown (fox) jumps"]
  for text in texts:
    enc = ref.encode(text, add_special_tokens=False)
    want = [True] + [a != b for a, b in zip(enc.word_ids, enc.word_ids[1:])]
    assert tok.word_tables.starts(enc.ids).tolist() == want, (text, enc.tokens)
  # Masking in tf.data takes the same words: every word wholly masked or not at all.
  import tensorflow as tf
  spec = masking.MaskingSpec(**{**masking.spec_from_tokenizer(tok, _data()).__dict__,
                                "whole_word_masking": True})
  L = 40
  rows, words = [], []
  for text in texts:
    enc = ref.encode(text, add_special_tokens=False)
    rows.append([tok.cls_id, *enc.ids, tok.sep_id] + [0] * (L - len(enc.ids) - 2))
    words.append([None, *enc.word_ids, None])
  ids = tf.constant(rows, tf.int32)
  mask = tf.constant([[1] * (len(w)) + [0] * (L - len(w)) for w in words], tf.int32)
  maskable = tf.logical_and(tf.cast(mask, tf.bool), tf.not_equal(ids, tok.cls_id))
  maskable = tf.logical_and(maskable, tf.not_equal(ids, tok.sep_id))
  starts = masking.word_starts(ids, maskable, spec).numpy()
  for r, w in enumerate(words):
    want = [x is not None and (p == 1 or w[p - 1] != x) for p, x in enumerate(w)]
    assert starts[r, :len(w)].tolist() == want, texts[r]
  for seed in range(4):
    _, positions, _, weights_ = masking.mask_batch(ids, mask, tf.range(len(rows)), seed=seed,
                                                   epoch=0, spec=spec)
    for r, w in enumerate(words):
      chosen = {int(p) for p, k in zip(positions[r], weights_[r]) if k > 0}
      assert chosen
      for word in {w[p] for p in chosen}:
        assert chosen >= {p for p, x in enumerate(w) if x == word}, (texts[r], chosen)


def _data():
  from bertjax.configs import base
  from bertjax.data.config import DataConfig
  return DataConfig.from_config(base.get_config().data)


def test_hugging_faces_tokenizer_json_is_not_taken_for_bertjaxs_record(tok_file, tmp_path):
  """A BERT folder's vocab.txt beside a fast tokenizer's tokenizer.json: the casing is the
  folder's (its name here), not a record's default; an old record still reads as one."""
  from test_data_fixtures import write_vocab
  folder = tmp_path / "cased_L-2_H-128"
  folder.mkdir()
  write_vocab(str(folder / "vocab.txt"), ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
  shutil.copyfile(tok_file, folder / "tokenizer.json")
  assert vocab_record.read_record(str(folder)) is None
  assert vocabulary.folder_casing(str(folder))[0] is False
  (folder / "tokenizer.json").write_text(json.dumps(
      {"file": "vocab.txt", "kind": "wordpiece", "do_lower_case": True, "fingerprint": "x"}))
  assert vocab_record.read_record(str(folder))["fingerprint"] == "x"
  assert vocabulary.folder_casing(str(folder))[0] is True


def test_modernbert_ids_fit_uint16_shards_and_zero_is_a_real_id():
  assert prepare.id_dtype(50_368) == "uint16" and prepare.id_dtype(65_536) == "uint16"
  assert prepare.id_dtype(65_537) == "int32"  # past uint16's ids 0..65535 the shards hold int32
  from bertjax.data import pipeline
  ids = np.array([[50281, 0, 7, 0, 50282, 0, 0], [50281, 5, 50282, 0, 0, 0, 0]], np.int32)
  assert pipeline.real_positions(ids).numpy().tolist() == [[1, 1, 1, 1, 1, 0, 0],
                                                           [1, 1, 1, 0, 0, 0, 0]]


def test_preparation_and_pipeline_with_a_tokenizer_json(tok_file, tmp_path):
  """Pre-training data: shards of the file's ids (its id 0, "!", a real piece inside sequences),
  rows zero-filled, input_mask up to the closing [SEP], whole words masked by the file's words."""
  from bertjax.data import pipeline
  from test_data_fixtures import data_config, write_corpus
  sentences = [t + "!" for t in CORPUS[:6]]
  docs = [[sentences[(d + k) % 6] for k in range(8)] for d in range(12)]
  c = data_config(tmp_path, n_docs=0, tokenizer="huggingface", vocab_path=tok_file,
                  source=write_corpus(str(tmp_path / "corpus.txt"), docs),
                  whole_word_masking=True, eval_fraction=0.0)
  tok = tokenizer_lib.load_tokenizer(c)
  prepare.ensure_prepared(c, tok)
  b = next(pipeline.make_pipeline(c, tok, split="train", global_batch_size=8))
  inside_zeros = 0
  for r in range(8):
    ids, mask = b["input_ids"][r], b["input_mask"][r]
    n = int(mask.sum())
    assert mask[:n].all() and ids[0] == tok.cls_id and ids[n - 1] == tok.sep_id
    assert not ids[n:].any()
    inside_zeros += int((ids[:n] == 0).sum())
    positions = b["masked_lm_positions"][r][b["masked_lm_weights"][r] > 0]
    assert len(positions) and (positions < n).all()
  assert inside_zeros > 0


# A ModernBERT folder as the whole init_from --------------------------------------------------

@pytest.fixture(scope="module")
def modern_folder(tok_file, tmp_path_factory):
  import torch
  from transformers import ModernBertConfig, ModernBertForMaskedLM
  tok = tokenizer_lib.load_vocabulary(tok_file)
  folder = tmp_path_factory.mktemp("modernbert")
  config = ModernBertConfig(
      vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
      num_attention_heads=2, max_position_embeddings=64, local_attention=8,
      global_attn_every_n_layers=2, pad_token_id=tok.pad_id, cls_token_id=tok.cls_id,
      sep_token_id=tok.sep_id, bos_token_id=tok.cls_id, eos_token_id=tok.sep_id)
  torch.manual_seed(0)
  ModernBertForMaskedLM(config).save_pretrained(str(folder))
  shutil.copyfile(tok_file, folder / "tokenizer.json")
  return str(folder)


def write_csv(path, rows):
  with open(path, "w", newline="", encoding="utf-8") as f:
    w = csv.DictWriter(f, list(rows[0]))
    w.writeheader()
    w.writerows(rows)
  return str(path)


def test_a_modernbert_folder_is_a_complete_init_from(modern_folder, tok_file, tmp_path,
                                                    monkeypatch):
  import jax
  source = weights.inspect(modern_folder)
  assert (source.tokenizer_kind, os.path.basename(source.vocab_file)) == ("huggingface",
                                                                          "tokenizer.json")
  assert source.do_lower_case is False and "normalizer" in source.casing_why
  # Pre-training from the folder takes its tokenizer the same way (config.data names none).
  from bertjax.pretrain import job as pretrain_job
  data = pretrain_job._init_vocabulary(_data(), source)  # pylint: disable=protected-access
  assert (data.tokenizer, data.vocab_path) == ("huggingface", source.vocab_file)
  assert tokenizer_lib.load_tokenizer(data).fingerprint == tokenizer_lib.load_vocabulary(
      tok_file).fingerprint
  rows = [{"text": f"{w} Café naïve {k}", "label": w} for k in range(16)
          for w in ("déjà", "quick")]
  config = fx.ft_config("classification", modern_folder, batch_size=16, num_epochs=1)
  config.data.train_file = write_csv(tmp_path / "train.csv", rows)
  config.data.dev_file = write_csv(tmp_path / "dev.csv", rows[:8])
  workdir = str(tmp_path / "run")
  builds = fx.Builds(monkeypatch, devices=jax.devices()[:1])  # one device: a third less compiling
  run.finetune(config, workdir)
  # The encoder the run starts from is the folder's, its embedding rows indexed by the file's ids.
  table = weights.read(source)[weights.ENCODER]["embeddings"]["word_embeddings"]["embedding"]
  np.testing.assert_array_equal(
      builds.first_params[weights.ENCODER]["embeddings"]["word_embeddings"]["embedding"], table)
  record = vocab_record.read_record(workdir)
  assert record["kind"] == "huggingface" and record["file"] == "hf_tokenizer.json"
  tok = tokenizer_lib.load_vocabulary(tok_file)
  assert record["fingerprint"] == tok.fingerprint
  # Prediction with the workdir alone: its copy of the tokenizer, the same ids.
  p = predict_lib.Predictor.from_workdir(workdir)
  assert p.tokenizer.fingerprint == tok.fingerprint
  texts = ["déjà Café naïve 3", "quick Café", "  Naïve   déjà\tvu 🙂"]
  out = p(texts)
  assert all(set(r["probabilities"]) == {"déjà", "quick"} for r in out)
  # And back out to transformers with nothing but the workdir: its class, labels and tokenizer
  # give the probabilities bertjax.predict gave, text for text.
  import torch
  import transformers
  from bertjax.convert import modernbert as convert_modernbert
  exported = str(tmp_path / "exported")
  convert_modernbert.export_folder(workdir, exported)
  hf_tok = transformers.AutoTokenizer.from_pretrained(exported)
  hf_model = transformers.AutoModelForSequenceClassification.from_pretrained(
      exported, attn_implementation="eager").eval()
  assert type(hf_model).__name__ == "ModernBertForSequenceClassification"
  with torch.no_grad():
    logits = hf_model(**hf_tok(texts, return_tensors="pt", padding=True)).logits
  probs = torch.softmax(logits, -1).numpy()
  for row, want in zip(out, probs):
    got = [row["probabilities"][hf_model.config.id2label[i]] for i in range(len(want))]
    np.testing.assert_allclose(got, want, atol=1e-4)
  # Tagging from the same folder: windows framed by the file's template, each word as it reads.
  sentences = [tagged.Sentence("s", ("Café", "naïve", "résumé"), ("B-LOC", "I-LOC", "O"))]
  feats = word_windows.make_features(sentences, tok, 16, ("O", "B-LOC", "I-LOC"))
  want = fast(tok_file)("Café naïve résumé")["input_ids"]
  assert feats["input_ids"][0, :len(want)].tolist() == want
  assert feats["label_weights"][0].sum() == 3


def test_export_writes_tokenizer_files_transformers_loads(modern_folder, tok_file, tmp_path):
  from transformers import AutoTokenizer
  from bertjax.convert import modernbert as convert_modernbert
  out = str(tmp_path / "out")
  convert_modernbert.export_folder(modern_folder, out)
  loaded = AutoTokenizer.from_pretrained(out)
  tok = tokenizer_lib.load_vocabulary(tok_file)
  for text in TEXTS:
    ids, types, _, _ = tok.template.frame(tok.encode(text))
    assert loaded(text)["input_ids"] == ids
  assert "token_type_ids" not in loaded("a")  # ModernBERT takes none
  with open(os.path.join(out, "config.json")) as f:
    config = json.load(f)
  assert (config["pad_token_id"], config["cls_token_id"]) == (tok.pad_id, tok.cls_id)
  # The import keeps the tokenizer beside the parameters, recorded by content, not by name.
  imported = str(tmp_path / "imported")
  convert_modernbert.import_folder(modern_folder, imported)
  source = weights.inspect(imported)
  assert source.kind == "converted" and source.tokenizer_kind == "huggingface"
  assert os.path.basename(source.vocab_file) == "hf_tokenizer.json"
  assert source.fingerprint == tok.fingerprint


def test_padding_ids_do_not_reach_real_positions(modern_folder):
  """Rows are padded with [PAD]'s id by the feature builders and with zeros by prediction and the
  pre-training pipeline: the real positions' outputs are the same bits either way."""
  import jax
  from bertjax.model.encoder import BertModel
  tok = tokenizer_lib.load_vocabulary(os.path.join(modern_folder, "tokenizer.json"))
  source = weights.inspect(modern_folder)
  params = weights.read(source)[weights.ENCODER]
  features, _ = pairs.encode_pairs(["Café naïve", "a"], ["résumé", "déjà vu 🙂"], tok, 24)
  assert (features["input_ids"][features["input_mask"] == 0] == tok.pad_id).all()
  model = BertModel(source.config)
  apply = jax.jit(lambda ids: model.apply({"params": params}, ids, features["input_mask"],
                                          features["segment_ids"], deterministic=True)[0])
  zeros = np.where(features["input_mask"] == 1, features["input_ids"], 0)
  real = features["input_mask"] == 1
  assert np.array_equal(np.asarray(apply(features["input_ids"]))[real],
                        np.asarray(apply(zeros))[real])
