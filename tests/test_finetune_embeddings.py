"""The embeddings family end to end (bertjax/finetune/families/embeddings.py): a CSV of (query,
positive, hard negative) rows becomes, with one command, a retriever far above its untrained
encoder on dev queries searched against a corpus file; its test rankings, `bertjax.predict`'s
embed and search modes and the sentence-transformers export all give the same vectors; a stopped
run resumes to the uninterrupted run's end; a settings search runs its trials; the readers refuse
what they should, naming the file, line and column.

The task (finetune_fixtures.retrieval_rows): a query names its topic by one word, its passages by
another, so only training shows which goes with which: the untrained encoder ranks at chance.
"""

import csv
import json
import os
import shutil

import jax
import numpy as np
import pytest

from bertjax.convert import hf as convert_hf
from bertjax.errors import Refusal
from bertjax.finetune import families
from bertjax.finetune.job import run, search
from bertjax.finetune.kit import retrieval
from bertjax.formats import taskspec as spec_lib
from bertjax.inputs import passages
from bertjax.predict import predictor as predict_lib
import finetune_fixtures as fx

EPOCHS = 5


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
  return fx.pretrain(str(tmp_path_factory.mktemp("pretrain")))


def write_csv(path, rows, columns):
  with open(path, "w", newline="", encoding="utf-8") as f:
    w = csv.DictWriter(f, columns, extrasaction="ignore")
    w.writeheader()
    w.writerows(rows)
  return str(path)


def write_jsonl(path, rows):
  with open(path, "w", encoding="utf-8") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
  return str(path)


def read_jsonl(path):
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  root = tmp_path_factory.mktemp("retrieval")
  corpus, dev = fx.retrieval_corpus(1)
  _, test = fx.retrieval_corpus(2)
  return {"train": write_csv(root / "train.csv", fx.retrieval_rows(240, 0),
                             ("id", "query", "positive", "negative")),
          "corpus": write_jsonl(root / "corpus.jsonl", corpus),
          "dev": write_jsonl(root / "dev.jsonl", dev),
          "test": write_jsonl(root / "test.jsonl", [{"id": q["id"], "query": q["query"]}
                                                    for q in test]),
          "root": root}


def embeddings_config(pretrained, files, **train):
  config = fx.ft_config("embeddings", pretrained, batch_size=16,
                       **{"learning_rate": 2e-3, "num_epochs": EPOCHS, **train})
  d = config.data
  d.train_file, d.dev_file, d.test_file = files["train"], files["dev"], files["test"]
  d.corpus_file, d.negatives, d.max_query_length = files["corpus"], "negative", 16
  return fx.save_at_end(config)


@pytest.fixture(scope="module")
def trained(pretrained, files, tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("embeddings") / "run")
  return workdir, run.finetune(embeddings_config(pretrained, files), workdir)


def test_a_retriever_learns_from_pairs_far_above_its_untrained_encoder(trained, pretrained,
                                                                     files):
  workdir, results = trained
  best = results["best"]["scores"]
  assert set(retrieval.MAIN_METRICS) <= set(best) and best["queries"] == 24
  # The untrained encoder, its vectors made alike (mean pooling, unit length), on the same search.
  predictor = predict_lib.Predictor.from_workdir(pretrained, embed=True)
  queries = read_jsonl(files["dev"])
  corpus = read_jsonl(files["corpus"])
  ids = [c["id"] for c in corpus]
  unit = lambda v: v / np.linalg.norm(v, axis=1, keepdims=True)
  q = unit(np.concatenate(list(predictor.embed(queries, "mean", "query", max_seq_length=16))))
  c = unit(np.concatenate(list(predictor.embed(corpus, "mean", "text", max_seq_length=32))))
  ranked, _ = retrieval.search(q, c, 100)
  untrained = retrieval.report(ranked, [[ids.index(i) for i in r["positive"].split(",")]
                                        for r in queries])
  assert untrained["mrr_at_10"] < 0.45, untrained  # chance: ~0.2 for 2 of 48 passages
  assert best["mrr_at_10"] > untrained["mrr_at_10"] + 0.35, (best, untrained)
  assert best["recall_at_10"] >= 0.9 and results["main_metric"] == "mrr_at_10"
  spec = spec_lib.read(workdir)
  assert (spec.family, spec.pooling, spec.normalize, spec.max_query_length) == (
      "embeddings", "mean", True, 16)
  assert any("dev: 24 queries against 48 passages" in n for n in results["notes"])


def test_the_test_rankings_and_the_search_mode_agree(trained, files, tmp_path):
  workdir, _ = trained
  written = read_jsonl(os.path.join(workdir, "predictions", "test.jsonl"))
  assert [w["id"] for w in written] == [f"t{k}" for k in range(24)]
  assert all(len(w["hits"]) == 10 for w in written)
  # The same best checkpoint through bertjax.predict: the corpus's passage vectors first, then
  # the search with them, and the search encoding the corpus itself.
  vectors = str(tmp_path / "corpus.npy")
  predict_lib.run(workdir, files["corpus"], vectors, mode="embed")
  corpus_NxD = np.load(vectors)
  assert corpus_NxD.shape == (48, 32)
  np.testing.assert_allclose(np.linalg.norm(corpus_NxD, axis=1), 1.0, rtol=1e-5)
  outs = []
  for name, kept in (("with.jsonl", vectors), ("without.jsonl", "")):
    outs.append(str(tmp_path / name))
    predict_lib.run(workdir, files["test"], outs[-1], mode="search", corpus=files["corpus"],
                    corpus_vectors=kept, top_k=10)
  got = [read_jsonl(o) for o in outs]
  assert [[h["id"] for h in r["hits"]] for r in got[0]] == [[h["id"] for h in r["hits"]]
                                                            for r in got[1]]
  for mine, theirs in zip(got[0], written):
    assert mine["id"] == theirs["id"]
    fx.assert_same_records(mine["hits"], theirs["hits"])


def test_embed_writes_one_file_per_kind_of_text_and_the_api_embeds_queries(trained, files,
                                                                           tmp_path):
  workdir, _ = trained
  both = write_jsonl(tmp_path / "both.jsonl", [{"query": q["query"], "text": c["text"]} for q, c in
                                               zip(read_jsonl(files["dev"]),
                                                   read_jsonl(files["corpus"]))])
  out = str(tmp_path / "v.npy")
  predict_lib.run(workdir, both, out, mode="embed")
  q, p = np.load(str(tmp_path / "v.queries.npy")), np.load(str(tmp_path / "v.passages.npy"))
  assert q.shape == p.shape == (24, 32) and not os.path.exists(out)
  single = str(tmp_path / "q.npy")
  predict_lib.run(workdir, files["dev"], single, mode="embed")  # queries alone: one file
  np.testing.assert_allclose(np.load(single), q, atol=1e-6)
  records = predict_lib.Predictor.from_workdir(workdir)([r["query"] for r in
                                                         read_jsonl(files["dev"])[:3]])
  np.testing.assert_allclose(np.array([r["vector"] for r in records]), q[:3], atol=2e-6)
  with pytest.raises(Refusal, match="was trained to make its vectors with pooling='mean'"):
    predict_lib.run(workdir, files["dev"], str(tmp_path / "x.npy"), mode="embed",
                    pooling="cls")


def test_corpus_vectors_of_another_encoder_or_corpus_are_refused_naming_both(trained, pretrained,
                                                                          files, tmp_path, capsys):
  """What embed writes records its encoder and texts (OUT.npy.bertjax.json); search refuses
  vectors whose record names another (they searched silently: MRR@10 0.14 and 0.04 for 0.42)."""
  workdir, _ = trained
  corpus, test = files["corpus"], files["test"]
  right = str(tmp_path / "right.npy")
  predict_lib.run(workdir, corpus, right, mode="embed")
  with open(right + ".bertjax.json") as f:
    record = json.load(f)
  assert record["encoder"]["pooling"] == "mean" and record["encoder"]["normalize"] is True
  assert record["encoder"]["max_seq_length"] == 32 and len(record["encoder"]["weights"]) == 64
  assert record["input"]["rows"] == 48 and record["shape"] == [48, 32]
  predict_lib.run(workdir, corpus, right, mode="embed")  # its own output: written again
  search = lambda vectors, corpus=corpus: predict_lib.run(
      workdir, test, str(tmp_path / "hits.jsonl"), mode="search", corpus=corpus,
      corpus_vectors=vectors)
  # Another encoder of the same width (its pooling alike): named beside this search's.
  other = str(tmp_path / "other.npy")
  predict_lib.run(pretrained, corpus, other, mode="embed", pooling="mean")
  with pytest.raises(Refusal, match=r"other.npy holds vectors of the encoder \w{12} \(.*pretrain"
                                    r".*\); this search encodes with the encoder \w{12} \(.*run"):
    search(other)
  # Another corpus of as many passages (the same, reversed): the texts differ.
  reversed_corpus = write_jsonl(tmp_path / "reversed.jsonl", read_jsonl(corpus)[::-1])
  with pytest.raises(Refusal, match=r"right.npy holds the vectors of 48 texts of .*corpus.jsonl "
                                    r"\(sha256 \w+\), not of the 48 passages of --corpus=.*"
                                    r"reversed.jsonl"):
    search(right, reversed_corpus)
  # An .npy from elsewhere (no record) is searched, said unchecked; the right one silently.
  plain = str(tmp_path / "plain.npy")
  np.save(plain, np.load(right))
  capsys.readouterr()
  search(right)
  assert "unchecked" not in capsys.readouterr().out
  search(plain)
  assert "plain.npy has no record of the encoder and texts that made it" in capsys.readouterr().out
  # The fingerprint: of the weights, the same from every read of them, computed once.
  a, b = (predict_lib.Predictor.from_workdir(workdir) for _ in range(2))
  assert a.fingerprint == b.fingerprint == record["encoder"]["weights"]
  assert predict_lib.Predictor.from_workdir(pretrained, embed=True).fingerprint != a.fingerprint


def test_an_empty_passage_is_counted_in_a_line(trained, files, tmp_path, capsys):
  workdir, _ = trained
  corpus = write_jsonl(tmp_path / "corpus.jsonl", read_jsonl(files["corpus"]) + [
      {"id": "e1", "text": " "}, {"id": "e2", "text": ""}])
  predict_lib.run(workdir, files["test"], str(tmp_path / "hits.jsonl"), mode="search",
                  corpus=corpus)
  assert (f"search: 2 of the 50 passages of --corpus={corpus} are empty (the first at "
          f"{corpus}:49): each is ranked as an empty text") in capsys.readouterr().out


def test_the_export_loads_in_sentence_transformers_with_the_same_vectors(trained, files,
                                                                         tmp_path):
  sentence_transformers = pytest.importorskip("sentence_transformers")
  workdir, _ = trained
  out = str(tmp_path / "export")
  said = convert_hf.export_folder(workdir, out)
  assert "BertModel" in said and "sentence-transformers" in said
  with open(os.path.join(out, "config.json")) as f:
    assert json.load(f)["architectures"] == ["BertModel"]
  texts = [c["text"] for c in read_jsonl(files["corpus"])]
  theirs = sentence_transformers.SentenceTransformer(out, device="cpu").encode(
      texts, convert_to_numpy=True)
  vectors = str(tmp_path / "corpus.npy")
  predict_lib.run(workdir, files["corpus"], vectors, mode="embed")
  np.testing.assert_allclose(theirs, np.load(vectors), atol=1e-5, rtol=0)


def test_a_stopped_run_resumes_to_the_uninterrupted_end(trained, pretrained, files, tmp_path,
                                                        monkeypatch, capsys):
  straight, straight_results = trained
  workdir = str(tmp_path / "run")
  config = embeddings_config(pretrained, files)
  with monkeypatch.context() as mp:
    fx.sigterm_at(mp, 20)  # in epoch 2 (15 steps an epoch)
    assert run.finetune(config, workdir) == {}
  _an_unfinished_run_says_so(workdir, config, files, tmp_path, monkeypatch, capsys)
  results = run.finetune(config, workdir)
  assert [e["scores"] for e in results["evaluations"]] == [
      e["scores"] for e in straight_results["evaluations"]]
  assert read_jsonl(os.path.join(workdir, "predictions", "test.jsonl")) == read_jsonl(
      os.path.join(straight, "predictions", "test.jsonl"))
  # The workdir's vectors are its own: another pooling there is refused before any step.
  config.contrastive.pooling = "cls"
  with pytest.raises(Refusal, match=r"\(pooling, normalize\) = \('mean', True\)"):
    run.finetune(config, workdir)


def _an_unfinished_run_says_so(workdir, config, files, tmp_path, monkeypatch, capsys):
  """A run stopped at step 20 (its best epoch: step 15): its export says which step it took and
  that the run is unfinished, in its line and its config.json; a copy with no best epoch (stopped
  before its first evaluation), that no evaluation chose the step; a rerun of the copy on another
  training file, that the data changed (each went unsaid), and its dev set as queries and
  passages."""
  def export(source, name, **kw):
    said = convert_hf.export_folder(source, str(tmp_path / name), **kw).splitlines()
    with open(tmp_path / name / "config.json") as f:
      return said, json.load(f)[convert_hf.EXPORTED]
  said, record = export(workdir, "best")
  assert said[1] == ("Exported step 15 is the best dev evaluation (epoch 1) of a run that has not "
                     "finished (no results.json): a later epoch may score higher; rerun its "
                     "fine-tuning command to finish it."), said
  assert record == {"step": 15, "chosen_by": "the best dev evaluation (epoch 1)",
                    "finished": False}
  said, record = export(workdir, "latest", checkpoint="latest")
  assert said[1] == ("Exported step 20 is exported as chosen by --checkpoint=latest, not an "
                     "evaluation (no results.json: the run has not finished)."), said
  copy = str(tmp_path / "copy")
  shutil.copytree(workdir, copy)
  shutil.rmtree(os.path.join(copy, "best"))
  said, record = export(copy, "none")
  assert "step 20 is exported as chosen by no evaluation: the newest checkpoint" in said[1], said
  changed = copy_config(config, train_file=write_csv(
      tmp_path / "other.csv", fx.retrieval_rows(240, 7), ("id", "query", "positive", "negative")))
  capsys.readouterr()
  with monkeypatch.context() as mp:
    fx.Builds(mp, abort_at_first_step=True)
    with pytest.raises(fx.Abort):
      run.finetune(changed, copy)
  said = capsys.readouterr().out
  assert "bertjax: the training data is not what steps 1-20 trained on (its features' sha256 " in (
      said)
  assert "; dev: dev 24 queries against 48 passages\n" in said  # was "dev 72", queries + passages


def copy_config(config, **data):
  config = config.copy_and_resolve_references()
  for key, value in data.items():
    config.data[key] = value
  return config


@pytest.mark.parametrize("rows", [1, 20])
def test_a_batch_of_more_rows_than_distinct_pairs_is_refused(pretrained, files, tmp_path, rows):
  """One pair (or one pair 20 times) at batch 16: every in-batch negative was a copy of the
  positive, masked out: loss 0.0 and nothing learnt, after a note."""
  one = fx.retrieval_rows(1, 0)
  train = write_csv(tmp_path / "one.csv", one * rows, ("id", "query", "positive", "negative"))
  config = copy_config(embeddings_config(pretrained, files), train_file=train)
  with pytest.raises(Refusal, match=r"train.batch_size=16 is larger than the 1 distinct \(query, "
                                    r"positive\) pairs of .*one.csv: .*Lower train.batch_size to "
                                    r"at most 1, or add pairs"):
    run.finetune(config, str(tmp_path / "run"))


def test_a_corpus_files_notes_name_it_and_the_summary_counts_queries_and_passages(pretrained,
                                                                                 files):
  """Passages cut to max_seq_length are the corpus file's (were said the dev file's, once for dev
  and again for test); the dev set is 24 queries against 48 passages (was counted "dev 72")."""
  from bertjax.data import tokenizer as tokenizer_lib  # pylint: disable=import-outside-toplevel
  from bertjax.finetune.kit.config import TaskConfig  # pylint: disable=import-outside-toplevel
  from bertjax.weights import reader as weights  # pylint: disable=import-outside-toplevel
  source = weights.inspect(pretrained)
  tokenizer = tokenizer_lib.load_vocabulary(source.vocab_file, source.tokenizer_kind, True)
  config = embeddings_config(pretrained, files)
  config.data.max_seq_length = 5  # the passages are 3 to 5 words, 5 to 7 tokens
  data = families.get("embeddings").load(TaskConfig.from_config(config), tokenizer)
  cut = [n for n in data.notes if " passages of " in n and "were cut" in n
         and "distinct passages" not in n]  # (the training file's)
  assert len(cut) == 1 and files["corpus"] in cut[0], data.notes
  assert data.evals[0].size == "24 queries against 48 passages"
  assert f"dev: 24 queries against 48 passages (of {files['corpus']})" in data.notes


def test_a_settings_search_runs_the_family(pretrained, files, tmp_path):
  config = embeddings_config(pretrained, files, num_epochs=1)
  config.train.learning_rate = None  # chosen on dev among the rates given
  config.search.learning_rate = "1e-3,3e-3"
  results = search.finetune(config, str(tmp_path / "search"))
  summary = results["search"]
  assert len(summary["settings"]) == 2 and summary["main_metric"] == "mrr_at_10"
  assert all(np.isfinite(s["median"]) for s in summary["settings"])
  assert results["best"]["scores"]["main"] == max(s["median"] for s in summary["settings"])


def test_the_family_is_registered_with_its_retrieval_metrics():
  family = families.get("embeddings")
  assert family.main_metrics == retrieval.MAIN_METRICS and family.head == ""
  assert families.main_value("embeddings", {"ndcg_at_10": 0.4}, "ndcg_at_10") == 0.4


# The readers ------------------------------------------------------------------------------------

COLUMNS = passages.Columns("query", "positive", ("neg",), "text")


def test_dev_pairs_are_their_own_corpus_and_a_repeated_query_is_one(tmp_path):
  path = write_csv(tmp_path / "dev.csv", [
      {"id": "a", "query": "q1", "positive": "p1", "neg": "p2"},
      {"id": "b", "query": "q2", "positive": "p2", "neg": ""},
      {"id": "c", "query": "q1", "positive": "p3", "neg": "p1"}], ("id", "query", "positive",
                                                                  "neg"))
  judged = passages.judged_pairs(path, COLUMNS)
  assert judged.corpus == ["p1", "p2", "p3"] and judged.query_ids == ["a", "b"]
  assert judged.relevant == [[0, 2], [1]]
  rows = passages.read_pairs(path, COLUMNS)
  assert rows.passages == [["p1", "p2"], ["p2"], ["p3", "p1"]]


def test_judged_queries_name_their_passages_by_id(tmp_path):
  corpus = write_jsonl(tmp_path / "corpus.jsonl", [{"id": 7, "text": "x"}, {"id": "b",
                                                                           "text": "y"}])
  ids, texts = passages.read_corpus(corpus, COLUMNS)
  assert ids == ["7", "b"] and texts == ["x", "y"]
  dev = write_jsonl(tmp_path / "dev.jsonl", [{"query": "q", "positive": "b, 7"},
                                             {"query": "r", "positive": ["b"]}])
  judged = passages.read_judged(dev, COLUMNS, ids, texts, corpus)
  assert judged.relevant == [[1, 0], [1]] and judged.query_ids == ["0", "1"]


@pytest.mark.parametrize("case", ["no_column", "empty_query", "unknown_id", "twice",
                                  "empty_passage"])
def test_bad_files_are_refused_naming_the_line_and_column(tmp_path, case):
  corpus = write_jsonl(tmp_path / "corpus.jsonl", [{"id": "a", "text": "x"}] + (
      [{"id": "a", "text": "y"}] if case == "twice" else []) + (
      [{"id": "b", "text": " "}] if case == "empty_passage" else []))
  rows = [{"query": "" if case == "empty_query" else "q",
           "positive": "zz" if case == "unknown_id" else "a"}]
  dev = write_jsonl(tmp_path / "dev.jsonl", rows)
  if case == "no_column":
    with pytest.raises(Refusal, match=r"dev.jsonl:1: no column 'neg'; the file has \['positive', "
                                      r"'query'\]\. Name the columns with config\.data\.query / "
                                      r"positive / negatives"):
      passages.read_pairs(dev, COLUMNS)
    return
  if case == "twice":
    with pytest.raises(Refusal, match=r"corpus.jsonl:2: the passage id 'a' is given twice "
                                      r"\(first at .*corpus.jsonl:1\)"):
      passages.read_corpus(corpus, COLUMNS)
    return
  if case == "empty_passage":  # ranked, and scored, by its [CLS] and [SEP] alone: refused
    with pytest.raises(Refusal, match=r"corpus.jsonl:2: column 'text' is empty; every row needs "
                                      r"its passage's text \(fill it, or leave the row out\)"):
      passages.read_corpus(corpus, COLUMNS)
    return
  message = {"empty_query": r"dev.jsonl:1: column 'query' is empty",
             "unknown_id": r"dev.jsonl:1: column 'positive' names the passage id 'zz', which "
                           r".*corpus.jsonl does not hold"}[case]
  with pytest.raises(Refusal, match=message):
    passages.read_judged(dev, COLUMNS, *passages.read_corpus(corpus, COLUMNS), corpus)
