"""Tagging: a tag per word (CoNLL-2003, one's own tagged words), entities scored as conlleval does.

  reading    CoNLL column files, or CSV / TSV / JSON Lines of words and tags, in the IO, BIO, IOB1
             or IOBES scheme (bertjax/inputs/tagged.py), learned as IOB2 tags of the entity types
  features   a word is labeled on its first piece; its other pieces, [CLS], [SEP] and padding have
             weight 0. A sentence longer than the window is split into several windows at word
             boundaries rather than truncated, and the windows' predictions are joined back per
             sentence (bertjax/inputs/word_windows.py)
  head       sequence -> dropout -> dense(C) ("classifier"); cross-entropy on first pieces
  metric     entity precision, recall, F1 (overall and per type), token accuracy
  predicted  {"text": ..., "entities": [{"type", "start", "end", "text"}], "tags": [IOB2]}
  export     transformers' BertForTokenClassification with id2label / label2id
"""

from __future__ import annotations

import functools
import os
import re
from typing import Mapping, Sequence

import jax.numpy as jnp
import numpy as np

from bertjax.errors import Refusal
from bertjax.finetune.families.record import Family
from bertjax.finetune.kit import custom, metrics as ft_metrics, objectives
from bertjax.finetune.kit.config import TaskConfig
from bertjax.finetune.kit.taskdata import EvalSet, TaskData
from bertjax.formats import taskspec as spec_lib
from bertjax.inputs import tagged, textfiles, word_windows
from bertjax.model import heads
from bertjax.training import train

def num_outputs(spec: spec_lib.TaskSpec) -> int:
  return len(spec.labels)


def objective(spec: spec_lib.TaskSpec) -> train.Objective:
  num_labels = len(spec.labels)
  return objectives.labelled(
      f"tagging_{num_labels}",
      functools.partial(heads.BertForTokenClassification, num_labels=num_labels), "tag_loss",
      "label_ids",
      lambda batch: batch["label_weights"].astype(jnp.float32) * objectives.weight(batch)[:, None],
      functools.partial(objectives.dummy, label_ids=((None,), np.int32),
                        label_weights=((None,), np.float32)),
      # Label ids, not logits: the host needs only the argmax, and [B, L, C] floats are C times
      # the transfer.
      lambda logits: {"predicted": jnp.argmax(logits, axis=-1).astype(jnp.int32)})


# Scores, predicted tags --------------------------------------------------------------------------

def conlleval(gold: Sequence[Sequence[str]], predicted: Sequence[Sequence[str]]) -> dict:
  """Entity-level precision, recall and F1 as conlleval counts them (fractions, not percents):
  a predicted entity is correct only if its type and both boundaries equal a gold entity's.

  Also: token accuracy, the three counts, and the same per entity type under "per_type".
  """
  if len(gold) != len(predicted):
    raise ValueError(f"{len(predicted)} predicted sentences for {len(gold)} gold ones.")
  counts: dict[str, list[int]] = {}  # type -> [gold, predicted, correct]
  tokens = correct_tokens = 0
  for n, (g, p) in enumerate(zip(gold, predicted)):
    if len(g) != len(p):
      raise ValueError(f"Sentence {n}: {len(p)} predicted tags for {len(g)} words.")
    tokens += len(g)
    correct_tokens += sum(a == b for a, b in zip(g, p))
    gold_set, predicted_set = set(tagged.chunks(g)), set(tagged.chunks(p))
    for kind, *_ in gold_set:
      counts.setdefault(kind, [0, 0, 0])[0] += 1
    for kind, *_ in predicted_set:
      counts.setdefault(kind, [0, 0, 0])[1] += 1
    for kind, *_ in gold_set & predicted_set:
      counts[kind][2] += 1

  def scores(n_gold, n_predicted, n_correct):
    precision = n_correct / n_predicted if n_predicted else 0.0
    recall = n_correct / n_gold if n_gold else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"precision": precision, "recall": recall, "f1": f1, "gold_entities": n_gold,
            "predicted_entities": n_predicted, "correct_entities": n_correct}

  totals = [sum(c[k] for c in counts.values()) for k in range(3)]
  result = scores(*totals)
  result["accuracy"] = correct_tokens / tokens if tokens else 0.0
  result["per_type"] = {kind: scores(*c) for kind, c in sorted(counts.items())}
  return result


def scorer(sentences: Sequence[tagged.Sentence], features, labels: Sequence[str], main: str):
  """An EvalSet's `score`: conlleval's numbers of the predicted tags, and "main"."""
  gold = [list(s.tags) for s in sentences]

  def score(outputs):
    predicted = word_windows.tags_from_predictions(features, outputs["predicted"], sentences,
                                                   labels)
    out = conlleval(gold, predicted)
    return {**out, "main": ft_metrics.main_value(
        "tagging", FAMILY.main_metrics, FAMILY.lower_is_better, out, main)}
  return score


def word_starts(words: Sequence[str]) -> tuple[str, list[int]]:
  """The words joined by spaces, and where each starts in that text."""
  starts, at = [], 0
  for w in words:
    starts.append(at)
    at += len(w) + 1
  return " ".join(words), starts


def entities(text: str, words: Sequence[str], starts: Sequence[int], tags: Sequence[str]
             ) -> list[dict]:
  """Each entity of the IOB2 tags, with its characters [start, end) in `text` (where word i
  starts at starts[i])."""
  out = []
  for kind, first, end in tagged.chunks(tags):
    begin, stop = starts[first], starts[end - 1] + len(words[end - 1])
    out.append({"type": kind, "start": begin, "end": stop, "text": text[begin:stop]})
  return out


def decode_tags(sentences: Sequence[tagged.Sentence], features, predicted_NxL, labels
                ) -> list[dict]:
  tags = word_windows.tags_from_predictions(features, predicted_NxL, sentences, labels)
  out = []
  for s, t in zip(sentences, tags):
    text, starts = word_starts(s.words)
    out.append({"text": text, "entities": entities(text, s.words, starts, t), "tags": list(t)})
  return out


# Prediction -------------------------------------------------------------------------------------

def columns(spec: spec_lib.TaskSpec, row: Mapping) -> list[str]:
  """The words column; or, in a row without one, the text (split into words on whitespace)."""
  if spec.tokens not in row and spec.text_a in row:
    return [spec.text_a]
  return [spec.tokens]


def as_row(x, spec: spec_lib.TaskSpec) -> dict:
  return {spec.tokens: list(x)}


def words_of(row: textfiles.Row, spec) -> tuple[str, list[str], list[int]]:
  """The text, its words and where each starts: a tokens column joined by spaces, or a text
  column split on whitespace (offsets then point into the text as given)."""
  if spec.tokens in row:
    words = textfiles.list_of(row, spec.tokens)
    text, starts = word_starts(words)
    return text, words, starts
  text = textfiles.text_of(row, spec.text_a)
  found = list(re.finditer(r"\S+", text))
  return text, [m.group() for m in found], [m.start() for m in found]


def records(rows, spec: spec_lib.TaskSpec, tokenizer, run) -> list[dict]:
  sentences, texts, starts = [], [], []
  for r in rows:
    text, words, at = words_of(r, spec)
    texts.append(text)
    starts.append(at)
    sentences.append(tagged.Sentence(r.where, tuple(words), ("O",) * len(words)))
  features = word_windows.make_features(sentences, tokenizer, spec.max_seq_length, spec.labels)
  tags = word_windows.tags_from_predictions(features, run(features)["predicted"], sentences,
                                            spec.labels)
  return [{"text": text, "entities": entities(text, s.words, at, t), "tags": t}
          for text, s, at, t in zip(texts, sentences, starts, tags)]


# One's own task ---------------------------------------------------------------------------------

def read_tagged(path: str, spec: spec_lib.TaskSpec, fmt: str
                ) -> list[tuple[str, list[str], list[str]]]:
  """(where, words, tags as written) of each sentence of a tagging file."""
  if fmt == custom.CONLL or (not fmt and os.path.splitext(path)[1].lower() in (".conll", ".bio")):
    return [(f"{path}:{line}", words, tags) for line, words, tags in tagged.read_columns(path)]
  out = []
  for row in textfiles.read_rows(path, [spec.tokens, spec.tags], fmt):
    words, tags = textfiles.list_of(row, spec.tokens), textfiles.list_of(row, spec.tags)
    if len(words) != len(tags):
      raise Refusal(f"{row.where}: {len(words)} word(s) in {spec.tokens!r} but {len(tags)} "
                    f"tag(s) in {spec.tags!r}; a tagging row has one tag per word.")
    if not words:
      raise Refusal(f"{row.where}: no words in column {spec.tokens!r}.")
    out.append((row.where, words, tags))
  if not out:
    raise Refusal(f"{path}: no sentences.")
  return out


def tagged_sentences(raw, scheme: str, labels: Sequence[str]) -> list[tagged.Sentence]:
  sentences = []
  known = set(labels)
  for where, words, tags in raw:
    iob2 = tagged.scheme_to_iob2(tags, scheme, where)
    for i, tag in enumerate(iob2):
      if tag not in known:
        raise Refusal(f"{where} word {i + 1}: entity type of tag {tags[i]!r} is not in the "
                      f"label map {list(labels)}; add the type to config.data.labels or fix "
                      "the tag.")
    sentences.append(tagged.Sentence(where, tuple(words), tuple(iob2)))
  return sentences


def load(cfg: TaskConfig, tokenizer) -> TaskData:
  """Tagging from one's own files (bertjax/finetune/kit/custom.py): CoNLL columns, or rows of words
  and tags; tags read in their scheme (config.data.tag_scheme, or detected from the training
  file) and learned as IOB2 tags of the entity types found."""
  train_path, dev_path, test_path = custom.paths(cfg.data, "tagging")
  main = ft_metrics.main_metric(cfg.eval.main_metric, "tagging", FAMILY.main_metrics)
  fmt = cfg.data.format
  probe = custom.spec_of("tagging", cfg, ("O", "B-X"))
  raw_train = read_tagged(train_path, probe, fmt)
  scheme = (cfg.data.tag_scheme or tagged.detect_scheme(t for _, _, t in raw_train)).upper()
  if scheme == "IOB2":
    scheme = "BIO"
  if scheme not in spec_lib.TAG_SCHEMES:
    raise Refusal(f"config.data.tag_scheme={cfg.data.tag_scheme!r}: use one of "
                  f"{spec_lib.TAG_SCHEMES} or '' to detect it from the training file.")
  given = custom.labels_given(cfg.data)
  if given:
    kinds = [tagged.scheme_tag(t)[1] for t in given if t != "O"]
  else:
    kinds = [tagged.scheme_tag(t)[1] for _, _, tags in raw_train for t in tags if t != "O"]
  labels = tagged.tag_labels(kinds)
  if len(labels) < 2:
    raise Refusal(f"{train_path}: no entity tags (every word is O); nothing to learn.")
  spec = custom.spec_of("tagging", cfg, labels, scheme)

  def features(sentences):
    return word_windows.make_features(sentences, tokenizer, spec.max_seq_length, labels)

  train = features(tagged_sentences(raw_train, scheme, labels))
  dev_sentences = tagged_sentences(read_tagged(dev_path, spec, fmt), scheme, labels)
  dev_f = features(dev_sentences)
  evals = [EvalSet("dev", dev_f, scorer(dev_sentences, dev_f, labels, main),
                   report=scorer(dev_sentences, dev_f, labels, main))]
  predicts = []
  if test_path:
    test_sentences = tagged_sentences(read_tagged(test_path, spec, fmt), scheme, labels)
    test_f = features(test_sentences)
    write = custom.jsonl_writer("test", lambda outputs: decode_tags(
        test_sentences, test_f, outputs["predicted"], labels))
    predicts.append(EvalSet("test", test_f, scorer(test_sentences, test_f, labels, main), write,
                            report=scorer(test_sentences, test_f, labels, main)))
  notes = [f"tags read as {scheme}" + ("" if cfg.data.tag_scheme else " (detected)")
           + f", learned as IOB2 over {len(labels)} tags"]
  return TaskData("tagging", objective(spec), train, evals, predicts, main, notes, spec=spec)


FAMILY = Family(
    "tagging", head="classifier", hf_class="BertForTokenClassification", hf_head="classifier",
    modernbert_class="ModernBertForTokenClassification", min_labels=2,
    main_metrics=("f1", "precision", "recall", "accuracy"), lower_is_better=(),
    batch_keys=("label_ids", "label_weights"),
    packed=False, num_outputs=num_outputs, objective=objective, columns=columns, as_row=as_row,
    records=records, load=load)
