"""transformers' ModernBertFor* task classes in a folder's config.json: which class a folder holds,
the subtrees of bertjax's parameters its heads go to, and the entries an export writes for one.
bertjax/formats/modernbert.py maps the tensors."""

from __future__ import annotations

from typing import Any

from bertjax.errors import Refusal
from bertjax.model.config import BertConfig

# transformers' task classes, by the subtree of bertjax's parameters their `classifier` goes to;
# `head` (ModernBertPredictionHead) goes to PREDICTION_HEAD (bertjax/model/heads.py) in each. A class
# keeps what a fine-tuned model does with text in config.json: `architectures`, `id2label`,
# `problem_type`, `classifier_pooling`. A folder's are read as an `hf.TaskClass` (the family it
# is, fine-tuning says: bertjax/finetune/families/); an export's are written by `task_config`.
QA_HEAD = "span"  # the span head's subtree (question answering)
CLASSIFIERS = ("classifier", QA_HEAD)
CLASSIFIER_SUBTREES = {"ModernBertForSequenceClassification": "classifier",
                        "ModernBertForTokenClassification": "classifier",
                        "ModernBertForQuestionAnswering": QA_HEAD}
PREDICTION_HEAD = "prediction_head"
TASK_SUBTREES = (PREDICTION_HEAD,) + CLASSIFIERS
_SEQUENCE_CLASS = "ModernBertForSequenceClassification"
_REGRESSION = "regression"  # transformers' problem_type of a one-output sequence head


def task_class(hf_config: dict | None) -> str | None:
  """The task class a config.json's `architectures` names (None: a masked LM or a bare encoder)."""
  return next((a for a in (hf_config or {}).get("architectures") or ()
               if a in CLASSIFIER_SUBTREES), None)


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


def heads_in(names, hf_config: dict | None = None) -> tuple[str, ...]:
  """The subtrees beside the encoder that a state dict holds: the MLM head ("mlm"), or a task
  class's prediction head and classifier (config.json's `architectures` says which class)."""
  names = [str(n) for n in names]
  if any(n.startswith("classifier.") for n in names):
    cls = task_class(hf_config)
    if cls is None:
      raise Refusal("model.safetensors holds a task head (classifier.*) but config.json's "
                    f"architectures={(hf_config or {}).get('architectures')} names none of "
                    f"{sorted(CLASSIFIER_SUBTREES)}; write the class there")
    return (PREDICTION_HEAD, CLASSIFIER_SUBTREES[cls])
  return ("mlm",) if any(n.startswith("head.") for n in names) else ()
