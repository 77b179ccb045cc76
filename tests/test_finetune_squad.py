"""SQuAD: tokenizer offsets, windows and max context, decoding back to the original text, bad
input, and the official EM / F1 on hand-made cases."""

import json
import logging
import os
import re
import unicodedata

import numpy as np
import pytest

from bertjax.data import tokenizer as tokenizer_lib
from bertjax.data.normalize import original_normalize
from bertjax.finetune.kit import squad_metrics as metrics, squad_postprocess as post
from bertjax.finetune.tasks import squad
from bertjax.inputs import questions

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "q", "?", ",", ".", "!", "'", "new", "york",
         "city", "cafe", "muller", "zoe", "s", "born", "in", "1895", "renee", "\u6771", "\u4eac",
         "the", "was", "ist", "where", "what", "who"] + [f"w{i}" for i in range(80)]


@pytest.fixture(scope="module")
def wp(tmp_path_factory):
  path = tmp_path_factory.mktemp("vocab") / "vocab.txt"
  path.write_text("\n".join(SPECIALS + WORDS + ["##s", "##e"]) + "\n")
  return tokenizer_lib.load_tokenizer(str(path))


def _example(qid, question, context, answer=None, start=None, impossible=False):
  if answer is None:
    return questions.SquadExample(qid, question, context, (), (), impossible, None)
  start = context.index(answer) if start is None else start
  return questions.SquadExample(qid, question, context, (answer,), (start,), False,
                                (start, start + len(answer)))


def _write(path, paragraphs):
  path.write_text(json.dumps({"version": "v2.0", "data": [{"title": "t",
                                                            "paragraphs": paragraphs}]}))
  return str(path)


# Unicode the normalizer changes in length or drops: accents (precomposed and combining), a
# dotted capital I (lower-cases to two characters), CJK (gets spaces), controls, a soft hyphen,
# extra spaces, tabs, curly quotes.
HARD_TEXTS = ["Born in  New   York City, the Caf\u00e9 M\u00fcller!",
              "Rene\u0301e was\t\tin \u6771\u4eac.",
              "Zo\u00eb\u2019s  \u0130st \u00a0alpha\x00beta ga\u00admma", "  ", ""]


def test_wordpiece_offsets_point_into_the_original_text(wp):
  for text, (ids, start_N, end_N) in zip(HARD_TEXTS, wp.encode_with_offsets(HARD_TEXTS)):
    assert list(ids) == wp.encode(text)
    assert np.all(start_N < end_N) and np.all(start_N[1:] >= end_N[:-1])  # ordered, disjoint
    for i, s, e in zip(ids, start_N, end_N):
      piece = text[s:e]
      assert piece == piece.strip()
      if wp.pieces[i] != "[UNK]":
        # The original characters normalize to exactly the piece (a ## piece continues a word;
        # CJK characters get spaces around them).
        normalized = original_normalize(piece, True).strip()
        assert normalized == wp.pieces[i].removeprefix("##")
  (_, s, e), = wp.encode_with_offsets(["Caf\u00e9 M\u00fcller"])
  assert [(int(a), int(b)) for a, b in zip(s, e)] == [(0, 4), (5, 11)]
  # A combining accent that normalization drops stays with the word it ends.
  (_, s, e), = wp.encode_with_offsets(["Cafe\u0301 x"])
  assert "Cafe\u0301 x"[s[0]:e[0]] == "Cafe\u0301"


def test_sentencepiece_offsets_cover_every_non_space_character(tmp_path):
  sentences = [f"Alpha beta caf\u00e9 number {i} in New York, Zo\u00eb says!" for i in range(200)]
  tok = tokenizer_lib.load_tokenizer(tokenizer_lib.train_sentencepiece(
      sentences, vocab_size=60, output=str(tmp_path / "spm")))
  texts = ["Alpha   beta  caf\u00e9 \uff01 Zo\u00eb", "New York, 12 ."]
  for text, (ids, start_N, end_N) in zip(texts, tok.encode_with_offsets(texts)):
    assert list(ids) == tok.encode(text)
    spans = [text[s:e] for s, e in zip(start_N, end_N)]
    # In order and without the spaces SentencePiece puts before a word, the spans are the text.
    assert "".join(spans) == "".join(text.split())
    assert all(span == span.strip() for span in spans)


def test_max_context_by_hand():
  # Windows 0..4, 2..6, 4..8 of 9 tokens; score = min(left, right) + 0.01 * 5. Token 3: 1.05 in
  # windows 0 and 1 (tie: the first); token 4: 2.05 in window 1; token 5: 1.05 in 1 and 2 (first).
  assert list(questions.max_context_W([(0, 5), (2, 5), (4, 5)], 9)) == [0, 0, 0, 0, 1, 1, 2, 2, 2]
  # Window lengths break ties of min(left, right): token 2 scores 1 + 0.04 in 0..3 and 1 + 0.05
  # in 1..5.
  assert list(questions.max_context_W([(0, 4), (1, 5)], 6)) == [0, 0, 1, 1, 1, 1]


def test_windows_by_hand():
  # 20 tokens, windows of 8 every 5: 0..7, 5..12, 10..17, then 15..19 reaches the end.
  assert questions._windows(20, 8, 5) == [(0, 8), (5, 8), (10, 8), (15, 5)]
  # A stride over the window moves by the window: 0..3, 4..7, 8..9. No context: one empty window.
  assert questions._windows(10, 4, 6) == [(0, 4), (4, 4), (8, 2)]
  assert questions._windows(0, 4, 2) == [(0, 0)]


def _original_windows(n, max_doc, stride):
  spans, start = [], 0
  while start < n:
    length = min(n - start, max_doc)
    spans.append((start, length))
    if start + length == n:
      break
    start += min(length, stride)
  return spans


def _original_best(spans, pos):
  best, best_score = None, None
  for w, (s, n) in enumerate(spans):
    if s <= pos <= s + n - 1:
      score = min(pos - s, s + n - 1 - pos) + 0.01 * n
      if best_score is None or score > best_score:
        best, best_score = w, score
  return best


# Windows of 19 tokens every 7, 16 every 5, and (stride over the window) 59 then 1.
@pytest.mark.parametrize("max_seq_length,doc_stride", [(24, 7), (21, 5), (64, 128)])
def test_windows_reach_every_answer_and_mark_the_max_context(wp, max_seq_length, doc_stride):
  context = " ".join(f"w{i}" for i in range(60))  # 60 one-token words
  examples = [_example(f"q{i}", "q ?", context, " ".join(f"w{j}" for j in range(i, i + 3)))
              for i in range(58)]
  feats = questions.make_features(examples, wp, max_seq_length=max_seq_length,
                                  doc_stride=doc_stride, max_query_length=8)
  word_starts = [context.index(f"w{i} ") if i < 59 else context.index("w59") for i in range(60)]
  max_doc = max_seq_length - 2 - 3  # the query "q ?" is 2 tokens
  spans = _original_windows(60, max_doc, doc_stride)
  assert set(range(60)) == {p for s, n in spans for p in range(s, s + n)}
  for e, ex in enumerate(examples):
    rows = np.flatnonzero(feats["example_index"] == e)
    assert len(rows) == len(spans)
    reached = False
    for w, (f, (s, n)) in enumerate(zip(rows, spans)):
      starts = feats["token_start_char"][f]
      ctx = np.flatnonzero(starts >= 0)
      assert list(starts[ctx]) == word_starts[s:s + n]  # the original's windows, in order
      flags = feats["token_is_max_context"][f, ctx]
      assert list(flags) == [_original_best(spans, p) == w for p in range(s, s + n)]
      sp, ep = feats["start_positions"][f], feats["end_positions"][f]
      if sp:
        reached = True
        got = ex.context[feats["token_start_char"][f, sp]:feats["token_end_char"][f, ep]]
        assert got == ex.answers[0]
      else:
        assert ep == 0 and not (s <= e and e + 2 < s + n)  # [CLS] only when not wholly inside
    # Windows overlapping by 2 tokens or more hold every 3-token answer whole; without overlap
    # (stride >= window, which make_features warns of) an answer across the cut is in none.
    if max_doc - doc_stride >= 2:
      assert reached, f"answer of {ex.qas_id} is in no window"


def test_feature_layout(wp):
  ex = _example("a", "where born ?", "alpha beta gamma", "beta")
  feats = questions.make_features([ex], wp, max_seq_length=12, max_query_length=2)
  # [CLS] where born [SEP] alpha beta gamma [SEP]: the query is cut to 2 tokens.
  assert [wp.pieces[i] for i in feats["input_ids"][0, :8]] == [
      "[CLS]", "where", "born", "[SEP]", "alpha", "beta", "gamma", "[SEP]"]
  assert list(feats["segment_ids"][0]) == [0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0]
  assert list(feats["input_mask"][0]) == [1] * 8 + [0] * 4
  assert (feats["start_positions"][0], feats["end_positions"][0]) == (5, 5)
  with pytest.raises(ValueError, match="max_seq_length 40 leaves no room"):
    questions.make_features([ex], wp, max_seq_length=40, max_query_length=64)


CONTEXTS = [("Born in  New   York City, the Caf\u00e9  M\u00fcller was born in 1895.",
             ["New   York City", "Caf\u00e9  M\u00fcller", "1895"]),
            ("Rene\u0301e was in \u6771\u4eac; Zo\u00eb\u2019s \u0130st was\u00a0 in  alpha.",
             ["Rene\u0301e", "\u6771\u4eac", "Zo\u00eb\u2019s", "\u0130st was\u00a0 in  alpha"])]


def _oracle_logits(feats):
  F, L = feats["input_ids"].shape
  start, end = np.zeros((F, L), np.float32), np.zeros((F, L), np.float32)
  start[np.arange(F), feats["start_positions"]] = 10
  end[np.arange(F), feats["end_positions"]] = 10
  return start, end


def test_decoded_answers_are_the_exact_original_substrings(wp, tmp_path):
  paragraphs = [{"context": c, "qas": [{"id": f"{p}-{i}", "question": "what ?", "answers": [
      {"text": a, "answer_start": c.index(a)}]} for i, a in enumerate(answers)]}
                for p, (c, answers) in enumerate(CONTEXTS)]
  data = questions.read_squad_json(_write(tmp_path / "dev.json", paragraphs), is_training=False)
  feats = questions.make_features(data.examples, wp, max_seq_length=14, doc_stride=4,
                                  max_query_length=4)
  assert feats["input_ids"].shape[0] > len(data.examples)  # several windows per question
  result = post.postprocess(data.examples, feats, *_oracle_logits(feats))
  assert result.predictions == {ex.qas_id: ex.answers[0] for ex in data.examples}
  for ex in data.examples:
    assert all(e["text"] in ex.context for e in result.nbest[ex.qas_id])
  scores = metrics.evaluate_v1(metrics.gold_answers(data.examples), result.predictions)
  assert scores == {"exact_match": 100.0, "f1": 100.0}


def _one_window(wp):
  ex = _example("x", "q", "alpha beta gamma delta epsilon w0 w1 w2", "beta gamma")
  return ex, questions.make_features([ex], wp, max_seq_length=16, max_query_length=4)


def test_candidate_filters(wp):
  # [CLS]0 q1 [SEP]2 alpha3 beta4 gamma5 delta6 epsilon7 w0..w2 [SEP]11; all logits 0 but
  # "beta gamma" = (4, 5), which scores 10, and a tempting pair scoring 40.
  ex, feats = _one_window(wp)
  L = feats["input_ids"].shape[1]

  def predict(tempt, max_answer_length=30):
    start, end = np.zeros((1, L), np.float32), np.zeros((1, L), np.float32)
    start[0, 4], end[0, 5] = 5, 5
    for (s, e) in tempt:
      start[0, s], end[0, e] = 20, 20
    return post.postprocess([ex], feats, start, end,
                            max_answer_length=max_answer_length).predictions["x"]

  # The candidates themselves (their texts would be empty and skipped anyway): inside the context,
  # in order, not too long.
  start, end = np.random.default_rng(0).normal(size=(2, 1, L)).astype(np.float32)
  f_C, s_C, e_C = post._candidates(feats, start, end, 20, 3)
  assert len(f_C) and np.all((s_C >= 3) & (e_C <= 10) & (s_C <= e_C) & (e_C - s_C < 3))
  assert predict([]) == "beta gamma"
  assert predict([(1, 1)]) == "beta gamma"  # the question token is no answer
  # (6, 3) ends before it starts; the best valid pairs start at 6 and score 20: (6, 6) is
  # tried before (6, 7) (equal end logits: the lower position ranks first).
  assert predict([(6, 3)]) == "delta"
  # alpha..epsilon is 5 tokens: with at most 3, (3, 5) = 20 + 5 is the best.
  assert predict([(3, 7)], max_answer_length=3) == "alpha beta gamma"


def test_start_must_be_the_max_context_token(wp):
  # 10 words, 6 per window, stride 4: windows 0..5 and 4..9; w5 has its max context in window 1
  # (min(5-4, 9-5) = 1 there, 0 in window 0).
  context = " ".join(f"w{i}" for i in range(10))
  ex = _example("m", "q", context, "w5 w6")
  feats = questions.make_features([ex], wp, max_seq_length=10, doc_stride=4, max_query_length=1)
  assert feats["input_ids"].shape[0] == 2
  off = 3  # [CLS] q [SEP]
  start, end = np.full((2, 10), -100, np.float32), np.full((2, 10), -100, np.float32)
  start[0, off + 5], end[0, off + 5] = 20, 20  # "w5" in window 0, where w5 is not max context
  start[1, off + 1], end[1, off + 2] = 3, 3  # "w5 w6" in window 1
  result = post.postprocess([ex], feats, start, end)
  assert result.predictions["m"] == "w5 w6"


def test_nbest_and_v2_null_threshold(wp, tmp_path):
  ex, feats = _one_window(wp)
  L = feats["input_ids"].shape[1]
  start, end = np.zeros((1, L), np.float32), np.zeros((1, L), np.float32)
  start[0, 4], end[0, 5] = 5, 5  # "beta gamma" = 10
  start[0, 0], end[0, 0] = 6, 6  # null = 12: null - best = 2
  for threshold, want in ((0.0, ""), (2.0, "beta gamma"), (2.5, "beta gamma")):
    r = post.postprocess([ex], feats, start, end, version_2_with_negative=True,
                         null_score_diff_threshold=threshold)
    assert r.predictions["x"] == want and r.null_odds["x"] == pytest.approx(2.0)
  nbest = r.nbest["x"]
  assert (nbest[0]["text"], nbest[0]["start_logit"], nbest[0]["end_logit"]) == ("", 6.0, 6.0)
  assert nbest[1]["text"] == "beta gamma"
  texts = [e["text"] for e in nbest]
  assert len(texts) == len(set(texts)) == 20  # 36 spans of 8 words, null included, cut at 20
  totals = [e["start_logit"] + e["end_logit"] for e in nbest]
  assert totals == sorted(totals, reverse=True)
  assert sum(e["probability"] for e in nbest) == pytest.approx(1.0)
  # e^12 / (e^12 + e^10 + ...): the null is the most probable.
  assert nbest[0]["probability"] > nbest[1]["probability"] > nbest[2]["probability"]
  paths = post.write_predictions(r, str(tmp_path / "out"))
  assert [os.path.basename(p) for p in paths] == ["predictions.json", "nbest_predictions.json",
                                                  "null_odds.json"]
  assert json.load(open(paths[0])) == {"x": "beta gamma"}
  assert list(json.load(open(paths[1]))["x"][0]) == ["text", "probability", "start_logit",
                                                     "end_logit"]


def test_nbest_texts_are_unique(wp):
  ex = _example("u", "q", "w1 w2 w1", "w1")
  feats = questions.make_features([ex], wp, max_seq_length=10, max_query_length=1)
  start, end = np.zeros((1, 10), np.float32), np.zeros((1, 10), np.float32)
  start[0, [3, 5]], end[0, [3, 5]] = [5, 4], [5, 4]  # "w1" at 3 (score 10) and at 5 (8)
  nbest = post.postprocess([ex], feats, start, end).nbest["u"]
  texts = [e["text"] for e in nbest]
  # 6 spans of 3 tokens, 5 distinct texts: the second "w1" is dropped.
  assert texts == ["w1", "w1 w2 w1", "w1 w2", "w2 w1", "w2"]
  assert (nbest[0]["start_logit"], nbest[0]["end_logit"]) == (5.0, 5.0)


def test_v2_null_score_is_the_lowest_over_the_windows(wp):
  context = " ".join(f"w{i}" for i in range(10))
  ex = _example("m", "q", context, "w5 w6")
  feats = questions.make_features([ex], wp, max_seq_length=10, doc_stride=4, max_query_length=1)
  start, end = np.zeros((2, 10), np.float32), np.zeros((2, 10), np.float32)
  start[:, 0], end[:, 0] = [3, 1], [3, 1]  # null scores 6 and 2: the null is 2, from window 1
  start[1, 4], end[1, 5] = 0.5, 0.5  # best non-null "w5 w6" = 1
  r = post.postprocess([ex], feats, start, end, version_2_with_negative=True)
  assert r.null_odds["m"] == pytest.approx(1.0) and r.predictions["m"] == ""
  assert {"text": "", "probability": pytest.approx(r.nbest["m"][0]["probability"]),
          "start_logit": 1.0, "end_logit": 1.0} in r.nbest["m"]
  with pytest.raises(ValueError, match="do not match the 2 features"):
    post.postprocess([ex], feats, start[:1], end[:1])


def test_bad_files_name_the_file_and_the_question(tmp_path, caplog):
  empty = tmp_path / "empty.json"
  empty.write_text("  \n")
  with pytest.raises(ValueError, match=re.escape(f"{empty} is empty")):
    questions.read_squad_json(str(empty), is_training=True)
  broken = tmp_path / "broken.json"
  broken.write_text('{"data": [\n\n  {"paragraphs": }]}')
  with pytest.raises(ValueError, match=re.escape(f"{broken}:3:")):
    questions.read_squad_json(str(broken), is_training=True)
  with pytest.raises(FileNotFoundError, match="nowhere.json"):
    questions.read_squad_json(str(tmp_path / "nowhere.json"), is_training=True)
  no_question = _write(tmp_path / "nq.json",
                       [{"context": "c", "qas": [{"id": "q7", "answers": []}]}])
  with pytest.raises(ValueError, match=r"nq.json: data\[0\].paragraphs\[0\].qas\[0\] \(id 'q7'\) "
                                       r"lacks 'question'"):
    questions.read_squad_json(no_question, is_training=False)
  twice = _write(tmp_path / "twice.json", [{"context": "c", "qas": [
      {"id": "d", "question": "?", "answers": [], "is_impossible": True}] * 2}])
  with pytest.raises(ValueError, match="twice.json: question id 'd' appears twice"):
    questions.read_squad_json(twice, is_training=False)

  context = "alpha beta gamma"
  path = _write(tmp_path / "train.json", [{"context": context, "qas": [
      {"id": "good", "question": "?", "answers": [{"text": "beta", "answer_start": 6}]},
      {"id": "off", "question": "?", "answers": [{"text": "beta", "answer_start": 7}]},
      {"id": "none", "question": "?", "answers": []},
      {"id": "null", "question": "?", "answers": [], "is_impossible": True}]}])
  with caplog.at_level(logging.WARNING):
    train = questions.read_squad_json(path, is_training=True)
  assert [ex.qas_id for ex in train.examples] == ["good", "null"]
  assert [q for q, _ in train.skipped] == ["off", "none"]
  assert "'beta' does not match the context at answer_start 7 ('eta ')" in train.skipped[0][1]
  assert "train.json: skipped 2 question(s)" in caplog.text and "off:" in caplog.text
  # Evaluation keeps every question (the totals must not change), without a training target.
  dev = questions.read_squad_json(path, is_training=False)
  assert [ex.qas_id for ex in dev.examples] == ["good", "off", "none", "null"]
  assert dev.examples[1].answer_span is None and [q for q, _ in dev.unmatched] == ["off", "none"]
  only_bad = _write(tmp_path / "bad.json", [{"context": "c", "qas": [
      {"id": "o", "question": "?", "answers": [{"text": "x", "answer_start": 0}]}]}])
  with pytest.raises(ValueError, match="bad.json holds no usable question"):
    questions.read_squad_json(only_bad, is_training=True)


def test_tfds_is_never_downloaded(tmp_path, monkeypatch):
  with pytest.raises(FileNotFoundError, match=f"squad/v1.1 is not built under {tmp_path}"):
    squad.read_squad_tfds("squad/v1.1", "train", data_dir=str(tmp_path), is_training=True)
  with pytest.raises(ValueError, match="use one of"):
    squad.read_squad_tfds("squad", "train", data_dir=str(tmp_path), is_training=True)

  # TFDS's own records (bytes, answers as parallel arrays), from a stand-in builder.
  import tensorflow_datasets as tfds
  record = {"id": b"t1", "title": b"T", "context": "Caf\u00e9 alpha".encode(),
            "question": b"what ?", "is_impossible": False,
            "answers": {"text": np.array(["Caf\u00e9".encode(), b"alpha"], object),
                        "answer_start": np.array([0, 5], np.int32)}}

  class Builder:
    data_dir = str(tmp_path)
    info = type("Info", (), {"splits": {"validation": None}})

    def is_prepared(self):
      return True

    def as_dataset(self, split, shuffle_files):
      return [record]

  monkeypatch.setattr(tfds, "builder", lambda name, data_dir: Builder())
  monkeypatch.setattr(tfds, "as_numpy", lambda ds: ds)
  got = squad.read_squad_tfds("squad/v2.0", "validation", data_dir=str(tmp_path),
                              is_training=False).examples
  assert got == [questions.SquadExample("t1", "what ?", "Caf\u00e9 alpha", ("Caf\u00e9", "alpha"),
                                        (0, 5), False, (0, 4))]
  with pytest.raises(ValueError, match=r"no split 'train'; it has \['validation'\]"):
    squad.read_squad_tfds("squad/v2.0", "train", data_dir=str(tmp_path), is_training=True)


def test_normalize_answer():
  # lower -> drop punctuation ("cat's" -> "cats", "a-ok" -> "aok") -> drop whole-word articles
  # ("theater" stays) -> one space between words.
  assert metrics.normalize_answer("The  Cat's, a-ok!") == "cats aok"
  assert metrics.normalize_answer("An apple at the\ttheater") == "apple at theater"
  assert metrics.normalize_answer("  ") == ""
  assert unicodedata.normalize("NFC", metrics.normalize_answer("Caf\u00e9!")) == "caf\u00e9"


def test_v1_metrics_by_hand():
  gold = {"q1": ["Broncos", "The Denver Broncos"], "q2": ["1895"], "q3": ["NYC", "New York City"]}
  preds = {"q1": "denver broncos!", "q2": "in 1895", "q3": "York"}
  # q1: EM 1, F1 1 (the second gold; the first gives EM 0). q2: [in, 1895] vs [1895]: P 1/2, R 1
  # -> F1 2/3, EM 0. q3: [york] vs "NYC" 0, vs [new, york, city]: P 1, R 1/3 -> F1 1/2; EM 0.
  # EM = 1/3 = 33.33%; F1 = (1 + 2/3 + 1/2) / 3 = 72.22%.
  got = metrics.evaluate_v1(gold, preds)
  assert got["exact_match"] == pytest.approx(100 / 3) and got["f1"] == pytest.approx(650 / 9)
  # An unanswered question counts 0: EM 1/4 = 25%, F1 (13/6) / 4 = 54.17%.
  got = metrics.evaluate_v1({**gold, "q4": ["x"]}, preds)
  assert got["exact_match"] == pytest.approx(25.0) and got["f1"] == pytest.approx(1300 / 24)
  assert metrics.f1_score("", "") == 0.0 and metrics.f1_score("", "", version_2=True) == 1.0


def test_v2_metrics_by_hand():
  gold = {"a": ["Paris"], "b": ["the Seine", "Seine river"], "c": [], "d": [], "e": ["the", "Rome"],
          "f": ["The"]}
  preds = {"a": "Paris", "b": "river", "c": "", "d": "Lyon", "e": "", "f": ""}
  # Raw: a EM 1 F1 1; b EM 0, F1 max(0, [river] vs [seine, river] = 2/3); c: "" for no answer,
  # EM 1 F1 1; d EM 0 F1 0; e: gold "the" normalizes to nothing and is dropped, "" vs "Rome":
  # EM 0 F1 0; f: no gold text is left, so "" is the gold: EM 1 F1 1 (and it counts as HasAns).
  # exact = 3/6 = 50%, f1 = (1 + 2/3 + 1 + 1) / 6; HasAns (a, b, e, f): f1 = (1 + 2/3 + 1) / 4.
  got = metrics.evaluate_v2(gold, preds)
  assert got["exact"] == 50.0 and got["f1"] == pytest.approx((11 / 3) / 6 * 100)
  assert got["HasAns_total"] == 4 and got["HasAns_f1"] == pytest.approx((8 / 3) / 4 * 100)
  assert got["NoAns_exact"] == 50.0 and "best_f1" not in got
  for q in "ef":
    del gold[q], preds[q]
  null_odds = {"a": -3.0, "b": 0.5, "c": 2.0, "d": 1.5}
  got = metrics.evaluate_v2(gold, preds, null_odds)
  # na_prob > 1.0 counts as "no answer": c (correct either way) and d (now correct: 1).
  # exact = (1 + 0 + 1 + 1) / 4 = 75%; f1 = (1 + 2/3 + 1 + 1) / 4 = 91.67%.
  assert got["exact"] == 75.0 and got["f1"] == pytest.approx((11 / 3) / 4 * 100)
  assert (got["HasAns_exact"], got["NoAns_exact"], got["NoAns_total"]) == (50.0, 100.0, 2)
  # Best threshold: start at 2 (both no-answers right), answer in order a (-3), b (0.5), d (1.5),
  # c (2.0). exact: a +1 -> 3 (best, at -3), b +0, d -1 ("Lyon" for no answer), c +0 -> 3/4.
  # f1: a +1 -> 3, b +2/3 -> 11/3 (best, at 0.5), d -1, c +0 -> (11/3)/4 = 91.67%.
  assert (got["best_exact"], got["best_exact_thresh"]) == (75.0, -3.0)
  assert got["best_f1"] == pytest.approx((11 / 3) / 4 * 100) and got["best_f1_thresh"] == 0.5
  with pytest.raises(ValueError, match=r"1 of 4 questions have no prediction \(e.g. \['d'\]\)"):
    metrics.evaluate_v2(gold, {k: v for k, v in preds.items() if k != "d"})


def test_benchmark_runs_small():
  # Its documented command line (absl flags, the benchmark named as an argument).
  import subprocess, sys  # pylint: disable=import-outside-toplevel,multiple-imports
  out = subprocess.run([sys.executable, "-m", "bertjax.benchmark", "finetune", "squad",
                        "--train_questions", "60", "--train_contexts=12", "--dev_questions=30",
                        "--dev_contexts=6", "--whole_words=500"], capture_output=True, text=True,
                       check=True, timeout=300).stdout
  assert "train features: 60 questions" in out and "questions/s" in out
  assert "post-processing v2.0: 30 questions" in out
