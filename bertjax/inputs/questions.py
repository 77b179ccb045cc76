"""Questions and their contexts as the model's input, in SQuAD's layout (v1.1, or v2.0 with
unanswerable questions): `SquadExample`s from JSON files of that layout (the span family's own
files, and the SQuAD benchmark's: bertjax/finetune/tasks/squad.py), and the windowed features
`[CLS] question [SEP] window [SEP]` of the original `run_squad.py`.

The original splits contexts on whitespace and walks characters to map answers and predictions;
here the tokenizer's character offsets do both, so a feature knows for each context token the exact
characters of the original context it covers (`token_start_char`, `token_end_char`).

Letters in names: F features, L max_seq_length, N tokens of one context, W windows of one question.
"""

import dataclasses
import json
import logging
from typing import Iterable, Sequence

import numpy as np

from bertjax.errors import Refusal

# Defaults of the original run_squad.py.
MAX_SEQ_LENGTH, DOC_STRIDE, MAX_QUERY_LENGTH = 384, 128, 64
_FORMAT = ('a SQuAD file is JSON {"version": ..., "data": [{"title": ..., "paragraphs": '
           '[{"context": ..., "qas": [{"id": ..., "question": ..., "answers": [{"text": ..., '
           '"answer_start": ...}], "is_impossible": ...}]}]}]}')


@dataclasses.dataclass(frozen=True)
class SquadExample:
  """One question. `answers` keeps every gold text (evaluation takes the max over them);
  `answer_span` is the character span [start, end) of the first one in `context`, the training
  target, or None (unanswerable, or an answer that does not match its offset)."""

  qas_id: str
  question: str
  context: str
  answers: tuple[str, ...]
  answer_starts: tuple[int, ...]
  is_impossible: bool = False
  answer_span: tuple[int, int] | None = None


@dataclasses.dataclass
class SquadSet:
  """The questions of one source, and those the reader skipped or could not give a target,
  as (question id, reason)."""

  source: str
  examples: list[SquadExample]
  skipped: list[tuple[str, str]]
  unmatched: list[tuple[str, str]]


def _field(obj, key: str, kind, where: str):
  if not isinstance(obj, dict) or key not in obj:
    raise Refusal(f"{where} lacks {key!r}; {_FORMAT}.")
  value = obj[key]
  if not isinstance(value, kind) or isinstance(value, bool):
    names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
    raise Refusal(f"{where}: {key!r} is a {type(value).__name__}, not a {names}; {_FORMAT}.")
  return value


def read_squad_json(path: str, *, is_training: bool) -> SquadSet:
  """The questions of a SQuAD v1.1 or v2.0 JSON file (local or gs://)."""
  import tensorflow as tf
  if not tf.io.gfile.exists(path):
    raise FileNotFoundError(f"SQuAD file {path} does not exist.")
  with tf.io.gfile.GFile(path, "rb") as f:
    raw = f.read()
  if not raw.strip():
    raise Refusal(f"SQuAD file {path} is empty; {_FORMAT}.")
  try:
    doc = json.loads(raw)
  except (json.JSONDecodeError, UnicodeDecodeError) as err:
    where = f"{path}:{err.lineno}:{err.colno}" if hasattr(err, "lineno") else path
    raise Refusal(f"{where}: not JSON ({err}); {_FORMAT}.") from None
  articles = _field(doc, "data", list, f"SQuAD file {path}")

  def records():
    for a, article in enumerate(articles):
      for p, para in enumerate(_field(article, "paragraphs", list, f"{path}: data[{a}]")):
        where = f"{path}: data[{a}].paragraphs[{p}]"
        context = _field(para, "context", str, where)
        for q, qa in enumerate(_field(para, "qas", list, where)):
          qwhere = f"{where}.qas[{q}] (id {qa.get('id') if isinstance(qa, dict) else None!r})"
          answers = _field(qa, "answers", list, qwhere)
          yield {"id": str(_field(qa, "id", (str, int), qwhere)),
                 "question": _field(qa, "question", str, qwhere), "context": context,
                 "texts": [_field(x, "text", str, qwhere) for x in answers],
                 "starts": [_field(x, "answer_start", int, qwhere) for x in answers],
                 "is_impossible": bool(qa.get("is_impossible", False)),
                 "marked": "is_impossible" in qa}

  return squad_set(records(), path, is_training)


def squad_set(records: Iterable[dict], source: str, is_training: bool) -> SquadSet:
  """Examples from reader records; a training question without a usable answer is skipped as the
  original skips it (evaluation keeps every question: skipping one would change the totals)."""
  examples, skipped, unmatched, seen = [], [], [], set()
  contexts = {}  # one string object per distinct context, so features tokenize each once
  for r in records:
    qid, context = r["id"], contexts.setdefault(r["context"], r["context"])
    if qid in seen:
      raise Refusal(f"{source}: question id {qid!r} appears twice; ids name predictions.")
    seen.add(qid)
    span, problem = None, None
    if r["is_impossible"]:
      pass
    elif not r["texts"]:
      if not r["marked"]:
        problem = "has no answer and no is_impossible flag (v2.0 files mark unanswerable ones)"
    else:
      text, start = r["texts"][0], r["starts"][0]
      if text and 0 <= start and context[start:start + len(text)] == text:
        span = (start, start + len(text))
      else:
        problem = (f"answer {text!r} does not match the context at answer_start {start} "
                   f"({context[max(start, 0):max(start, 0) + len(text)]!r})")
    if problem and is_training:
      skipped.append((qid, problem))
      continue
    if problem:
      unmatched.append((qid, problem))
    examples.append(SquadExample(qid, r["question"], context, tuple(r["texts"]),
                                 tuple(r["starts"]), r["is_impossible"], span))
  for what, items in (("skipped", skipped), ("kept without a training target", unmatched)):
    if items:
      logging.warning("%s: %s %d question(s) (the original run_squad.py warns 'Could not find "
                      "answer'), e.g. %s", source, what, len(items),
                      "; ".join(f"{q}: {why}" for q, why in items[:3]))
  if not examples:
    raise Refusal(f"{source} holds no usable question ({len(skipped)} skipped); {_FORMAT}.")
  return SquadSet(source, examples, skipped, unmatched)


def _windows(n_doc: int, max_doc: int, doc_stride: int) -> list[tuple[int, int]]:
  """(start, length) of the original's sliding windows; an empty context gets one empty window so
  that every question has a feature."""
  spans, start = [], 0
  while start < n_doc:
    length = min(n_doc - start, max_doc)
    spans.append((start, length))
    if start + length == n_doc:
      break
    start += min(length, doc_stride)
  return spans or [(0, 0)]


def max_context_W(spans: Sequence[tuple[int, int]], n_doc: int) -> np.ndarray:
  """For each context token, the window that sees it with the most context: the largest
  min(left, right) + 0.01 * window length, the first such window on ties (as the original)."""
  start_Wx1 = np.array([s for s, _ in spans], np.int64)[:, None]
  length_Wx1 = np.array([n for _, n in spans], np.int64)[:, None]
  pos_1xN = np.arange(n_doc)[None, :]
  score_WxN = (np.minimum(pos_1xN - start_Wx1, start_Wx1 + length_Wx1 - 1 - pos_1xN)
               + 0.01 * length_Wx1)
  inside_WxN = (pos_1xN >= start_Wx1) & (pos_1xN < start_Wx1 + length_Wx1)
  return np.argmax(np.where(inside_WxN, score_WxN, -np.inf), axis=0)


def make_features(examples: Sequence[SquadExample], tokenizer, *,
                  max_seq_length: int = MAX_SEQ_LENGTH, doc_stride: int = DOC_STRIDE,
                  max_query_length: int = MAX_QUERY_LENGTH) -> dict[str, np.ndarray]:
  """Windowed features of the examples, arrays over F features:

  input_ids, input_mask, segment_ids [F, L] int32 (the original's names); start_positions,
  end_positions [F] int32 (0 = [CLS] when the answer is not wholly inside the window, or there is
  none); example_index [F] int32; token_start_char, token_end_char [F, L] int32 (characters of the
  example's context, -1 outside the window's context part); token_is_max_context [F, L] bool.
  """
  template = tokenizer.template
  specials = template.specials(True)  # 3 for BERT's [CLS] query [SEP] context [SEP]
  if max_seq_length - max_query_length - specials < 1 or doc_stride < 1:
    raise Refusal(f"max_seq_length {max_seq_length} leaves no room for context after a query "
                  f"of max_query_length {max_query_length} and {specials} special tokens (or "
                  f"doc_stride {doc_stride} < 1); raise max_seq_length or lower "
                  "max_query_length.")
  if doc_stride >= max_seq_length - max_query_length - specials:
    logging.warning("doc_stride %d is not below the shortest window (max_seq_length %d - "
                    "max_query_length %d - %d): windows may not overlap, and an answer across a "
                    "window's end is then in no window.", doc_stride, max_seq_length,
                    max_query_length, specials)
  ctx_index = {}
  for ex in examples:
    ctx_index.setdefault(ex.context, len(ctx_index))
  doc = tokenizer.encode_with_offsets(list(ctx_index))
  queries = tokenizer.encode_batch([ex.question for ex in examples])

  plans = []  # per example: (query ids, context index, windows, answer token span or None)
  for ex, query in zip(examples, queries):
    query = query[:max_query_length]
    c = ctx_index[ex.context]
    _, start_N, end_N = doc[c]
    spans = _windows(len(start_N), max_seq_length - len(query) - specials, doc_stride)
    target = None
    if ex.answer_span is not None and not ex.is_impossible:
      # First token ending after the answer's start, last token starting before its end.
      first = int(np.searchsorted(end_N, ex.answer_span[0], side="right"))
      last = int(np.searchsorted(start_N, ex.answer_span[1], side="left")) - 1
      target = (first, last) if first <= last else None
    plans.append((query, c, spans, target))

  F, L = sum(len(p[2]) for p in plans), max_seq_length
  out = {"input_ids": np.zeros((F, L), np.int32), "input_mask": np.zeros((F, L), np.int32),
         "segment_ids": np.zeros((F, L), np.int32),
         "start_positions": np.zeros(F, np.int32), "end_positions": np.zeros(F, np.int32),
         "example_index": np.zeros(F, np.int32),
         "token_start_char": np.full((F, L), -1, np.int32),
         "token_end_char": np.full((F, L), -1, np.int32),
         "token_is_max_context": np.zeros((F, L), bool)}
  f = 0
  for e, (query, c, spans, target) in enumerate(plans):
    ids_N, start_N, end_N = doc[c]
    best_N = max_context_W(spans, len(ids_N)) if len(spans) > 1 else None
    for w, (s, n) in enumerate(spans):
      row, types, _, off = template.frame(query, ids_N[s:s + n].tolist())  # off: first context
      out["input_ids"][f, :len(row)] = row
      out["input_mask"][f, :len(row)] = 1
      out["segment_ids"][f, :len(row)] = types
      out["token_start_char"][f, off:off + n] = start_N[s:s + n]
      out["token_end_char"][f, off:off + n] = end_N[s:s + n]
      out["token_is_max_context"][f, off:off + n] = True if best_N is None else best_N[s:s + n] == w
      if target is not None and s <= target[0] and target[1] < s + n:
        out["start_positions"][f] = target[0] - s + off
        out["end_positions"][f] = target[1] - s + off
      out["example_index"][f] = e
      f += 1
  return out
