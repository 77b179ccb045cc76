"""Span: extractive question answering, an answer as a span of the context (SQuAD v1.1 / v2.0, one's
own files in SQuAD's JSON layout).

  features   windows over long contexts (doc_stride), the question first
             (bertjax/inputs/questions.py)
  head       sequence -> dense(2) ("span"): start and end logits; the mean of the two
             cross-entropies, as the original run_squad.py
  metric     exact, f1 (the official SQuAD measures; v2.0's HasAns / NoAns split)
  predicted  {"answer": ..., "start": character offset in the context (-1: no answer),
             "score": the answer's n-best probability}; "" is v2.0's null answer
  export     transformers' BertForQuestionAnswering (qa_outputs: start, then end)
"""

from __future__ import annotations

import functools

import numpy as np

from bertjax.errors import Refusal
from bertjax.finetune.families.record import Family
from bertjax.finetune.kit import (custom, metrics as ft_metrics, objectives, squad_metrics,
                                  squad_postprocess)
from bertjax.finetune.kit.config import TaskConfig
from bertjax.finetune.kit.taskdata import EvalSet, TaskData
from bertjax.formats import taskspec as spec_lib
from bertjax.inputs import questions, textfiles
from bertjax.model import heads, losses
from bertjax.training import train

def num_outputs(spec: spec_lib.TaskSpec) -> int:
  del spec
  return 2


def objective(spec: spec_lib.TaskSpec | None = None) -> train.Objective:
  del spec  # start and end, whatever the task
  def metrics(out, batch):
    start_BxL, end_BxL = out
    w_B = objectives.weight(batch)
    start_loss, den = losses.weighted_cross_entropy(start_BxL, batch["start_positions"], w_B)
    end_loss, _ = losses.weighted_cross_entropy(end_BxL, batch["end_positions"], w_B)
    return {"span_loss": ((start_loss + end_loss) / 2, den),
            "start_accuracy": losses.weighted_accuracy(start_BxL, batch["start_positions"], w_B),
            "end_accuracy": losses.weighted_accuracy(end_BxL, batch["end_positions"], w_B)}

  return train.Objective(
      "span", heads.BertForSpanExtraction, objectives.inputs, metrics,
      lambda batch: {"span_loss": objectives.count(batch)},
      functools.partial(objectives.dummy, start_positions=((), np.int32),
                        end_positions=((), np.int32)),
      lambda out: {"start_logits": out[0], "end_logits": out[1]})


def _postprocess(examples, features, outputs, spec: spec_lib.TaskSpec):
  return squad_postprocess.postprocess(
      examples, features, outputs["start_logits"], outputs["end_logits"],
      n_best_size=spec.n_best_size, max_answer_length=spec.max_answer_length,
      version_2_with_negative=spec.version_2_with_negative,
      null_score_diff_threshold=spec.null_score_diff_threshold)


def _features(examples, spec: spec_lib.TaskSpec, tokenizer) -> dict[str, np.ndarray]:
  return questions.make_features(examples, tokenizer, max_seq_length=spec.max_seq_length,
                                 doc_stride=spec.doc_stride,
                                 max_query_length=spec.max_query_length)


def records(rows, spec: spec_lib.TaskSpec, tokenizer, run) -> list[dict]:
  examples = [questions.SquadExample(str(k), textfiles.text_of(r, spec.text_a),
                                     textfiles.text_of(r, spec.text_b), (), ())
              for k, r in enumerate(rows)]
  features = _features(examples, spec, tokenizer)
  result = _postprocess(examples, features, run(features), spec)
  return [{"answer": result.predictions[e.qas_id], "start": result.answer_starts[e.qas_id],
           "score": round(result.scores[e.qas_id], 6)} for e in examples]


def spec_of(name: str, cfg: TaskConfig, version_2: bool) -> spec_lib.TaskSpec:
  """The spec of a span task: a question and a context per example, decoded as `cfg` says."""
  d, e = cfg.data, cfg.eval
  return spec_lib.TaskSpec(
      name, "span", (), d.max_seq_length, text_a="question", text_b="context",
      version_2_with_negative=version_2, doc_stride=d.doc_stride,
      max_query_length=d.max_query_length, n_best_size=e.n_best_size,
      max_answer_length=e.max_answer_length, null_score_diff_threshold=e.null_score_diff_threshold)


def task(spec: spec_lib.TaskSpec, train_set: questions.SquadSet, dev_set: questions.SquadSet,
         main: str, tokenizer) -> TaskData:
  """A span task of SQuAD's layout (the benchmarks' and one's own): train on train_set, score
  dev_set with the official EM / F1 and write predictions.json, nbest_predictions.json (and
  null_odds.json) for it."""
  train_features = _features(train_set.examples, spec, tokenizer)
  dev_features = _features(dev_set.examples, spec, tokenizer)
  gold = squad_metrics.gold_answers(dev_set.examples)
  notes = [f"{s.source}: {what} {len(items)} question(s) whose answer does not match its offset"
           for s, what, items in ((train_set, "skipped", train_set.skipped),
                                  (dev_set, "kept without a target", dev_set.unmatched)) if items]

  def predict(outputs):
    return _postprocess(dev_set.examples, dev_features, outputs, spec)

  def score(outputs):
    result = predict(outputs)
    if not spec.version_2_with_negative:
      out = squad_metrics.evaluate_v1(gold, result.predictions)
      return {**out, "main": out[main]}
    out = squad_metrics.evaluate_v2(gold, result.predictions, result.null_odds)
    return {**{k: float(v) for k, v in out.items()}, "main": float(out[main])}

  def write(outputs, output_dir):
    return squad_postprocess.write_predictions(predict(outputs), output_dir)

  dev = EvalSet("dev", dev_features, score)
  written = EvalSet("dev", dev_features, None, write)
  return TaskData(spec.task, objective(spec), train_features, [dev], [written], main, notes,
                  spec=spec)


def load(cfg: TaskConfig, tokenizer) -> TaskData:
  """One's own QA files in SQuAD's JSON layout: v2.0 style where config.data says, or where any
  training question is unanswerable."""
  data = cfg.data
  if not (data.train_file and data.dev_file):
    raise Refusal("A span task from one's own files needs config.data.train_file and "
                  "config.data.dev_file, each in SQuAD's JSON layout.")
  train_set = questions.read_squad_json(data.train_file, is_training=True)
  said = data.version_2_with_negative
  version_2 = bool(said) if said is not None else any(e.is_impossible for e in train_set.examples)
  main = ft_metrics.main_metric(cfg.eval.main_metric, "span", FAMILY.main_metrics)
  dev_set = questions.read_squad_json(data.dev_file, is_training=False)
  return task(spec_of("span", cfg, version_2), train_set, dev_set, main, tokenizer)


FAMILY = Family(
    "span", head="span", hf_class="BertForQuestionAnswering", hf_head="qa_outputs",
    modernbert_class="ModernBertForQuestionAnswering", min_labels=0,
    main_metrics=("f1", "exact"), lower_is_better=(),
    batch_keys=("start_positions", "end_positions"),
    packed=False, num_outputs=num_outputs, objective=objective, columns=custom.pair_columns,
    as_row=custom.pair_row, records=records, load=load,
    # The columns of a span example (SQuAD's): what a fine-tuned folder's spec reads.
    folder_columns=("question", "context"))
