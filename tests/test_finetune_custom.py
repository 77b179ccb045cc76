"""One's own task end to end (bertjax/finetune/kit/custom.py, bertjax/predict/predictor.py): each family trains on
small files in its formats to a score only a working path reaches, scores itself, writes its label
map, and predicts new text line by line as the run's own test predictions say; 1 and 8 devices
write the same prediction file; the readers take what real files hold (quotes with newlines, BOM,
CRLF) and refuse what they should, naming the file, line and fix.

The tasks are rules a 2-layer, 32-wide encoder learns in a few epochs (finetune_fixtures):
classification: which of four key words a text holds (plus a pair column it must ignore);
regression: how many counted words a text holds; tagging: names and places as entities.
"""

import csv
import json
import os
import random

import jax
import numpy as np
import pytest

from bertjax import errors
from bertjax.finetune import families
from bertjax.finetune.families import classification, tagging
from bertjax.finetune.job import run
from bertjax.finetune.kit import custom
from bertjax.formats import taskspec as spec_lib
from bertjax.inputs import pairs, tagged, textfiles
from bertjax.predict import predictor as predict_lib
import finetune_fixtures as fx

ROUTES = ("billing", "delivery", "login", "refund")  # the label names
KEY = dict(zip(ROUTES, fx.KEYS + fx.COUNTED[:1]))  # each route's key word




@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
  return fx.pretrain(str(tmp_path_factory.mktemp("pretrain")))


def route_rows(n, seed):
  rng = random.Random(seed)
  rows = []
  for i in range(n):
    label = ROUTES[i % len(ROUTES)]
    words = fx._words(rng, 3, 9)  # pylint: disable=protected-access
    fx._insert(rng, words, KEY[label])  # pylint: disable=protected-access
    rows.append({"id": f"r{seed}-{i}", "text": " ".join(words), "label": label})
  rng.shuffle(rows)
  return rows


def write_csv(path, rows, columns=("id", "text", "label")):
  with open(path, "w", newline="", encoding="utf-8") as f:
    w = csv.DictWriter(f, columns, extrasaction="ignore")
    w.writeheader()
    w.writerows(rows)
  return str(path)


def custom_config(task, init_from, train_file, dev_file, test_file="", **data):
  config = fx.ft_config(task, init_from, batch_size=16, num_epochs=4)
  d = config.data
  d.train_file, d.dev_file, d.test_file = str(train_file), str(dev_file), str(test_file)
  for k, v in data.items():
    d[k] = v
  return config


def read_jsonl(path):
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f]


# Classification: CSV to a score, a label map, predictions, the same on 1 and 8 devices ----------

@pytest.fixture(scope="module")
def routing(pretrained, tmp_path_factory):
  root = tmp_path_factory.mktemp("routing")
  train = write_csv(root / "train.csv", route_rows(384, 0))
  dev = write_csv(root / "dev.csv", route_rows(64, 1))
  test_rows = route_rows(40, 2)
  test = write_csv(root / "test.csv", test_rows, ("id", "text"))  # no labels: predicted only
  workdir = str(root / "run")
  config = custom_config("classification", pretrained, train, dev, test)
  config.train.class_weights = "balanced"
  results = run.finetune(fx.save_at_end(config), workdir)
  return workdir, results, test, test_rows


def test_classification_learns_and_reports(routing):
  workdir, results, _, test_rows = routing
  assert results["labels"] == sorted(ROUTES)
  best = results["best"]["scores"]
  assert best["accuracy"] >= 0.9, best  # chance is 0.25
  report = results["dev_report"]
  # The report's figures agree with its own confusion matrix.
  m = np.array(report["confusion"]["matrix"])
  assert m.sum() == 64 and report["confusion"]["labels"] == sorted(ROUTES)
  assert report["accuracy"] == pytest.approx(np.trace(m) / m.sum())
  for k, name in enumerate(sorted(ROUTES)):
    c = report["per_class"][name]
    assert c["support"] == m[k].sum() == 16
    assert c["recall"] == pytest.approx(m[k, k] / m[k].sum())
  spec = spec_lib.read(workdir)
  assert spec.family == "classification" and spec.labels == tuple(sorted(ROUTES))
  # Test rows predicted with the best checkpoint, in the file's order, with their ids.
  written = read_jsonl(os.path.join(workdir, "predictions", "test.jsonl"))
  assert [r["id"] for r in written] == [r["id"] for r in test_rows]
  right = np.mean([w["label"] == r["label"] for w, r in zip(written, test_rows)])
  assert right >= 0.9
  for w in written:
    assert set(w["probabilities"]) == set(ROUTES)
    assert w["label"] == max(w["probabilities"], key=w["probabilities"].get)


def test_predict_command_matches_the_run_and_the_api(routing, tmp_path, capsys):
  workdir, _, test, test_rows = routing
  out = str(tmp_path / "out.jsonl")
  predict_lib.run(workdir, test, out)
  assert "40 rows" in capsys.readouterr().out
  # What the run wrote for its test split, line by line (the same best checkpoint; the run
  # pads every row to max_seq_length, so the probabilities agree to rounding).
  got, ran = read_jsonl(out), read_jsonl(os.path.join(workdir, "predictions", "test.jsonl"))
  assert [(g["id"], g["label"]) for g in got] == [(r["id"], r["label"]) for r in ran]
  for g, r in zip(got, ran):
    for name, p in g["probabilities"].items():
      assert p == pytest.approx(r["probabilities"][name], abs=1e-5)
  api = predict_lib.Predictor.from_workdir(workdir)([r["text"] for r in test_rows[:5]])
  assert [a["label"] for a in api] == [r["label"] for r in read_jsonl(out)[:5]]


def test_predict_on_one_and_eight_devices_writes_the_same_file(routing, tmp_path):
  workdir, _, test, _ = routing
  outs = []
  for devices in (jax.devices()[:1], jax.devices()):
    p = predict_lib.Predictor.from_workdir(workdir, tokens_per_device=24, devices=devices)
    assert p.mesh.devices.size == len(devices)
    outs.append(str(tmp_path / f"{len(devices)}.jsonl"))
    predict_lib.predict_file(p, test, outs[-1])
  with open(outs[0], "rb") as a, open(outs[1], "rb") as b:
    assert a.read() == b.read()


def test_embed_writes_one_vector_per_row(routing, pretrained, tmp_path, capsys):
  """At the length the model was trained at, said with the pooling (was: 128 tokens, capped at
  the 64 positions, unsaid; positions past 32 no step of the fine-tuning trained)."""
  workdir, _, test, _ = routing
  for source, pooling, length, recorded in (
      (workdir, "mean", fx.SEQ, "its task.json's max_seq_length"),
      (pretrained, "cls", 64, "its config.json's data.max_seq_length")):
    out = str(tmp_path / f"{pooling}.npy")
    capsys.readouterr()
    predict_lib.run(source, test, out, mode="embed", pooling=pooling)
    said = capsys.readouterr().out
    assert f"embed: {pooling} pooling (the " in said, said
    assert f"texts cut at {length} tokens (the length it was trained at: {recorded})" in said
    vectors = np.load(out)
    assert vectors.shape == (40, 32) and np.isfinite(vectors).all()
    assert np.std(vectors, axis=0).max() > 0  # rows differ
    with open(out + ".bertjax.json") as f:
      assert json.load(f)["encoder"]["max_seq_length"] == length


def test_predict_refuses_a_pretraining_run_and_other_columns(routing, pretrained, tmp_path):
  workdir, _, _, _ = routing
  with pytest.raises(ValueError, match="no task head.*--mode=embed"):
    predict_lib.Predictor.from_workdir(pretrained)
  other = write_csv(tmp_path / "other.csv", [{"body": "x", "label": "y"}], ("body", "label"))
  p = predict_lib.Predictor.from_workdir(workdir)
  with pytest.raises(ValueError, match=r"other.csv:2: no column 'text'; the file has "
                     r"\['body', 'label'\].*--text_a"):
    predict_lib.predict_file(p, other, str(tmp_path / "o.jsonl"))
  assert not os.path.exists(tmp_path / "o.jsonl")
  # Named by a flag, the same file is read.
  assert len(p([{"text": "x"}])) == 1
  predict_lib.predict_file(p, other, str(tmp_path / "o.jsonl"), columns={"text_a": "body"})
  assert len(read_jsonl(tmp_path / "o.jsonl")) == 1


BLANKS = ["first", "", "third", "   ", "fifth refund", "sixth"]  # row 2 `""`, row 4 spaces


def test_every_input_row_gets_its_line_in_order(routing, tmp_path, capsys):
  """A one-column file whose rows include an empty text (`""`, as csv writes it) and one of
  spaces: six rows in, six lines out, line k the prediction of row k (was: 4 lines, shifted)."""
  workdir = routing[0]
  csv_path = write_csv(tmp_path / "in.csv", [{"text": t} for t in BLANKS], ("text",))
  jsonl_path = tmp_path / "in.jsonl"
  jsonl_path.write_text("".join(json.dumps({"text": t}) + "\n" for t in BLANKS))
  import pyarrow as pa  # pylint: disable=import-outside-toplevel
  import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel
  parquet_path = str(tmp_path / "in.parquet")
  pq.write_table(pa.table({"text": BLANKS}), parquet_path, row_group_size=4)
  p = predict_lib.Predictor.from_workdir(workdir)
  alone = [p([t])[0] for t in BLANKS]
  for path, first in ((csv_path, 2), (str(jsonl_path), 1), (parquet_path, None)):
    rows = list(textfiles.iter_rows(path))  # the CSV's line 1 is its header
    assert [r["text"] for r in rows] == BLANKS
    assert [r.where for r in rows] == ([f"{path}:{first + k}" for k in range(6)] if first else
                                       [f"{path}, row group {k // 4}, row {k % 4}" for k in range(6)])
    out = str(tmp_path / "out.jsonl")
    assert predict_lib.run(workdir, path, out) == 6
    got = read_jsonl(out)
    assert [g["label"] for g in got] == [a["label"] for a in alone]
    for g, a in zip(got, alone):
      assert g["probabilities"] == pytest.approx(a["probabilities"], abs=1e-5)


def test_texts_cut_to_max_seq_length_are_counted_and_marked(routing, pretrained, tmp_path, capsys):
  workdir = routing[0]
  long_text = " ".join(["refund"] + ["bedu"] * 5000)
  path = write_csv(tmp_path / "in.csv", [{"text": t} for t in ("short", long_text, "x")],
                   ("text",))
  predict_lib.run(workdir, path, str(tmp_path / "o.jsonl"))
  assert ("1 of the rows are longer than max_seq_length=" in capsys.readouterr().out)
  got = read_jsonl(tmp_path / "o.jsonl")
  assert [r.get("truncated") for r in got] == [None, True, None]
  # Fine-tuning's files: the cut rows are counted in the run's notes.
  spec = spec_lib.read(workdir)
  rows = custom.Rows(path, spec, "", need_labels=False)
  notes = []
  custom.pair_features(rows, spec, predict_lib.Predictor.from_workdir(workdir).tokenizer, notes)
  assert notes == [f"1 of 3 row(s) of {path} are longer than data.max_seq_length="
                   f"{spec.max_seq_length} tokens and were cut to fit (the first at {path}:3); "
                   "raise data.max_seq_length to keep more"]


def test_predict_never_overwrites_its_input_or_a_file_it_did_not_write(routing, tmp_path, capsys):
  workdir, _, test, _ = routing
  with open(test, "rb") as f:
    texts = f.read()
  with pytest.raises(ValueError, match=r"--output=.*is the input file"):
    predict_lib.run(workdir, test, test)
  with pytest.raises(ValueError, match=r"is the input file"):  # the same file by another path
    predict_lib.run(workdir, test, os.path.join(os.path.dirname(test), ".", "test.csv"),
                    overwrite=True)
  with open(test, "rb") as f:
    assert f.read() == texts
  notes = tmp_path / "notes.jsonl"
  notes.write_text('{"my": "notes"}\n')
  with pytest.raises(ValueError, match=r"exists and is not a file bertjax.predict wrote.*"
                     r"--overwrite"):
    predict_lib.run(workdir, test, str(notes))
  assert notes.read_text() == '{"my": "notes"}\n'
  assert predict_lib.run(workdir, test, str(notes), overwrite=True) == 40
  assert predict_lib.run(workdir, test, str(notes)) == 40  # its own output: written again
  # A refused prediction leaves no .part; one left by a killed run is removed and said.
  bad = tmp_path / "bad.csv"
  bad.write_text("text\nfine\n\"unclosed\n")
  with pytest.raises(ValueError, match="quote"):
    predict_lib.run(workdir, str(bad), str(tmp_path / "o.jsonl"))
  assert not (tmp_path / "o.jsonl.part").exists() and not (tmp_path / "o.jsonl").exists()
  (tmp_path / "o.jsonl.part").write_text("half")
  capsys.readouterr()
  predict_lib.run(workdir, test, str(tmp_path / "o.jsonl"))
  assert "removing " in capsys.readouterr().err and not (tmp_path / "o.jsonl.part").exists()


def test_json_labels_equal_as_numbers_are_one_class_and_near_spellings_are_said(tmp_path):
  path = tmp_path / "t.jsonl"
  path.write_text("".join(json.dumps({"text": "x", "label": v}) + "\n"
                          for v in (1, 1.0, 0, 0.0, 2.5, "Pos", "pos", " neg", "neg")))
  probe = spec_lib.TaskSpec("classification", "classification", ("a", "b"), text_a="text")
  rows = custom.Rows(str(path), probe, "", need_labels=True)
  assert rows.labels == ["1", "1", "0", "0", "2.5", "Pos", "pos", "neg", "neg"]
  notes = " | ".join(classification.label_notes(rows, "label"))
  assert "1 label(s) in column 'label'" in notes and "spaces around them" in notes
  assert "['Pos', 'pos']" in notes and "differ only in case" in notes and "t.jsonl:6" in notes


# Regression (TSV) and tagging (CoNLL columns in IOBES) -------------------------------------------

def test_regression_from_tsv(pretrained, tmp_path):
  def rows(n, seed):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
      words, k = fx._words(rng, 3, 8), rng.randint(0, 3)  # pylint: disable=protected-access
      for _ in range(k):
        fx._insert(rng, words, rng.choice(fx.COUNTED))  # pylint: disable=protected-access
      out.append(f"{' '.join(words)}\t{k}\n")
    return "sentence\tscore\n" + "".join(out)
  for name, n, seed in (("train", 384, 0), ("dev", 64, 1)):
    fx.write_file(str(tmp_path / f"{name}.tsv"), rows(n, seed))
  config = custom_config("regression", pretrained, tmp_path / "train.tsv", tmp_path / "dev.tsv",
                         text_a="sentence", label="score")
  config.eval.main_metric = "mse"
  results = run.finetune(fx.save_at_end(config), str(tmp_path / "run"))
  report = results["dev_report"]
  assert report["pearson"] > 0.8 and report["spearman"] > 0.8, report  # 0 by chance
  assert results["best"]["scores"]["main"] == pytest.approx(-results["best"]["scores"]["mse"])
  out = predict_lib.Predictor.from_workdir(str(tmp_path / "run"))(["x y z"])
  assert set(out[0]) == {"value"}
  _export(str(tmp_path / "run"), tmp_path / "hf")
  model = _same_outputs(str(tmp_path / "run"), tmp_path / "hf", "BertForSequenceClassification",
                        ["a b c", fx.COUNTED[0] + " x " + fx.COUNTED[1]])
  assert model.config.problem_type == "regression" and model.config.num_labels == 1


def iobes(words_tags):
  """IOB1 fixture sentences rewritten in IOBES (an entity's last word E-, a one-word one S-)."""
  out = []
  for sentence in words_tags:
    iob2 = tagged.to_iob2([t for _, t in sentence])
    tags = []
    for i, t in enumerate(iob2):
      last = i + 1 == len(iob2) or not iob2[i + 1].startswith("I-")
      if t == "O":
        tags.append(t)
      elif t.startswith("B-"):
        tags.append(("S-" if last else "B-") + t[2:])
      else:
        tags.append(("E-" if last else "I-") + t[2:])
    out.append([(w, t) for (w, _), t in zip(sentence, tags)])
  return out


def test_tagging_from_conll_columns_and_json_lines_in_iobes(pretrained, tmp_path):
  for name, n, seed in (("train", 384, 0), ("dev", 64, 1), ("test", 16, 2)):
    sentences = iobes(fx.conll_sentences(n, seed))
    fx.write_file(str(tmp_path / f"{name}.conll"),
                  "".join("".join(f"{w} {t}\n" for w, t in s) + "\n" for s in sentences))
    # The same sentences as JSON Lines (the dev file is read from these).
    fx.write_file(str(tmp_path / f"{name}.jsonl"), "".join(
        json.dumps({"tokens": [w for w, _ in s], "tags": [t for _, t in s]}) + "\n"
        for s in sentences))
  config = custom_config("tagging", pretrained, tmp_path / "train.conll", tmp_path / "dev.jsonl",
                         tmp_path / "test.conll")
  # 2 epochs at 2e-3 (48 steps): dev F1 1.0 with seeds 0, 1 and 2 (0.99 to 1.0 after the first).
  config.train.num_epochs, config.train.learning_rate = 2, 2e-3
  results = run.finetune(fx.save_at_end(config), str(tmp_path / "run"))
  assert "tags read as IOBES (detected)" in " ".join(results["notes"])
  assert results["labels"] == ["O", "B-LOC", "I-LOC", "B-PER", "I-PER"]
  report = results["dev_report"]
  assert report["f1"] >= 0.9 and set(report["per_type"]) == {"LOC", "PER"}, report
  written = read_jsonl(tmp_path / "run" / "predictions" / "test.jsonl")
  gold = iobes(fx.conll_sentences(16, 2))
  for record, sentence in zip(written, gold):
    assert record["text"] == " ".join(w for w, _ in sentence)
    for e in record["entities"]:
      assert record["text"][e["start"]:e["end"]] == e["text"]
  # predict on raw text: offsets into the text as given (two spaces kept).
  p = predict_lib.Predictor.from_workdir(str(tmp_path / "run"))
  words = [w for w, _ in gold[0]]
  text = "  ".join(words)
  got = p([{"text": text}])[0]
  assert [e["text"] for e in got["entities"]] == [e["text"].replace(" ", "  ")
                                                  for e in written[0]["entities"]]
  for e in got["entities"]:
    assert text[e["start"]:e["end"]] == e["text"]
  # A blank text is a row like any other: its record, in its place.
  blank = p([{"text": "x"}, {"text": ""}, {"text": "  "}, {"text": text}])
  assert [r["entities"] for r in blank[1:3]] == [[], []]
  fx.assert_same_records(blank[3], got)  # another call's shape: floats within RECORD_ATOL
  _export(str(tmp_path / "run"), tmp_path / "hf")
  model = _same_outputs(str(tmp_path / "run"), tmp_path / "hf", "BertForTokenClassification",
                        [" ".join(w for w, _ in s) for s in gold[:4]])
  assert model.config.id2label == dict(enumerate(results["labels"]))


# Readers and refusals (no training) -------------------------------------------------------------

def test_csv_reader_takes_quotes_newlines_bom_and_crlf(tmp_path):
  path = tmp_path / "a.csv"
  path.write_bytes("\ufeffid,text,label\r\n1,\"a, \"\"quoted\"\"\r\nsecond line\",x\r\n\r\n"
                   "2,plain,y\r\n".encode("utf-8"))
  rows = textfiles.read_rows(str(path), ["text", "label"])
  assert [r["text"] for r in rows] == ['a, "quoted"\r\nsecond line', "plain"]
  assert [r.where for r in rows] == [f"{path}:2", f"{path}:5"]
  # The same rows as TSV and as JSON Lines read alike.
  (tmp_path / "a.tsv").write_text("id\ttext\tlabel\n1\tplain\ty\n")
  (tmp_path / "a.jsonl").write_text('{"id": 1, "text": "plain", "label": "y"}\n\n')
  for name in ("a.tsv", "a.jsonl"):
    (row,) = textfiles.read_rows(str(tmp_path / name), ["text", "label"])
    assert (textfiles.text_of(row, "text"), str(row["label"])) == ("plain", "y")


def test_parquet_rows_read_as_their_json_lines_twin_for_every_family(tmp_path):
  """Parquet (the Hub's format of task datasets) through the one reader of rows that every
  family and prediction use: the same values as JSON Lines, a row named by its row group."""
  import pyarrow as pa  # pylint: disable=import-outside-toplevel
  import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel
  from bertjax.finetune.families import regression  # pylint: disable=import-outside-toplevel
  from bertjax.inputs import passages  # pylint: disable=import-outside-toplevel
  rows = [{"text": f"text {k}", "label": ["no", "yes"][k % 2], "score": k / 4,
           "tokens": ["a", f"w{k}"], "tags": ["O", "B-X"], "query": f"q{k}",
           "positive": f"p{k}"} for k in range(5)]
  pq.write_table(pa.Table.from_pylist(rows), tmp_path / "t.parquet", row_group_size=3)
  (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  got = list(textfiles.iter_rows(str(tmp_path / "t.parquet")))
  assert got == list(textfiles.iter_rows(str(tmp_path / "t.jsonl"))) == rows
  assert [r.where for r in got][2:4] == [f"{tmp_path / 't.parquet'}, row group 0, row 2",
                                         f"{tmp_path / 't.parquet'}, row group 1, row 0"]
  both = [str(tmp_path / name) for name in ("t.parquet", "t.jsonl")]
  probe = spec_lib.TaskSpec("classification", "classification", ("no", "yes"), text_a="text")
  assert [custom.Rows(p, probe, "", need_labels=True).labels for p in both] == [
      ["no", "yes", "no", "yes", "no"]] * 2
  probe = spec_lib.TaskSpec("regression", "regression", (), text_a="text", label="score")
  assert custom.Rows(both[0], probe, "", True, regression.label_of).labels == [
      0.0, 0.25, 0.5, 0.75, 1.0]
  probe = spec_lib.TaskSpec("tagging", "tagging", ("O", "B-X"), tokens="tokens", tags="tags")
  assert [w for _, w, _ in tagging.read_tagged(both[0], probe, "")] == [r["tokens"] for r in rows]
  assert passages.read_pairs(both[0], passages.Columns()).queries == [r["query"] for r in rows]
  # Its refusals name the file and the row (group): a missing column, a damaged file.
  with pytest.raises(ValueError, match=r"t.parquet, row group 0, row 0: no column 'body'"):
    custom.Rows(both[0], spec_lib.TaskSpec("classification", "classification", ("no", "yes"),
                                           text_a="body"), "", need_labels=True)
  data = (tmp_path / "t.parquet").read_bytes()
  (tmp_path / "cut.parquet").write_bytes(data[:len(data) // 2])
  with pytest.raises(ValueError, match=r"cut.parquet, row group 0: not a readable Parquet file "
                                       r"\(.*\): truncated or corrupt"):
    list(textfiles.iter_rows(str(tmp_path / "cut.parquet")))


@pytest.mark.parametrize("body, message", [
    ("id,body,label\n1,a,x\n", r"a.csv:2: no column 'text'; the file has \['body', 'id', 'label'\]"),
    ("text,label\na,x\nb,\n", r"a.csv:3: empty label in column 'label'"),
    ("text,label\na,x\nb,y,z\n", r"a.csv:3: 3 field\(s\) where the header has 2"),
    ("text,label\n\"a,x\n", r"a.csv:\d: .*quote"),
    ("", r"a.csv: the file is empty"),
    ("text,label\n", r"a.csv: no examples"),
])
def test_bad_csv_named_by_file_and_line(tmp_path, body, message):
  path = tmp_path / "a.csv"
  path.write_text(body)
  probe = spec_lib.TaskSpec("classification", "classification", ("a", "b"), text_a="text")
  with pytest.raises(ValueError, match=message):
    custom.Rows(str(path), probe, "", need_labels=True)


def test_encodings_and_long_fields_are_named_where_they_are(tmp_path):
  """A byte that is not UTF-8 past the decoder's first chunk is named on its own line and byte
  (was: a place within the chunk); a UTF-16 file is said to be UTF-16 (was: 'not UTF-8' with a
  Latin-1 fix that makes garbage); a field over csv's limit says the limit and JSON Lines (was: 'a
  quote opened and not closed?')."""
  probe = spec_lib.TaskSpec("classification", "classification", ("a", "b"), text_a="text")
  body = "".join(f"row number {k} of some length,x\n" for k in range(2, 600))
  late = tmp_path / "late.csv"
  late.write_bytes(b"text,label\n" + body.encode() + b"caf\xe9 au lait,y\n")
  assert late.stat().st_size > 16384
  with pytest.raises(ValueError, match=r"late.csv:600: not UTF-8 \(byte 4 of the line"):
    custom.Rows(str(late), probe, "", need_labels=True)
  for name in ("late.jsonl",):
    (tmp_path / name).write_bytes(
        "".join('{"text": "r%d", "label": "x"}\n' % k for k in range(1, 700)).encode()
        + b'{"text": "caf\xe9", "label": "y"}\n')
    with pytest.raises(ValueError, match=rf"{name}:700: not UTF-8 \(byte 14 of the line"):
      custom.Rows(str(tmp_path / name), probe, "", need_labels=True)
  wide = tmp_path / "wide.csv"
  wide.write_bytes("text,label\nhello,x\n".encode("utf-16"))
  with pytest.raises(ValueError, match=r"wide.csv: UTF-16 \(its byte-order mark\), not UTF-8.*"
                     r"iconv -f UTF-16 -t UTF-8"):
    custom.Rows(str(wide), probe, "", need_labels=True)
  long = tmp_path / "long.csv"
  long.write_text('text,label\nshort,x\n"' + "word " * 30000 + '",y\n')
  with pytest.raises(ValueError, match=r"long.csv:3: a field longer than 131,072 characters.*"
                     r"JSON Lines"):
    custom.Rows(str(long), probe, "", need_labels=True)


def test_dev_label_outside_the_map_is_refused(pretrained, tmp_path):
  write_csv(tmp_path / "train.csv", route_rows(16, 0))
  rows = route_rows(8, 1)
  rows[5]["label"] = "sales"
  write_csv(tmp_path / "dev.csv", rows)
  config = custom_config("classification", pretrained, tmp_path / "train.csv",
                         tmp_path / "dev.csv")
  with pytest.raises(ValueError, match=r"dev.csv:7: label 'sales' is not in the label map"):
    run.finetune(config, str(tmp_path / "run"))
  assert not os.path.exists(tmp_path / "run" / "checkpoints")


def test_tagging_rows_with_mismatched_lengths_and_schemes(tmp_path):
  path = tmp_path / "t.jsonl"
  path.write_text('{"tokens": ["a", "b"], "tags": ["O"]}\n')
  probe = spec_lib.TaskSpec("tagging", "tagging", ("O", "B-X"))
  with pytest.raises(ValueError, match=r"t.jsonl:1: 2 word\(s\) in 'tokens' but 1 tag"):
    tagging.read_tagged(str(path), probe, "")
  assert tagged.detect_scheme([["B-PER", "I-PER", "O", "B-LOC"]]) == "BIO"
  assert tagged.detect_scheme([["I-PER", "I-PER", "O", "B-PER"]]) == "IOB1"
  assert tagged.detect_scheme([["PER", "O", "LOC"]]) == "IO"
  assert tagged.detect_scheme([["B-PER", "E-PER", "S-LOC"]]) == "IOBES"
  # One entity list, whatever the scheme it is written in.
  same = {"BIO": ["B-PER", "I-PER", "B-PER", "O", "B-LOC"],
          "IOB1": ["I-PER", "I-PER", "B-PER", "O", "I-LOC"],
          "IOBES": ["B-PER", "E-PER", "S-PER", "O", "S-LOC"]}
  for scheme, tags in same.items():
    assert tagged.chunks(tagged.scheme_to_iob2(tags, scheme, "x")) == [("PER", 0, 2), ("PER", 2, 3),
                                                                 ("LOC", 4, 5)], scheme
  with pytest.raises(ValueError, match=r"x word 2: tag 'E-PER' is not BIO"):
    tagged.scheme_to_iob2(["B-PER", "E-PER"], "BIO", "x")


def test_classification_report_known_answers():
  # true: a a a b b c; predicted: a a b b c c
  r = classification.report([0, 0, 1, 1, 2, 2], [0, 0, 0, 1, 1, 2], ("a", "b", "c"))
  assert r["confusion"]["matrix"] == [[2, 1, 0], [0, 1, 1], [0, 0, 1]]
  assert r["per_class"]["a"] == {"precision": 1.0, "recall": 2 / 3, "f1": 0.8, "support": 3}
  assert r["per_class"]["b"]["precision"] == 0.5 and r["per_class"]["c"]["recall"] == 1.0
  assert r["macro_f1"] == pytest.approx((0.8 + 0.5 + 2 / 3) / 3)
  assert r["accuracy"] == r["micro_f1"] == pytest.approx(4 / 6)


def test_class_weights(tmp_path):
  labels = ("a", "b", "c")
  ids = np.array([0, 0, 0, 0, 1, 1, 2, 2])
  assert classification.class_weights("balanced", labels, ids) == pytest.approx([8 / 12, 8 / 6, 8 / 6])
  assert classification.class_weights(" c=3", labels, ids) == [1.0, 1.0, 3.0]
  assert classification.class_weights("", labels, ids) is None
  with pytest.raises(ValueError, match=r"'d=3' is not label=weight with a label of"):
    classification.class_weights("d=3", labels, ids)
  # The weighted loss is the weighted mean of the examples' losses.
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  obj = classification.objective_of(3, [1.0, 1.0, 3.0])
  logits = jnp.array([[2.0, 0.0, 0.0], [0.0, 0.0, 2.0]])
  batch = {"label": jnp.array([0, 1]), "weight": jnp.ones(2)}
  loss, den = obj.metrics(logits, batch)["cls_loss"]
  nll = -jax.nn.log_softmax(logits)[jnp.arange(2), batch["label"]]
  assert float(den) == 2.0 and float(loss) == pytest.approx(float(nll.sum()))
  batch["label"] = jnp.array([0, 2])
  loss, den = obj.metrics(logits, batch)["cls_loss"]
  nll = -jax.nn.log_softmax(logits)[jnp.arange(2), batch["label"]]
  assert float(den) == 4.0 and float(loss) == pytest.approx(float(nll[0] + 3 * nll[1]))


def test_a_workdir_with_another_label_map_is_refused(routing, pretrained, tmp_path):
  workdir, _, _, _ = routing
  rows = route_rows(16, 0)
  for r in rows:
    r["label"] = r["label"].upper()
  train = write_csv(tmp_path / "train.csv", rows)
  config = custom_config("classification", pretrained, train, train)
  before = os.path.getmtime(os.path.join(workdir, "task.json"))
  with pytest.raises(ValueError, match=r"holds a run with the labels \['billing', .*these files "
                     r"give \['BILLING'"):
    run.finetune(config, workdir)
  assert os.path.getmtime(os.path.join(workdir, "task.json")) == before


def test_span_from_own_files_detects_v2_and_predicts_offsets(pretrained, tmp_path):
  """Own QA files in SQuAD's layout, a quarter of the questions unanswerable (their context lacks
  every answer word): read as v2.0 without being told; predictions on new contexts give the
  answer's exact characters, and "" with -1 where there is none."""
  def paragraphs(n, seed, prefix):
    out = fx.squad_paragraphs(n, seed, prefix, length=(6, 14))
    for k, p in enumerate(out):
      if k % 4 == 3:
        q = p["qas"][0]
        answer = q["answers"][0]
        p["context"] = p["context"].replace(answer["text"], "zz")
        q["answers"], q["is_impossible"] = [], True
    return out
  train = fx.write_squad(str(tmp_path / "train.json"), paragraphs(384, 0, "t"))
  dev = fx.write_squad(str(tmp_path / "dev.json"), paragraphs(64, 1, "d"))
  config = custom_config("span", pretrained, train, dev)
  config.data.max_seq_length = 32
  # 2 epochs at 2e-3 (48 steps): dev F1 100 from the first epoch on, with seeds 0, 1 and 2.
  config.train.num_epochs, config.train.learning_rate = 2, 2e-3
  results = run.finetune(fx.save_at_end(config), str(tmp_path / "run"))
  spec = spec_lib.read(str(tmp_path / "run"))
  assert spec.family == "span" and spec.version_2_with_negative
  assert "HasAns_f1" in results["best"]["scores"] and results["best"]["scores"]["main"] > 60
  new = paragraphs(24, 7, "n")
  rows = [{"id": p["qas"][0]["id"], "question": p["qas"][0]["question"], "context": p["context"]}
          for p in new]
  got = predict_lib.Predictor.from_workdir(str(tmp_path / "run"))(rows)
  right = 0
  for record, row, p in zip(got, rows, new):
    assert record["id"] == row["id"]
    if record["answer"]:
      assert row["context"][record["start"]:].startswith(record["answer"])
    else:
      assert record["start"] == -1
    gold = p["qas"][0]["answers"]
    right += record["answer"] == (gold[0]["text"] if gold else "")
  assert right >= 16, got  # of 24
  blank = predict_lib.Predictor.from_workdir(str(tmp_path / "run"))(
      rows[:1] + [{"id": "e", "question": "", "context": ""}] + rows[1:2])
  assert [r["id"] for r in blank] == [rows[0]["id"], "e", rows[1]["id"]]
  assert blank[1]["answer"] == ""
  fx.assert_same_records([blank[0], blank[2]], got[:2])  # another call's shape: RECORD_ATOL
  _export(str(tmp_path / "run"), tmp_path / "hf")
  _same_outputs(str(tmp_path / "run"), tmp_path / "hf", "BertForQuestionAnswering",
                [r["question"] for r in rows[:4]], [r["context"] for r in rows[:4]])


# Export to Hugging Face: each head in its transformers class, same logits, its labels --------------

def _export(workdir, out):
  from bertjax.convert import hf  # pylint: disable=import-outside-toplevel
  return hf.export_folder(workdir, str(out))


def _loaded(folder, cls_name):
  """The exported folder in its transformers class, and what transformers logged loading it."""
  import logging  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  records = []
  handler = logging.Handler()
  handler.emit = records.append
  logger = transformers.logging.get_logger()
  logger.addHandler(handler)
  try:
    model = getattr(transformers, cls_name).from_pretrained(str(folder)).eval()
  finally:
    logger.removeHandler(handler)
  return model, [r.getMessage() for r in records if r.levelno >= logging.WARNING]


def _same_outputs(workdir, folder, cls_name, texts, pair=None):
  """transformers' outputs of the export against bertjax's head on the same ids, within 1e-4."""
  import torch  # pylint: disable=import-outside-toplevel
  from bertjax.weights import reader as weights  # pylint: disable=import-outside-toplevel
  model, warned = _loaded(folder, cls_name)
  assert not warned, warned  # no missing or unused weights, nothing else
  p = predict_lib.Predictor.from_workdir(workdir)
  f, _ = pairs.encode_pairs(texts, pair, p.tokenizer, 32)
  head = families.get(p.spec.family).objective(p.spec).make_model(p.config)
  params = weights.read(weights.inspect_trained(workdir))
  ours = head.apply({"params": params}, f["input_ids"], f["input_mask"], f["segment_ids"])
  with torch.inference_mode():
    out = model(input_ids=torch.from_numpy(f["input_ids"]).long(),
                attention_mask=torch.from_numpy(f["input_mask"]).long(),
                token_type_ids=torch.from_numpy(f["segment_ids"]).long())
  if cls_name == "BertForQuestionAnswering":
    theirs, ours = np.stack([out.start_logits, out.end_logits]), np.stack(ours)
  else:
    theirs = out.logits.numpy()
  mask = f["input_mask"].astype(bool)
  if theirs.ndim == 3 and cls_name == "BertForTokenClassification":
    theirs, ours = theirs[mask], np.asarray(ours)[mask]  # padding positions mean nothing
  elif cls_name == "BertForQuestionAnswering":
    theirs, ours = theirs[:, mask], np.asarray(ours)[:, mask]
  np.testing.assert_allclose(np.asarray(ours), theirs, atol=1e-4, rtol=0)
  return model


def test_classification_exports_with_its_labels(routing, tmp_path):
  workdir, _, _, test_rows = routing
  said = _export(workdir, tmp_path / "hf")
  assert "BertForSequenceClassification, 4 labels" in said
  model = _same_outputs(workdir, tmp_path / "hf", "BertForSequenceClassification",
                        [r["text"] for r in test_rows[:8]])
  assert model.config.id2label == dict(enumerate(sorted(ROUTES)))
  assert model.config.problem_type == "single_label_classification"
  # The vocabulary and casing travel too: transformers' tokenizer gives bertjax's ids.
  import transformers  # pylint: disable=import-outside-toplevel
  tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
  p = predict_lib.Predictor.from_workdir(workdir)
  for r in test_rows[:8]:
    text = r["text"].upper()
    assert tok(text)["input_ids"] == [p.tokenizer.cls_id, *p.tokenizer.encode(text),
                                      p.tokenizer.sep_id]


def test_an_export_leaves_only_its_own_files(routing, tmp_path):
  """Exporting into a folder that held an earlier export (a SentencePiece one's tokenizer.json,
  which AutoTokenizer would load before vocab.txt) leaves only what this export wrote; a folder of
  other files, or a file, is refused before anything is written."""
  import tokenizers  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  workdir = routing[0]
  out = tmp_path / "hf"
  out.mkdir()
  stale = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer(
      tokenizers.models.WordLevel({"[UNK]": 0, "zz": 1}, unk_token="[UNK]")))
  stale.save_pretrained(str(out))
  assert (out / "tokenizer.json").exists()
  said = _export(workdir, out)
  assert "removed an earlier export's tokenizer.json" in said
  assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "special_tokens_map.json",
                                     "tokenizer_config.json", "vocab.txt"]
  p = predict_lib.Predictor.from_workdir(workdir)
  tok = transformers.AutoTokenizer.from_pretrained(str(out))
  assert tok("refund x")["input_ids"] == [p.tokenizer.cls_id, *p.tokenizer.encode("refund x"),
                                          p.tokenizer.sep_id]
  mine = tmp_path / "mine"
  mine.mkdir()
  (mine / "thesis.tex").write_text("mine")
  with pytest.raises(ValueError, match=r"holds files an export does not write \(thesis.tex\)"):
    _export(workdir, mine)
  assert os.listdir(mine) == ["thesis.tex"]
  with pytest.raises(ValueError, match=r"is a file; an export writes a folder"):
    _export(workdir, mine / "thesis.tex")


def test_an_export_of_a_damaged_best_step_names_the_latest_checkpoint(routing, tmp_path):
  import shutil  # pylint: disable=import-outside-toplevel
  from bertjax.training import checkpoint as checkpoint_lib  # pylint: disable=import-outside-toplevel
  workdir = str(tmp_path / "copy")
  shutil.copytree(routing[0], workdir)
  (step,) = [n for n in os.listdir(os.path.join(workdir, "best")) if n.isdigit()]
  for root, dirs, _ in os.walk(os.path.join(workdir, "best", step, "params")):
    if "d" in dirs:
      shutil.rmtree(os.path.join(root, "d"))
  with pytest.raises(errors.CheckpointDamagedError,
                     match=rf"step {step} is damaged .*--checkpoint=latest"):
    _export(workdir, tmp_path / "hf")
  from bertjax.convert import hf  # pylint: disable=import-outside-toplevel
  assert "Exported" in hf.export_folder(workdir, str(tmp_path / "hf2"), checkpoint="latest")


def test_a_fine_tuned_workdir_without_its_label_map_is_not_exported(routing, tmp_path):
  import shutil  # pylint: disable=import-outside-toplevel
  workdir = str(tmp_path / "copy")
  shutil.copytree(routing[0], workdir)
  os.remove(os.path.join(workdir, "task.json"))
  for folder in ("best", "checkpoints"):
    for step in os.listdir(os.path.join(workdir, folder)):
      path = os.path.join(workdir, folder, step, "meta", "metadata")
      if os.path.exists(path):
        with open(path) as f:
          meta = json.load(f)
        meta.pop(spec_lib.META_KEY, None)
        with open(path, "w") as f:
          json.dump(meta, f)
  with pytest.raises(ValueError, match=r"holds a fine-tuned head \(classifier\) but no label map"):
    _export(workdir, tmp_path / "hf")
  assert not os.path.exists(tmp_path / "hf")


def test_evaluate_mlm_scores_a_run_as_its_final_evaluation(pretrained):
  """bertjax.evaluate_mlm (runs of different recipes on one held-out set) gives a run, on its own
  data section, the figure of its final evaluation: the same sequences, the same masks."""
  from bertjax import evaluate_mlm  # pylint: disable=import-outside-toplevel
  from test_data_fixtures import data_config  # pylint: disable=import-outside-toplevel
  with open(os.path.join(pretrained, "metrics.jsonl")) as f:
    final = [json.loads(line) for line in f if "eval/mlm_accuracy" in line][-1]
  # fx.pretrain's data section, rebuilt over the same files (the prepared data is reused).
  data = data_config(os.path.join(os.path.dirname(pretrained), "data"), n_docs=30,
                     sents_per_doc=12)
  got = evaluate_mlm.score(pretrained, data, sequences=8)  # as fx.pretrain's eval_sequences
  assert got["step"] == final["step"]
  assert abs(got["mlm_accuracy"] - final["eval/mlm_accuracy"]) < 1e-6
  assert abs(got["mlm_loss"] - final["eval/mlm_loss"]) < 1e-4
