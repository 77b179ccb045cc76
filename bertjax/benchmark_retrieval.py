"""The embeddings family measured: `python -m bertjax.benchmark retrieval`.

    python -m bertjax.benchmark retrieval --encoder=workdirs/tiny --seeds=0,1,2
    python -m bertjax.benchmark retrieval --part=steps

`--part=quality` builds a pairs task offline from the built-in corpus (the one `make pretrain`
trains on; Python's own documentation): a query is a sentence, its positive the sentence that
follows it in the same docstring. Training pairs come from the documents pre-training trained
on (every sentence and the next), dev queries from its held-out ones, as disjoint pairs (s0, s1),
(s2, s3), ... so that no dev query is also a passage (`corpus.is_heldout`, the fraction the built-in task NEXT uses), searched
against every held-out positive (the dev corpus; a passage text equal to a dev query's is left
out). Then, over the seeds, it fine-tunes the encoder with `python -m bertjax.finetune
--config=configs/finetune.py:embeddings`'s run and scores on dev:

  trained     the fine-tuned retriever's best epoch (MRR@10 picks it)
  untrained   the same encoder's vectors before fine-tuning, cosine, cls (the tanh pooler's
              output) and mean pooling; the better of the two is the fair baseline
  bm25        bertjax/finetune/bm25.py over words

and prints MRR@10, recall@10 and nDCG@10 of each, per seed and as ranges.

`--part=steps` times the contrastive train step on the devices there are (an 8-device CPU mesh:
XLA_FLAGS=--xla_force_host_platform_device_count=8), the same batch three ways: the whole global
batch's passages as every query's negatives (an all-gather of the vectors), each device's own
passages alone (negative_groups = the devices), and the global negatives with the batch encoded
in chunks (GradCache, train.num_microbatches).
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import sys
import tempfile
import time

import jax
import numpy as np
from absl import flags

from bertjax import benchmark, cli, contrastive_training, predict, sharding, train
from bertjax.configs import finetune as finetune_config
from bertjax.contrastive import ContrastiveConfig
from bertjax.data import corpus as corpus_lib
from bertjax.finetune import bm25, retrieval, run as run_lib
from bertjax.model_config import BertConfig

REPORTED = ("mrr_at_10", "recall_at_10", "ndcg_at_10")
EVAL_FRACTION = 0.1  # pre-training's held-out share (configs/base.py data.eval_fraction)
MIN_WORDS = 4  # shorter sentences ("Return None.") answer too many queries to mean anything


def _usable(sentence: str) -> bool:
  return len(sentence.split()) >= MIN_WORDS


def pairs_task(folder: str, *, train_pairs: int, dev_queries: int, seed: int = 0) -> dict:
  """Writes train.jsonl (query, positive), corpus.jsonl (id, text) and dev.jsonl (id, query,
  positive: the id of its passage) into `folder`; returns their paths and sizes."""
  rng = np.random.default_rng(seed)
  train_rows, dev_rows = [], []
  for doc in corpus_lib.builtin_documents():
    held_out = corpus_lib.is_heldout(doc, EVAL_FRACTION)
    for i in range(0, len(doc) - 1, 2 if held_out else 1):  # training: every neighbour
      query, positive = " ".join(doc[i].split()), " ".join(doc[i + 1].split())
      if _usable(query) and _usable(positive) and query != positive:
        (dev_rows if held_out else train_rows).append((query, positive))
  queries = {q for q, _ in dev_rows}
  texts = sorted({p for _, p in dev_rows if p not in queries})
  ids = {text: f"p{hashlib.sha1(text.encode()).hexdigest()[:10]}" for text in texts}
  # One row per query text (a sentence said in two places is one query with one answer here:
  # the first), so that every side scores the same queries the run does.
  first = {}
  for q, p in dev_rows:
    if p in ids:
      first.setdefault(q, p)
  judged = list(first.items())
  train_rows = [train_rows[k] for k in rng.permutation(len(train_rows))[:train_pairs]]
  judged = [judged[k] for k in rng.permutation(len(judged))[:dev_queries]]
  paths = {name: os.path.join(folder, f"{name}.jsonl") for name in ("train", "corpus", "dev")}
  rows = {"train": [{"query": q, "positive": p} for q, p in train_rows],
          "corpus": [{"id": ids[t], "text": t} for t in texts],
          "dev": [{"id": f"q{k}", "query": q, "positive": ids[p]}
                  for k, (q, p) in enumerate(judged)]}
  for name, path in paths.items():
    with open(path, "w", encoding="utf-8") as f:
      f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows[name])
  return {**paths, **{f"{name}_rows": len(r) for name, r in rows.items()}}


def _read(path: str) -> list[dict]:
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f]


def _relevant(task: dict) -> tuple[list[str], list[str], list[list[int]]]:
  corpus = _read(task["corpus"])
  index = {c["id"]: k for k, c in enumerate(corpus)}
  dev = _read(task["dev"])
  return ([d["query"] for d in dev], [c["text"] for c in corpus],
          [[index[d["positive"]]] for d in dev])


def _scores(ranked_NxK, relevant) -> dict:
  got = retrieval.report(ranked_NxK, relevant)
  return {k: round(float(got[k]), 4) for k in REPORTED}


def untrained(encoder: str, task: dict, query_length: int, passage_length: int) -> dict:
  """The encoder's own vectors, unit length, for each pooling: {pooling: scores}."""
  queries, passages, relevant = _relevant(task)
  predictor = predict.Predictor.from_workdir(encoder, embed=True)
  unit = lambda v: v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)
  out = {}
  for pooling in predict.POOLINGS:
    q = unit(np.concatenate(list(predictor.embed(queries, pooling, max_seq_length=query_length))))
    p = unit(np.concatenate(list(predictor.embed(passages, pooling,
                                                 max_seq_length=passage_length))))
    out[pooling] = _scores(retrieval.search(q, p, 100)[0], relevant)
  return out


def lexical(task: dict) -> dict:
  queries, passages, relevant = _relevant(task)
  return _scores(bm25.BM25(passages).search(queries, 100)[0], relevant)


def trained(encoder: str, task: dict, workdir: str, seed: int, args) -> dict:
  """One fine-tuning run of the embeddings family (the command's own) and its best dev scores."""
  config = finetune_config.get_config("embeddings")
  config.checkpoint.init_from = encoder
  d, t = config.data, config.train
  d.train_file, d.dev_file, d.corpus_file = task["train"], task["dev"], task["corpus"]
  d.max_query_length, d.max_seq_length = args.query_length, args.passage_length
  t.learning_rate, t.num_epochs, t.batch_size, t.seed = (args.learning_rate, args.epochs,
                                                         args.batch_size, seed)
  config.checkpoint.async_save = False
  start = time.perf_counter()
  results = run_lib.finetune(config, workdir)
  scores = results["best"]["scores"]
  return {**{k: round(float(scores[k]), 4) for k in REPORTED},
          "best_epoch": results["best"].get("epoch"),
          "seconds": round(time.perf_counter() - start, 1)}


def _range(values) -> str:
  return f"{min(values):.3f}-{max(values):.3f}" if len(values) > 1 else f"{values[0]:.3f}"


def quality(args, seeds) -> dict:
  root = args.workdir or tempfile.mkdtemp(prefix="retrieval-")
  os.makedirs(root, exist_ok=True)
  task = pairs_task(root, train_pairs=args.train_pairs, dev_queries=args.dev_queries)
  print(f"task: {task['train_rows']} training pairs, {task['dev_rows']} dev queries against "
        f"{task['corpus_rows']} passages ({root})", flush=True)
  figures = {"bm25": lexical(task)}
  print(f"bm25: {figures['bm25']}", flush=True)
  figures["untrained"] = untrained(args.encoder, task, args.query_length, args.passage_length)
  print(f"untrained: {figures['untrained']}", flush=True)
  figures["trained"] = {}
  for seed in seeds:
    figures["trained"][seed] = trained(args.encoder, task,
                                       os.path.join(root, f"run-s{seed}"), seed, args)
    print(f"trained seed {seed}: {figures['trained'][seed]}", flush=True)
  fair = max(figures["untrained"], key=lambda p: figures["untrained"][p]["mrr_at_10"])
  print(f"\n{len(seeds)} seeds ({','.join(map(str, seeds))}); {task['dev_rows']} dev "
        f"queries, {task['corpus_rows']} passages")
  print(f"{'':28}" + "".join(f"{k:>16}" for k in REPORTED))
  rows = [("trained (range over seeds)", [[s[k] for s in figures["trained"].values()]
                                          for k in REPORTED])]
  rows += [(f"untrained, {p} pooling" + (" (fair)" if p == fair else ""),
            [[figures["untrained"][p][k]] for k in REPORTED]) for p in predict.POOLINGS]
  rows.append(("bm25", [[figures["bm25"][k]] for k in REPORTED]))
  for name, values in rows:
    print(f"{name:28}" + "".join(f"{_range(v):>16}" for v in values))
  return figures


def step_times(args) -> dict:
  """Median step seconds of the three ways of the module docstring, on a tiny encoder."""
  devices = jax.devices()
  n = len(devices)
  model = BertConfig(vocab_size=8000, hidden_size=128, num_layers=2, num_heads=2,
                     intermediate_size=512, max_position_embeddings=128)
  rng = np.random.default_rng(0)
  b, lq, lp = args.step_batch, args.query_length, args.passage_length
  host = {"query_ids": rng.integers(5, 8000, (b, lq), dtype=np.int32),
          "query_mask": np.ones((b, lq), np.int32),
          "passage_ids": rng.integers(5, 8000, (b, 2, lp), dtype=np.int32),
          "passage_mask": np.ones((b, 2, lp), np.int32),
          contrastive_training.KEY: np.arange(1, 2 * b + 1, dtype=np.int32).reshape(b, 2),
          "weight": np.ones((b,), np.float32)}
  ways = {"global negatives (all-gather)": (1, 1),
          f"per-device negatives ({n} groups)": (n, 1),
          f"global, GradCache ({args.chunks} chunks)": (1, args.chunks)}
  out = {}
  for name, (groups, chunks) in ways.items():
    cfg = train.TrainConfig(batch_size=b, num_train_steps=100, learning_rate=1e-4,
                            warmup_steps=1, num_microbatches=chunks)
    t = train.build(model, cfg, sharding.MeshConfig(), devices=devices,
                    objective=contrastive_training.objective(
                        ContrastiveConfig(negative_groups=groups)))
    batch = t.to_global(host)
    _, dropout = train.rng_streams(0)
    state = t.init_state(jax.random.PRNGKey(0))

    def step():
      nonlocal state
      state, metrics = t.train_step(state, batch, dropout)
      jax.block_until_ready(metrics)

    benchmark.time_steps(step, 2)  # compile and warm up
    times = benchmark.time_steps(step, args.steps)
    out[name] = {"step_s": round(statistics.median(times), 4), "min_s": round(min(times), 4)}
    print(f"{name:40} median {out[name]['step_s']:.4f} s, min {out[name]['min_s']:.4f} s "
          f"({b} queries x 2 passages, {lq}/{lp} tokens, {n} devices)", flush=True)
  return out


FLAGS = flags.FLAGS


def define_flags() -> None:
  flags.DEFINE_enum("part", "all", ["all", "quality", "steps"], "What to measure.")
  flags.DEFINE_string("encoder", "workdirs/tiny", "The pre-trained encoder (`make pretrain`'s "
                      "workdir, or any weights folder).")
  flags.DEFINE_list("seeds", ["0", "1", "2"], "Fine-tuning seeds.")
  flags.DEFINE_string("workdir", "", "Where the task's files and the runs go ('' = a new "
                      "temporary folder).")
  flags.DEFINE_integer("train_pairs", 16000, "Training pairs kept (drawn at random).")
  flags.DEFINE_integer("dev_queries", 500, "Dev queries kept (the corpus is every held-out "
                       "positive).")
  flags.DEFINE_float("learning_rate", 3e-4, "Fine-tuning's rate.")
  flags.DEFINE_float("epochs", 1.0, "Fine-tuning's epochs.")
  flags.DEFINE_integer("batch_size", 64, "Fine-tuning's global batch (queries).")
  flags.DEFINE_integer("query_length", 32, "Tokens of a query.")
  flags.DEFINE_integer("passage_length", 64, "Tokens of a passage.")
  flags.DEFINE_integer("step_batch", 64, "steps: the global batch (queries).")
  flags.DEFINE_integer("chunks", 4, "steps: GradCache's chunks.")
  flags.DEFINE_integer("steps", 10, "steps: timed steps per way.")
  flags.DEFINE_string("json", "", "Also write the figures to this file.")


def main(argv) -> None:
  del argv
  figures = {}
  if FLAGS.part in ("all", "quality"):
    figures["quality"] = quality(FLAGS, [int(s) for s in FLAGS.seeds])
  if FLAGS.part in ("all", "steps"):
    figures["steps"] = step_times(FLAGS)
  if FLAGS.json:
    with open(FLAGS.json, "w", encoding="utf-8") as f:
      json.dump(figures, f, indent=1)


if __name__ == "__main__":
  define_flags()
  cli.old_name("bertjax.benchmark retrieval")
  cli.run(main)
