"""The built-in task NEXT of `make finetune`: its labels come from the text, and nothing it scores
was seen in pre-training."""

import json
import subprocess
import sys

from bertjax.data import corpus
from bertjax.finetune import builtin
from bertjax.finetune.tasks import glue


def _successors(docs):
  """sentence -> the sentences that follow it in these documents."""
  out = {}
  for doc in docs:
    for a, b in zip(doc, doc[1:]):
      out.setdefault(builtin._clean(a), set()).add(builtin._clean(b))
  return out


def test_next_labels_follow_the_text_and_scored_pairs_come_from_heldout_documents(tmp_path):
  counts = builtin.write_task(str(tmp_path), max_train_pairs=2000)
  docs = [d for d in corpus.builtin_documents() if len(d) >= 2]
  held = [d for d in docs if corpus.is_heldout(d, 0.1)]
  train_docs = [d for d in docs if not corpus.is_heldout(d, 0.1)]
  held_next, train_next = _successors(held), _successors(train_docs)
  held_sentences = {builtin._clean(s) for d in held for s in d}
  train_only = {builtin._clean(s) for d in train_docs for s in d} - held_sentences

  dev = glue.read_glue_tsv(str(tmp_path), "NEXT", "dev").examples
  test = glue.read_glue_tsv(str(tmp_path), "NEXT", "test").examples
  train = glue.read_glue_tsv(str(tmp_path), "NEXT", "train").examples
  assert (len(train), len(dev), len(test)) == (counts["train"], counts["dev"], counts["test"])
  assert len(train) == 2000 and len(dev) > 500 and len(test) > 500
  # Balanced exactly: one pair of each label per sentence with a successor.
  assert sum(e.label == "1" for e in dev) * 2 == len(dev)
  for split in (dev, train):
    successors = held_next if split is dev else train_next
    positives = [e for e in split if e.label == "1"]
    negatives = [e for e in split if e.label == "0"]
    # "1": B follows A in a document of the right side of pre-training's split.
    assert all(e.text_b in successors.get(e.text_a, ()) for e in positives)
    # "0": B comes from another document (a repeated sentence can follow A by chance, rarely).
    by_chance = sum(e.text_b in successors.get(e.text_a, ()) for e in negatives)
    assert by_chance <= 0.02 * len(negatives)
  # Nothing scored comes from a document pre-training trained on.
  assert not any(e.text_a in train_only or e.text_b in train_only for e in dev + test)


def test_compare_prints_both_runs_from_the_makefiles_command_line(tmp_path):
  # `make finetune` ends with `python -m bertjax.finetune.builtin compare PRETRAINED RANDOM`.
  (tmp_path / "data" / builtin.NAME).mkdir(parents=True)
  (tmp_path / "data" / builtin.NAME / "dev.tsv").write_text("header\n" + "row\n" * 4)
  for name, score, epochs in (("pre", 0.75, 3), ("rand", 0.5, 10)):
    (tmp_path / name).mkdir()
    (tmp_path / name / "config.json").write_text(json.dumps(
        {"data": {"data_dir": str(tmp_path / "data")},
         "train": {"learning_rate": 3e-4, "num_epochs": epochs}}))
    (tmp_path / name / "results.json").write_text(json.dumps(
        {"best": {"scores": {"main": score}, "epoch": 2}, "final": {"main": score}}))
  out = subprocess.run([sys.executable, "-m", "bertjax.finetune.builtin", "compare",
                        str(tmp_path / "pre"), str(tmp_path / "rand")], capture_output=True,
                       text=True, check=True, timeout=300).stdout
  assert "(held-out documents, 4 pairs)" in out and "pre-training adds +0.2500" in out
  # Each side's settings are printed with its score (the random twin has its own).
  assert "best 0.7500 (epoch 2)   last 0.7500   (lr 3.0e-4, 3 epochs)" in out
  assert "best 0.5000 (epoch 2)   last 0.5000   (lr 3.0e-4, 10 epochs)" in out
