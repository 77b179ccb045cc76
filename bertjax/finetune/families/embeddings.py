"""Embeddings: sentence vectors for search, trained contrastively from one's own (query, passage)
pairs, as a retriever (bertjax/model/contrastive.py, bertjax/training/contrastive.py).

  model      one encoder for queries and passages (a bi-encoder), mean or [CLS] pooling, unit
             vectors or not (config.contrastive); nothing beside the encoder is predicted from
  loss       InfoNCE over every passage of the global batch, the rows' hard negatives included
             (symmetric optional), or the sigmoid loss; a copy of a query's positive elsewhere in
             the batch is no negative of it (each distinct passage text has a key)
  metric     mrr_at_10 (the default main metric), recall_at_1, recall_at_10, recall_at_100,
             ndcg_at_10: the dev queries searched against the dev corpus (finetune/retrieval.py)
  predicted  {"vector": [...]} of a text (as a query); bertjax.predict's embed (.npy of query or
             passage vectors) and search (each query's best passages) modes
  export     the encoder alone (BertModel, ModernBertModel) and sentence-transformers' files

Files (bertjax/inputs/passages.py): training rows of data.query, data.positive and optional
data.negatives columns; dev (and an optional test) file of the same pairs, whose passages are
then the corpus searched, or, with data.corpus_file (data.passage and id columns), of queries and
the ids of their relevant passages in it. Queries are cut to data.max_query_length tokens,
passages to data.max_seq_length.

Evaluation encodes the dev queries and the corpus on the mesh (run.predict: batches of
train.eval_batch_size texts), gathers the vectors to the host and searches exactly
(retrieval.search): memory on the host is the corpus's vectors, M x hidden x 4 bytes (1M passages
of BERT-Base: 2.9 GiB), plus one block of scores (64 MiB).
"""

from __future__ import annotations

import os
from typing import Mapping

import numpy as np

from bertjax.errors import Refusal
from bertjax.finetune.families.record import Family
from bertjax.finetune.kit import custom, metrics as ft_metrics, retrieval
from bertjax.finetune.kit.config import TaskConfig
from bertjax.finetune.kit.taskdata import EvalSet, TaskData
from bertjax.formats import taskspec as spec_lib
from bertjax.formats.sentence_transformers import SentenceVectors
from bertjax.inputs import pairs as pairs_lib, passages, textfiles
from bertjax.model.contrastive import ContrastiveConfig
from bertjax.training import contrastive as contrastive_training, train

NAME = "embeddings"
DEPTH = 100  # ranks searched: recall_at_100's
WRITTEN = 10  # hits written per query (predictions/test.jsonl), MRR@10's and nDCG@10's depth


def settings_of(spec: spec_lib.TaskSpec) -> ContrastiveConfig:
  """How the spec's vectors are made (the loss does not matter to a prediction)."""
  return ContrastiveConfig(pooling=spec.pooling or "mean", normalize=spec.normalize)


def num_outputs(spec: spec_lib.TaskSpec) -> int:
  del spec
  return 0  # no head: the vectors are the encoder's width


def objective(spec: spec_lib.TaskSpec) -> train.Objective:
  return contrastive_training.objective(settings_of(spec))


def sentence(spec: spec_lib.TaskSpec) -> SentenceVectors:
  """sentence-transformers' description of the vectors: one length for every text, the
  passages' (a query longer than max_query_length is cut there by bertjax, not by it)."""
  return SentenceVectors(spec.pooling or "mean", spec.normalize, spec.max_seq_length)


def columns(spec: spec_lib.TaskSpec, row: Mapping) -> list[str]:
  del row
  return [spec.text_a]


def as_row(x, spec: spec_lib.TaskSpec) -> dict:
  raise Refusal(f"An {NAME} model embeds texts: give strings, or rows with the column "
                f"{spec.text_a!r}, not {type(x).__name__}.")


def encode(texts, tokenizer, length: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
  """One text a row, `[CLS] text [SEP]`: (features [N, length], which texts were cut)."""
  return pairs_lib.encode_pairs(list(texts), None, tokenizer, length)


def records(rows, spec: spec_lib.TaskSpec, tokenizer, run) -> list[dict]:
  """{"vector": [...]} of each row's text_a, as a query (its length: max_query_length)."""
  features, cut_N = encode([textfiles.text_of(r, spec.text_a) for r in rows], tokenizer,
                           spec.max_query_length)
  vectors = run(features)["vector"]
  return custom.pair_records([{"vector": [round(float(x), 6) for x in v]} for v in vectors],
                             cut_N)


# Features ---------------------------------------------------------------------------------------

def _cut_note(cut_N: np.ndarray, what: str, path: str, key: str, length: int) -> list[str]:
  if not cut_N.any():
    return []
  return [f"{int(cut_N.sum())} of {len(cut_N)} {what} of {path} are longer than data.{key}="
          f"{length} tokens and were cut to fit; raise data.{key} to keep more"]


def training_features(rows: passages.Pairs, spec: spec_lib.TaskSpec, tokenizer, path: str,
                      notes: list[str]) -> dict[str, np.ndarray]:
  """query_ids, query_mask [N, Lq]; passage_ids, passage_mask [N, C, Lp] (C: 1 + the most hard
  negatives a row has; a row with fewer has empty slots); passage_key [N, C] (1 + the index of
  the distinct passage text, 0 for an empty slot). Each distinct text is encoded once."""
  index: dict[str, int] = {}
  for row in rows.passages:
    for text in row:
      index.setdefault(text, len(index))
  queries, cut_q = encode(rows.queries, tokenizer, spec.max_query_length)
  unique, cut_p = encode(list(index), tokenizer, spec.max_seq_length)
  n, c = len(rows.queries), max(len(row) for row in rows.passages)
  at_NxC = np.full((n, c), -1, np.int64)
  for i, row in enumerate(rows.passages):
    at_NxC[i, :len(row)] = [index[t] for t in row]
  present_NxC = at_NxC >= 0
  take = lambda x: x[np.maximum(at_NxC, 0)] * present_NxC[..., None]
  notes += _cut_note(cut_q, "queries", path, "max_query_length", spec.max_query_length)
  notes += _cut_note(cut_p, "distinct passages", path, "max_seq_length", spec.max_seq_length)
  positives = [row[0] for row in rows.passages]
  shared = len(positives) - len(set(positives))
  if shared:
    notes.append(f"{shared} row(s) of {path} share their positive passage with an earlier row: "
                 "each such passage is no negative of the other rows it answers")
  return {"query_ids": queries["input_ids"], "query_mask": queries["input_mask"],
          "passage_ids": take(unique["input_ids"]), "passage_mask": take(unique["input_mask"]),
          contrastive_training.KEY: np.where(present_NxC, at_NxC + 1, 0).astype(np.int32)}


def search_features(judged: passages.Judged, spec: spec_lib.TaskSpec, tokenizer, path: str,
                    corpus_path: str, notes: list[str]) -> list[dict[str, np.ndarray]]:
  """[the queries' features (of `path`), the corpus's (of `corpus_path`: the corpus file, or
  `path` itself for dev pairs)]: two inputs of their own lengths, which evaluation encodes one
  after the other (run.predict). A corpus's note is made once (dev and test share the file)."""
  queries, cut_q = encode(judged.queries, tokenizer, spec.max_query_length)
  corpus, cut_p = encode(judged.corpus, tokenizer, spec.max_seq_length)
  notes += _cut_note(cut_q, "queries", path, "max_query_length", spec.max_query_length)
  notes += [n for n in _cut_note(cut_p, "passages", corpus_path, "max_seq_length",
                                 spec.max_seq_length) if n not in notes]
  return [queries, corpus]


def ranked(outputs) -> tuple[np.ndarray, np.ndarray]:
  """(ids [N, k], scores [N, k]) of each query's best passages: the two inputs' vectors."""
  return retrieval.search(outputs[0]["vector"], outputs[1]["vector"], DEPTH)


def scorer(judged: passages.Judged, main: str):
  def score(outputs) -> dict:
    out = retrieval.report(ranked(outputs)[0], judged.relevant)
    return {**out, "main": ft_metrics.main_value(NAME, FAMILY.main_metrics, (), out, main)}
  return score


def hits(judged: passages.Judged, ids_NxK: np.ndarray, scores_NxK: np.ndarray,
         k: int = WRITTEN) -> list[dict]:
  """One record per query: its id and its best k passages' ids and scores, best first."""
  return [{"id": query_id, "hits": [{"id": judged.corpus_ids[int(j)], "score": round(float(s), 6)}
                                    for j, s in zip(ids[:k], scores[:k])]}
          for query_id, ids, scores in zip(judged.query_ids, ids_NxK, scores_NxK)]


def writer(judged: passages.Judged, split: str):
  def write(outputs, output_dir):
    return [custom.write_jsonl(os.path.join(output_dir, f"{split}.jsonl"),
                               hits(judged, *ranked(outputs)))]
  return write


# One's own task ---------------------------------------------------------------------------------

def spec_of(cfg: TaskConfig) -> spec_lib.TaskSpec:
  d = cfg.data
  return spec_lib.TaskSpec(
      task=NAME, family=NAME, max_seq_length=d.max_seq_length, text_a=d.query, text_b=d.passage,
      max_query_length=d.max_query_length, pooling=cfg.contrastive.pooling,
      normalize=cfg.contrastive.normalize)


def column_names(d) -> passages.Columns:
  negatives = tuple(c.strip() for c in d.negatives.split(",") if c.strip())
  return passages.Columns(d.query, d.positive, negatives, d.passage)


def load(cfg: TaskConfig, tokenizer) -> TaskData:
  """Embeddings from one's own files (the module docstring)."""
  d = cfg.data
  train_path, dev_path, test_path = custom.paths(d, NAME)
  main = ft_metrics.main_metric(cfg.eval.main_metric, NAME, FAMILY.main_metrics)
  if d.max_query_length < 3:
    raise Refusal(f"data.max_query_length={d.max_query_length}: a query needs at least 3 tokens "
                  "([CLS], one piece, [SEP]); 32 or 64 are the usual.")
  if cfg.class_weights:
    raise Refusal(f"train.class_weights applies to classification, not {NAME}.")
  spec = spec_of(cfg)
  names = column_names(d)
  notes: list[str] = []
  train_rows = passages.read_pairs(train_path, names, d.format)
  train_features = training_features(train_rows, spec, tokenizer, train_path, notes)
  corpus = passages.read_corpus(d.corpus_file, names, d.format) if d.corpus_file else None

  def judged(path: str, need_relevant: bool) -> passages.Judged:
    if corpus is None:
      return passages.judged_pairs(path, names, d.format)
    return passages.read_judged(path, names, *corpus, d.corpus_file, d.format, need_relevant)

  dev = judged(dev_path, True)
  size = f"{len(dev.queries)} queries against {len(dev.corpus)} passages"
  evals = [EvalSet("dev", search_features(dev, spec, tokenizer, dev_path,
                                          d.corpus_file or dev_path, notes),
                   scorer(dev, main), report=scorer(dev, main), size=size)]
  predicts = []
  if test_path:
    test = judged(test_path, False)
    scored = scorer(test, main) if test.scored else None
    predicts.append(EvalSet("test", search_features(test, spec, tokenizer, test_path,
                                                    d.corpus_file or test_path, notes),
                            scored, writer(test, "test"), report=scored))
  notes.append(f"dev: {size} ("
               + (f"of {d.corpus_file})" if corpus else f"the passages of {dev_path})"))
  distinct = set(zip(train_rows.queries, (row[0] for row in train_rows.passages)))
  return TaskData(NAME, contrastive_training.objective(cfg.contrastive), train_features, evals,
                  predicts, main, notes, spec=spec,
                  distinct=(len(distinct), f"distinct (query, positive) pairs of {train_path}"))


FAMILY = Family(
    NAME, head="", hf_class="BertModel", hf_head="", modernbert_class="ModernBertModel",
    min_labels=0, main_metrics=retrieval.MAIN_METRICS, lower_is_better=(),
    batch_keys=contrastive_training.BATCH_KEYS[:-1],
    packed=False, num_outputs=num_outputs, objective=objective, columns=columns, as_row=as_row,
    records=records, load=load, sentence=sentence)
