"""ModernBERT's fine-tuned classes: the config.json entries an export of a fine-tuned modern model
writes.

transformers' ModernBertForSequenceClassification, ModernBertForTokenClassification and
ModernBertForQuestionAnswering keep what a fine-tuned model does with text in config.json: the
class (`architectures`), the labels by id (`id2label`, `label2id`), `problem_type` (regression or
single-label classification) and `classifier_pooling` ("cls" or "mean"). A folder's are read as a
`hf.TaskClass` (bertjax/weights.py records it; bertjax/finetune/families/ resolves it to the spec
a fine-tuning workdir records, so `bertjax.predict` takes the folder as it is), and a fine-tuned
model's written here (so an export loads as its class). Their tensors (`head.*`, the prediction
head; `classifier.*`) are bertjax/formats/modernbert.py's.
"""

from __future__ import annotations

from typing import Any

from bertjax.errors import Refusal
from bertjax.model import BertConfig

_SEQUENCE_CLASS = "ModernBertForSequenceClassification"
_REGRESSION = "regression"  # transformers' problem_type of a one-output sequence head


def task_config(config: BertConfig, *, cls: str, outputs: int,
                labels: tuple[str, ...]) -> dict[str, Any]:
  """config.json's entries of a fine-tuned model of the class `cls` (its family's): the class,
  the labels (LABEL_i where the head's `outputs` are not the labels), problem_type,
  classifier_pooling and classifier_dropout (the dropout the run fine-tuned with)."""
  if config.task_head != "modernbert":
    raise Refusal(
        f"This model was fine-tuned with BERT's task head (task_head={config.task_head!r}: pooled "
        "-> dense), which transformers' ModernBertFor* classes do not have (theirs: dense, "
        "activation, norm -> dense). Fine-tune it again with --config.model.task_head=modernbert "
        "to export it.")
  names = (labels if labels and len(labels) == outputs
           else tuple(f"LABEL_{i}" for i in range(outputs)))
  out = {"architectures": [cls],
         "id2label": {str(i): name for i, name in enumerate(names)},
         "label2id": {name: i for i, name in enumerate(names)},
         "classifier_pooling": config.classifier_pooling,
         "classifier_dropout": config.hidden_dropout}
  if cls == _SEQUENCE_CLASS:  # transformers' own rule: one output is a regression
    out["problem_type"] = _REGRESSION if outputs == 1 else "single_label_classification"
  return out
