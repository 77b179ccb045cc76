"""Task families: the one place fine-tuning grows. A family is what a head does with text
(classification, regression, tagging, span); each is one module here owning its reading of one's
own files, its features, head and objective, metric, prediction records and export class. The
benchmarks (GLUE, SQuAD, CoNLL-2003, NEXT: bertjax/finetune/tasks.py) are readers that hand a
family their examples.

Adding a family: a module beside these providing every name of HOOKS, and one line in FAMILIES
(docs/finetuning.md#adding-a-task-family). `TaskSpec.family` (bertjax/finetune/spec.py) names
the family a fine-tuned model belongs to; prediction and export ask it here.

The hooks, as each module defines them:
  HEAD             the head's parameter subtree beside the encoder's ("bert")
  HF_CLASS         the transformers class an export writes ...
  HF_HEAD          ... and the name of its head there (bertjax/convert/hf.py writes both)
  MIN_LABELS       the fewest label names a spec of the family holds
  MAIN_METRICS     the dev numbers that may pick the best checkpoint (the first by default) ...
  LOWER_IS_BETTER  ... and those of them where lower is better
  BATCH_KEYS       the feature arrays of targets a batch carries to the device, beside the inputs
  RECORD_KEYS      the keys of a prediction record (how predict knows a file it wrote)
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

from bertjax.finetune.families import classification, regression, span, tagging

FAMILIES: dict[str, ModuleType] = {
    "classification": classification,
    "regression": regression,
    "tagging": tagging,
    "span": span,
}

HOOKS = ("HEAD", "HF_CLASS", "HF_HEAD", "MIN_LABELS", "MAIN_METRICS", "LOWER_IS_BETTER",
         "BATCH_KEYS", "RECORD_KEYS", "num_outputs", "objective", "columns", "as_row", "records", "load")


def get(name: str) -> ModuleType:
  if name not in FAMILIES:
    raise ValueError(f"family={name!r} is not one of {tuple(FAMILIES)}")
  return FAMILIES[name]


def main_value(family: str, scores: Mapping[str, float], main: str) -> float:
  """The number that picks the best checkpoint: higher is better."""
  fam = get(family)
  if main not in fam.MAIN_METRICS:
    raise ValueError(f"config.eval.main_metric={main!r} is not one a {family} task reports; "
                     f"choose one of {list(fam.MAIN_METRICS)}.")
  return -scores[main] if main in fam.LOWER_IS_BETTER else scores[main]


def main_metric(evaluation, family: str) -> str:
  """config.eval.main_metric (an `EvalConfig`), checked against the family; "" = its first."""
  main = evaluation.main_metric or get(family).MAIN_METRICS[0]
  main_value(family, {m: 0.0 for m in get(family).MAIN_METRICS}, main)
  return main
