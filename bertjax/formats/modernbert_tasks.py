"""ModernBERT's fine-tuned classes and bertjax's task specs (bertjax/taskspec.py).

transformers' ModernBertForSequenceClassification, ModernBertForTokenClassification and
ModernBertForQuestionAnswering keep what a fine-tuned model does with text in config.json: the
class (`architectures`), the labels by id (`id2label`, `label2id`), `problem_type` (regression or
single-label classification) and `classifier_pooling` ("cls" or "mean"). Here a config.json becomes
the spec a fine-tuning workdir records (so `bertjax.predict` takes the folder as it is), and a
spec becomes those entries (so an export loads as its class). Their tensors (`head.*`, the
prediction head; `classifier.*`) are bertjax/formats/modernbert.py's.
"""

from __future__ import annotations

from typing import Any

from bertjax import taskspec
from bertjax.errors import Refusal
from bertjax.formats import modernbert
from bertjax.model import BertConfig

_SEQUENCE_CLASS = "ModernBertForSequenceClassification"
_REGRESSION = "regression"  # transformers' problem_type of a one-output sequence head


def _classes() -> list[str]:
  """The ModernBERT classes of the registered families."""
  return sorted({getattr(f, "MODERNBERT_CLASS", None) for f in taskspec.FAMILIES.values()} - {None})


def _labels(hf_config: dict) -> tuple[str, ...]:
  id2label = hf_config.get("id2label") or {}
  try:
    by_id = {int(k): str(v) for k, v in id2label.items()}
  except ValueError:
    raise Refusal(f"config.json's id2label={id2label} has keys that are not label ids; write "
                  "them as \"0\", \"1\", ...") from None
  if sorted(by_id) != list(range(len(by_id))):
    raise Refusal(f"config.json's id2label has ids {sorted(by_id)}; a head's labels are "
                  f"0 to {len(by_id) - 1}, each named once")
  return tuple(by_id[i] for i in range(len(by_id)))


def spec_from_config(hf_config: dict, config: BertConfig) -> dict[str, Any] | None:
  """The task spec (TaskSpec.to_dict's keys; None for a masked LM or a bare encoder) of a
  fine-tuned ModernBERT config.json. Texts are read from the column "text" (and, for pairs, the
  one `bertjax.predict --text_b` names; a span model's from "question" and "context"), up to the
  model's max_position_embeddings tokens."""
  cls = modernbert.task_class(hf_config)
  if cls is None:
    return None
  labels = _labels(hf_config)
  problem = hf_config.get("problem_type")
  if cls == _SEQUENCE_CLASS and problem == "multi_label_classification":
    raise Refusal("config.json's problem_type='multi_label_classification': bertjax's "
                  "classification gives one label per text; fine-tune a single-label head "
                  "(problem_type 'single_label_classification')")
  # The families of this class (each family says its class: bertjax/finetune/families/); a
  # sequence's class is two, told apart by transformers' own rule: one output is a regression.
  names = [n for n, f in taskspec.FAMILIES.items() if getattr(f, "MODERNBERT_CLASS", None) == cls]
  if len(names) > 1:
    one = problem == _REGRESSION or len(labels) == 1
    names = [n for n in names if (taskspec.family_of(n).MIN_LABELS == 0) == one] or names
  if not names:
    raise Refusal(f"config.json's class {cls} is not one a task family of bertjax reads; those "
                  f"are {_classes()}")
  family = taskspec.family_of(names[0])
  labels = labels if family.MIN_LABELS else ()
  out = {"task": names[0], "family": names[0], "labels": list(labels),
         "max_seq_length": config.max_position_embeddings}
  columns = getattr(family, "COLUMNS", None)
  if columns:  # a family with columns of its own (span: SQuAD's question and context)
    out.update(text_a=columns[0], text_b=columns[1])
  return out


def task_config(spec, config: BertConfig) -> dict[str, Any]:
  """config.json's entries of a fine-tuned model's class (a `TaskSpec` of a modern workdir):
  the class, the labels, problem_type, classifier_pooling and classifier_dropout (the dropout
  the run fine-tuned with)."""
  if config.task_head != "modernbert":
    raise Refusal(
        f"This model was fine-tuned with BERT's task head (task_head={config.task_head!r}: pooled "
        "-> dense), which transformers' ModernBertFor* classes do not have (theirs: dense, "
        "activation, norm -> dense). Fine-tune it again with --config.model.task_head=modernbert "
        "to export it.")
  family = taskspec.family_of(spec.family)
  cls = getattr(family, "MODERNBERT_CLASS", None)
  if cls is None:
    raise Refusal(f"A {spec.family} model has no ModernBERT class; those exported are "
                  f"{_classes()}")
  outputs = family.num_outputs(spec)
  labels = (spec.labels if spec.labels and len(spec.labels) == outputs
            else tuple(f"LABEL_{i}" for i in range(outputs)))
  out = {"architectures": [cls],
         "id2label": {str(i): name for i, name in enumerate(labels)},
         "label2id": {name: i for i, name in enumerate(labels)},
         "classifier_pooling": config.classifier_pooling,
         "classifier_dropout": config.hidden_dropout}
  if cls == _SEQUENCE_CLASS:  # transformers' own rule: one output is a regression
    out["problem_type"] = _REGRESSION if outputs == 1 else "single_label_classification"
  return out
