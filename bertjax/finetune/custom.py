"""One's own task from one's own files: `--config=configs/finetune.py:FAMILY` with FAMILY one of

  classification  one text (or a pair) and a label name per row; any number of labels
  regression      one text (or a pair) and a number per row
  tagging         words and one tag per word (IO, BIO, IOB1 or IOBES), entity-level scores
  span            extractive QA from files in SQuAD's JSON layout (v1.1, or v2.0 with
                  unanswerable questions)

Classification, regression and tagging read CSV, TSV or JSON Lines (bertjax/finetune/textfiles.py)
with the columns named under config.data (text_a, text_b, label; tokens and tags for tagging, each
a JSON list or words separated by spaces); tagging also reads CoNLL column files (format "conll",
or a .conll file). data.train_file and data.dev_file are needed, data.test_file is optional: it is
predicted with the best checkpoint into predictions/test.jsonl (the lines `bertjax.predict`
writes) and scored too where every row has a label.

The label map comes from config.data.labels where given, else from the training file: the labels
sorted (as numbers where every one is an integer, else as text), so the same file always gives the
same ids. It is written to the workdir (task.json) and with every checkpoint. A dev or test label
outside it is an error naming the file, line and label. Tags are read in their scheme
(config.data.tag_scheme, or detected from the training file) and learned as IOB2 tags of the
entity types found (bertjax/finetune/ner.py).

What each family reports after every epoch (all in evaluations.json and results.json; the per-class
scores and the confusion matrix of the best checkpoint in results.json's "dev_report"):
  classification  accuracy, macro_f1, micro_f1; per class precision, recall, F1, support
  regression      pearson, spearman, mse
  tagging         entity precision, recall, F1 (overall and per type), token accuracy
  span            exact, f1 (the official SQuAD measures; v2.0's HasAns / NoAns split)
config.eval.main_metric picks the best checkpoint (metrics.MAIN_METRICS; "" = the first).
"""

from __future__ import annotations

import json
import os
from typing import Callable, Mapping, Sequence

import numpy as np

from bertjax import files
from bertjax import taskspec as spec_lib
from bertjax.finetune import glue, metrics as ft_metrics, ner, objectives
from bertjax.finetune import textfiles
from bertjax.finetune.config import EvalConfig, FinetuneDataConfig, TaskConfig
from bertjax.finetune.taskdata import EvalSet, TaskData

FAMILIES = ("classification", "regression", "tagging")  # span goes through tasks' SQuAD path
CONLL = "conll"


def _labels_given(data: FinetuneDataConfig) -> tuple[str, ...]:
  return tuple(x.strip() for x in data.labels.split(",") if x.strip())


def sorted_labels(names) -> tuple[str, ...]:
  """Numeric order where every label is an integer ("2" before "10"), else text order."""
  names = set(names)
  try:
    return tuple(sorted(names, key=int))
  except ValueError:
    return tuple(sorted(names))


def text_columns(spec: spec_lib.TaskSpec) -> list[str]:
  return [spec.text_a] + ([spec.text_b] if spec.text_b else [])


# Classification and regression ------------------------------------------------------------------

def _label_of(row: textfiles.Row, column: str, family: str) -> str | float:
  value = row[column]
  if family == "regression":
    try:
      number = float(value)
    except (TypeError, ValueError):
      number = float("nan")
    if not np.isfinite(number):
      raise ValueError(f"{row.where}: column {column!r} holds {value!r}, not a number; a "
                       "regression task needs a number on every row.")
    return number
  if isinstance(value, float) and value.is_integer():
    # A JSON number is its value, not its spelling: 1 and 1.0 (pandas writes an integer column
    # holding a gap as floats) are one class, named as the integer.
    value = int(value)
  text = "" if value is None else str(value).strip()
  if not text:
    raise ValueError(f"{row.where}: empty label in column {column!r}; every training and dev row "
                     "needs one (leave a row out, or give it its label).")
  return text


def label_notes(rows: "Rows", column: str) -> list[str]:
  """What a user should hear about the labels of a file: surrounding spaces taken off, and
  labels told apart only by case (kept apart: "Pos" and "pos" may be meant as two)."""
  notes = []
  spaced = [w for w, r in zip(rows.where, rows.raw_labels)
            if isinstance(r, str) and r != r.strip()]
  if spaced:
    notes.append(f"{len(spaced)} label(s) in column {column!r} of {rows.path} had spaces around "
                 f"them, taken off (first at {spaced[0]})")
  by_folded: dict[str, dict[str, str]] = {}
  for where, label in zip(rows.where, rows.labels):
    by_folded.setdefault(label.casefold(), {}).setdefault(label, where)
  for spellings in by_folded.values():
    if len(spellings) > 1:
      notes.append(f"labels {sorted(spellings)} in {rows.path} differ only in case and are "
                   f"separate classes (at {', '.join(spellings[k] for k in sorted(spellings))}); "
                   "write them alike if they are one")
  return notes


class Rows:
  """The examples of one file: texts, labels (None where the file has none) and where each is."""

  def __init__(self, path: str, spec: spec_lib.TaskSpec, fmt: str, need_labels: bool):
    rows = textfiles.read_rows(path, text_columns(spec) + ([spec.label] if need_labels else []),
                               fmt)
    self.path = path
    self.where = [r.where for r in rows]
    self.texts_a = [textfiles.text_of(r, spec.text_a) for r in rows]
    self.texts_b = [textfiles.text_of(r, spec.text_b) for r in rows] if spec.text_b else None
    self.ids = [str(r.get("id", k)) for k, r in enumerate(rows)]
    labelled = need_labels or all(spec.label in r and str(r[spec.label]).strip() for r in rows)
    self.raw_labels = [r[spec.label] for r in rows] if labelled else None
    self.labels = [_label_of(r, spec.label, spec.family) for r in rows] if labelled else None


def _label_ids(rows: Rows, labels: Sequence[str]) -> np.ndarray:
  index = {name: k for k, name in enumerate(labels)}
  for where, label in zip(rows.where, rows.labels):
    if label not in index:
      raise ValueError(f"{where}: label {label!r} is not in the label map {list(labels)} (read "
                       "from the training file, or config.data.labels); add it there, or fix "
                       "the row.")
  return np.array([index[label] for label in rows.labels], np.int32)


def truncation_note(rows: Rows, truncated_N: np.ndarray, max_seq_length: int) -> list[str]:
  """The note a file of texts cut to fit gets: how many, and the first (no text is cut unsaid)."""
  if not truncated_N.any():
    return []
  return [f"{int(truncated_N.sum())} of {len(truncated_N)} row(s) of {rows.path} are longer than "
          f"data.max_seq_length={max_seq_length} tokens and were cut to fit (the first at "
          f"{rows.where[int(np.argmax(truncated_N))]}); raise data.max_seq_length to keep more"]


def pair_features(rows: Rows, spec: spec_lib.TaskSpec, tokenizer,
                  notes: list[str] | None = None) -> dict[str, np.ndarray]:
  """The rows' features (and labels where they have them); texts cut to fit are said in `notes`."""
  features, truncated_N = glue.encode_pairs(rows.texts_a, rows.texts_b, tokenizer,
                                            spec.max_seq_length)
  if notes is not None:
    notes += truncation_note(rows, truncated_N, spec.max_seq_length)
  if rows.labels is not None:
    features["label"] = (np.array(rows.labels, np.float32) if spec.family == "regression"
                         else _label_ids(rows, spec.labels))
  return features


def class_weights(raw: str, labels: Sequence[str], train_ids_N: np.ndarray) -> list[float] | None:
  """Of config.train.class_weights: "" (none), "balanced" (n / (C * count): each class weighs as
  much in the loss as any other, sklearn's rule) or "name=weight,..." (unnamed classes weigh 1)."""
  raw = raw.strip()
  if not raw:
    return None
  counts_C = np.bincount(train_ids_N, minlength=len(labels))
  if raw == "balanced":
    absent = [labels[k] for k in np.flatnonzero(counts_C == 0)]
    if absent:
      raise ValueError(f"train.class_weights='balanced': the label(s) {absent} have no training "
                       "example, so no weight; drop them from config.data.labels or give weights.")
    return [float(w) for w in len(train_ids_N) / (len(labels) * counts_C)]
  weights = [1.0] * len(labels)
  for item in raw.split(","):
    name, eq, value = item.partition("=")
    name = name.strip()
    if not eq or name not in labels:
      raise ValueError(f"train.class_weights={raw!r}: {item.strip()!r} is not label=weight with "
                       f"a label of {list(labels)}; or use 'balanced'.")
    try:
      weights[labels.index(name)] = float(value)
    except ValueError:
      raise ValueError(f"train.class_weights: {value!r} (for {name!r}) is not a number.") from None
  if min(weights) < 0 or max(weights) <= 0:
    raise ValueError(f"train.class_weights={raw!r}: weights must be >= 0, one at least > 0.")
  return weights


def decode_pairs(spec: spec_lib.TaskSpec, outputs: Mapping[str, np.ndarray]) -> list[dict]:
  """One record per example: the label and each label's probability, or the value."""
  if spec.family == "regression":
    return [{"value": round(float(v), 6)} for v in outputs["score"]]
  logits_NxC = np.asarray(outputs["logits"], np.float64)
  probs_NxC = np.exp(logits_NxC - logits_NxC.max(-1, keepdims=True))
  probs_NxC /= probs_NxC.sum(-1, keepdims=True)
  return [{"label": spec.labels[int(np.argmax(p))],
           "probabilities": {name: round(float(x), 6) for name, x in zip(spec.labels, p)}}
          for p in probs_NxC]


# Tagging ----------------------------------------------------------------------------------------

def read_tagged(path: str, spec: spec_lib.TaskSpec, fmt: str
                ) -> list[tuple[str, list[str], list[str]]]:
  """(where, words, tags as written) of each sentence of a tagging file."""
  if fmt == CONLL or (not fmt and os.path.splitext(path)[1].lower() in (".conll", ".bio")):
    return [(f"{path}:{line}", words, tags) for line, words, tags in ner.read_columns(path)]
  out = []
  for row in textfiles.read_rows(path, [spec.tokens, spec.tags], fmt):
    words, tags = textfiles.list_of(row, spec.tokens), textfiles.list_of(row, spec.tags)
    if len(words) != len(tags):
      raise ValueError(f"{row.where}: {len(words)} word(s) in {spec.tokens!r} but {len(tags)} "
                       f"tag(s) in {spec.tags!r}; a tagging row has one tag per word.")
    if not words:
      raise ValueError(f"{row.where}: no words in column {spec.tokens!r}.")
    out.append((row.where, words, tags))
  if not out:
    raise ValueError(f"{path}: no sentences.")
  return out


def tagged_sentences(raw, scheme: str, labels: Sequence[str]) -> list[ner.Sentence]:
  sentences = []
  known = set(labels)
  for where, words, tags in raw:
    iob2 = ner.scheme_to_iob2(tags, scheme, where)
    for i, tag in enumerate(iob2):
      if tag not in known:
        raise ValueError(f"{where} word {i + 1}: entity type of tag {tags[i]!r} is not in the "
                         f"label map {list(labels)}; add the type to config.data.labels or fix "
                         "the tag.")
    sentences.append(ner.Sentence(where, tuple(words), tuple(iob2)))
  return sentences


def word_starts(words: Sequence[str]) -> tuple[str, list[int]]:
  """The words joined by spaces, and where each starts in that text."""
  starts, at = [], 0
  for w in words:
    starts.append(at)
    at += len(w) + 1
  return " ".join(words), starts


def entities(text: str, words: Sequence[str], starts: Sequence[int], tags: Sequence[str]
             ) -> list[dict]:
  """Each entity of the IOB2 tags, with its characters [start, end) in `text` (where word i
  starts at starts[i])."""
  out = []
  for kind, first, end in ner.chunks(tags):
    begin, stop = starts[first], starts[end - 1] + len(words[end - 1])
    out.append({"type": kind, "start": begin, "end": stop, "text": text[begin:stop]})
  return out


def decode_tags(sentences: Sequence[ner.Sentence], features, predicted_NxL, labels) -> list[dict]:
  tags = ner.tags_from_predictions(features, predicted_NxL, sentences, labels)
  records = []
  for s, t in zip(sentences, tags):
    text, starts = word_starts(s.words)
    records.append({"text": text, "entities": entities(text, s.words, starts, t), "tags": list(t)})
  return records


# The task ---------------------------------------------------------------------------------------

def spec_of(family: str, cfg: TaskConfig, labels: Sequence[str] = (), scheme: str = "",
            version_2: bool = False) -> spec_lib.TaskSpec:
  d, e = cfg.data, cfg.eval
  return spec_lib.TaskSpec(
      task=family, family=family, labels=tuple(labels), max_seq_length=d.max_seq_length,
      text_a=d.text_a, text_b=d.text_b, label=d.label, tokens=d.tokens, tags=d.tags,
      tag_scheme=scheme, version_2_with_negative=version_2, doc_stride=d.doc_stride,
      max_query_length=d.max_query_length, n_best_size=e.n_best_size,
      max_answer_length=e.max_answer_length,
      null_score_diff_threshold=e.null_score_diff_threshold)


def _paths(d: FinetuneDataConfig, family: str) -> tuple[str, str, str]:
  missing = [k for k in ("train_file", "dev_file") if not getattr(d, k)]
  if missing:
    raise ValueError(f"A {family} task from one's own files needs "
                     + " and ".join(f"config.data.{k}" for k in missing)
                     + " (CSV, TSV or JSON Lines; data.test_file is optional).")
  return d.train_file, d.dev_file, d.test_file


def main_metric(evaluation: EvalConfig, family: str) -> str:
  main = evaluation.main_metric or ft_metrics.MAIN_METRICS[family][0]
  ft_metrics.main_value(family, {m: 0.0 for m in ft_metrics.MAIN_METRICS[family]}, main)
  return main


def write_jsonl(path: str, records: Sequence[dict]) -> str:
  files.makedirs(os.path.dirname(path) or ".")
  files.write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
  return path


def load(family: str, cfg: TaskConfig, tokenizer):
  """The TaskData of one's own classification, regression or tagging task (see the module
  docstring)."""
  if cfg.data.source != "files":
    raise ValueError(f"config.data.source={cfg.data.source!r}: one's own {family} task reads "
                     "its files (data.train_file, data.dev_file); TFDS serves the benchmarks.")
  train_path, dev_path, test_path = _paths(cfg.data, family)
  main = main_metric(cfg.eval, family)
  fmt = cfg.data.format
  if family == "tagging":
    return _tagging(cfg, tokenizer, main, fmt, train_path, dev_path, test_path)
  probe = spec_of(family, cfg, ("a", "b") if family == "classification" else ())
  train_rows = Rows(train_path, probe, fmt, need_labels=True)
  labels: tuple[str, ...] = ()
  if family == "classification":
    labels = _labels_given(cfg.data) or sorted_labels(train_rows.labels)
    if len(labels) < 2:
      raise ValueError(f"{train_path}: one label ({labels[0]!r}) in the whole file; "
                       "classification needs at least two.")
  spec = spec_of(family, cfg, labels)
  notes = label_notes(train_rows, spec.label) if family == "classification" else []
  train = pair_features(train_rows, spec, tokenizer, notes)
  if family == "classification":
    weights = class_weights(cfg.class_weights, labels, train["label"])
    objective = objectives.classification(len(labels), weights)
    if weights is not None:
      notes.append("class weights " + ", ".join(f"{n}={w:.3g}" for n, w in zip(labels, weights)))
  else:
    if cfg.class_weights:
      raise ValueError("train.class_weights applies to classification, not regression.")
    objective = objectives.regression()

  def report(rows: Rows) -> Callable[[Mapping[str, np.ndarray]], dict]:
    def score(outputs):
      if family == "regression":
        out = ft_metrics.regression_report(outputs["score"], np.array(rows.labels, np.float32))
      else:
        out = ft_metrics.classification_report(np.argmax(outputs["logits"], -1),
                                               _label_ids(rows, labels), labels)
      return {**out, "main": ft_metrics.main_value(family, out, main)}
    return score

  def writer(rows: Rows, split: str):
    def write(outputs, output_dir):
      records = [{"id": i, **r} for i, r in zip(rows.ids, decode_pairs(spec, outputs))]
      return [write_jsonl(os.path.join(output_dir, f"{split}.jsonl"), records)]
    return write

  dev_rows = Rows(dev_path, spec, fmt, need_labels=True)
  if family == "classification":
    notes += label_notes(dev_rows, spec.label)
  dev = EvalSet("dev", pair_features(dev_rows, spec, tokenizer, notes), report(dev_rows),
                     report=report(dev_rows))
  predicts = []
  if test_path:
    test_rows = Rows(test_path, spec, fmt, need_labels=False)
    scored = report(test_rows) if test_rows.labels is not None else None
    predicts.append(EvalSet("test", pair_features(test_rows, spec, tokenizer, notes), scored,
                                 writer(test_rows, "test"), report=scored))
  return TaskData(family, objective, train, [dev], predicts, main, notes, spec=spec)


def _tagging(cfg: TaskConfig, tokenizer, main, fmt, train_path,
             dev_path, test_path):
  probe = spec_of("tagging", cfg, ("O", "B-X"))
  raw_train = read_tagged(train_path, probe, fmt)
  scheme = (cfg.data.tag_scheme or ner.detect_scheme(t for _, _, t in raw_train)).upper()
  if scheme == "IOB2":
    scheme = "BIO"
  if scheme not in spec_lib.TAG_SCHEMES:
    raise ValueError(f"config.data.tag_scheme={cfg.data.tag_scheme!r}: use one of "
                     f"{spec_lib.TAG_SCHEMES} or '' to detect it from the training file.")
  given = _labels_given(cfg.data)
  if given:
    kinds = [ner.scheme_tag(t)[1] for t in given if t != "O"]
  else:
    kinds = [ner.scheme_tag(t)[1] for _, _, tags in raw_train
             for t in tags if t != "O"]
  labels = ner.tag_labels(kinds)
  if len(labels) < 2:
    raise ValueError(f"{train_path}: no entity tags (every word is O); nothing to learn.")
  spec = spec_of("tagging", cfg, labels, scheme)
  L = spec.max_seq_length

  def features(sentences):
    return ner.ner_features(sentences, tokenizer, L, labels)

  def report(sentences, f):
    gold = [list(s.tags) for s in sentences]

    def score(outputs):
      predicted = ner.tags_from_predictions(f, outputs["predicted"], sentences, labels)
      out = ner.conlleval(gold, predicted)
      return {**out, "main": ft_metrics.main_value("tagging", out, main)}
    return score

  def writer(sentences, f, split):
    def write(outputs, output_dir):
      return [write_jsonl(os.path.join(output_dir, f"{split}.jsonl"),
                          decode_tags(sentences, f, outputs["predicted"], labels))]
    return write

  train = features(tagged_sentences(raw_train, scheme, labels))
  dev_sentences = tagged_sentences(read_tagged(dev_path, spec, fmt), scheme, labels)
  dev_f = features(dev_sentences)
  evals = [EvalSet("dev", dev_f, report(dev_sentences, dev_f),
                        report=report(dev_sentences, dev_f))]
  predicts = []
  if test_path:
    test_sentences = tagged_sentences(read_tagged(test_path, spec, fmt), scheme, labels)
    test_f = features(test_sentences)
    predicts.append(EvalSet("test", test_f, report(test_sentences, test_f),
                                 writer(test_sentences, test_f, "test"),
                                 report=report(test_sentences, test_f)))
  notes = [f"tags read as {scheme}" + ("" if cfg.data.tag_scheme else " (detected)")
           + f", learned as IOB2 over {len(labels)} tags"]
  return TaskData("tagging", objectives.tagging(len(labels)), train, evals, predicts, main,
                       notes, spec=spec)
