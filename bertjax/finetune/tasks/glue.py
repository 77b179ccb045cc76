"""GLUE: the tasks, their files (GLUE's TSVs or TFDS), features, and the submission files.

Each task's files as GLUE's download lays them out under one data_dir (`CoLA/train.tsv`,
`MNLI/dev_matched.tsv`, `diagnostic/diagnostic.tsv`, ...), with their own columns and header
rules, are described in TASKS. Labels are kept as the strings the files and the GLUE server use
("0"/"1", "entailment", ...); a label's id is its position in `GlueTask.labels`, in the order of
the original run_classifier.py so its fine-tuned classifiers load with the same meaning.

Features follow the original: `[CLS] A [SEP] B [SEP]`, segment 0 up to the first `[SEP]`, 1 after;
a pair too long loses one token at a time from the end of the longer text (B on a tie), as every
pair is encoded (bertjax/inputs/pairs.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Iterable, Mapping, NamedTuple, Sequence

import numpy as np

from bertjax import files
from bertjax.data import corpus
from bertjax.errors import Refusal
from bertjax.inputs import pairs

@dataclasses.dataclass(frozen=True)
class Layout:
  """Where a split lives and its columns (0-based)."""
  file: str  # relative to data_dir
  header: str | None  # the first field of the header row; None: the file has no header
  columns: int  # every row has exactly this many
  text_a: int
  text_b: int | None
  label: int | None  # None: an unlabeled (test) split
  index: int | None  # the column of the id a submission row carries; None: the row's ordinal


@dataclasses.dataclass(frozen=True)
class GlueTask:
  name: str  # GLUE's name (also its directory): "CoLA", "STS-B", ...
  labels: tuple[str, ...]  # as in the files and the submission; () for regression
  splits: Mapping[str, Layout]
  tfds_name: str  # glue/<tfds_name>
  tfds_splits: Mapping[str, str]  # our split -> TFDS split
  tfds_fields: tuple[str, ...]  # TFDS text features for A (and B)
  tfds_labels: tuple[str, ...]  # our label name of each TFDS label id
  submissions: Mapping[str, str]  # test split -> file name the GLUE server expects
  skip_bad_rows: bool = False  # the distributed file has malformed rows (QQP): skip and count

  @property
  def is_regression(self) -> bool:
    return not self.labels

  @property
  def num_labels(self) -> int:
    return len(self.labels) or 1


BINARY = ("0", "1")
NLI = ("contradiction", "entailment", "neutral")  # the original's order for MNLI
TFDS_NLI = ("entailment", "neutral", "contradiction")
ENTAIL = ("entailment", "not_entailment")
_DEV = {"train": "train", "dev": "validation", "test": "test"}


def _pair_task(name, labels, tfds_name, fields, tfds_labels, width_labeled=4, a=1, b=2,
               header="index") -> GlueTask:
  """QNLI, RTE, WNLI: `index A B label`, tests `index A B`."""
  return GlueTask(
      name, labels,
      {"train": Layout(f"{name}/train.tsv", header, width_labeled, a, b, width_labeled - 1, None),
       "dev": Layout(f"{name}/dev.tsv", header, width_labeled, a, b, width_labeled - 1, None),
       "test": Layout(f"{name}/test.tsv", "index", width_labeled - 1, a, b, None, 0)},
      tfds_name, _DEV, fields, tfds_labels, {"test": f"{name}.tsv"})


TASKS: dict[str, GlueTask] = {t.name: t for t in [
    # No header in train and dev: source, label, original label mark, sentence.
    GlueTask("CoLA", BINARY,
             {"train": Layout("CoLA/train.tsv", None, 4, 3, None, 1, None),
              "dev": Layout("CoLA/dev.tsv", None, 4, 3, None, 1, None),
              "test": Layout("CoLA/test.tsv", "index", 2, 1, None, None, 0)},
             "cola", _DEV, ("sentence",), BINARY, {"test": "CoLA.tsv"}),
    GlueTask("SST-2", BINARY,
             {"train": Layout("SST-2/train.tsv", "sentence", 2, 0, None, 1, None),
              "dev": Layout("SST-2/dev.tsv", "sentence", 2, 0, None, 1, None),
              "test": Layout("SST-2/test.tsv", "index", 2, 1, None, None, 0)},
             "sst2", _DEV, ("sentence",), BINARY, {"test": "SST-2.tsv"}),
    # Quality, #1 ID, #2 ID, #1 String, #2 String.
    GlueTask("MRPC", BINARY,
             {"train": Layout("MRPC/train.tsv", "Quality", 5, 3, 4, 0, None),
              "dev": Layout("MRPC/dev.tsv", "Quality", 5, 3, 4, 0, None),
              "test": Layout("MRPC/test.tsv", "index", 5, 3, 4, None, 0)},
             "mrpc", _DEV, ("sentence1", "sentence2"), BINARY, {"test": "MRPC.tsv"}),
    # index, genre, filename, year, old_index, source1, source2, sentence1, sentence2, score.
    GlueTask("STS-B", (),
             {"train": Layout("STS-B/train.tsv", "index", 10, 7, 8, 9, None),
              "dev": Layout("STS-B/dev.tsv", "index", 10, 7, 8, 9, None),
              "test": Layout("STS-B/test.tsv", "index", 9, 7, 8, None, 0)},
             "stsb", _DEV, ("sentence1", "sentence2"), (), {"test": "STS-B.tsv"}),
    # id, qid1, qid2, question1, question2, is_duplicate; tests: id, question1, question2.
    GlueTask("QQP", BINARY,
             {"train": Layout("QQP/train.tsv", "id", 6, 3, 4, 5, None),
              "dev": Layout("QQP/dev.tsv", "id", 6, 3, 4, 5, None),
              "test": Layout("QQP/test.tsv", "id", 3, 1, 2, None, 0)},
             "qqp", _DEV, ("question1", "question2"), BINARY, {"test": "QQP.tsv"},
             skip_bad_rows=True),
    # index, promptID, pairID, genre, 4 parses, sentence1, sentence2, then label1 and gold_label
    # (train) or label1..label5 and gold_label (dev); tests stop after sentence2.
    GlueTask("MNLI", NLI,
             {"train": Layout("MNLI/train.tsv", "index", 12, 8, 9, 11, None),
              "dev_matched": Layout("MNLI/dev_matched.tsv", "index", 16, 8, 9, 15, None),
              "dev_mismatched": Layout("MNLI/dev_mismatched.tsv", "index", 16, 8, 9, 15, None),
              "test_matched": Layout("MNLI/test_matched.tsv", "index", 10, 8, 9, None, 0),
              "test_mismatched": Layout("MNLI/test_mismatched.tsv", "index", 10, 8, 9, None, 0)},
             "mnli", {"train": "train", "dev_matched": "validation_matched",
                      "dev_mismatched": "validation_mismatched", "test_matched": "test_matched",
                      "test_mismatched": "test_mismatched"},
             ("premise", "hypothesis"), TFDS_NLI,
             {"test_matched": "MNLI-m.tsv", "test_mismatched": "MNLI-mm.tsv"}),
    _pair_task("QNLI", ENTAIL, "qnli", ("question", "sentence"), ENTAIL),
    _pair_task("RTE", ENTAIL, "rte", ("sentence1", "sentence2"), ENTAIL),
    _pair_task("WNLI", BINARY, "wnli", ("sentence1", "sentence2"), BINARY),
    # The diagnostic set: MNLI's labels, predicted by an MNLI model, scored by the server only.
    GlueTask("AX", NLI, {"test": Layout("diagnostic/diagnostic.tsv", "index", 3, 1, 2, None, 0)},
             "ax", {"test": "test"}, ("premise", "hypothesis"), TFDS_NLI, {"test": "AX.tsv"}),
    # Not GLUE: the built-in task of `make finetune` (bertjax/finetune/builtin.py), in RTE's layout.
    _pair_task("NEXT", BINARY, "", ("sentence1", "sentence2"), BINARY),
]}

# Rows per test file on the GLUE server; a submission of another size is rejected there.
TEST_SIZES = {"CoLA.tsv": 1063, "SST-2.tsv": 1821, "MRPC.tsv": 1725, "STS-B.tsv": 1379,
              "QQP.tsv": 390965, "MNLI-m.tsv": 9796, "MNLI-mm.tsv": 9847, "QNLI.tsv": 5463,
              "RTE.tsv": 3000, "WNLI.tsv": 146, "AX.tsv": 1104}


def get_task(name: str) -> GlueTask:
  """A task by GLUE's name or TFDS's ("sts-b", "stsb", "STS-B" alike)."""
  key = name.lower().replace("-", "").replace("_", "")
  for task in TASKS.values():
    if key in (task.name.lower().replace("-", ""), task.tfds_name or None):
      return task
  raise Refusal(f"Unknown GLUE task {name!r}; known: {list(TASKS)}.")


def _split_layout(task: GlueTask, split: str) -> Layout:
  if split not in task.splits:
    raise Refusal(f"{task.name} has no split {split!r}; its splits: {list(task.splits)}.")
  return task.splits[split]


@dataclasses.dataclass(frozen=True)
class Example:
  guid: str  # "file:line" (or "tfds name split #n"): where any later message can point
  text_a: str
  text_b: str | None
  label: str | float | None  # a name of task.labels, a score (STS-B), None in test splits
  index: int  # the id a submission row carries


class GlueSplit(NamedTuple):
  examples: list[Example]
  skipped: list[str]  # "file:line: why" of each row left out (QQP's malformed rows)


def _label_of(task: GlueTask, raw: str, where: str) -> str | float:
  if task.is_regression:
    try:
      score = float(raw)
    except ValueError:
      score = float("nan")
    if not 0.0 <= score <= 5.0:  # nan fails too
      raise Refusal(f"{where}: {task.name} label {raw!r} is not a similarity score in [0, 5].")
    return score
  if raw not in task.labels:
    raise Refusal(f"{where}: label {raw!r} is not one of {task.name}'s labels "
                  f"{list(task.labels)}; is this the right file for the task?")
  return raw


def read_glue_tsv(data_dir: str, task: str | GlueTask, split: str,
                  skip_bad_rows: bool | None = None) -> GlueSplit:
  """The examples of one split from GLUE's TSV files under `data_dir`.

  A row with the wrong number of columns is an error naming its file and line, except where
  `skip_bad_rows` (default: the task's own, True for QQP only) leaves it out, counted in `skipped`
  and in a warning. A label outside the task's set is always an error.
  """
  task = task if isinstance(task, GlueTask) else get_task(task)
  layout = _split_layout(task, split)
  skip = task.skip_bad_rows if skip_bad_rows is None else skip_bad_rows
  path = os.path.join(data_dir, layout.file)
  if not files.exists(path):
    raise FileNotFoundError(f"{task.name} {split}: no file {path}. data_dir should be laid out as "
                            f"GLUE's download ({layout.file} under it).")
  with files.open_file(path, "rb") as f:
    raw = f.read()
  try:
    text = raw.decode("utf-8")
  except UnicodeDecodeError as err:
    raise Refusal(f"{path}: not UTF-8 at byte {err.start}; GLUE's files are UTF-8.") from None
  # MRPC's train.tsv keeps the byte-order mark of Microsoft's original file.
  text = text.removeprefix("\ufeff")
  # Fields are split on tabs with no quoting (quotes are part of the text in GLUE's files).
  lines = text.split("\n")
  while lines and not lines[-1].strip():
    lines.pop()  # the newline ending the last row, or trailing blank lines
  if not lines:
    raise Refusal(f"{path}: the file is empty; expected {task.name} {split} rows.")
  first = 0
  if layout.header is not None:
    found = lines[0].rstrip("\r").split("\t")[0]
    if found != layout.header:
      raise Refusal(f"{path}:1: expected a header row starting with {layout.header!r} "
                    f"(GLUE's {layout.file}), found {found[:40]!r}.")
    first = 1
  examples, skipped = [], []
  for i in range(first, len(lines)):
    where = f"{path}:{i + 1}"
    fields = lines[i].rstrip("\r").split("\t")
    if len(fields) != layout.columns:
      why = (f"{where}: {len(fields)} column(s), {task.name} {split} rows have {layout.columns}"
             f"{' (a blank line)' if not lines[i].strip() else ''}")
      if not skip:
        raise Refusal(why + "; fix the row, or pass skip_bad_rows=True to leave such rows out.")
      skipped.append(why)
      continue
    label = None if layout.label is None else _label_of(task, fields[layout.label], where)
    if layout.index is None:
      index = len(examples)
    else:
      try:
        index = int(fields[layout.index])
      except ValueError:
        raise Refusal(f"{where}: index {fields[layout.index]!r} is not an integer.") from None
    examples.append(Example(where, fields[layout.text_a],
                            None if layout.text_b is None else fields[layout.text_b], label, index))
  if skipped:
    logging.warning("%s %s: left out %d malformed row(s) of %d; first: %s", task.name, split,
                    len(skipped), len(lines) - first, "; ".join(skipped[:3]))
  if not examples:
    raise Refusal(f"{path}: no {task.name} {split} rows (only a header, or every row malformed).")
  return GlueSplit(examples, skipped)


def examples_from_tfds(task: GlueTask, split: str, rows: Iterable[Mapping],
                       label_names: Sequence[str] | None, where: str) -> GlueSplit:
  """Examples from TFDS rows (numpy, as `tfds.as_numpy` yields them: bytes texts, label -1 for
  the unlabeled test splits)."""
  # Binary tasks are named differently in TFDS ("acceptable", ...) but their ids are the files'
  # 0/1; named labels must agree name for name, or the mapping below would be wrong.
  names = tuple(label_names or ())
  if not task.is_regression and (len(names) != len(task.tfds_labels) or
                                 (task.labels != BINARY and names != task.tfds_labels)):
    raise Refusal(f"{where}: TFDS label names {list(names)} are not the "
                  f"{list(task.tfds_labels)} this reader maps to {task.name}'s labels; this "
                  f"TFDS version of the dataset is not supported.")
  unlabeled = task.splits[split].label is None
  examples = []
  for n, row in enumerate(rows):
    texts = [row[k].decode("utf-8") if isinstance(row[k], bytes) else str(row[k])
             for k in task.tfds_fields]
    raw = row["label"]
    if unlabeled:
      label = None
    elif task.is_regression:
      label = _label_of(task, str(float(raw)), f"{where} #{n}")
    elif 0 <= int(raw) < len(task.tfds_labels):
      label = task.tfds_labels[int(raw)]
    else:
      raise Refusal(f"{where} #{n}: label id {raw} is outside {task.name}'s "
                    f"{len(task.labels)} labels.")
    examples.append(Example(f"{where} #{n}", texts[0], texts[1] if len(texts) > 1 else None,
                            label, int(row["idx"])))
  if not examples:
    raise Refusal(f"{where}: the split holds no examples.")
  return GlueSplit(examples, [])


def read_glue_tfds(data_dir: str | None, task: str | GlueTask, split: str) -> GlueSplit:
  """The examples of one split from the TFDS `glue/<name>` dataset already built under data_dir.

  Nothing is downloaded: a dataset not built there is an error saying where it was looked for.
  """
  import tensorflow_datasets as tfds
  task = task if isinstance(task, GlueTask) else get_task(task)
  _split_layout(task, split)
  if not task.tfds_name:
    raise Refusal(f"{task.name} has no TFDS dataset; read its TSV files (source='files').")
  name = f"glue/{task.tfds_name}"
  builder = corpus.built_tfds(name, data_dir, "read GLUE's TSV files instead")
  feature = builder.info.features["label"]
  ds = builder.as_dataset(split=task.tfds_splits[split], shuffle_files=False)
  return examples_from_tfds(task, split, tfds.as_numpy(ds), getattr(feature, "names", None),
                            f"tfds {name} {task.tfds_splits[split]}")


def glue_features(task: str | GlueTask, examples: Sequence[Example], tokenizer,
                  max_seq_length: int) -> dict[str, np.ndarray]:
  """input_ids, input_mask, segment_ids [N, L] int32; label [N] (int32 ids, or float32 scores for
  STS-B; -1 or nan where the split has none); index [N] int64 (for submissions)."""
  task = task if isinstance(task, GlueTask) else get_task(task)
  pair = any(e.text_b is not None for e in examples)
  n = len(examples)
  inputs, truncated_N = pairs.encode_pairs([e.text_a for e in examples],
                                           [e.text_b for e in examples] if pair else None,
                                           tokenizer, max_seq_length)
  if truncated_N.any():
    logging.info("%s: %d of %d example(s) truncated to max_seq_length %d.", task.name,
                 truncated_N.sum(), n, max_seq_length)
  if task.is_regression:
    label_N = np.array([np.nan if e.label is None else e.label for e in examples], np.float32)
  else:
    label_id = {name: k for k, name in enumerate(task.labels)}
    bad = next((e for e in examples if e.label is not None and e.label not in label_id), None)
    if bad is not None:
      raise Refusal(f"{bad.guid}: label {bad.label!r} is not one of {task.name}'s labels "
                    f"{list(task.labels)}.")
    label_N = np.array([-1 if e.label is None else label_id[e.label] for e in examples], np.int32)
  return {**inputs, "label": label_N, "index": np.array([e.index for e in examples], np.int64)}


def write_submission(output_dir: str, task: str | GlueTask, split: str, indices: Sequence[int],
                     predictions: Sequence) -> str:
  """Writes GLUE's `TASK.tsv` (`index<TAB>prediction`, label names) for a test split; returns it.

  predictions: label ids (argmax of the logits), or scores for STS-B.
  """
  task = task if isinstance(task, GlueTask) else get_task(task)
  if split not in task.submissions:
    raise ValueError(f"GLUE takes predictions of {task.name}'s test split(s) "
                     f"{list(task.submissions)}, not of {split!r}.")
  indices_N, predictions_N = np.asarray(indices).reshape(-1), np.asarray(predictions).reshape(-1)
  if indices_N.shape != predictions_N.shape:
    raise ValueError(f"{task.name} {split}: {indices_N.size} indices for {predictions_N.size} "
                     f"predictions; pass one of each per test example.")
  if len(set(indices_N.tolist())) != indices_N.size:
    raise ValueError(f"{task.name} {split}: repeated indices; one prediction per test example "
                     f"(windows or padding rows merged?).")
  if task.is_regression:
    names = [f"{float(p):.3f}" for p in predictions_N]
  else:
    bad = predictions_N[(predictions_N < 0) | (predictions_N >= len(task.labels))]
    if bad.size:
      raise ValueError(f"{task.name} {split}: prediction id {bad[0]} is not a label id 0.."
                       f"{len(task.labels) - 1}; pass the argmax of the logits.")
    names = [task.labels[int(p)] for p in predictions_N]
  file_name = task.submissions[split]
  if TEST_SIZES.get(file_name, indices_N.size) != indices_N.size:
    logging.warning("%s holds %d predictions; the GLUE server expects %d.", file_name,
                    indices_N.size, TEST_SIZES[file_name])
  order = np.argsort(indices_N, kind="stable")
  files.makedirs(output_dir)
  path = os.path.join(output_dir, file_name)
  body = "".join(f"{indices_N[k]}\t{names[k]}\n" for k in order)
  # Write-then-rename: a reader (or an upload script) never sees half a file, a failed write
  # leaves no part.
  files.write_text(path, "index\tprediction\n" + body)
  return path
