"""Queries and passages for a retriever (the embeddings family, bertjax/finetune/families/
embeddings.py, and prediction's search), read from CSV, TSV or JSON Lines (textfiles.py), with the
columns a config or a command names:

  training rows   a query column, a positive column (the passage that answers it) and optional
                  columns of hard negatives: in CSV and TSV one passage a column (an empty cell:
                  none), in JSON Lines a passage or a list of them
  a corpus        an id column and a text column (none empty): the passages a query is
                  searched against
  judged queries  a query column and a column of the ids of its relevant passages in a corpus:
                  one id, several separated by commas, or (JSON Lines) a list
  dev pairs       without a corpus file, a dev file of training rows is its own corpus: every
                  distinct passage text of it (positives and hard negatives) once, in the order
                  first seen, and each query's positives are its relevant passages

A query asked on several rows is one query, whose relevant passages are all of theirs (scored
once, as trec_eval scores a query); its id is the first row's `id` column, else its row number.
Refusals name the file, line and column and the fix, as the other readers'.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Sequence

from bertjax.errors import Refusal
from bertjax.inputs import textfiles


# How a refusal of a missing column says the keys that name them (configs/finetune.py).
KEYS = ("query / positive / negatives, a corpus's text column with config.data.passage (its "
        "ids: an 'id' column)")


@dataclasses.dataclass(frozen=True)
class Columns:
  query: str = "query"
  positive: str = "positive"  # training and dev pairs: a text; judged queries: ids
  negatives: tuple[str, ...] = ()
  passage: str = "text"  # a corpus's text column (and prediction's passages)
  id: str = "id"


@dataclasses.dataclass
class Pairs:
  """Training rows: the query, its passages (the positive first, then its hard negatives) and
  where the row starts."""

  queries: list[str]
  passages: list[list[str]]
  where: list[str]


@dataclasses.dataclass
class Judged:
  """Queries with their relevant passages in a corpus: what the retrieval metrics score
  (bertjax/finetune/kit/retrieval.py). `relevant` holds corpus indices; a query without any (a test
  file of queries alone) is searched, not scored."""

  queries: list[str]
  query_ids: list[str]
  relevant: list[list[int]]
  corpus: list[str]
  corpus_ids: list[str]

  def relevant_of(self, query: str, query_id: str, by_query: dict[str, int]) -> list[int]:
    """The list of `query`'s relevant passages, to be added to: a repeated query is one query
    (its first row's id), `by_query` its index."""
    if query not in by_query:
      by_query[query] = len(self.queries)
      self.queries.append(query)
      self.query_ids.append(query_id)
      self.relevant.append([])
    return self.relevant[by_query[query]]

  @property
  def scored(self) -> bool:
    return any(self.relevant)


def _text(row: textfiles.Row, column: str, what: str) -> str:
  text = textfiles.text_of(row, column)
  if not text.strip():
    raise Refusal(f"{row.where}: column {column!r} is empty; every row needs {what} (fill it, "
                  "or leave the row out).")
  return text


def _negatives(row: textfiles.Row, column: str) -> list[str]:
  value = row[column]
  values = value if isinstance(value, list) else [value]
  texts = []
  for v in values:
    if isinstance(v, (dict, list)):
      raise Refusal(f"{row.where}: column {column!r} holds a {type(v).__name__} among its hard "
                    "negatives; give a passage's text, or a list of texts.")
    if v is not None and str(v).strip():
      texts.append(str(v))
  return texts


def read_pairs(path: str, columns: Columns, fmt: str = "") -> Pairs:
  """Training rows (or dev pairs): every row needs its query and positive; hard negatives are
  optional on each row, their columns in the header."""
  rows = textfiles.read_rows(path, [columns.query, columns.positive, *columns.negatives], fmt,
                             KEYS)
  pairs = Pairs([], [], [])
  for row in rows:
    pairs.queries.append(_text(row, columns.query, "a query"))
    passages = [_text(row, columns.positive, "its positive passage")]
    for column in columns.negatives:
      passages += _negatives(row, column)
    pairs.passages.append(passages)
    pairs.where.append(row.where)
  return pairs


def _row_id(row: textfiles.Row, k: int, column: str) -> str:
  return str(row[column]).strip() if column in row and str(row[column]).strip() else str(k)


def judged_pairs(path: str, columns: Columns, fmt: str = "") -> Judged:
  """Dev (or test) pairs as judged queries against the corpus of their own passages."""
  rows = textfiles.read_rows(path, [columns.query, columns.positive, *columns.negatives], fmt,
                             KEYS)
  corpus: dict[str, int] = {}
  by_query: dict[str, int] = {}
  judged = Judged([], [], [], [], [])
  for k, row in enumerate(rows):
    query = _text(row, columns.query, "a query")
    positive = _text(row, columns.positive, "its positive passage")
    at = [corpus.setdefault(t, len(corpus)) for t in
          [positive] + [n for c in columns.negatives for n in _negatives(row, c)]]
    relevant = judged.relevant_of(query, _row_id(row, k, columns.id), by_query)
    if at[0] not in relevant:
      relevant.append(at[0])
  judged.corpus = list(corpus)
  judged.corpus_ids = [f"p{k}" for k in range(len(corpus))]
  return judged


def read_corpus(path: str, columns: Columns, fmt: str = "") -> tuple[list[str], list[str]]:
  """(ids, texts) of a corpus file; an id given twice is refused, naming both lines."""
  ids, texts, seen = [], [], {}
  for row in textfiles.read_rows(path, [columns.id, columns.passage], fmt, KEYS):
    passage_id = str(row[columns.id]).strip()
    if not passage_id:
      raise Refusal(f"{row.where}: column {columns.id!r} is empty; every passage of the corpus "
                    "needs its id (what the dev file's relevant passages name).")
    if passage_id in seen:
      raise Refusal(f"{row.where}: the passage id {passage_id!r} is given twice (first at "
                    f"{seen[passage_id]}); give each passage an id of its own.")
    seen[passage_id] = row.where
    ids.append(passage_id)
    # An empty passage would be ranked by its [CLS] and [SEP] alone, as an empty positive would
    # be trained on: refused alike.
    texts.append(_text(row, columns.passage, "its passage's text"))
  return ids, texts


def _ids(row: textfiles.Row, column: str) -> list[str]:
  value = row[column]
  if isinstance(value, list):
    return [str(v).strip() for v in value if str(v).strip()]
  if isinstance(value, (int, float)) and not isinstance(value, bool):
    return [str(int(value)) if float(value).is_integer() else str(value)]
  text = "" if value is None else str(value).strip()
  if text.startswith("["):
    try:
      return [str(v).strip() for v in json.loads(text) if str(v).strip()]
    except (json.JSONDecodeError, TypeError):
      pass
  return [t.strip() for t in text.split(",") if t.strip()]


def read_judged(path: str, columns: Columns, corpus_ids: Sequence[str], corpus: Sequence[str],
                corpus_path: str, fmt: str = "", need_relevant: bool = True) -> Judged:
  """Queries and the ids of their relevant passages in `corpus_ids` (the positive column); a
  file without that column (need_relevant=False: a test file) gives queries to search alone."""
  rows = textfiles.read_rows(path, [columns.query] + ([columns.positive] if need_relevant
                                                      else []), fmt, KEYS)
  index = {passage_id: k for k, passage_id in enumerate(corpus_ids)}
  labelled = need_relevant or all(columns.positive in row for row in rows)
  by_query: dict[str, int] = {}
  judged = Judged([], [], [], list(corpus), list(corpus_ids))
  for k, row in enumerate(rows):
    query = _text(row, columns.query, "a query")
    found = []
    if labelled:
      named = _ids(row, columns.positive)
      if not named:
        raise Refusal(f"{row.where}: column {columns.positive!r} names no passage id; with "
                      "config.data.corpus_file it holds the ids of the query's relevant "
                      f"passages in {corpus_path} (one, or several separated by commas).")
      for passage_id in named:
        if passage_id not in index:
          raise Refusal(f"{row.where}: column {columns.positive!r} names the passage id "
                        f"{passage_id!r}, which {corpus_path} does not hold (its column "
                        f"{columns.id!r}); fix the id, or add the passage to the corpus.")
        found.append(index[passage_id])
    relevant = judged.relevant_of(query, _row_id(row, k, columns.id), by_query)
    relevant += [i for i in found if i not in relevant]
  return judged
