"""Each fine-tuning task as the run sees it: the objective, the training features, the sets scored
after every epoch, and the sets only predicted (test splits) with what is written for them.

  GLUE (CoLA, SST-2, MRPC, STS-B, QQP, MNLI, QNLI, RTE, WNLI) and NEXT (the built-in task):
      dev split(s) scored with the task's GLUE metrics; test split(s) written as the GLUE server's
      `TASK.tsv`. MNLI scores dev_matched (main) and dev_mismatched, and also predicts AX (the
      diagnostic set) where its file is present: GLUE scores AX with the MNLI model.
  SQuAD v1.1 / v2.0: the dev file scored with the official EM / F1; predictions.json,
      nbest_predictions.json (and null_odds.json) written for it.
  CoNLL-2003: dev ("testa") scored with conlleval's entity F1, test ("testb") scored and written
      as `word gold predicted` columns, the input conlleval reads.
  One's own task: the name of a task family (bertjax/finetune/families/), whose `load` reads
      one's own files (bertjax/finetune/kit/custom.py).

Each benchmark here is a reader: it reads its files into a family's examples and hands them to
the family's features, objective and metric (GLUE and NEXT: classification or regression; SQuAD:
span; CoNLL-2003: tagging), adding only what is its own (GLUE's metrics and submission files,
the conlleval columns). Every task also says what its model does with text (`spec.TaskSpec`:
family, label names by id, input columns, decoding), which the run keeps beside its weights for
prediction and export.

`load(cfg, tokenizer)` (cfg: the run's `config.TaskConfig`) reads everything before the first
step, so a bad file fails at once.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import numpy as np

from bertjax import files
from bertjax.errors import Refusal
from bertjax.finetune import families
from bertjax.finetune.families import span, tagging
from bertjax.finetune.kit import metrics as ft_metrics, objectives
from bertjax.finetune.kit.config import FinetuneDataConfig, TaskConfig
from bertjax.finetune.kit.taskdata import EvalSet, TaskData
from bertjax.finetune.tasks import glue, ner, squad
from bertjax.formats import taskspec as spec_lib
from bertjax.inputs import questions, tagged, word_windows
from bertjax.training import contrastive as contrastive_training

SQUAD_TASKS = {"squad_v1.1": "squad/v1.1", "squad_v2.0": "squad/v2.0"}
NER_TASKS = ("conll2003",)


def names() -> tuple[str, ...]:
  """What --config=configs/finetune.py:TASK accepts, besides GLUE's names in any spelling; the
  families' names last: one's own task, from files."""
  return (tuple(t.lower() for t in glue.TASKS if t != "AX") + tuple(SQUAD_TASKS) + NER_TASKS
          + tuple(families.FAMILIES))


def canonical(name: str) -> str:
  key = name.strip().lower()
  if key in SQUAD_TASKS or key in NER_TASKS or key in families.FAMILIES:
    return key
  if key in ("squad1", "squad_v1", "squad"):
    return "squad_v1.1"
  if key in ("squad2", "squad_v2"):
    return "squad_v2.0"
  if key in ("conll", "ner"):
    return "conll2003"
  try:
    task = glue.get_task(key)
  except ValueError:
    raise Refusal(f"Unknown fine-tuning task {name!r}; choose one of {list(names())}.") from None
  if task.name == "AX":
    raise Refusal("AX (GLUE's diagnostic set) has no training data: GLUE scores it with the "
                  "MNLI model, so task=mnli writes AX.tsv beside MNLI's test predictions.")
  return task.name


def load(cfg: TaskConfig, tokenizer) -> TaskData:
  name = canonical(cfg.task)
  if name in families.FAMILIES:
    return families.get(name).load(cfg, tokenizer)
  if name in SQUAD_TASKS:
    return _squad(name, cfg, tokenizer)
  if name in NER_TASKS:
    return _conll(name, cfg.data, tokenizer)
  return _glue(name, cfg.data, tokenizer)


def _tfds_dir(data: FinetuneDataConfig) -> str | None:
  return data.tfds_data_dir or None


def _check_source(data: FinetuneDataConfig) -> None:
  if data.source not in ("files", "tfds"):
    raise Refusal(f"config.data.source={data.source!r}: use 'files' (the task's original files) "
                  "or 'tfds' (a TFDS dataset already built under tfds_data_dir).")


# GLUE ------------------------------------------------------------------------------------------

def _glue_split(name: str, data: FinetuneDataConfig, split: str):
  if data.source == "tfds":
    return glue.read_glue_tfds(_tfds_dir(data), name, split)
  if not data.data_dir:
    raise Refusal(f"{name} from files needs config.data.data_dir: the folder of GLUE's download "
                  f"(holding {glue.get_task(name).splits[split].file}).")
  return glue.read_glue_tsv(data.data_dir, name, split)


def _glue_available(name: str, data: FinetuneDataConfig, split: str) -> bool:
  if data.source == "tfds":
    return True
  return os.path.exists(os.path.join(data.data_dir, glue.get_task(name).splits[split].file))


def _glue(name: str, data: FinetuneDataConfig, tokenizer) -> TaskData:
  _check_source(data)
  task = glue.get_task(name)
  notes = []

  def features(task_name, split):
    got = _glue_split(task_name, data, split)
    if got.skipped:
      notes.append(f"{task_name} {split}: left out {len(got.skipped)} malformed row(s), e.g. "
                   f"{got.skipped[0]}")
    return glue.glue_features(task_name, got.examples, tokenizer, data.max_seq_length)

  pair = any(layout.text_b is not None for layout in task.splits.values())
  spec = spec_lib.TaskSpec(name, "regression" if task.is_regression else "classification",
                           task.labels, data.max_seq_length,
                           text_a="text_a" if pair else "text", text_b="text_b" if pair else "")
  family = families.get(spec.family)
  train_features = features(name, "train")

  def scorer(task_name, labels_N):
    def score(outputs):
      return ft_metrics.glue_metrics(task_name, family.predicted(outputs), labels_N)
    return score

  def submission(task_name, split, index_N):
    def write(outputs, output_dir):
      return [glue.write_submission(output_dir, task_name, split, index_N,
                                    family.predicted(outputs))]
    return write

  dev_splits = [s for s in task.splits if s.startswith("dev")]
  evals = []
  for split in dev_splits:
    f = features(name, split)
    evals.append(EvalSet(split, f, scorer(name, f["label"])))
  predicts = []
  test_sets = [(name, s) for s in task.submissions]
  if name == "MNLI":
    test_sets.append(("AX", "test"))
  for task_name, split in test_sets:
    if not _glue_available(task_name, data, split):
      notes.append(f"{task_name} {split}: no file under data_dir; not predicted")
      continue
    f = features(task_name, split)
    predicts.append(EvalSet(f"{task_name}_{split}" if task_name != name else split, f, None,
                            submission(task_name, split, f["index"])))
  main = ft_metrics.GLUE_METRICS[name].main
  return TaskData(name, family.objective(spec), train_features, evals, predicts, main, notes,
                  spec=spec)


# SQuAD -----------------------------------------------------------------------------------------

def _squad_set(name: str, data: FinetuneDataConfig, split: str,
               is_training: bool) -> questions.SquadSet:
  if data.source == "tfds":
    tfds_split = "train" if split == "train" else "validation"
    return squad.read_squad_tfds(SQUAD_TASKS[name], tfds_split, data_dir=_tfds_dir(data),
                                 is_training=is_training)
  path = data.train_file if split == "train" else data.dev_file
  if not path:
    raise Refusal(f"{name} from files needs config.data.{'train' if split == 'train' else 'dev'}"
                  f"_file: the SQuAD JSON ({'train' if split == 'train' else 'dev'}-"
                  f"{name.split('_v')[1]}.json).")
  return questions.read_squad_json(path, is_training=is_training)


def _check_squad_version(name: str, squad_set: questions.SquadSet) -> questions.SquadSet:
  """v1.1 has no unanswerable question: one in its file means a v2.0 file, which v1.1 would train
  on as if answerable and score with no gold answer. Refused before any step."""
  impossible = [e.qas_id for e in squad_set.examples if e.is_impossible]
  if name == "squad_v1.1" and impossible:
    raise Refusal(f"{squad_set.source}: {len(impossible)} question(s) marked is_impossible "
                  f"(e.g. id {impossible[0]!r}): a SQuAD v2.0 file. Fine-tune it with "
                  "configs/finetune.py:squad_v2.0, or give squad_v1.1 a v1.1 file.")
  return squad_set


def _squad(name: str, cfg: TaskConfig, tokenizer) -> TaskData:
  _check_source(cfg.data)
  train_set = _check_squad_version(name, _squad_set(name, cfg.data, "train", True))
  dev_set = _check_squad_version(name, _squad_set(name, cfg.data, "dev", False))
  return span.task(span.spec_of(name, cfg, name == "squad_v2.0"), train_set, dev_set, "f1",
                   tokenizer)


# CoNLL-2003 ------------------------------------------------------------------------------------

def _ner_split(data: FinetuneDataConfig, split: str) -> list[tagged.Sentence]:
  if data.source == "tfds":
    return ner.read_conll_tfds(_tfds_dir(data), {"dev": "validation"}.get(split, split))
  path = {"train": data.train_file, "dev": data.dev_file, "test": data.test_file}[split]
  if not path:
    raise Refusal(f"conll2003 from files needs config.data.{split}_file (eng.train, eng.testa, "
                  f"eng.testb in the original release).")
  return ner.read_conll(path)


def _conll(name: str, data: FinetuneDataConfig, tokenizer) -> TaskData:
  _check_source(data)
  labels = ner.CONLL2003_LABELS
  spec = spec_lib.TaskSpec(name, "tagging", labels, data.max_seq_length, tag_scheme="BIO")

  def features(sentences):
    return word_windows.make_features(sentences, tokenizer, data.max_seq_length, labels)

  def scorer(sentences, f):
    full = tagging.scorer(sentences, f, labels, "f1")

    def score(outputs):  # conlleval's overall numbers, as the CoNLL-2003 papers report them
      out = full(outputs)
      return {k: out[k] for k in ("precision", "recall", "f1", "accuracy", "main")}
    return score

  def writer(sentences, f, split):
    def write(outputs, output_dir):
      predicted = word_windows.tags_from_predictions(f, outputs["predicted"], sentences,
                                                     labels)
      files.makedirs(output_dir)
      path = os.path.join(output_dir, f"{split}_predictions.txt")
      # Atomic (temp file + rename): a kill mid-write never leaves half a predictions file.
      files.write_text(path, "".join(
          "".join(f"{w} {g} {p}\n" for w, g, p in zip(s.words, s.tags, tags)) + "\n"
          for s, tags in zip(sentences, predicted)))
      return [path]
    return write

  train_features = features(_ner_split(data, "train"))
  evals, predicts = [], []
  for split in ("dev", "test"):
    if split == "test" and data.source == "files" and not data.test_file:
      continue
    sentences = _ner_split(data, split)
    f = features(sentences)
    if split == "dev":
      evals.append(EvalSet("dev", f, scorer(sentences, f)))
    predicts.append(EvalSet(split, f, scorer(sentences, f), writer(sentences, f, split)))
  return TaskData(name, tagging.objective(spec), train_features, evals, predicts, "f1", spec=spec)


def num_examples(features) -> int:
  """Rows of a set's features; of every input where it has several (embeddings: queries and
  passages, each of its own length)."""
  if isinstance(features, (list, tuple)):
    return sum(num_examples(f) for f in features)
  return len(next(iter(features.values())))


def tokens_per_example(features: Mapping[str, np.ndarray]) -> int:
  """The token positions one training example encodes: its row's length, or a query's and its
  passages' (embeddings: Lq + C x Lp), for the search's memory estimate."""
  texts = [features[k] for k in ("input_ids", *contrastive_training.INPUTS[::2]) if k in features]
  return sum(int(np.prod(x.shape[1:])) for x in texts)


def model_features(features: Mapping[str, np.ndarray]) -> dict[str, Any]:
  """The arrays a batch carries to the device (not indices, offsets or other host-side keys)."""
  keep = set(objectives.INPUTS).union(*(f.batch_keys for f in families.FAMILIES.values()))
  return {k: v for k, v in features.items() if k in keep}
