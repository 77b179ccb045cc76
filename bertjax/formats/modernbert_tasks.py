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

from bertjax.formats import modernbert
from bertjax.model import BertConfig

# A fine-tuned model's class by its task family (bertjax/taskspec.py); like formats/hf.py's
# TASK_CLASSES, a table of the families below fine-tuning, held to their registry by
# tests/test_finetune_families.py.
TASK_CLASSES = {"classification": "ModernBertForSequenceClassification",
                "regression": "ModernBertForSequenceClassification",
                "tagging": "ModernBertForTokenClassification",
                "span": "ModernBertForQuestionAnswering"}
_FAMILIES = {"ModernBertForTokenClassification": "tagging",
             "ModernBertForQuestionAnswering": "span"}


def _labels(hf_config: dict) -> tuple[str, ...]:
  id2label = hf_config.get("id2label") or {}
  try:
    by_id = {int(k): str(v) for k, v in id2label.items()}
  except ValueError:
    raise ValueError(f"config.json's id2label={id2label} has keys that are not label ids; write "
                     "them as \"0\", \"1\", ...") from None
  if sorted(by_id) != list(range(len(by_id))):
    raise ValueError(f"config.json's id2label has ids {sorted(by_id)}; a head's labels are "
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
  family = _FAMILIES.get(cls, "classification")
  problem = hf_config.get("problem_type")
  if family == "classification":
    if problem == "multi_label_classification":
      raise ValueError("config.json's problem_type='multi_label_classification': bertjax's "
                       "classification gives one label per text; fine-tune a single-label head "
                       "(problem_type 'single_label_classification')")
    if problem == "regression" or len(labels) == 1:
      family, labels = "regression", ()
  out = {"task": family, "family": family, "labels": list(labels),
         "max_seq_length": config.max_position_embeddings}
  if family == "span":  # SQuAD's columns, as a span workdir reads them
    out.update(labels=[], text_a="question", text_b="context")
  return out


def task_config(spec, config: BertConfig) -> dict[str, Any]:
  """config.json's entries of a fine-tuned model's class (a `TaskSpec` of a modern workdir):
  the class, the labels, problem_type, classifier_pooling and classifier_dropout (the dropout
  the run fine-tuned with)."""
  if config.task_head != "modernbert":
    raise ValueError(
        f"This model was fine-tuned with BERT's task head (task_head={config.task_head!r}: pooled "
        "-> dense), which transformers' ModernBertFor* classes do not have (theirs: dense, "
        "activation, norm -> dense). Fine-tune it again with --config.model.task_head=modernbert "
        "to export it.")
  family = spec.family
  if family not in TASK_CLASSES:
    raise ValueError(f"A {family} model has no ModernBERT class; those exported are "
                     f"{sorted(TASK_CLASSES)}")
  labels = {"regression": ("LABEL_0",), "span": ("LABEL_0", "LABEL_1")}.get(family, spec.labels)
  out = {"architectures": [TASK_CLASSES[family]],
         "id2label": {str(i): name for i, name in enumerate(labels)},
         "label2id": {name: i for i, name in enumerate(labels)},
         "classifier_pooling": config.classifier_pooling,
         "classifier_dropout": config.hidden_dropout}
  if family == "regression":
    out["problem_type"] = "regression"
  elif family == "classification":
    out["problem_type"] = "single_label_classification"
  return out
