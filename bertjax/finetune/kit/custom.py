"""One's own task from one's own files: `--config=configs/finetune.py:FAMILY`, FAMILY the name of
a task family (bertjax/finetune/families/: classification, regression, tagging, span,
embeddings); each family's `load` reads its files with the pieces here.

Classification, regression and tagging read CSV, TSV, JSON Lines or Parquet
(bertjax/inputs/textfiles.py) with the columns named under config.data (text_a, text_b, label;
tokens and tags for tagging, each a JSON list or words separated by spaces); tagging also reads CoNLL column files (format "conll",
or a .conll file); span reads SQuAD's JSON layout (v1.1, or v2.0 with unanswerable questions).
data.train_file and data.dev_file are needed, data.test_file is optional: it is predicted with the
best checkpoint into predictions/test.jsonl (the lines `bertjax.predict` writes) and scored too
where every row has a label.

The label map comes from config.data.labels where given, else from the training file: the labels
sorted (as numbers where every one is an integer, else as text), so the same file always gives the
same ids. It is written to the workdir (task.json) and with every checkpoint. A dev or test label
outside it is an error naming the file, line and label.

Every family reports its numbers after every epoch (in evaluations.json and results.json; the full
report of the best checkpoint in results.json's "dev_report"); config.eval.main_metric picks the
best checkpoint among the family's main_metrics ("" = the first).
"""

from __future__ import annotations

import json
import os
from typing import Callable, Mapping, Sequence

import numpy as np

from bertjax import files
from bertjax.errors import Refusal
from bertjax.finetune.kit.config import FinetuneDataConfig, TaskConfig
from bertjax.finetune.kit.taskdata import EvalSet
from bertjax.formats import taskspec as spec_lib
from bertjax.inputs import pairs, textfiles

CONLL = "conll"


def labels_given(data: FinetuneDataConfig) -> tuple[str, ...]:
  return tuple(x.strip() for x in data.labels.split(",") if x.strip())


def text_columns(spec: spec_lib.TaskSpec) -> list[str]:
  return [spec.text_a] + ([spec.text_b] if spec.text_b else [])


def pair_columns(spec: spec_lib.TaskSpec, row: Mapping) -> list[str]:
  del row  # every row of a pair task needs the same columns
  return text_columns(spec)


def pair_row(x, spec: spec_lib.TaskSpec) -> dict:
  """A (text_a, text_b) pair as a row of the model's columns."""
  a, b = x
  return {spec.text_a: a, spec.text_b or "text_b": b}


def pair_inputs(rows: Sequence[Mapping], spec: spec_lib.TaskSpec, tokenizer
                ) -> tuple[dict[str, np.ndarray], np.ndarray]:
  """`[CLS] A [SEP] B [SEP]` features of rows (textfiles.Row) in the spec's columns, and which
  rows were cut to fit, [N] bool."""
  texts_a = [textfiles.text_of(r, spec.text_a) for r in rows]
  texts_b = [textfiles.text_of(r, spec.text_b) for r in rows] if spec.text_b else None
  return pairs.encode_pairs(texts_a, texts_b, tokenizer, spec.max_seq_length)


def pair_records(records: list[dict], truncated_N: np.ndarray) -> list[dict]:
  """Prediction records of pairs, marked where the text was cut to fit: the prediction is of its
  first max_seq_length tokens (predict counts them)."""
  for record, cut in zip(records, truncated_N):
    if cut:
      record["truncated"] = True
  return records


def truncation_note(rows: "Rows", truncated_N: np.ndarray, max_seq_length: int) -> list[str]:
  """The note a file of texts cut to fit gets: how many, and the first (no text is cut unsaid)."""
  if not truncated_N.any():
    return []
  return [f"{int(truncated_N.sum())} of {len(truncated_N)} row(s) of {rows.path} are longer than "
          f"data.max_seq_length={max_seq_length} tokens and were cut to fit (the first at "
          f"{rows.where[int(np.argmax(truncated_N))]}); raise data.max_seq_length to keep more"]


def text_label(row, column: str) -> str:
  """A label column read as a class name (`Rows`' default reading; regression reads numbers)."""
  value = row[column]
  if isinstance(value, float) and value.is_integer():
    # A JSON number is its value, not its spelling: 1 and 1.0 (pandas writes an integer column
    # holding a gap as floats) are one class, named as the integer.
    value = int(value)
  text = "" if value is None else str(value).strip()
  if not text:
    raise Refusal(f"{row.where}: empty label in column {column!r}; every training and dev row "
                  "needs one (leave a row out, or give it its label).")
  return text


class Rows:
  """The examples of one file: texts, labels (None where the file has none) and where each is.
  label_of(row, column) reads a label: a class name by default, a number for regression."""

  def __init__(self, path: str, spec: spec_lib.TaskSpec, fmt: str, need_labels: bool,
               label_of: Callable = text_label):
    rows = textfiles.read_rows(path, text_columns(spec) + ([spec.label] if need_labels else []),
                               fmt)
    self.path = path
    self.rows = rows
    self.where = [r.where for r in rows]
    self.ids = [str(r.get("id", k)) for k, r in enumerate(rows)]
    labelled = need_labels or all(spec.label in r and str(r[spec.label]).strip() for r in rows)
    self.raw_labels = [r[spec.label] for r in rows] if labelled else None
    self.labels = [label_of(r, spec.label) for r in rows] if labelled else None


def pair_features(rows: Rows, spec: spec_lib.TaskSpec, tokenizer, notes: list[str] | None = None,
                  label_array: Callable | None = None) -> dict[str, np.ndarray]:
  """The rows' features, and their labels where they have them (label_array(rows, spec): the
  family's ids or values); texts cut to fit are said in `notes`."""
  features, truncated_N = pair_inputs(rows.rows, spec, tokenizer)
  if notes is not None:
    notes += truncation_note(rows, truncated_N, spec.max_seq_length)
  if rows.labels is not None:
    if label_array is None:
      raise ValueError(f"{rows.path}: labelled rows need the family's label_array.")
    features["label"] = label_array(rows, spec)
  return features


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


def paths(d: FinetuneDataConfig, family: str) -> tuple[str, str, str]:
  """data.train_file, dev_file and test_file of one's own task (read from files only)."""
  if d.source != "files":
    raise Refusal(f"config.data.source={d.source!r}: one's own {family} task reads "
                  "its files (data.train_file, data.dev_file); TFDS serves the benchmarks.")
  missing = [k for k in ("train_file", "dev_file") if not getattr(d, k)]
  if missing:
    raise Refusal(f"A {family} task from one's own files needs "
                  + " and ".join(f"config.data.{k}" for k in missing)
                  + " (CSV, TSV, JSON Lines or Parquet; data.test_file is optional).")
  return d.train_file, d.dev_file, d.test_file


def write_jsonl(path: str, records: Sequence[dict]) -> str:
  files.makedirs(os.path.dirname(path) or ".")
  files.write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
  return path


def jsonl_writer(split: str, records: Callable[[Mapping[str, np.ndarray]], list[dict]]):
  """An EvalSet's `write`: the records of the outputs as OUTPUT_DIR/SPLIT.jsonl."""
  def write(outputs, output_dir):
    return [write_jsonl(os.path.join(output_dir, f"{split}.jsonl"), records(outputs))]
  return write


def pair_sets(cfg: TaskConfig, spec: spec_lib.TaskSpec, tokenizer, features, report, decode,
              notes: list[str], label_notes=lambda rows: [], label_of: Callable = text_label
              ) -> tuple[list[EvalSet], list[EvalSet]]:
  """The dev set (scored) and the optional test set (predicted; scored where labelled) of a
  classification or regression task: features(rows) (adding to `notes`), report(rows) -> score,
  decode(outputs); label_notes(rows): what the dev file's labels are to be said."""
  _, dev_path, test_path = cfg.data.train_file, cfg.data.dev_file, cfg.data.test_file
  fmt = cfg.data.format
  dev_rows = Rows(dev_path, spec, fmt, need_labels=True, label_of=label_of)
  notes += label_notes(dev_rows)
  evals = [EvalSet("dev", features(dev_rows), report(dev_rows), report=report(dev_rows))]
  predicts = []
  if test_path:
    test_rows = Rows(test_path, spec, fmt, need_labels=False, label_of=label_of)
    scored = report(test_rows) if test_rows.labels is not None else None
    write = jsonl_writer("test", lambda outputs: [
        {"id": i, **r} for i, r in zip(test_rows.ids, decode(outputs))])
    predicts.append(EvalSet("test", features(test_rows), scored, write, report=scored))
  return evals, predicts
