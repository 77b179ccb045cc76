"""Tagged words as the model's input: a window of word pieces per row, each word labelled on its
first piece, and the predictions of the windows joined back to one tag per word.

A sentence longer than a row is split into several windows at word boundaries rather than cut:
evaluation must score every word (conlleval counts the entities a cut would drop as missed), and
prediction must tag every word it was given. The tagging family (one's own files, prediction) and
CoNLL-2003 build on it with their own label sets.
"""

from __future__ import annotations

import logging
from typing import Mapping, Sequence

import numpy as np

from bertjax.errors import Refusal
from bertjax.inputs import tagged


def make_features(sentences: Sequence[tagged.Sentence], tokenizer, max_seq_length: int,
                  labels: Sequence[str]) -> dict[str, np.ndarray]:
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
                          sentences: Sequence[tagged.Sentence],
                          labels: Sequence[str]) -> list[list[str]]:
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
