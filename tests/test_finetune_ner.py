"""CoNLL-2003 NER: column files, IOB1/IOB2, first-piece labels, windows, conlleval counting."""

import os
import random

import numpy as np
import pytest

from bertjax.finetune.families import tagging
from bertjax.finetune.tasks import ner
from bertjax.inputs import tagged, word_windows

VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "eu", "reject", "##s", "german", "call",
         "to", "boy", "##cott", "british", "lamb", ".", "peter", "black", "##burn"]
ID = {p: i for i, p in enumerate(VOCAB)}
L = {t: k for k, t in enumerate(ner.CONLL2003_LABELS)}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
  from bertjax.data.tokenizer import load_tokenizer
  path = tmp_path_factory.mktemp("vocab") / "vocab.txt"
  path.write_text("\n".join(VOCAB) + "\n")
  return load_tokenizer(str(path))


# The start of CoNLL-2003's eng.train as released: IOB1 (I- opens an entity, B- only between two
# adjacent entities of one type), POS and chunk columns, -DOCSTART- and blank lines.
IOB1 = """-DOCSTART- -X- O O

EU NNP I-NP I-ORG
rejects VBZ I-VP O
German JJ I-NP I-MISC
call NN I-NP O
to TO I-VP O
boycott VB I-VP O
British JJ I-NP I-MISC
lamb NN I-NP O
. . O O

Peter NNP I-NP I-PER
Blackburn NNP I-NP I-PER
EU NNP I-NP I-ORG
German JJ I-NP B-ORG

-DOCSTART- -X- O O

Peter NNP I-NP I-PER
"""
IOB2_TAGS = [("B-ORG", "O", "B-MISC", "O", "O", "O", "B-MISC", "O", "O"),
             ("B-PER", "I-PER", "B-ORG", "B-ORG"), ("B-PER",)]


def _write(tmp_path, text, name="eng.train"):
  path = os.path.join(str(tmp_path), name)
  with open(path, "w") as f:
    f.write(text)
  return path


def test_reads_iob1_column_file_as_iob2(tmp_path):
  path = _write(tmp_path, IOB1)
  sentences = ner.read_conll(path)
  assert [s.tags for s in sentences] == IOB2_TAGS
  assert sentences[0].words[:3] == ("EU", "rejects", "German")
  assert [s.where for s in sentences] == [f"{path}:3", f"{path}:13", f"{path}:20"]


def test_iob2_file_reads_the_same(tmp_path):
  lines, tags = [], iter(t for s in IOB2_TAGS for t in s)
  for line in IOB1.splitlines():
    fields = line.split()
    if fields and fields[0] != "-DOCSTART-":
      fields[-1] = next(tags)
    lines.append(" ".join(fields))
  iob1 = ner.read_conll(_write(tmp_path, IOB1, "a"))
  iob2 = ner.read_conll(_write(tmp_path, "\n".join(lines) + "\n", "b"))
  assert [(s.words, s.tags) for s in iob1] == [(s.words, s.tags) for s in iob2]


def test_two_column_file_and_tag_column(tmp_path):
  path = _write(tmp_path, "EU\tB-ORG\tx\ncall\tO\tx\n\n\n")
  assert ner.read_conll(path, tag_column=1)[0].tags == ("B-ORG", "O")


@pytest.mark.parametrize("text,message", [
    ("EU NNP I-NP I-ORG\nrejects VBZ I-VP\n", r"eng.train:2: 3 column\(s\), expected 4"),
    ("EU NNP I-NP I-ORG\n\nNew York NNP I-NP I-LOC\n", r"eng.train:3: 5 column\(s\), expected 4"),
    ("EU NNP I-NP I-ORG\nx NN I-NP I-DATE\n", r"eng.train:2: tag 'I-DATE' is not one of"),
    ("EU NNP I-NP ORG\n", r"eng.train:1: tag 'ORG' is not one of"),
    ("EU\n", r"eng.train:1: one column"),
    ("", r"eng.train: no sentences"),
    ("-DOCSTART- -X- O O\n\n", r"eng.train: no sentences"),
])
def test_bad_input_names_the_file_and_line(tmp_path, text, message):
  with pytest.raises(ValueError, match=message):
    ner.read_conll(_write(tmp_path, text))


def test_missing_file(tmp_path):
  with pytest.raises(FileNotFoundError, match="No CoNLL file .*eng.testa"):
    ner.read_conll(str(tmp_path / "eng.testa"))


@pytest.mark.parametrize("tags,iob2,entities", [
    (["I-PER", "I-PER", "O", "I-LOC"], ["B-PER", "I-PER", "O", "B-LOC"],
     [("PER", 0, 2), ("LOC", 3, 4)]),
    (["I-PER", "B-PER", "I-PER"], ["B-PER", "B-PER", "I-PER"], [("PER", 0, 1), ("PER", 1, 3)]),
    (["I-PER", "I-LOC"], ["B-PER", "B-LOC"], [("PER", 0, 1), ("LOC", 1, 2)]),  # type change
    (["O", "I-ORG", "I-ORG", "O"], ["O", "B-ORG", "I-ORG", "O"], [("ORG", 1, 3)]),
    (["B-MISC", "I-MISC", "B-MISC"], ["B-MISC", "I-MISC", "B-MISC"],  # IOB2 stays as it is
     [("MISC", 0, 2), ("MISC", 2, 3)]),
    (["B-PER", "I-LOC", "I-LOC"], ["B-PER", "B-LOC", "I-LOC"], [("PER", 0, 1), ("LOC", 1, 3)]),
    (["O", "O"], ["O", "O"], []),
])
def test_iob_conversion_and_conlleval_entities(tags, iob2, entities):
  assert tagged.to_iob2(tags) == iob2
  assert tagged.chunks(tags) == entities == tagged.chunks(iob2)


def _split(tag):
  return ("O", "") if tag == "O" else tuple(tag.split("-", 1))


def _conlleval_reference(gold, predicted):
  """conlleval.pl's per-token state machine (startOfChunk / endOfChunk / inCorrect), sentence
  ends read as an O; returns (correct entities, gold entities, predicted entities)."""
  def end(prev, tag, prev_type, kind):
    return ((prev in "BI" and tag in "BO") or (prev != "O" and prev_type != kind))

  def start(prev, tag, prev_type, kind):
    return (tag == "B" or (prev == "O" and tag == "I") or (tag != "O" and prev_type != kind))

  correct = found_gold = found_guessed = 0
  for g_tags, p_tags in zip(gold, predicted):
    in_correct, last = False, (("O", ""), ("O", ""))
    for g, p in zip([*g_tags, "O"], [*p_tags, "O"]):
      (cg, tg), (cp, tp) = _split(g), _split(p)
      (lcg, ltg), (lcp, ltp) = last
      if in_correct:
        g_end, p_end = end(lcg, cg, ltg, tg), end(lcp, cp, ltp, tp)
        if g_end and p_end and ltg == ltp:
          correct, in_correct = correct + 1, False
        elif g_end != p_end or tg != tp:
          in_correct = False
      g_start, p_start = start(lcg, cg, ltg, tg), start(lcp, cp, ltp, tp)
      if g_start and p_start and tg == tp:
        in_correct = True
      found_gold += g_start
      found_guessed += p_start
      last = ((cg, tg), (cp, tp))
  return correct, found_gold, found_guessed


def test_conlleval_hand_made_counts():
  gold = [["B-PER", "I-PER", "O", "B-LOC"], ["I-ORG", "I-ORG", "B-ORG"]]  # IOB2, then IOB1
  predicted = [["B-PER", "O", "O", "B-LOC"],  # PER boundary wrong, LOC right
               ["I-ORG", "I-ORG", "I-ORG"]]  # one ORG where gold has two: wrong
  result = tagging.conlleval(gold, predicted)
  assert (result["correct_entities"], result["gold_entities"], result["predicted_entities"]) == (
      1, 4, 3)
  assert result["precision"] == pytest.approx(1 / 3) and result["recall"] == pytest.approx(1 / 4)
  assert result["f1"] == pytest.approx(2 / 7)  # 2PR / (P + R)
  assert result["accuracy"] == pytest.approx(5 / 7)
  assert result["per_type"]["LOC"]["f1"] == 1.0
  assert result["per_type"]["ORG"]["predicted_entities"] == 1
  # Right span, wrong type: not counted.
  assert tagging.conlleval([["B-PER"]], [["B-ORG"]])["correct_entities"] == 0
  # I- after O in a prediction opens an entity, which matches a gold B-.
  assert tagging.conlleval([["O", "B-LOC", "I-LOC"]], [["O", "I-LOC", "I-LOC"]])["f1"] == 1.0
  assert tagging.conlleval([["O"]], [["O"]])["f1"] == 0.0  # nothing to find: 0, as conlleval prints


def test_conlleval_counts_equal_the_state_machine_on_random_tags():
  rng = random.Random(0)
  tags = list(ner.CONLL2003_LABELS)
  gold = [[rng.choice(tags) for _ in range(rng.randint(1, 12))] for _ in range(400)]
  predicted = [[t if rng.random() < 0.7 else rng.choice(tags) for t in s] for s in gold]
  result = tagging.conlleval(gold, predicted)
  assert (result["correct_entities"], result["gold_entities"], result["predicted_entities"]) == (
      _conlleval_reference(gold, predicted))
  assert 0 < result["correct_entities"] < result["gold_entities"]


def test_conlleval_refuses_misaligned_input():
  with pytest.raises(ValueError, match="Sentence 0: 1 predicted tags for 2 words"):
    tagging.conlleval([["O", "O"]], [["O"]])
  with pytest.raises(ValueError, match="Tag 'X' .* is not O, B-TYPE or I-TYPE"):
    tagging.conlleval([["X"]], [["O"]])


def test_first_piece_labels_and_weights(tok):
  s = tagged.Sentence("x", ("EU", "rejects", "boycott", "."), ("B-ORG", "O", "B-MISC", "O"))
  f = word_windows.make_features([s], tok, 10, ner.CONLL2003_LABELS)
  i = ID
  np.testing.assert_array_equal(f["input_ids"][0], [i["[CLS]"], i["eu"], i["reject"], i["##s"],
                                                    i["boy"], i["##cott"], i["."], i["[SEP]"], 0, 0])
  np.testing.assert_array_equal(f["label_weights"][0], [0, 1, 1, 0, 1, 0, 1, 0, 0, 0])
  np.testing.assert_array_equal(f["label_ids"][0], [0, L["B-ORG"], L["O"], 0, L["B-MISC"], 0,
                                                    L["O"], 0, 0, 0])
  np.testing.assert_array_equal(f["input_mask"][0], [1] * 8 + [0] * 2)
  assert not f["segment_ids"].any()


def test_long_sentence_splits_into_windows_and_joins_back(tok):
  words = ("Peter", "Blackburn", "rejects", "German", "lamb", "EU", "call", "boycott")
  tags = ("B-PER", "I-PER", "O", "B-MISC", "O", "B-ORG", "O", "O")
  short = tagged.Sentence("y", ("EU",), ("B-ORG",))
  sentences = [tagged.Sentence("x", words, tags), short]
  f = word_windows.make_features(sentences, tok, 7, ner.CONLL2003_LABELS)  # 5 pieces per window
  # Pieces per word: 1 2 2 1 1 1 1 2; whole words per window: 3 words | 4 | 1 -> 3 windows,
  # then the short sentence.
  np.testing.assert_array_equal(f["sentence_index"], [0, 0, 0, 1])
  np.testing.assert_array_equal(f["first_word"], [0, 3, 7, 0])
  assert f["label_weights"].sum() == len(words) + 1  # every word labeled exactly once
  assert (f["input_mask"].sum(1) <= 7).all()
  # Gold ids in, gold tags out; conlleval over the joined sentences then scores 1.
  predicted = np.where(f["label_weights"] > 0, f["label_ids"], L["I-LOC"])
  joined = word_windows.tags_from_predictions(f, predicted, sentences, ner.CONLL2003_LABELS)
  assert joined == [list(tags), ["B-ORG"]]
  assert tagging.conlleval([s.tags for s in sentences], joined)["f1"] == 1.0
  with pytest.raises(ValueError, match="keep the windows in order"):
    word_windows.tags_from_predictions({**f, "sentence_index": f["sentence_index"][[0, 0, 0, 1]],
                                        "first_word": f["first_word"][[1, 0, 2, 3]]}, predicted,
                                       sentences, ner.CONLL2003_LABELS)


def test_word_without_pieces_and_word_longer_than_the_window(tok):
  s = tagged.Sentence("x", ("\u200b", "Blackburn"), ("O", "B-PER"))  # a zero-width space: no pieces
  f = word_windows.make_features([s], tok, 3, ner.CONLL2003_LABELS)
  np.testing.assert_array_equal(f["input_ids"], [[ID["[CLS]"], ID["[UNK]"], ID["[SEP]"]],
                                                 [ID["[CLS]"], ID["black"], ID["[SEP]"]]])
  assert word_windows.tags_from_predictions(f, f["label_ids"], [s], ner.CONLL2003_LABELS) == [
      ["O", "B-PER"]]
  with pytest.raises(ValueError, match=r"here:3: tag\(s\) \['B-DATE'\] are not in the labels"):
    word_windows.make_features([tagged.Sentence("here:3", ("x",), ("B-DATE",))], tok, 8,
                               ner.CONLL2003_LABELS)


def test_tfds_not_built_and_rows(tmp_path):
  with pytest.raises(FileNotFoundError, match=r"TFDS dataset conll2003 is not built under "
                     + str(tmp_path) + r"/conll2003.*never downloads"):
    ner.read_conll_tfds(str(tmp_path), "train")
  assert os.listdir(tmp_path) == []
  names = list(ner.CONLL2003_LABELS)
  rows = [{"tokens": np.array([b"-DOCSTART-"])[:0], "ner": np.array([], np.int64)},
          {"tokens": np.array([b"EU", b"rejects"]), "ner": np.array([4, 0])}]  # I-ORG, O
  sentences = ner.sentences_from_tfds(rows, names, "t")
  assert [(s.words, s.tags) for s in sentences] == [(("EU", "rejects"), ("B-ORG", "O"))]
