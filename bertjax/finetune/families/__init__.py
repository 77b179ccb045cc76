"""Task families: the one place fine-tuning grows. A family is what a head does with text
(classification, regression, tagging, span); each is one module here owning its reading of one's
own files, its features, head and objective, metric, prediction records and export class. The
benchmarks (GLUE, SQuAD, CoNLL-2003, NEXT: bertjax/finetune/tasks.py) are readers that hand a
family their examples.

Adding a family: a module beside these providing every name of HOOKS, and one line in FAMILIES
(docs/finetuning.md#adding-a-task-family). `TaskSpec.family` (bertjax/taskspec.py) names the
family a fine-tuned model belongs to; FAMILIES is the registry the spec reads (it sits below
fine-tuning, so the families register themselves there), and prediction and export ask it.

The hooks, as each module defines them:
  HEAD             the head's parameter subtree beside the encoder's ("bert")
  HF_CLASS         the transformers class an export writes ...
  HF_HEAD          ... and the name of its head there (bertjax/formats/hf.py writes both)
  MODERNBERT_CLASS the transformers ModernBERT class of the family (formats/modernbert_tasks.py
                   reads and writes it; None where ModernBERT has none)
  MIN_LABELS       the fewest label names a spec of the family holds
  MAIN_METRICS     the dev numbers that may pick the best checkpoint (the first by default) ...
  LOWER_IS_BETTER  ... and those of them where lower is better
  BATCH_KEYS       the feature arrays of targets a batch carries to the device, beside the inputs
  RECORD_KEYS      the keys of a prediction record (how predict knows a file it wrote)
  PACKED           one output per text from its [CLS]: the objective's model takes sequence_ids
                   and cls_positions, and prediction packs several texts into a row
                   (bertjax/prediction_rows.py); False for per-token heads
  num_outputs(spec)                  the head's width
  objective(spec)                    the head, its loss and outputs (a `train.Objective`)
  columns(spec, row)                 the input columns `predict` needs of a row
  as_row(x, spec)                    a `Predictor` input that is neither a string nor a dict
  records(rows, spec, tokenizer, run)  one prediction record per row (bertjax/predict.py's
                                       docstring); run: features -> the objective's outputs
  load(cfg, tokenizer)               one's own task from files: a `taskdata.TaskData`
"""

from __future__ import annotations

from types import ModuleType
from typing import Mapping

from bertjax import taskspec
from bertjax.finetune import metrics as ft_metrics
from bertjax.finetune.families import classification, regression, span, tagging

FAMILIES: dict[str, ModuleType] = taskspec.FAMILIES
FAMILIES.update({
    "classification": classification,
    "regression": regression,
    "tagging": tagging,
    "span": span,
})

HOOKS = ("HEAD", "HF_CLASS", "HF_HEAD", "MODERNBERT_CLASS", "MIN_LABELS", "MAIN_METRICS",
         "LOWER_IS_BETTER", "BATCH_KEYS", "RECORD_KEYS", "PACKED", "num_outputs", "objective",
         "columns", "as_row", "records", "load")


def get(name: str) -> ModuleType:
  return taskspec.family_of(name)


def main_value(family: str, scores: Mapping[str, float], main: str) -> float:
  """The number that picks the best checkpoint: higher is better."""
  fam = get(family)
  return ft_metrics.main_value(family, fam.MAIN_METRICS, fam.LOWER_IS_BETTER, scores, main)
