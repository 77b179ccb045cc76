"""The embeddings family measured: `python -m bertjax.benchmark retrieval`.

    python -m bertjax.benchmark retrieval --part=quality --encoder=workdirs/tiny --seeds=0,1,2
    python -m bertjax.benchmark retrieval --part=steps
    python -m bertjax.benchmark retrieval --part=aot --passage_length=128   (libtpu: '.[tpu]')

`--part=quality` builds pairs tasks offline from the built-in corpus (the one `make pretrain`
trains on; Python's own documentation), each with training pairs from the modules pre-training
trained on and dev queries from its held-out ones (`corpus.is_heldout`, the fraction the built-in
task NEXT uses), searched against every held-out positive (the dev corpus; a passage text equal
to a dev query's is left out). `--tasks` (both by default):

  next      a query is a sentence, its positive the sentence that follows it in its module's
            docstrings; training takes every sentence and the next, dev disjoint pairs (s0, s1),
            (s2, s3), ... so that no dev query is also a passage. What a pair shares is mostly
            its rare words, which a 128-wide tiny encoder blurs: fine-tuning gains little here
  summary   a docstring's first (summary) sentence, its positive the rest of that docstring (the
            title -> body pairs of E5-style training); what a bi-encoder learns from pairs

Then, over the seeds, it fine-tunes the encoder with `python -m bertjax.finetune
--config=configs/finetune.py:embeddings`'s run and scores on dev:

  trained     the fine-tuned retriever's best epoch (MRR@10 picks it)
  untrained   the same encoder's vectors before fine-tuning, cosine, cls (the tanh pooler's
              output) and mean pooling; the better of the two is the fair baseline
  bm25        bertjax/finetune/tasks/bm25.py over words

and prints MRR@10, recall@10 and nDCG@10 of each, per seed and as ranges, and the trained
retriever's MRR@10 over the fair baseline's. Figures:
docs/your-own-task.md#embeddings-a-retriever-from-query-passage-pairs.

`--part=steps` times the contrastive train step on the devices there are (an 8-device CPU mesh:
XLA_FLAGS=--xla_force_host_platform_device_count=8), the same batch three ways: the whole global
batch's passages as every query's negatives (an all-gather of the vectors), each device's own
passages alone (negative_groups = the devices), and the global negatives with the batch encoded
in chunks (GradCache, train.num_microbatches).

`--part=aot` finds the largest global batch whose contrastive step (BERT-Base, each query with
its positive, every passage of the batch a negative, no GradCache) fits the chips of
--aot_topology (v5p-8: 4 chips of 95 GiB): compiled by libtpu's compile-only client on this
machine (as `python -m bertjax.aot`), queries per chip doubled from --aot_start until XLA's
buffer assignment (or its refusal) exceeds HBM, then the gap halved --aot_bisections times.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import tempfile
import time

import jax
import numpy as np
from absl import flags

from bertjax import aot, cli
from bertjax.benchmark import train as benchmark
from bertjax.configs import bert_base, finetune as finetune_config
from bertjax.data import corpus as corpus_lib
from bertjax.data.corpora import builtin_corpus
from bertjax.errors import Refusal
from bertjax.finetune.job import run as run_lib
from bertjax.finetune.kit import retrieval
from bertjax.finetune.tasks import bm25
from bertjax.model.config import BertConfig
from bertjax.model.contrastive import ContrastiveConfig
from bertjax.parallel import sharding, topologies
from bertjax.predict import predictor as predict
from bertjax.training import contrastive as contrastive_training, train

REPORTED = ("mrr_at_10", "recall_at_10", "ndcg_at_10")
EVAL_FRACTION = 0.1  # pre-training's held-out share (configs/base.py data.eval_fraction)
MIN_WORDS = 4  # shorter sentences ("Return None.") answer too many queries to mean anything
# The pairs tasks made from the built-in corpus (the module docstring).
TASKS = {"next": "a sentence -> the next sentence of its module's docstrings",
         "summary": "a docstring's first (summary) sentence -> the rest of that docstring"}


def _usable(sentence: str) -> bool:
  return len(sentence.split()) >= MIN_WORDS


def _next_sentences(doc: list[str], held_out: bool):
  for i in range(0, len(doc) - 1, 2 if held_out else 1):  # training: every neighbour
    yield doc[i], doc[i + 1]


def _summaries(docstrings: list[list[str]]):
  for sentences in docstrings:
    if len(sentences) > 1:
      yield sentences[0], " ".join(sentences[1:])


def _candidate_pairs(task: str):
  """(held out, query, positive) of a task of TASKS, unfiltered."""
  if task == "next":
    for doc in corpus_lib.builtin_documents():
      held_out = corpus_lib.is_heldout(doc, EVAL_FRACTION)
      for query, positive in _next_sentences(doc, held_out):
        yield held_out, query, positive
  else:
    for docstrings in builtin_corpus.builtin_modules():  # each the document of a module
      doc = [s for d in docstrings for s in d]
      held_out = corpus_lib.is_heldout(doc, EVAL_FRACTION)
      for query, positive in _summaries([list(d) for d in docstrings]):
        yield held_out, query, positive


def pairs_task(folder: str, *, train_pairs: int, dev_queries: int, seed: int = 0,
               task: str = "next") -> dict:
  """Writes train.jsonl (query, positive), corpus.jsonl (id, text) and dev.jsonl (id, query,
  positive: the id of its passage) of `task` (TASKS) into `folder`; returns their paths and
  sizes."""
  rng = np.random.default_rng(seed)
  train_rows, dev_rows = [], []
  for held_out, query, positive in _candidate_pairs(task):
    query, positive = " ".join(query.split()), " ".join(positive.split())
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
  """Each task of --tasks: its figures ({bm25, untrained, trained}) and their table."""
  root = args.workdir or tempfile.mkdtemp(prefix="retrieval-")
  out = {}
  for name in args.tasks:
    if name not in TASKS:
      raise Refusal(f"--tasks: {name!r} is none of {sorted(TASKS)}")
    out[name] = task_quality(args, seeds, name, os.path.join(root, name))
  return out


def task_quality(args, seeds, name: str, root: str) -> dict:
  os.makedirs(root, exist_ok=True)
  task = pairs_task(root, train_pairs=args.train_pairs, dev_queries=args.dev_queries, task=name)
  print(f"task {name} ({TASKS[name]}): {task['train_rows']} training pairs, {task['dev_rows']} "
        f"dev queries against {task['corpus_rows']} passages ({root})", flush=True)
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
  print(f"\ntask {name}: {len(seeds)} seeds ({','.join(map(str, seeds))}); {task['dev_rows']} "
        f"dev queries, {task['corpus_rows']} passages")
  print(f"{'':28}" + "".join(f"{k:>16}" for k in REPORTED))
  rows = [("trained (range over seeds)", [[s[k] for s in figures["trained"].values()]
                                          for k in REPORTED])]
  rows += [(f"untrained, {p} pooling" + (" (fair)" if p == fair else ""),
            [[figures["untrained"][p][k]] for k in REPORTED]) for p in predict.POOLINGS]
  rows.append(("bm25", [[figures["bm25"][k]] for k in REPORTED]))
  for row, values in rows:
    print(f"{row:28}" + "".join(f"{_range(v):>16}" for v in values))
  best = figures["untrained"][fair]["mrr_at_10"]
  got = [s["mrr_at_10"] for s in figures["trained"].values()]
  print(f"trained / fair untrained MRR@10: {_range([g / best for g in got])}x", flush=True)
  return figures


def compile_contrastive(model_config: BertConfig, devices, batch: int, query_length: int,
                        passage_length: int, passages: int = 1, chunks: int = 1):
  """The contrastive train step (InfoNCE over the whole global batch) of `batch` queries, each
  with `passages` passages, compiled for `devices` (the batch over them, the state replicated:
  configs/base.py's mesh), `chunks` GradCache chunks."""
  cfg = train.TrainConfig(batch_size=batch, num_train_steps=100, warmup_steps=10,
                          learning_rate=2e-5, weight_decay=0.01, num_microbatches=chunks)
  objective = contrastive_training.objective(ContrastiveConfig())
  t = train.build(model_config, cfg, sharding.MeshConfig(), devices, objective)
  one = objective.dummy_batch(1, query_length, passage_length, passages)
  shapes = {k: jax.ShapeDtypeStruct((batch,) + v.shape[1:], v.dtype, sharding=t.batch_sharding)
            for k, v in one.items()}
  key = jax.eval_shape(jax.random.PRNGKey, 0)
  key = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=sharding.replicated(t.mesh))
  return t.train_step.lower(t.abstract_state, shapes, key).compile()


def largest_batch(fits, start: int, bisections: int) -> tuple[int, int, list]:
  """(the largest n that `fits`, the smallest tried that does not (0: none), the probes): n
  doubles from `start` until one does not fit, then `bisections` halvings of the gap between
  the last that fits and the first that does not (the resolution: their gap / 2**bisections).
  `fits(n)` -> (bool, bytes)."""
  probes, lo, hi, n = [], 0, 0, start
  while True:
    ok, need = fits(n)
    probes.append((n, ok, need))
    if not ok:
      hi = n
      break
    lo, n = n, 2 * n
  for _ in range(bisections):
    if lo == 0 or hi - lo <= start // 2 ** bisections:
      break
    n = (lo + hi) // 2
    ok, need = fits(n)
    probes.append((n, ok, need))
    lo, hi = (n, hi) if ok else (lo, n)
  return lo, hi, probes


def aot_negatives(args) -> dict:
  """The largest global batch of negatives whose contrastive step fits a chip of
  `args.aot_topology`: BERT-Base (configs/bert_base.py: bfloat16 matmuls, scanned layers, no
  remat), each query with its positive alone, every passage of the global batch a negative of
  every query, compiled by libtpu's compile-only client (as `python -m bertjax.aot`) and read
  from XLA's buffer assignment (or its refusal) against the chip's HBM."""
  topology = topologies.parse_topology(args.aot_topology)
  devices = aot.topology_devices(topology)
  model_config = BertConfig.from_dict(bert_base.get_config().model, vocab_size=30522)
  hbm = topology.hbm_gib * aot.GIB
  lq, lp, n = args.query_length, args.passage_length, len(devices)

  def fits(per_chip: int):
    start = time.perf_counter()
    try:
      need = aot.Memory.of(compile_contrastive(model_config, devices, per_chip * n, lq, lp)).total
    except Exception as err:  # pylint: disable=broad-except
      found = aot.xla_out_of_memory(err)
      if found is None:
        raise
      need = found[0]
    print(f"{per_chip * n:7d} queries ({per_chip} per chip): {need / aot.GIB:7.2f} GiB of "
          f"{topology.hbm_gib:g} GiB per chip, {'fits' if need <= hbm else 'does not fit'} "
          f"({time.perf_counter() - start:.0f} s to compile)", flush=True)
    return need <= hbm, need

  lo, hi, probes = largest_batch(fits, args.aot_start, args.aot_bisections)
  print(f"{topology.name} ({n} chips), BERT-Base, queries {lq} and passages {lp} tokens: "
        f"{lo * n} queries ({lo} per chip) fit, {hi * n} do not; every query has "
        f"{lo * n} passages, {lo * n - 1} of them negatives", flush=True)
  return {"topology": topology.name, "chips": n, "query_length": lq, "passage_length": lp,
          "largest_per_chip": lo, "largest_global": lo * n, "smallest_failing_per_chip": hi,
          "probes": [{"per_chip": p, "fits": ok, "gib": round(b / aot.GIB, 2)}
                     for p, ok, b in probes]}


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
  flags.DEFINE_enum("part", "all", ["all", "quality", "steps", "aot"], "What to measure "
                    "(all: quality and steps; aot only when named).")
  flags.DEFINE_string("encoder", "workdirs/tiny", "The pre-trained encoder (`make pretrain`'s "
                      "workdir, or any weights folder).")
  flags.DEFINE_list("seeds", ["0", "1", "2"], "Fine-tuning seeds.")
  flags.DEFINE_string("workdir", "", "Where the task's files and the runs go ('' = a new "
                      "temporary folder).")
  flags.DEFINE_list("tasks", ["next", "summary"], "quality: the pairs tasks (TASKS).")
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
  flags.DEFINE_string("aot_topology", "v5p-8", "aot: the Cloud TPU slice compiled for.")
  flags.DEFINE_integer("aot_start", 256, "aot: the first queries per chip tried (then doubled).")
  flags.DEFINE_integer("aot_bisections", 2, "aot: halvings of the gap after doubling.")
  flags.DEFINE_string("json", "", "Also write the figures to this file.")


def main(argv) -> None:
  del argv
  figures = {}
  if FLAGS.part in ("all", "quality"):
    figures["quality"] = quality(FLAGS, [int(s) for s in FLAGS.seeds])
  if FLAGS.part in ("all", "steps"):
    figures["steps"] = step_times(FLAGS)
  if FLAGS.part == "aot":
    figures["aot"] = aot_negatives(FLAGS)
  if FLAGS.json:
    with open(FLAGS.json, "w", encoding="utf-8") as f:
      json.dump(figures, f, indent=1)


if __name__ == "__main__":
  define_flags()
  cli.run(main)
