"""GLUE: every task's files in GLUE's own layout, features, truncation, submissions, bad input."""

import logging
import os

import numpy as np
import pytest

from bertjax.finetune.tasks import glue
from bertjax.inputs import pairs

VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "sat", "dog", "ran", "a",
         "b", ".", "?", '"']
ID = {p: i for i, p in enumerate(VOCAB)}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
  from bertjax.data.tokenizer import load_tokenizer
  path = tmp_path_factory.mktemp("vocab") / "vocab.txt"
  path.write_text("\n".join(VOCAB) + "\n")
  return load_tokenizer(str(path))


def _write(root, rel, text):
  path = os.path.join(str(root), rel)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w", encoding="utf-8") as f:
    f.write(text)
  return path


MNLI_HEAD = ("index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse\t"
             "sentence1_parse\tsentence2_parse\tsentence1\tsentence2")
PARSES = "( the cat )\t( a dog )\t(ROOT the cat)\t(ROOT a dog)"
STSB_HEAD = "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2"

# (task, split, file, its text as GLUE distributes it, expected (text_a, text_b, label, index)).
LAYOUTS = [
    ("CoLA", "train", "CoLA/train.tsv",  # no header
     "gj04\t1\t\tthe cat sat .\ngj04\t0\t*\tcat the sat .\n",
     [("the cat sat .", None, "1", 0), ("cat the sat .", None, "0", 1)]),
    ("CoLA", "dev", "CoLA/dev.tsv", "gj04\t0\t*\tsat cat .\n", [("sat cat .", None, "0", 0)]),
    ("CoLA", "test", "CoLA/test.tsv", "index\tsentence\n0\tthe dog ran .\n1\tran .\n",
     [("the dog ran .", None, None, 0), ("ran .", None, None, 1)]),
    ("SST-2", "train", "SST-2/train.tsv", "sentence\tlabel\nthe cat sat \t1\n",
     [("the cat sat ", None, "1", 0)]),
    ("SST-2", "dev", "SST-2/dev.tsv", "sentence\tlabel\na dog ran . \t0\n",
     [("a dog ran . ", None, "0", 0)]),
    ("SST-2", "test", "SST-2/test.tsv", "index\tsentence\n0\tthe cat .\n",
     [("the cat .", None, None, 0)]),
    ("MRPC", "train", "MRPC/train.tsv",  # starts with the BOM of Microsoft's original file
     "\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String\n1\t702876\t702977\tthe cat sat .\t"
     "a cat sat .\n", [("the cat sat .", "a cat sat .", "1", 0)]),
    ("MRPC", "dev", "MRPC/dev.tsv",
     "Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n0\t1\t2\tthe cat\tthe dog\n",
     [("the cat", "the dog", "0", 0)]),
    ("MRPC", "test", "MRPC/test.tsv",
     "index\t#1 ID\t#2 ID\t#1 String\t#2 String\n0\t1089874\t1089925\tthe dog\ta dog\n",
     [("the dog", "a dog", None, 0)]),
    ("STS-B", "train", "STS-B/train.tsv",
     STSB_HEAD + "\tscore\n0\tmain-captions\tMSRvid\t2012test\t0001\tnone\tnone\tthe cat sat .\t"
     "a cat sat .\t5.000\n", [("the cat sat .", "a cat sat .", 5.0, 0)]),
    ("STS-B", "dev", "STS-B/dev.tsv",
     STSB_HEAD + "\tscore\n0\tmain-captions\tMSRvid\t2012test\t0000\tnone\tnone\tthe cat\ta dog\t"
     "0.250\n", [("the cat", "a dog", 0.25, 0)]),
    ("STS-B", "test", "STS-B/test.tsv",
     STSB_HEAD + "\n7\tmain-captions\tMSRvid\t2012test\t0024\tnone\tnone\tthe cat\tthe dog\n",
     [("the cat", "the dog", None, 7)]),
    ("QQP", "train", "QQP/train.tsv",
     "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n133273\t213221\t213222\tthe cat ?\t"
     "a cat ?\t1\n", [("the cat ?", "a cat ?", "1", 0)]),
    ("QQP", "dev", "QQP/dev.tsv",
     "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n201359\t303345\t303346\tthe dog ?\t"
     "a cat ?\t0\n", [("the dog ?", "a cat ?", "0", 0)]),
    ("QQP", "test", "QQP/test.tsv", "id\tquestion1\tquestion2\n0\tthe cat ?\tthe dog ?\n",
     [("the cat ?", "the dog ?", None, 0)]),
    ("MNLI", "train", "MNLI/train.tsv",  # quotes are text: GLUE's files are not CSV-quoted
     MNLI_HEAD + "\tlabel1\tgold_label\n0\t31193\t31193n\tgovernment\t" + PARSES +
     '\t"the cat\ta dog "\tneutral\tneutral\n', [('"the cat', 'a dog "', "neutral", 0)]),
    ("MNLI", "dev_matched", "MNLI/dev_matched.tsv",
     MNLI_HEAD + "\tlabel1\tlabel2\tlabel3\tlabel4\tlabel5\tgold_label\n0\t63735\t63735n\tslate\t" +
     PARSES + "\tthe cat\ta dog\tentailment\tneutral\tneutral\tneutral\tcontradiction\tneutral\n",
     [("the cat", "a dog", "neutral", 0)]),
    ("MNLI", "dev_mismatched", "MNLI/dev_mismatched.tsv",
     MNLI_HEAD + "\tlabel1\tlabel2\tlabel3\tlabel4\tlabel5\tgold_label\n0\t75290\t75290c\tletters\t"
     + PARSES + "\tthe dog\ta cat\tcontradiction\tcontradiction\tcontradiction\tcontradiction\t"
     "contradiction\tcontradiction\n", [("the dog", "a cat", "contradiction", 0)]),
    ("MNLI", "test_matched", "MNLI/test_matched.tsv",
     MNLI_HEAD + "\n0\t31493\t31493\ttravel\t" + PARSES + "\tthe cat\tthe dog\n",
     [("the cat", "the dog", None, 0)]),
    ("MNLI", "test_mismatched", "MNLI/test_mismatched.tsv",
     MNLI_HEAD + "\n3\t75290\t75290\tletters\t" + PARSES + "\ta cat\ta dog\n",
     [("a cat", "a dog", None, 3)]),
    ("QNLI", "train", "QNLI/train.tsv",
     "index\tquestion\tsentence\tlabel\n0\tthe cat ?\tthe cat sat .\tentailment\n",
     [("the cat ?", "the cat sat .", "entailment", 0)]),
    ("QNLI", "dev", "QNLI/dev.tsv",
     "index\tquestion\tsentence\tlabel\n0\tthe dog ?\tthe cat sat .\tnot_entailment\n",
     [("the dog ?", "the cat sat .", "not_entailment", 0)]),
    ("QNLI", "test", "QNLI/test.tsv", "index\tquestion\tsentence\n0\ta ?\tb .\n",
     [("a ?", "b .", None, 0)]),
    ("RTE", "train", "RTE/train.tsv",
     "index\tsentence1\tsentence2\tlabel\n0\tthe cat sat .\ta cat sat .\tentailment\n",
     [("the cat sat .", "a cat sat .", "entailment", 0)]),
    ("RTE", "dev", "RTE/dev.tsv",
     "index\tsentence1\tsentence2\tlabel\n0\tthe cat\ta dog\tnot_entailment\n",
     [("the cat", "a dog", "not_entailment", 0)]),
    ("RTE", "test", "RTE/test.tsv", "index\tsentence1\tsentence2\n0\ta\tb\n",
     [("a", "b", None, 0)]),
    ("WNLI", "train", "WNLI/train.tsv", "index\tsentence1\tsentence2\tlabel\n0\ta cat\tb\t1\n",
     [("a cat", "b", "1", 0)]),
    ("WNLI", "dev", "WNLI/dev.tsv", "index\tsentence1\tsentence2\tlabel\n0\ta\tb\t0\n",
     [("a", "b", "0", 0)]),
    ("WNLI", "test", "WNLI/test.tsv", "index\tsentence1\tsentence2\n0\ta\tb\n",
     [("a", "b", None, 0)]),
    ("AX", "test", "diagnostic/diagnostic.tsv",
     "index\tsentence1\tsentence2\n0\tthe cat sat .\tthe cat did not sit .\n",
     [("the cat sat .", "the cat did not sit .", None, 0)]),
    # The built-in task of `make finetune` (not GLUE), written in RTE's layout.
    ("NEXT", "train", "NEXT/train.tsv", "index\tsentence1\tsentence2\tlabel\n0\ta .\tb .\t1\n",
     [("a .", "b .", "1", 0)]),
    ("NEXT", "dev", "NEXT/dev.tsv", "index\tsentence1\tsentence2\tlabel\n3\ta .\tc .\t0\n",
     [("a .", "c .", "0", 0)]),
    ("NEXT", "test", "NEXT/test.tsv", "index\tsentence1\tsentence2\n7\ta\tb\n",
     [("a", "b", None, 7)]),
]


def test_every_task_and_split_has_a_layout_case():
  assert {(t, s) for t, s, *_ in LAYOUTS} == {(t.name, s) for t in glue.TASKS.values()
                                              for s in t.splits}


@pytest.mark.parametrize("task,split,rel,text,expected", LAYOUTS,
                         ids=[f"{t}-{s}" for t, s, *_ in LAYOUTS])
def test_reads_each_split_in_glues_layout(tmp_path, task, split, rel, text, expected):
  _write(tmp_path, rel, text)
  # Windows line ends read the same.
  _write(tmp_path / "crlf", rel, text.replace("\n", "\r\n"))
  for root in (tmp_path, tmp_path / "crlf"):
    examples, skipped = glue.read_glue_tsv(str(root), task, split)
    assert [(e.text_a, e.text_b, e.label, e.index) for e in examples] == expected
    assert skipped == []
  assert examples[0].guid.endswith(f"{rel}:{1 if glue.TASKS[task].splits[split].header is None else 2}")


def test_task_lookup_by_glue_or_tfds_name():
  assert glue.get_task("sts-b") is glue.get_task("stsb") is glue.TASKS["STS-B"]
  assert glue.get_task("mnli").labels == ("contradiction", "entailment", "neutral")
  assert glue.TASKS["STS-B"].is_regression and glue.TASKS["STS-B"].num_labels == 1
  with pytest.raises(ValueError, match="Unknown GLUE task 'squad'"):
    glue.get_task("squad")
  with pytest.raises(ValueError, match=r"MNLI has no split 'dev'; its splits: .*dev_matched"):
    glue.read_glue_tsv("/nonexistent", "MNLI", "dev")


QQP_HEAD = "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n"


def test_qqp_malformed_rows_are_skipped_counted_and_named(tmp_path, caplog):
  # A question holding a newline splits its row in two, as in the distributed QQP train.tsv.
  _write(tmp_path, "QQP/train.tsv", QQP_HEAD + "0\t1\t2\tthe cat ?\ta cat ?\t1\n"
         "1\t3\t4\tthe dog\n ran ?\ta dog ?\t0\n2\t5\t6\ta ?\tb ?\t0\n")
  with caplog.at_level(logging.WARNING):
    examples, skipped = glue.read_glue_tsv(str(tmp_path), "QQP", "train")
  assert [e.index for e in examples] == [0, 1]
  assert [e.text_a for e in examples] == ["the cat ?", "a ?"]
  assert len(skipped) == 2
  assert skipped[0].endswith("QQP/train.tsv:3: 4 column(s), QQP train rows have 6")
  assert "QQP/train.tsv:4: 3 column(s)" in skipped[1]
  assert "left out 2 malformed row(s) of 4" in caplog.text
  with pytest.raises(ValueError, match=r"QQP/train.tsv:3: 4 column\(s\).*skip_bad_rows=True"):
    glue.read_glue_tsv(str(tmp_path), "QQP", "train", skip_bad_rows=False)


BAD_INPUTS = [
    ("MRPC", "train", "MRPC/train.tsv",
     "Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n1\t1\t2\tthe cat\n",
     r"MRPC/train.tsv:2: 4 column\(s\), MRPC train rows have 5; fix the row"),
    ("RTE", "dev", "RTE/dev.tsv", "index\tsentence1\tsentence2\tlabel\n0\ta\tb\tentailment\n\n"
     "1\ta\tb\tentailment\n", r"RTE/dev.tsv:3: 1 column\(s\).*\(a blank line\)"),
    ("RTE", "train", "RTE/train.tsv", "index\tsentence1\tsentence2\tlabel\n0\ta\tb\tentailed\n",
     r"RTE/train.tsv:2: label 'entailed' is not one of RTE's labels \['entailment', "
     r"'not_entailment'\]"),
    ("MNLI", "dev_matched", "MNLI/dev_matched.tsv",
     MNLI_HEAD + "\tlabel1\tlabel2\tlabel3\tlabel4\tlabel5\tgold_label\n0\t1\t1n\tslate\t" + PARSES
     + "\ta\tb\t-\t-\t-\t-\t-\t-\n", r"MNLI/dev_matched.tsv:2: label '-' is not one of"),
    ("CoLA", "train", "CoLA/train.tsv", "source\tlabel\tmark\tsentence\ngj04\t1\t\ta .\n",
     r"CoLA/train.tsv:1: label 'label' is not one of CoLA's"),  # a header CoLA does not have
    ("STS-B", "train", "STS-B/train.tsv", STSB_HEAD + "\tscore\n0\tg\tf\ty\t1\tn\tn\ta\tb\t5.5\n",
     r"STS-B/train.tsv:2: STS-B label '5.5' is not a similarity score in \[0, 5\]"),
    ("STS-B", "dev", "STS-B/dev.tsv", STSB_HEAD + "\tscore\n0\tg\tf\ty\t1\tn\tn\ta\tb\thigh\n",
     r"STS-B/dev.tsv:2: STS-B label 'high'"),
    ("SST-2", "train", "SST-2/train.tsv", "", r"SST-2/train.tsv: the file is empty"),
    ("SST-2", "dev", "SST-2/dev.tsv", "sentence\tlabel\n", r"SST-2/dev.tsv: no SST-2 dev rows"),
    ("SST-2", "test", "SST-2/test.tsv", "0\tthe cat\n",
     r"SST-2/test.tsv:1: expected a header row starting with 'index'"),
    ("QNLI", "test", "QNLI/test.tsv", "index\tquestion\tsentence\nx\ta\tb\n",
     r"QNLI/test.tsv:2: index 'x' is not an integer"),
]


@pytest.mark.parametrize("task,split,rel,text,message", BAD_INPUTS,
                         ids=[m.split(":")[0].replace("\\", "") for *_, m in BAD_INPUTS])
def test_bad_input_names_the_file_and_line(tmp_path, task, split, rel, text, message):
  _write(tmp_path, rel, text)
  with pytest.raises(ValueError, match=message):
    glue.read_glue_tsv(str(tmp_path), task, split)


def test_missing_file_names_the_path_and_layout(tmp_path):
  with pytest.raises(FileNotFoundError, match=r"MNLI test_mismatched: no file .*"
                     r"MNLI/test_mismatched.tsv\. data_dir should be laid out as GLUE's download"):
    glue.read_glue_tsv(str(tmp_path), "MNLI", "test_mismatched")


def _reference_truncate(a, b, budget):
  a, b = list(a), list(b)
  while len(a) + len(b) > budget:
    (a if len(a) > len(b) else b).pop()
  return a, b


@pytest.mark.parametrize("len_a,len_b,budget,expected", [
    (5, 2, 4, (2, 2)), (3, 3, 4, (2, 2)), (4, 3, 4, (2, 2)), (10, 1, 5, (4, 1)),
    (2, 2, 3, (2, 1)),  # a tie loses from B
    (1, 9, 6, (1, 5)), (3, 2, 10, (3, 2)), (0, 7, 3, (0, 3))])
def test_longest_first_truncation(len_a, len_b, budget, expected):
  a, b = list(range(100, 100 + len_a)), list(range(200, 200 + len_b))
  got_a, got_b = pairs.truncate_pair(a, b, budget)
  assert (len(got_a), len(got_b)) == expected
  assert (got_a, got_b) == _reference_truncate(a, b, budget)
  assert got_a == a[:len(got_a)] and got_b == b[:len(got_b)]  # from the end, never the front


def test_pair_features_layout_and_truncation(tok):
  task = glue.TASKS["MNLI"]
  examples = [glue.Example("x:1", "the cat sat .", "a dog ran", "entailment", 4),
              glue.Example("x:2", "the cat the cat the cat", "a", "neutral", 5),
              glue.Example("x:3", "cat", "dog", None, 6)]
  f = glue.glue_features(task, examples, tok, max_seq_length=8)
  i = ID
  np.testing.assert_array_equal(f["input_ids"], [
      # 4 + 3 tokens for a budget of 5: A loses 1, then B (a tie) 1.
      [i["[CLS]"], i["the"], i["cat"], i["sat"], i["[SEP]"], i["a"], i["dog"], i["[SEP]"]],
      [i["[CLS]"], i["the"], i["cat"], i["the"], i["cat"], i["[SEP]"], i["a"], i["[SEP]"]],
      [i["[CLS]"], i["cat"], i["[SEP]"], i["dog"], i["[SEP]"], 0, 0, 0]])
  np.testing.assert_array_equal(f["segment_ids"], [[0, 0, 0, 0, 0, 1, 1, 1],
                                                   [0, 0, 0, 0, 0, 0, 1, 1],
                                                   [0, 0, 0, 1, 1, 0, 0, 0]])
  np.testing.assert_array_equal(f["input_mask"][2], [1, 1, 1, 1, 1, 0, 0, 0])
  # Label ids in the original's MNLI order; -1 where the split is unlabeled.
  np.testing.assert_array_equal(f["label"], [1, 2, -1])
  assert f["label"].dtype == np.int32 and f["input_ids"].dtype == np.int32
  np.testing.assert_array_equal(f["index"], [4, 5, 6])


def test_single_sentence_and_regression_features(tok):
  f = glue.glue_features("SST-2", [glue.Example("x", "the cat sat . the dog ran .", None, "1", 0)],
                         tok, max_seq_length=5)
  np.testing.assert_array_equal(f["input_ids"][0], [ID["[CLS]"], ID["the"], ID["cat"], ID["sat"],
                                                    ID["[SEP]"]])
  np.testing.assert_array_equal(f["segment_ids"][0], 0)
  f = glue.glue_features("STS-B", [glue.Example("x", "a", "b", 3.8, 0),
                                   glue.Example("y", "a", "b", None, 1)], tok, max_seq_length=6)
  assert f["label"].dtype == np.float32 and f["label"][0] == pytest.approx(3.8)
  assert np.isnan(f["label"][1])
  with pytest.raises(ValueError, match=r"here:7: label 'yes' is not one of RTE's labels"):
    glue.glue_features("RTE", [glue.Example("here:7", "a", "b", "yes", 0)], tok, 8)
  with pytest.raises(ValueError, match="max_seq_length 3 leaves no room"):
    glue.glue_features("MRPC", [glue.Example("x", "a", "b", "1", 0)], tok, max_seq_length=3)


@pytest.mark.parametrize("task,split,file_name,predictions,lines", [
    ("CoLA", "test", "CoLA.tsv", [1, 0], ["1", "0"]),
    ("SST-2", "test", "SST-2.tsv", [0, 1], ["0", "1"]),
    ("MRPC", "test", "MRPC.tsv", [1, 1], ["1", "1"]),
    ("STS-B", "test", "STS-B.tsv", [4.56789, 0.1], ["4.568", "0.100"]),
    ("QQP", "test", "QQP.tsv", [0, 1], ["0", "1"]),
    ("MNLI", "test_matched", "MNLI-m.tsv", [0, 2], ["contradiction", "neutral"]),
    ("MNLI", "test_mismatched", "MNLI-mm.tsv", [1, 0], ["entailment", "contradiction"]),
    ("QNLI", "test", "QNLI.tsv", [1, 0], ["not_entailment", "entailment"]),
    ("RTE", "test", "RTE.tsv", [0, 1], ["entailment", "not_entailment"]),
    ("WNLI", "test", "WNLI.tsv", [1, 0], ["1", "0"]),
    ("AX", "test", "AX.tsv", [2, 1], ["neutral", "entailment"]),
])
def test_submission_files(tmp_path, task, split, file_name, predictions, lines, caplog):
  with caplog.at_level(logging.WARNING):
    path = glue.write_submission(str(tmp_path / "out"), task, split, [1, 0], predictions)
  assert os.path.basename(path) == file_name
  # Rows sorted by index, label names as GLUE expects them.
  with open(path) as f:
    assert f.read() == f"index\tprediction\n0\t{lines[1]}\n1\t{lines[0]}\n"
  assert f"{file_name} holds 2 predictions; the GLUE server expects" in caplog.text
  assert os.listdir(tmp_path / "out") == [file_name]


def test_submission_refusals(tmp_path):
  with pytest.raises(ValueError, match=r"GLUE takes predictions of MNLI's test split\(s\) "
                     r"\['test_matched', 'test_mismatched'\], not of 'dev_matched'"):
    glue.write_submission(str(tmp_path), "MNLI", "dev_matched", [0], [0])
  with pytest.raises(ValueError, match=r"prediction id 2 is not a label id 0\.\.1"):
    glue.write_submission(str(tmp_path), "RTE", "test", [0, 1], [0, 2])
  with pytest.raises(ValueError, match="repeated indices"):
    glue.write_submission(str(tmp_path), "RTE", "test", [0, 0], [0, 1])
  with pytest.raises(ValueError, match="2 indices for 1 predictions"):
    glue.write_submission(str(tmp_path), "RTE", "test", [0, 1], [0])


def test_tfds_dataset_not_built_is_an_error_naming_where(tmp_path):
  with pytest.raises(FileNotFoundError, match=r"TFDS dataset glue/mrpc is not built under "
                     + str(tmp_path) + r"/glue/mrpc/.*never downloads"):
    glue.read_glue_tfds(str(tmp_path), "MRPC", "dev")
  assert os.listdir(tmp_path) == []  # nothing was fetched or created


def test_tfds_rows_map_to_the_tasks_labels():
  # TFDS numbers MNLI entailment, neutral, contradiction; the original contradiction, entailment,
  # neutral: the mapping goes by name.
  mnli = glue.TASKS["MNLI"]
  rows = [{"premise": b"the cat", "hypothesis": b"a dog", "label": 0, "idx": 9},
          {"premise": b"a", "hypothesis": b"b", "label": 2, "idx": 3}]
  examples, _ = glue.examples_from_tfds(mnli, "dev_matched", rows,
                                        ["entailment", "neutral", "contradiction"], "t")
  assert [(e.text_a, e.text_b, e.label, e.index) for e in examples] == [
      ("the cat", "a dog", "entailment", 9), ("a", "b", "contradiction", 3)]
  cola = [{"sentence": b"the cat", "label": 1, "idx": 0}]
  examples, _ = glue.examples_from_tfds(glue.TASKS["CoLA"], "train", cola,
                                        ["unacceptable", "acceptable"], "t")
  assert (examples[0].text_b, examples[0].label) == (None, "1")
  test_rows = [{"sentence1": b"a", "sentence2": b"b", "label": -1, "idx": 0}]
  examples, _ = glue.examples_from_tfds(glue.TASKS["RTE"], "test", test_rows,
                                        ["entailment", "not_entailment"], "t")
  assert examples[0].label is None
  sts = [{"sentence1": b"a", "sentence2": b"b", "label": np.float32(2.5), "idx": 0}]
  assert glue.examples_from_tfds(glue.TASKS["STS-B"], "dev", sts, None, "t")[0][0].label == 2.5
  with pytest.raises(ValueError, match="TFDS label names .* not supported"):
    glue.examples_from_tfds(mnli, "train", rows, ["contradiction", "entailment", "neutral"], "t")
  with pytest.raises(ValueError, match="t #0: label id 5 is outside RTE's 2 labels"):
    glue.examples_from_tfds(glue.TASKS["RTE"], "dev", [dict(test_rows[0], label=5)],
                            ["entailment", "not_entailment"], "t")
