"""Tagging: a tag per word (CoNLL-2003, one's own tagged words), entities scored as conlleval does.

  reading    CoNLL column files, or CSV / TSV / JSON Lines of words and tags, in the IO, BIO, IOB1
             or IOBES scheme (bertjax/finetune/ner.py), learned as IOB2 tags of the entity types
  features   a word is labeled on its first piece; its other pieces, [CLS], [SEP] and padding have
             weight 0. A sentence longer than the window is split into several windows at word
             boundaries rather than truncated: evaluation must score every word of the official
             files (conlleval counts the entities a truncation would drop as missed), and the
             windows' predictions are joined back per sentence
  head       sequence -> dropout -> dense(C) ("classifier"); cross-entropy on first pieces
  metric     entity precision, recall, F1 (overall and per type), token accuracy
  predicted  {"text": ..., "entities": [{"type", "start", "end", "text"}], "tags": [IOB2]}
  export     transformers' BertForTokenClassification with id2label / label2id
"""

from __future__ import annotations

import functools
import logging
import os
import re
from typing import Mapping, Sequence

import jax.numpy as jnp
import numpy as np

from bertjax import heads, taskspec as spec_lib, train
from bertjax.errors import Refusal
from bertjax.finetune import custom, metrics as ft_metrics, ner, objectives
from bertjax.finetune.config import TaskConfig
from bertjax.finetune.taskdata import EvalSet, TaskData
from bertjax.inputs import textfiles

HEAD = "classifier"
HF_CLASS = "BertForTokenClassification"
HF_HEAD = "classifier"
MODERNBERT_CLASS = "ModernBertForTokenClassification"
MIN_LABELS = 2
MAIN_METRICS = ("f1", "precision", "recall", "accuracy")
BATCH_KEYS = ("label_ids", "label_weights")  # the targets a batch carries (objective)
RECORD_KEYS = ("text", "entities", "tags")  # of a prediction record (records)
PACKED = False  # an output per token: one text per row
LOWER_IS_BETTER = ()


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


# Features, scores, predicted tags ----------------------------------------------------------------

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
    gold_set, predicted_set = set(ner.chunks(g)), set(ner.chunks(p))
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



def ner_features(sentences: Sequence[ner.Sentence], tokenizer, max_seq_length: int,
                 labels: Sequence[str] = ner.CONLL2003_LABELS) -> dict[str, np.ndarray]:
  """input_ids, input_mask, segment_ids, label_ids [N, L] int32 and label_weights [N, L] float32
  (1 on each word's first piece), and per window sentence_index, first_word [N] int32.

  N counts windows: a sentence of more pieces than a row holds beside its special tokens (2 for
  BERT's [CLS] and [SEP]) takes several.
  """
  room = max_seq_length - tokenizer.template.specials(False)
  if room < 1:
    raise Refusal(f"max_seq_length {max_seq_length} leaves no room beside the special tokens.")
  label_id = {t: k for k, t in enumerate(labels)}
  for s in sentences:
    unknown = set(s.tags) - set(label_id)
    if unknown:
      raise Refusal(f"{s.where}: tag(s) {sorted(unknown)} are not in the labels {list(labels)}.")
  pieces = tokenizer.encode_words([s.words for s in sentences])
  # A window: (sentence, piece ids, each piece's label id or -1 after a word's first, first word).
  windows, empty, cut_words, split_sentences = [], 0, 0, 0
  at = 0
  for n, s in enumerate(sentences):
    ids, piece_labels, start, count = [], [], 0, 0
    for w, tag in enumerate(s.tags):
      word = pieces[at + w]
      if not word:  # a word the tokenizer drops entirely still needs a place for its label
        word, empty = [tokenizer.unk_id], empty + 1
      if len(word) > room:
        word, cut_words = word[:room], cut_words + 1
      if len(ids) + len(word) > room:
        windows.append((n, ids, piece_labels, start))
        ids, piece_labels, start, count = [], [], w, count + 1
      ids += word
      piece_labels += [label_id[tag]] + [-1] * (len(word) - 1)
    at += len(s.words)
    windows.append((n, ids, piece_labels, start))
    split_sentences += count > 0
  if empty or cut_words or split_sentences:
    logging.info("NER features: %d sentence(s) split into windows of %d pieces; %d word(s) "
                 "without pieces labeled on [UNK]; %d word(s) cut to the window.",
                 split_sentences, room, empty, cut_words)
  shape = (len(windows), max_seq_length)
  input_ids_NxL = np.full(shape, tokenizer.pad_id, np.int32)
  input_mask_NxL = np.zeros(shape, np.int32)
  segment_ids_NxL = np.zeros(shape, np.int32)
  label_ids_NxL = np.zeros(shape, np.int32)
  label_weights_NxL = np.zeros(shape, np.float32)
  for i, (_, ids, piece_labels, _) in enumerate(windows):
    row, types, at, _ = tokenizer.template.frame(ids)
    input_ids_NxL[i, :len(row)] = row
    input_mask_NxL[i, :len(row)] = 1
    segment_ids_NxL[i, :len(row)] = types
    piece_labels_P = np.array(piece_labels, np.int32)
    label_ids_NxL[i, at:at + len(ids)] = np.maximum(piece_labels_P, 0)
    label_weights_NxL[i, at:at + len(ids)] = piece_labels_P >= 0
  return {"input_ids": input_ids_NxL, "input_mask": input_mask_NxL,
          "segment_ids": segment_ids_NxL, "label_ids": label_ids_NxL,
          "label_weights": label_weights_NxL,
          "sentence_index": np.array([w[0] for w in windows], np.int32),
          "first_word": np.array([w[3] for w in windows], np.int32)}



def tags_from_predictions(features: Mapping[str, np.ndarray], predicted_ids_NxL: np.ndarray,
                          sentences: Sequence[ner.Sentence],
                          labels: Sequence[str] = ner.CONLL2003_LABELS) -> list[list[str]]:
  """One predicted tag per word of each sentence: the windows' first-piece predictions, joined."""
  predicted_ids_NxL = np.asarray(predicted_ids_NxL)
  if predicted_ids_NxL.shape != features["label_weights"].shape:
    raise ValueError(f"Predictions of shape {predicted_ids_NxL.shape} for features of shape "
                     f"{features['label_weights'].shape}; pass argmax(logits, -1) of every window.")
  tags: list[list[str]] = [[] for _ in sentences]
  for i, n in enumerate(features["sentence_index"]):
    if len(tags[n]) != features["first_word"][i]:
      raise ValueError(f"Window {i} starts at word {features['first_word'][i]} of sentence {n}, "
                       f"which has {len(tags[n])} tag(s) so far; keep the windows in order.")
    picked = predicted_ids_NxL[i][features["label_weights"][i] > 0]
    tags[n] += [labels[k] for k in picked]
  for n, s in enumerate(sentences):
    if len(tags[n]) != len(s.words):
      raise ValueError(f"{s.where}: {len(tags[n])} predicted tag(s) for {len(s.words)} words.")
  return tags


def scorer(sentences: Sequence[ner.Sentence], features, labels: Sequence[str], main: str):
  """An EvalSet's `score`: conlleval's numbers of the predicted tags, and "main"."""
  gold = [list(s.tags) for s in sentences]

  def score(outputs):
    predicted = tags_from_predictions(features, outputs["predicted"], sentences, labels)
    out = conlleval(gold, predicted)
    return {**out, "main": ft_metrics.main_value(
        "tagging", MAIN_METRICS, LOWER_IS_BETTER, out, main)}
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
  for kind, first, end in ner.chunks(tags):
    begin, stop = starts[first], starts[end - 1] + len(words[end - 1])
    out.append({"type": kind, "start": begin, "end": stop, "text": text[begin:stop]})
  return out


def decode_tags(sentences: Sequence[ner.Sentence], features, predicted_NxL, labels) -> list[dict]:
  tags = tags_from_predictions(features, predicted_NxL, sentences, labels)
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
    sentences.append(ner.Sentence(r.where, tuple(words), ("O",) * len(words)))
  features = ner_features(sentences, tokenizer, spec.max_seq_length, spec.labels)
  tags = tags_from_predictions(features, run(features)["predicted"], sentences, spec.labels)
  return [{"text": text, "entities": entities(text, s.words, at, t), "tags": t}
          for text, s, at, t in zip(texts, sentences, starts, tags)]


# One's own task ---------------------------------------------------------------------------------

def read_tagged(path: str, spec: spec_lib.TaskSpec, fmt: str
                ) -> list[tuple[str, list[str], list[str]]]:
  """(where, words, tags as written) of each sentence of a tagging file."""
  if fmt == custom.CONLL or (not fmt and os.path.splitext(path)[1].lower() in (".conll", ".bio")):
    return [(f"{path}:{line}", words, tags) for line, words, tags in ner.read_columns(path)]
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


def tagged_sentences(raw, scheme: str, labels: Sequence[str]) -> list[ner.Sentence]:
  sentences = []
  known = set(labels)
  for where, words, tags in raw:
    iob2 = ner.scheme_to_iob2(tags, scheme, where)
    for i, tag in enumerate(iob2):
      if tag not in known:
        raise Refusal(f"{where} word {i + 1}: entity type of tag {tags[i]!r} is not in the "
                      f"label map {list(labels)}; add the type to config.data.labels or fix "
                      "the tag.")
    sentences.append(ner.Sentence(where, tuple(words), tuple(iob2)))
  return sentences


def load(cfg: TaskConfig, tokenizer) -> TaskData:
  """Tagging from one's own files (bertjax/finetune/custom.py): CoNLL columns, or rows of words
  and tags; tags read in their scheme (config.data.tag_scheme, or detected from the training
  file) and learned as IOB2 tags of the entity types found."""
  train_path, dev_path, test_path = custom.paths(cfg.data, "tagging")
  main = ft_metrics.main_metric(cfg.eval.main_metric, "tagging", MAIN_METRICS)
  fmt = cfg.data.format
  probe = custom.spec_of("tagging", cfg, ("O", "B-X"))
  raw_train = read_tagged(train_path, probe, fmt)
  scheme = (cfg.data.tag_scheme or ner.detect_scheme(t for _, _, t in raw_train)).upper()
  if scheme == "IOB2":
    scheme = "BIO"
  if scheme not in spec_lib.TAG_SCHEMES:
    raise Refusal(f"config.data.tag_scheme={cfg.data.tag_scheme!r}: use one of "
                  f"{spec_lib.TAG_SCHEMES} or '' to detect it from the training file.")
  given = custom.labels_given(cfg.data)
  if given:
    kinds = [ner.scheme_tag(t)[1] for t in given if t != "O"]
  else:
    kinds = [ner.scheme_tag(t)[1] for _, _, tags in raw_train for t in tags if t != "O"]
  labels = ner.tag_labels(kinds)
  if len(labels) < 2:
    raise Refusal(f"{train_path}: no entity tags (every word is O); nothing to learn.")
  spec = custom.spec_of("tagging", cfg, labels, scheme)

  def features(sentences):
    return ner_features(sentences, tokenizer, spec.max_seq_length, labels)

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
