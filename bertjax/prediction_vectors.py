"""Sentence vectors and search: `bertjax.predict --mode=embed` and `--mode=search`.

  embed   an [N, hidden] float32 .npy of the input's texts, one row per input row. A model of the
          embeddings family (its task.json) embeds queries (its query column, cut to its
          max_query_length) and passages (its passage column, cut to max_seq_length) with the
          pooling and normalisation it was trained with: a file holding one of the columns gives
          OUT, one holding both gives OUT.queries.npy and OUT.passages.npy. Any other weights
          folder embeds --text_a (and --text_b, as a pair) with --pooling (cls: the tanh pooler's
          output, the pooled [CLS]; mean: the last layer's mean over real tokens).
  search  each query's --top_k passages of --corpus (an id column and the passage column) by the
          dot product of their vectors (the cosine for unit vectors), as JSON lines
          {"id": the query's id (its row number where the input has no id column),
           "hits": [{"id": a passage's id, "score": ...}, ...]}, best first. The corpus's vectors
          are read from --corpus_vectors (what embed wrote for the same corpus file, checked
          row for row against it) or encoded first. Memory: the corpus's vectors (M x hidden x 4
          bytes) and one block of scores (bertjax/finetune/retrieval.py); queries stream through
          a chunk at a time.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Iterable, Iterator

import numpy as np

from bertjax import files, prediction_files
from bertjax.errors import Refusal
from bertjax.finetune import retrieval
from bertjax.inputs import textfiles

QUERIES, PASSAGES = "queries", "passages"
PLAIN_LENGTH = 128  # tokens kept by a model that says none (not of the embeddings family)


@dataclasses.dataclass(frozen=True)
class Side:
  """One kind of text: its name, the input's column and the tokens kept."""

  name: str
  column: str
  length: int


def sides(predictor, columns: dict, max_seq_length: int = 0) -> dict[str, Side]:
  """The queries' and the passages' columns and lengths: an embeddings model's own (task.json),
  the --text_a / --text_b / --max_seq_length flags where given; for another model "text" alike."""
  spec = predictor.spec if predictor.vectors else None
  if spec is None:
    length = max_seq_length or PLAIN_LENGTH
    column = columns.get("text_a") or "text"
    return {QUERIES: Side(QUERIES, column, length),
            PASSAGES: Side(PASSAGES, columns.get("text_b") or column, length)}
  return {QUERIES: Side(QUERIES, columns.get("text_a") or spec.text_a,
                        max_seq_length or spec.max_query_length),
          PASSAGES: Side(PASSAGES, columns.get("text_b") or spec.text_b,
                         max_seq_length or spec.max_seq_length)}


def limits(predictor, columns: dict, max_seq_length: int = 0) -> str:
  """The tokens kept of a text, for the console: one length, or the queries' and passages'."""
  both = sides(predictor, columns, max_seq_length)
  query, passage = both[QUERIES].length, both[PASSAGES].length
  if query == passage:
    return f"max_seq_length={query} tokens"
  return f"max_query_length={query} tokens (a query) or max_seq_length={passage} (a passage)"


def _first_row(path: str, fmt: str) -> textfiles.Row:
  row = next(iter(textfiles.iter_rows(path, fmt)), None)
  if row is None:
    raise Refusal(f"{path}: no rows (only a header, or blank lines).")
  return row


def embed_plan(predictor, input_path: str, output: str, columns: dict, max_seq_length: int,
               fmt: str = "") -> list[tuple[Side, str]]:
  """(the kind of text, its output file) of each .npy embed writes for the input."""
  both = sides(predictor, columns, max_seq_length)
  if not predictor.vectors:
    return [(both[QUERIES], output)]
  row = _first_row(input_path, fmt)
  found = [s for s in both.values() if s.column in row]
  if not found:
    raise Refusal(f"{row.where}: neither the queries' column {both[QUERIES].column!r} nor the "
                  f"passages' {both[PASSAGES].column!r}; the file has {sorted(row)}. Name the "
                  "column with --text_a (queries) or --text_b (passages).")
  if len(found) == 1:
    return [(found[0], output)]
  stem = output[:-4] if output.endswith(".npy") else output
  return [(s, f"{stem}.{s.name}.npy") for s in found]


def vectors_of(predictor, rows: Iterable, side: Side, pooling: str,
               text_b: str = "") -> Iterator[np.ndarray]:
  """[n, hidden] float32 vectors of the rows' `side` texts, a chunk at a time."""
  return predictor.embed(rows, pooling, side.column, text_b, side.length)


def write_vectors(predictor, input_path: str, output: str, side: Side, pooling: str,
                  text_b: str = "", fmt: str = "") -> int:
  """Writes an [N, hidden] float32 .npy, filled a chunk at a time (N counted first)."""
  n = sum(1 for _ in textfiles.iter_rows(input_path, fmt))
  if n == 0:
    raise Refusal(f"{input_path}: no rows to embed.")
  progress, at = prediction_files.Progress(predictor), 0
  files.makedirs(os.path.dirname(output) or ".")
  with prediction_files.part_file(output) as tmp:
    out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float32,
                                    shape=(n, predictor.config.hidden_size))
    for vectors in vectors_of(predictor, textfiles.iter_rows(input_path, fmt), side, pooling,
                              text_b):
      out[at:at + len(vectors)] = vectors
      at += len(vectors)
      progress.update(at)
    out.flush()
    del out
  progress.update(at, final=True)
  return n


def corpus_vectors(predictor, corpus: str, side: Side, pooling: str, vectors_path: str = "",
                   fmt: str = "") -> tuple[list[str], np.ndarray]:
  """(ids, vectors [M, hidden]) of a corpus file: the vectors read from `vectors_path` (an .npy
  embed wrote, one row per passage) or encoded now."""
  ids, seen = [], {}
  for k, row in enumerate(textfiles.iter_rows(corpus, fmt)):
    textfiles.require(row, [side.column], "--", "text_b (the passages; their ids: an 'id' "
                      "column, else the row numbers)")
    passage_id = str(row["id"]).strip() if "id" in row else str(k)
    if passage_id in seen:
      raise Refusal(f"{row.where}: the passage id {passage_id!r} is given twice (first at "
                    f"{seen[passage_id]}); give each passage an id of its own.")
    seen[passage_id] = row.where
    ids.append(passage_id)
  if not ids:
    raise Refusal(f"--corpus={corpus}: no passages.")
  if not vectors_path:
    vectors = np.concatenate(list(vectors_of(predictor, textfiles.iter_rows(corpus, fmt), side,
                                             pooling)))
    return ids, vectors
  with files.open_file(vectors_path, "rb") as f:
    try:
      vectors = np.load(f)
    except ValueError as err:
      raise Refusal(f"--corpus_vectors={vectors_path}: not an .npy array ({err}).") from None
  width = predictor.config.hidden_size
  if vectors.ndim != 2 or vectors.shape != (len(ids), width):
    raise Refusal(f"--corpus_vectors={vectors_path} holds {vectors.shape} where --corpus={corpus}"
                  f" needs ({len(ids)}, {width}): a vector per passage of this model; write it "
                  f"with --mode=embed --input={corpus} (or leave the flag out to encode now).")
  return ids, np.asarray(vectors, np.float32)


def search_file(predictor, input_path: str, output: str, *, corpus: str, top_k: int,
                pooling: str, columns: dict, max_seq_length: int = 0, vectors_path: str = "",
                fmt: str = "") -> int:
  """Writes each query's best `top_k` passages of `corpus` (the module docstring); returns the
  number of queries."""
  if not corpus:
    raise Refusal("--mode=search needs --corpus=FILE: the passages searched (an id column and "
                  "the passages' column).")
  if top_k < 1:
    raise Refusal(f"--top_k={top_k} must be >= 1.")
  both = sides(predictor, columns, max_seq_length)
  ids, corpus_NxD = corpus_vectors(predictor, corpus, both[PASSAGES], pooling, vectors_path,
                                   fmt)
  progress, n = prediction_files.Progress(predictor), 0
  files.makedirs(os.path.dirname(output) or ".")
  with prediction_files.part_file(output) as tmp:
    with files.open_file(tmp, "w") as out:
      for chunk in list_chunks(textfiles.iter_rows(input_path, fmt)):
        queries = np.concatenate(list(vectors_of(predictor, chunk, both[QUERIES], pooling)))
        found, scores = retrieval.search(queries, corpus_NxD, top_k)
        for row, at, score in zip(chunk, found, scores):
          record = {"id": str(row["id"]) if "id" in row else str(n),
                    "hits": [{"id": ids[int(j)], "score": round(float(s), 6)}
                             for j, s in zip(at, score)]}
          out.write(json.dumps(record, ensure_ascii=False) + "\n")
          n += 1
        progress.update(n)
    if n == 0:
      raise Refusal(f"{input_path}: no queries to search.")
  progress.update(n, final=True)
  return n


def list_chunks(rows: Iterable, size: int = 4096) -> Iterator[list]:
  """The rows, `size` at a time (a chunk is embedded in one call of predictor.embed)."""
  chunk = []
  for row in rows:
    chunk.append(row)
    if len(chunk) == size:
      yield chunk
      chunk = []
  if chunk:
    yield chunk
