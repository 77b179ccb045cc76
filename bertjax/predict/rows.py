"""How prediction lays texts into a device's calls: groups of rows of near lengths, and packed rows.

A sequence-level head (classification, regression: the family's PACKED) and an embedding by [CLS]
read one state per text. Prediction then packs several texts into a row of up to PACK_WIDTH tokens, each
attending to itself alone (the encoder's `sequence_ids`, positions restarting at each text), and
the last layer computes the [CLS] positions only (BertModel's query_positions): a row wastes no
padding on short texts and the last layer costs a few positions instead of every one
(docs/performance.md#prediction-on-a-cpu). Per-token heads (tagging, span) take one text per row,
grouped by length.

Everything here is a function of the lengths alone, so the same texts meet in the same shapes
whatever the number of devices, and the outputs are the same bits on 1 or 8.
"""

from __future__ import annotations

import numpy as np

# Packed rows are at most this wide. A row's attention spans all of it (the mask keeps each text to
# itself, the products do not skip the rest), and on a CPU the attention's small batched products
# run far below the dense layers' rate: interleaved on 2 cores (1,024 texts around 24 tokens),
# rows of 32-64 ran 1.28x the unpacked groups at 4 layers x 256 (1.24x at BERT-Base), rows of 128
# 1.14x (docs/performance.md#prediction-on-a-cpu). Longer texts keep a row of their own.
PACK_WIDTH = 64
# At most this many texts share a row: the [CLS] slots of a call are a power of two up to it.
MAX_PER_ROW = 32


def bucket_width(length: int, cap: int) -> int:
  """The width a row of `length` tokens is padded to: a multiple of 8 up to 64, then of a quarter
  of the power of two below (80, 96, 112, 128, 160, ...): at most 8 tokens or 25% of padding,
  with few enough widths (12 up to 128, 20 up to 512) to compile each once."""
  length = max(int(length), 1)
  step = max(8, (1 << (length - 1).bit_length()) // 8)
  return min(-(-length // step) * step, cap)


def length_groups(lengths_N: np.ndarray, cap: int, tokens: int) -> list[tuple[np.ndarray, int, int]]:
  """(row indices, width, rows) of each group: rows ordered by length (then index), cut greedily
  so that a group's count fits its capacity `tokens // width` at the width of its longest row.
  A group that ends short of it (the last of a width, of the chunk) is given the power of two
  above its count instead, if smaller: its empty rows cost positions too (3.5% of them on 512
  texts of the benchmark), and a width gets at most a few more shapes to compile.
  A function of the lengths alone: the same rows meet in the same shapes on any device count."""
  order_N = np.lexsort((np.arange(len(lengths_N)), lengths_N))
  widths_N = np.array([bucket_width(k, cap) for k in lengths_N[order_N]], np.int64)
  capacity_N = np.maximum(1, tokens // widths_N)
  groups, start, n = [], 0, len(order_N)
  while start < n:
    stop = start + 1  # widths grow along the order, capacities shrink: stop where one is full
    while stop < n and stop - start + 1 <= capacity_N[stop]:
      stop += 1
    rows = min(int(capacity_N[stop - 1]), 1 << (stop - start - 1).bit_length())
    groups.append((order_N[start:stop], int(widths_N[stop - 1]), rows))
    start = stop
  return groups


def pack(lengths_N: np.ndarray, width: int, max_per_row: int = MAX_PER_ROW) -> list[np.ndarray]:
  """The texts of each packed row (indices into lengths_N), at most `width` tokens a row.

  From the longest text down: a row takes the longest left, then the next longest while they fit,
  then the shortest while they fit (short texts fill the ends of rows of long ones). A text
  longer than `width` is a row alone. Every text is in exactly one row."""
  order_N = np.lexsort((np.arange(len(lengths_N)), lengths_N))  # ascending, ties by index
  sizes = lengths_N[order_N]
  rows, lo, hi = [], 0, len(order_N) - 1
  while lo <= hi:
    row, used = [hi], int(sizes[hi])
    hi -= 1
    if used <= width:
      while lo <= hi and len(row) < max_per_row and used + sizes[hi] <= width:
        row.append(hi)
        used += int(sizes[hi])
        hi -= 1
      while lo <= hi and len(row) < max_per_row and used + sizes[lo] <= width:
        row.append(lo)
        used += int(sizes[lo])
        lo += 1
    rows.append(order_N[np.array(row)])
  return rows


def slots(count: int) -> int:
  """The [CLS] slots a row of `count` texts is computed with: the power of two at or above it."""
  return 1 << (max(int(count), 1) - 1).bit_length()


def packed_arrays(features: dict[str, np.ndarray], lengths_N: np.ndarray, rows: list[np.ndarray],
                  n_rows: int, width: int, n_slots: int) -> dict[str, np.ndarray]:
  """The arrays of `n_rows` packed rows (those past len(rows) empty): input_ids, input_mask,
  segment_ids and sequence_ids (1, 2, ... per text, 0 for padding) [n_rows, width], and
  cls_positions [n_rows, n_slots] (each text's first token; empty slots read position 0)."""
  out = {key: np.zeros((n_rows, width), features[key].dtype)
         for key in ("input_ids", "input_mask", "segment_ids")}
  out["sequence_ids"] = np.zeros((n_rows, width), np.int32)
  out["cls_positions"] = np.zeros((n_rows, n_slots), np.int32)
  for r, texts in enumerate(rows):
    at = 0
    for k, t in enumerate(texts):
      size = int(lengths_N[t])
      for key in ("input_ids", "input_mask", "segment_ids"):
        out[key][r, at:at + size] = features[key][t, :size]
      out["sequence_ids"][r, at:at + size] = k + 1
      out["cls_positions"][r, k] = at
      at += size
  return out


INPUTS = ("input_ids", "input_mask", "segment_ids", "sequence_ids", "cls_positions")


def _by_call(groups_by_shape: dict, devices: int):
  """(shape key, groups, rows a group) per call: the groups of one shape, `devices` at a time."""
  for key, same in groups_by_shape.items():
    for at in range(0, len(same), devices):
      yield key, same[at:at + devices], same[at][2]


def grouped_calls(features: dict[str, np.ndarray], tokens: int, devices: int):
  """Yields (arrays, groups, width, rows) per call of an unpacked prediction: the call's
  ("input_ids", "input_mask", "segment_ids") arrays [devices x rows, width], each device's share
  one length group (length_groups), and the groups themselves, in the order of the slots."""
  max_len = features["input_ids"].shape[1]
  by_shape: dict[tuple[int, int], list] = {}
  for group in length_groups(features["input_mask"].sum(1), max_len, tokens):
    by_shape.setdefault(group[1:], []).append(group)
  for (width, _), calls, capacity in _by_call(by_shape, devices):
    arrays = []
    for key in INPUTS[:3]:
      a = np.zeros((devices * capacity, width), features[key].dtype)
      for slot, (rows, _, _) in enumerate(calls):
        a[slot * capacity:slot * capacity + len(rows)] = features[key][rows, :width]
      arrays.append(a)
    yield arrays, calls, width, capacity


def packed_calls(features: dict[str, np.ndarray], tokens: int, devices: int):
  """Yields (arrays, texts, at_out) per call of a packed prediction over every row of `features`:
  the call's INPUTS arrays, [devices x rows, ...], each device's share one group of packed rows
  (grouped by used length as length_groups groups texts, and by their [CLS] slots), the texts it
  computes, and where each text's output is among the call's [devices x rows x slots] outputs."""
  max_len = features["input_ids"].shape[1]
  lengths_N = features["input_mask"].sum(1)
  rows = pack(lengths_N, min(PACK_WIDTH, max_len))
  used_R = np.array([lengths_N[r].sum() for r in rows])
  by_shape: dict[tuple[int, int], list] = {}
  for group in length_groups(used_R, max_len, tokens):
    n_slots = slots(max(len(rows[r]) for r in group[0]))
    by_shape.setdefault((group[1], group[2], n_slots), []).append(group)
  empty = np.zeros(0, np.int64)
  for (width, _, n_slots), calls, capacity in _by_call(by_shape, devices):
    call_rows = [empty] * (devices * capacity)
    for slot, (group_rows, _, _) in enumerate(calls):
      call_rows[slot * capacity:slot * capacity + len(group_rows)] = [rows[r] for r in group_rows]
    a = packed_arrays(features, lengths_N, call_rows, len(call_rows), width, n_slots)
    # Text k of call row p is output p * n_slots + k.
    at_out = np.concatenate([p * n_slots + np.arange(len(r)) for p, r in enumerate(call_rows)])
    yield [a[key] for key in INPUTS], np.concatenate(call_rows), at_out


def in_input_order(parts: dict[str, list], index: list[np.ndarray]) -> dict[str, np.ndarray]:
  """Each output's pieces joined and put back in the input's order: index[i] names the input
  rows of the pieces parts[k][i]."""
  taken = np.concatenate(index)
  restore = np.empty(len(taken), np.int64)
  restore[taken] = np.arange(len(taken))
  return {k: np.concatenate(v)[restore] for k, v in parts.items()}
