"""Task families: the one place fine-tuning grows. A family is what a head does with text
(classification, regression, tagging, span, embeddings); each is one module here owning its
reading of one's own files, its features, head and objective, metric, prediction records and
export class, and building its typed record (`record.Family`) once, as `FAMILY`. The benchmarks (GLUE, SQuAD,
CoNLL-2003, NEXT: bertjax/finetune/tasks/tasks.py) are readers that hand a family their examples.

Adding a family: a module beside these ending in its `FAMILY = Family(...)`, and one line in
FAMILIES (docs/finetuning.md#adding-a-task-family). Nothing below fine-tuning knows the families:
`TaskSpec.family` (bertjax/formats/taskspec.py) is a name, which `get` resolves here, and a fine-tuned
folder's class (bertjax/weights/reader.py records what its config.json says) is resolved by `spec_of`.
"""

from __future__ import annotations

from typing import Mapping

from bertjax.errors import Refusal
from bertjax.finetune.families import classification, embeddings, regression, span, tagging
from bertjax.finetune.families.record import Family
from bertjax.finetune.kit import metrics as ft_metrics
from bertjax.formats import taskspec

FAMILIES: dict[str, Family] = {f.name: f for f in (
    classification.FAMILY,
    regression.FAMILY,
    tagging.FAMILY,
    span.FAMILY,
    embeddings.FAMILY,
)}
# transformers' problem_type of a one-output sequence head, and of one bertjax has no family for.
_REGRESSION, _MULTI_LABEL = "regression", "multi_label_classification"


def get(name: str) -> Family:
  """The family of this name (a `TaskSpec.family`)."""
  if name not in FAMILIES:
    raise Refusal(f"Invalid task spec: family={name!r} is not one of {tuple(FAMILIES)}")
  return FAMILIES[name]


def main_value(family: str, scores: Mapping[str, float], main: str) -> float:
  """The number that picks the best checkpoint: higher is better."""
  fam = get(family)
  return ft_metrics.main_value(family, fam.main_metrics, fam.lower_is_better, scores, main)


def spec_of(source) -> taskspec.TaskSpec | None:
  """The task of a weights folder (a `weights.Weights`; the families import none of the reader),
  checked against its family: the spec recorded with its checkpoint or in its task.json, else the
  one a fine-tuned ModernBERT class's config.json says (bertjax.predict then takes the folder as a
  fine-tuning workdir); None for a model with no task a family reads (a pre-training run, an
  encoder, a BertFor* class)."""
  spec = taskspec.of(source)
  if spec is None and source.task_class is not None:
    spec = _spec_of_class(source.task_class, source.config)
  return None if spec is None else get(spec.family).check(spec)


def _spec_of_class(task, config) -> taskspec.TaskSpec | None:
  """The spec of a ModernBERT task class (a `formats.hf.TaskClass`): its family is the one naming
  the class; a sequence class is two, told apart by transformers' own rule (one output is a
  regression). Texts are read from the column "text" (and, for pairs, the one `bertjax.predict
  --text_b` names; a span model's from its family's columns), up to the model's
  max_position_embeddings tokens."""
  found = [f for f in FAMILIES.values() if f.modernbert_class == task.architecture]
  if not found:
    return None
  if task.problem_type == _MULTI_LABEL:
    raise Refusal("config.json's problem_type='multi_label_classification': bertjax's "
                  "classification gives one label per text; fine-tune a single-label head "
                  "(problem_type 'single_label_classification')")
  if len(found) > 1:
    one = task.problem_type == _REGRESSION or len(task.labels) == 1
    found = [f for f in found if (f.min_labels == 0) == one] or found
  family = found[0]
  text_a, text_b = family.folder_columns
  return taskspec.TaskSpec(family.name, family.name, task.labels if family.min_labels else (),
                           config.max_position_embeddings, text_a=text_a, text_b=text_b)
