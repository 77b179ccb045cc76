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
          are read from --corpus_vectors (what embed wrote for the same corpus: its record must
          name this search's encoder and the corpus's texts, or it is refused; an .npy without a
          record is used unchecked, and said so) or encoded first. An empty passage is counted
          in a line. Memory: the corpus's vectors (M x hidden x 4 bytes) and one block of scores
          (bertjax/finetune/kit/retrieval.py); queries stream through a chunk at a time.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Iterable, Iterator, Sequence

import jax
import numpy as np

from bertjax import files
from bertjax.errors import Refusal
from bertjax.finetune.kit import retrieval
from bertjax.formats import taskspec
from bertjax.inputs import textfiles
from bertjax.model.config import ARCHITECTURE_FIELDS, SHAPE_FIELDS
from bertjax.predict import outputs as prediction_files

QUERIES, PASSAGES = "queries", "passages"
PLAIN_LENGTH = 128  # tokens kept by a model whose folder records no length it was trained at
# What a search compares of the corpus vectors' encoder with its own (the model's path is said,
# not compared: the same weights may be read from another folder).
COMPARED = ("weights", "pooling", "normalize", "max_seq_length", "pair")


@dataclasses.dataclass(frozen=True)
class Side:
  """One kind of text: its name, the input's column and the tokens kept."""

  name: str
  column: str
  length: int


def sides(predictor, columns: dict, max_seq_length: int = 0) -> dict[str, Side]:
  """The queries' and the passages' columns and lengths: an embeddings model's own (task.json),
  the --text_a / --text_b / --max_seq_length flags where given; for another model "text" alike,
  cut where it was trained (trained_length). No longer than the model's positions."""
  spec = predictor.spec if predictor.vectors else None
  cap = lambda n: min(n, predictor.config.max_position_embeddings)
  if spec is None:
    length = cap(max_seq_length or (predictor.trained_length or (PLAIN_LENGTH, ""))[0])
    column = columns.get("text_a") or "text"
    return {QUERIES: Side(QUERIES, column, length),
            PASSAGES: Side(PASSAGES, columns.get("text_b") or column, length)}
  return {QUERIES: Side(QUERIES, columns.get("text_a") or spec.text_a,
                        cap(max_seq_length or spec.max_query_length)),
          PASSAGES: Side(PASSAGES, columns.get("text_b") or spec.text_b,
                         cap(max_seq_length or spec.max_seq_length))}


def trained_length(source, spec) -> tuple[int, str] | None:
  """(tokens, where that is recorded) of the length a folder's model was trained at: a
  fine-tuning run's task.json, a pre-training run's config.json; None where its folder says none
  (a converted, Google or Hugging Face folder)."""
  if source.kind != "workdir":
    return None
  if spec is not None:
    return spec.max_seq_length, f"its {taskspec.FILE}'s max_seq_length"
  path = os.path.join(source.path, "config.json")
  if not files.exists(path):
    return None
  length = (files.read_json(path, "the run's config").get("data") or {}).get("max_seq_length")
  return (length, "its config.json's data.max_seq_length") if isinstance(length, int) else None


def vectors_line(predictor, columns: dict, max_seq_length: int, pooling: str) -> str:
  """How the vectors are made, for the console: the pooling, the normalisation, the tokens kept
  and where that length comes from."""
  if predictor.vectors:
    spec = predictor.spec
    return (f"{spec.pooling or 'mean'} pooling{', unit vectors' if spec.normalize else ''} as "
            f"trained ({taskspec.FILE}), texts cut at "
            f"{limits(predictor, columns, max_seq_length).removeprefix('max_seq_length=')}")
  length = sides(predictor, columns, max_seq_length)[QUERIES].length
  said = {"cls": "cls pooling (the pooled [CLS])", "mean": "mean pooling (the last layer's mean "
          "over real tokens)"}[pooling or "cls"]
  trained = predictor.trained_length
  if max_seq_length:
    why = "--max_seq_length"
  elif trained:
    why = f"the length it was trained at: {trained[1]}"
  else:
    why = "its folder records no length it was trained at; --max_seq_length sets one"
  return f"{said}, texts cut at {length} tokens ({why})"


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


def embed_file(predictor, input_path: str, output: str, *, columns: dict, max_seq_length: int,
               pooling: str, fmt: str, check) -> tuple[int, list[str]]:
  """Writes embed's .npy (or two, embed_plan) and their records; `check(path)` refuses a second
  path it may not write. Returns (rows, the files written)."""
  plan = embed_plan(predictor, input_path, output, columns, max_seq_length, fmt)
  for path in (p for _, p in plan if p != output):  # two files: OUT.queries.npy, ...
    check(path)
  text_b = "" if predictor.vectors else columns.get("text_b") or ""
  for side, path in plan:
    n = write_vectors(predictor, input_path, path, side, pooling, text_b, fmt)
  return n, [path for _, path in plan]


def vectors_of(predictor, rows: Iterable, side: Side, pooling: str,
               text_b: str = "") -> Iterator[np.ndarray]:
  """[n, hidden] float32 vectors of the rows' `side` texts, a chunk at a time."""
  return predictor.embed(rows, pooling, side.column, text_b, side.length)


# What made a file of vectors: the encoder and the texts ----------------------------------------

def fingerprint(params, config, vocabulary: str | None) -> str:
  """sha256 of what an encoder's vectors depend on beside its pooling and lengths: the
  parameters' bytes in the tree's order (each leaf's path, dtype and shape with them), the
  architecture and the vocabulary's fingerprint. One pass over the weights (BERT-Base: 0.4 GB)."""
  h = hashlib.sha256(json.dumps(
      {f: getattr(config, f) for f in (*SHAPE_FIELDS, *ARCHITECTURE_FIELDS)}, sort_keys=True,
      default=str).encode() + str(vocabulary).encode())
  for path, leaf in jax.tree_util.tree_leaves_with_path(jax.device_get(params)):
    a = np.ascontiguousarray(leaf)
    h.update(f"{jax.tree_util.keystr(path)} {a.dtype} {a.shape}".encode())
    h.update(a.reshape(-1).view(np.uint8))
  return h.hexdigest()


def encoder(predictor, side: Side, pooling: str, text_b: str = "") -> dict:
  """What a vector of `side` is made with (COMPARED, and the model's path to say)."""
  if predictor.vectors:
    kind, normalize = predictor.spec.pooling or "mean", bool(predictor.spec.normalize)
  else:
    kind, normalize = pooling or "cls", False
  return {"weights": predictor.fingerprint, "model": predictor.source, "pooling": kind,
          "normalize": normalize, "max_seq_length": side.length, "pair": text_b}


def _describe(made: dict) -> str:
  return (f"the encoder {str(made.get('weights'))[:12]} ({made.get('model')}; "
          f"{made.get('pooling')} pooling, {'unit' if made.get('normalize') else 'unnormalised'} "
          f"vectors, {made.get('max_seq_length')} tokens"
          + (f", pairs with {made['pair']!r}" if made.get("pair") else "") + ")")


class Texts:
  """The texts of a file as they are embedded: how many, the sha256 of them in order (each
  text's length, then its bytes), and the empty ones."""

  def __init__(self):
    self.hash, self.count, self.empty, self.first_empty = hashlib.sha256(), 0, 0, ""

  def add(self, row: textfiles.Row, columns: Sequence[str]) -> None:
    texts = [textfiles.text_of(row, c) for c in columns]
    for text in texts:
      data = text.encode("utf-8")
      self.hash.update(len(data).to_bytes(8, "little") + data)
    if not texts[0].strip():
      self.empty += 1
      self.first_empty = self.first_empty or row.where
    self.count += 1

  def record(self) -> dict:
    return {"rows": self.count, "texts_sha256": self.hash.hexdigest()}

  def empty_line(self, what: str, then: str) -> str | None:
    if not self.empty:
      return None
    return (f"{self.empty:,} of the {self.count:,} {what} are empty (the first at "
            f"{self.first_empty}): {then}")


def read_texts(path: str, columns: Sequence[str], fmt: str = "") -> Texts:
  texts = Texts()
  for row in textfiles.iter_rows(path, fmt):
    if not texts.count:
      textfiles.require(row, columns, "--")
    texts.add(row, columns)
  return texts


def check_vectors(vectors_path: str, made_now: dict, corpus: str, texts: Texts) -> None:
  """Refuses corpus vectors whose record names another encoder than `made_now` or other texts
  than the corpus's; says that an .npy without a record (or not the file its record describes)
  is used unchecked."""
  record = prediction_files.read_record(vectors_path)
  unchecked = None
  if record is None or record.get("mode") != "embed":
    unchecked = (f"has no record of the encoder and texts that made it (its "
                 f"{prediction_files.RECORD} beside it, which --mode=embed writes)")
  elif record.get("sha256") != prediction_files.digest(vectors_path):
    unchecked = "is not the file its record describes (its bytes changed since embed wrote it)"
  if unchecked:
    print(f"search: --corpus_vectors={vectors_path} {unchecked}: used as it is, unchecked",
          flush=True)
    return
  made = record.get("encoder") or {}
  if any(made.get(k) != made_now[k] for k in COMPARED):
    raise Refusal(f"--corpus_vectors={vectors_path} holds vectors of {_describe(made)}; this "
                  f"search encodes with {_describe(made_now)}: their scores do not compare. "
                  f"Write them with this model (--mode=embed --input={corpus}), or leave "
                  "--corpus_vectors out to encode the corpus now.")
  given = record.get("input") or {}
  if (given.get("rows"), given.get("texts_sha256")) != (texts.count, texts.hash.hexdigest()):
    raise Refusal(f"--corpus_vectors={vectors_path} holds the vectors of "
                  f"{given.get('rows')} texts of {given.get('path')} (sha256 "
                  f"{str(given.get('texts_sha256'))[:12]}), not of the {texts.count} passages of "
                  f"--corpus={corpus} (sha256 {texts.hash.hexdigest()[:12]}): a vector would "
                  f"score another passage. Write them with --mode=embed --input={corpus}, or "
                  "leave --corpus_vectors out to encode the corpus now.")


def write_vectors(predictor, input_path: str, output: str, side: Side, pooling: str,
                  text_b: str = "", fmt: str = "") -> int:
  """Writes an [N, hidden] float32 .npy, filled a chunk at a time (N counted first), and its
  record."""
  texts = read_texts(input_path, [side.column] + ([text_b] if text_b else []), fmt)
  n = texts.count
  if n == 0:
    raise Refusal(f"{input_path}: no rows to embed.")
  if line := texts.empty_line(f"texts of {input_path}", "each is embedded as an empty text"):
    print(f"embed: {line}", flush=True)
  made = {"mode": "embed", "kind": side.name, "encoder": encoder(predictor, side, pooling, text_b),
          "input": {"path": input_path, "column": side.column, **texts.record()},
          "shape": [n, predictor.config.hidden_size]}
  progress, at = prediction_files.Progress(predictor), 0
  files.makedirs(os.path.dirname(output) or ".")
  with prediction_files.part_file(output, made) as tmp:
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
                   fmt: str = "") -> tuple[list[str], np.ndarray, Texts]:
  """(ids, vectors [M, hidden], texts) of a corpus file: the vectors read from `vectors_path`
  (an .npy embed wrote, one row per passage, checked against its record) or encoded now."""
  ids, seen, texts = [], {}, Texts()
  for k, row in enumerate(textfiles.iter_rows(corpus, fmt)):
    textfiles.require(row, [side.column], "--", "text_b (the passages; their ids: an 'id' "
                      "column, else the row numbers)")
    passage_id = str(row["id"]).strip() if "id" in row else str(k)
    if passage_id in seen:
      raise Refusal(f"{row.where}: the passage id {passage_id!r} is given twice (first at "
                    f"{seen[passage_id]}); give each passage an id of its own.")
    seen[passage_id] = row.where
    ids.append(passage_id)
    texts.add(row, [side.column])
  if not ids:
    raise Refusal(f"--corpus={corpus}: no passages.")
  if line := texts.empty_line(f"passages of --corpus={corpus}", "each is ranked as an empty "
                              "text; leave those rows out to rank none"):
    print(f"search: {line}", flush=True)
  if not vectors_path:
    vectors = np.concatenate(list(vectors_of(predictor, textfiles.iter_rows(corpus, fmt), side,
                                             pooling)))
    return ids, vectors, texts
  check_vectors(vectors_path, encoder(predictor, side, pooling), corpus, texts)
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
  return ids, np.asarray(vectors, np.float32), texts


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
  ids, corpus_NxD, texts = corpus_vectors(predictor, corpus, both[PASSAGES], pooling,
                                          vectors_path, fmt)
  made = {"mode": "search", "encoder": encoder(predictor, both[QUERIES], pooling),
          "input": {"path": input_path}, "corpus": {"path": corpus, **texts.record()},
          "corpus_vectors": vectors_path, "top_k": top_k}

  def records() -> Iterator[dict]:
    n = 0
    for chunk in list_chunks(textfiles.iter_rows(input_path, fmt)):
      queries = np.concatenate(list(vectors_of(predictor, chunk, both[QUERIES], pooling)))
      found, scores = retrieval.search(queries, corpus_NxD, top_k)
      for row, at, score in zip(chunk, found, scores):
        yield {"id": str(row["id"]) if "id" in row else str(n),
               "hits": [{"id": ids[int(j)], "score": round(float(s), 6)}
                        for j, s in zip(at, score)]}
        n += 1

  return prediction_files.write_lines(output, made, records(),
                                      prediction_files.Progress(predictor),
                                      f"{input_path}: no queries to search.")


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
