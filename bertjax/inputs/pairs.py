"""Texts, one or a pair per row, as the model's input features: `[CLS] A [SEP] B [SEP]` (or the
tokenizer's template), segment 0 up to the first `[SEP]`, 1 after; a pair too long loses one token
at a time from the end of the longer text (B on a tie), as the original's run_classifier.py.
GLUE's features, one's own classification and regression rows, and prediction's all come here."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from bertjax.errors import Refusal


def truncate_pair(ids_a: list[int], ids_b: list[int], max_tokens: int) -> tuple[list, list]:
  """Drop the last token of the longer list (of B on a tie) until both fit in `max_tokens`."""
  len_a, len_b = len(ids_a), len(ids_b)
  while len_a + len_b > max_tokens:
    if len_a > len_b:
      len_a -= 1
    else:
      len_b -= 1
  return ids_a[:len_a], ids_b[:len_b]


def encode_pairs(texts_a: Sequence[str], texts_b: Sequence[str] | None, tokenizer,
                 max_seq_length: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
  """Rows framed by the tokenizer's template (`[CLS] A [SEP]` or `[CLS] A [SEP] B [SEP]` for
  BERT's): input_ids, input_mask, segment_ids [N, L] int32, and which rows were cut to fit, [N]
  bool (the longer text loses its last token first, B on a tie)."""
  pair = texts_b is not None
  template = tokenizer.template
  specials = template.specials(pair)
  if max_seq_length < specials + 1:
    raise Refusal(f"max_seq_length {max_seq_length} leaves no room for text beside the "
                  f"{specials} special tokens; use at least {specials + 1} (128 is the usual).")
  n, length = len(texts_a), max_seq_length
  ids_a = tokenizer.encode_batch(list(texts_a))
  ids_b = tokenizer.encode_batch([t or "" for t in texts_b]) if pair else None
  single_room = length - template.specials(False)
  input_ids_NxL = np.full((n, length), tokenizer.pad_id, np.int32)
  input_mask_NxL = np.zeros((n, length), np.int32)
  segment_ids_NxL = np.zeros((n, length), np.int32)
  truncated_N = np.zeros(n, bool)
  for i in range(n):
    if not pair or texts_b[i] is None:
      a, b = ids_a[i][:single_room], None
      truncated_N[i] = len(ids_a[i]) > single_room
    else:
      a, b = truncate_pair(ids_a[i], ids_b[i], length - specials)
      truncated_N[i] = len(a) + len(b) < len(ids_a[i]) + len(ids_b[i])
    row, types, _, _ = template.frame(a, b)
    input_ids_NxL[i, :len(row)] = row
    input_mask_NxL[i, :len(row)] = 1
    segment_ids_NxL[i, :len(row)] = types
  return ({"input_ids": input_ids_NxL, "input_mask": input_mask_NxL,
           "segment_ids": segment_ids_NxL}, truncated_N)
