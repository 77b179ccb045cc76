"""Sequence packing: several prepared sequences in one row of length L, placed by best-fit
decreasing inside a window of sequences.

Packing works on sequences that are already masked (bertjax/data/masking.py keys every mask by the
sequence's id and its own positions), so a sequence carries the same tokens, masks and labels
packed or not; packing only moves it to an offset in a row. The row layout (S = max sequences per
row, M = max predictions per sequence):

  input_ids, input_mask, segment_ids  [R, L]  each sequence's tokens at its offset, then padding
  sequence_ids                        [R, L]  0 = padding, k = the k-th sequence of the row
  masked_lm_positions, _ids, _weights [R, S*M] slots k*M .. k*M+M-1 belong to the k-th
                                              sequence; positions are in the row
  next_sentence_labels, nsp_positions,
  nsp_weights                         [R, S]  label, [CLS] position and 1 for each sequence; 0 in
                                              the slots of a row holding fewer than S
"""

from __future__ import annotations

import bisect
import dataclasses

import numpy as np

from bertjax.data.config import DataConfig
from bertjax.errors import Refusal


def best_fit_decreasing(lengths_N: np.ndarray, capacity: int, max_per_row: int):
  """Rows for sequences of `lengths_N`: longest first, each into the open row it fills best (the
  least room left that still fits; the earliest such row on a tie), or a new row.

  Deterministic. Returns (row_N, slot_N, offset_N, num_rows): sequence i is the slot_N[i]-th of
  row row_N[i] and starts at offset_N[i].
  """
  lengths_N = np.asarray(lengths_N, np.int64)
  n = len(lengths_N)
  if n and (lengths_N.min() < 1 or lengths_N.max() > capacity):
    raise ValueError(f"Sequence lengths must be within 1 and the row length {capacity}, got "
                     f"{lengths_N.min()}..{lengths_N.max()}.")
  row_N, slot_N, offset_N = (np.zeros(n, np.int64) for _ in range(3))
  order = np.argsort(-lengths_N, kind="stable")
  shortest = int(lengths_N.min()) if n else 0
  # Open rows as one sorted list of keys room * stride + row: bisect finds the best fit, and rows
  # that cannot take even the shortest sequence leave the list.
  stride = n + 1
  open_keys: list[int] = []
  used: list[int] = []
  count: list[int] = []
  for i in order.tolist():
    length = int(lengths_N[i])
    k = bisect.bisect_left(open_keys, length * stride)
    if k < len(open_keys):
      r = open_keys.pop(k) % stride
    else:
      r = len(used)
      used.append(0)
      count.append(0)
    row_N[i], slot_N[i], offset_N[i] = r, count[r], used[r]
    used[r] += length
    count[r] += 1
    room = capacity - used[r]
    if count[r] < max_per_row and room >= shortest:
      bisect.insort(open_keys, room * stride + r)
  return row_N, slot_N, offset_N, len(used)


def pack(block: dict, *, max_per_row: int, rng: np.random.Generator | None = None) -> dict:
  """Rows (the module's layout) from a block of masked sequences, one per row of [N, L] features
  (the unpacked pipeline's, `input_mask` giving each length), plus `example_ids` [N].

  The rows come out permuted by `rng` (None: in the order they were opened, longest first), so
  that a batch taken from a window's rows mixes long and short ones.
  """
  ids_NxL = block["input_ids"]
  n, length = ids_NxL.shape
  m = block["masked_lm_positions"].shape[1]
  s = max_per_row
  lengths_N = np.sum(block["input_mask"], axis=1, dtype=np.int64)
  row_N, slot_N, offset_N, rows = best_fit_decreasing(lengths_N, length, s)
  order_R = rng.permutation(rows) if rng is not None else np.arange(rows)
  row_N = np.argsort(order_R)[row_N]  # the row each sequence lands in after the permutation

  # Every token moves by the same amount as its sequence: flat indices of the real tokens only
  # (each sequence is a prefix of its unpacked row), never an [N, L] index array.
  src = np.flatnonzero(block["input_mask"])
  dest = src + np.repeat(row_N * length + offset_N - np.arange(n) * length, lengths_N)
  out = {}
  for name, values in (("input_ids", ids_NxL.reshape(-1)[src]),
                       ("segment_ids", np.asarray(block["segment_ids"]).reshape(-1)[src]),
                       ("sequence_ids", np.repeat(slot_N + 1, lengths_N))):
    flat = np.zeros(rows * length, np.int32)
    flat[dest] = values
    out[name] = flat.reshape(rows, length)
  out["input_mask"] = (out["sequence_ids"] > 0).astype(np.int32)

  weights_NxM = block["masked_lm_weights"]
  slots = (row_N * s + slot_N)[:, None] * m + np.arange(m)[None, :]
  shifted_NxM = np.where(weights_NxM > 0, block["masked_lm_positions"] + offset_N[:, None], 0)
  for name, value_NxM, dtype in (("masked_lm_positions", shifted_NxM, np.int32),
                                 ("masked_lm_ids", block["masked_lm_ids"], np.int32),
                                 ("masked_lm_weights", weights_NxM, np.float32)):
    flat = np.zeros(rows * s * m, dtype)
    flat[slots] = value_NxM
    out[name] = flat.reshape(rows, s * m)

  seq = row_N * s + slot_N
  for name, value_N, fill, dtype in (
      ("next_sentence_labels", block["next_sentence_labels"], 0, np.int32),
      ("nsp_positions", offset_N, 0, np.int32), ("nsp_weights", np.ones(n), 0, np.float32),
      ("example_ids", block["example_ids"], -1, np.int64)):
    flat = np.full(rows * s, fill, dtype)
    flat[seq] = value_N
    out[name] = flat.reshape(rows, s)
  return out


def unpack(rows: dict, length: int) -> list[dict]:
  """The sequences of packed rows, one dict each in row-major slot order: its tokens (unpadded),
  segment ids, masked positions (in the sequence), ids and weights of its real predictions, NSP
  label and example id (when the rows carry `example_ids`). For tests and inspection."""
  out = []
  s = rows["nsp_weights"].shape[1]
  m = rows["masked_lm_positions"].shape[1] // s
  for r in range(len(rows["input_ids"])):
    for k in range(s):
      if rows["nsp_weights"][r, k] == 0:
        continue
      where = np.flatnonzero(rows["sequence_ids"][r] == k + 1)
      start = int(rows["nsp_positions"][r, k])
      assert where[0] == start and np.all(np.diff(where) == 1) and where[-1] < length
      w = rows["masked_lm_weights"][r, k * m:(k + 1) * m] > 0
      seq = {"input_ids": rows["input_ids"][r, where],
             "segment_ids": rows["segment_ids"][r, where],
             "masked_lm_positions": rows["masked_lm_positions"][r, k * m:(k + 1) * m][w] - start,
             "masked_lm_ids": rows["masked_lm_ids"][r, k * m:(k + 1) * m][w],
             "next_sentence_labels": int(rows["next_sentence_labels"][r, k])}
      if "example_ids" in rows:
        seq["example_ids"] = int(rows["example_ids"][r, k])
      out.append(seq)
  return out


@dataclasses.dataclass
class FillStats:
  """Counts of what packing produced: how full the rows are, against one sequence per row."""

  sequences: int = 0
  rows: int = 0
  tokens: int = 0  # real (non-padding) tokens

  def add(self, sequences: int, rows: int, tokens: int):
    self.sequences += sequences
    self.rows += rows
    self.tokens += tokens

  def describe(self, length: int) -> str:
    fill = self.tokens / max(self.rows * length, 1)
    unpacked = self.tokens / max(self.sequences * length, 1)
    return (f"{self.sequences} sequences in {self.rows} rows of {length} "
            f"({self.sequences / max(self.rows, 1):.2f} per row): {100 * fill:.1f}% of the "
            f"positions are tokens ({100 * unpacked:.1f}% with one sequence per row)")


def settings(data: DataConfig) -> tuple[bool, int]:
  """(packing on, max sequences per row) of the data config, refusing values that cannot work
  (their types were checked when it was built)."""
  on, per_row = data.packing, data.max_sequences_per_row
  if per_row < 1:
    raise Refusal(f"config.data.max_sequences_per_row={per_row!r} must be an integer >= 1 "
                  f"(2 or 3 pack most of the room that padding leaves).")
  return on, per_row
