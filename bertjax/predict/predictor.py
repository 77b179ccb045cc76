"""A fine-tuned model on new text: `python -m bertjax.predict --workdir=FT_WORKDIR --input=FILE
--output=OUT.jsonl`, sentence vectors with `--mode=embed --output=OUT.npy`, or each query's best
passages of a corpus with `--mode=search --corpus=FILE --output=OUT.jsonl`.

The input is CSV, TSV, JSON Lines or Parquet (bertjax/inputs/textfiles.py) with the columns the model was
trained with (its task.json: text_a / text_b, tagging's tokens; span: question and context, an `id`
column is carried over where present); `--text_a=...` etc. name others. The output has one JSON line
per input row, in order:

  classification  {"label": ..., "probabilities": {label: p, ...}}
  regression      {"value": ...}
                  (both with "truncated": true where the text was cut to max_seq_length tokens)
  tagging         {"text": ..., "entities": [{"type", "start", "end", "text"}], "tags": [IOB2]}:
                  character offsets into "text" (the input text, or the words joined by spaces)
  span            {"answer": ..., "start": character offset in the context (-1: no answer),
                  "score": the answer's n-best probability}; "" is v2.0's null answer
  embeddings      {"vector": [...]}: the text's vector as a query

The weights are the best checkpoint's (best/) unless --checkpoint=latest or a step says otherwise.
The file is read in chunks of CHUNK_ROWS rows, so memory stays flat whatever its size. Each chunk
is ordered by length and cut into groups of neighbours: a group is padded to its longest row's
width (multiples of 8 up to 64, then four widths per doubling: 80, 96, 112, 128, 160, ...) and holds
as many rows as --tokens_per_device positions allow at that width (1,024: 128 rows of 8 tokens,
8 of 128), so short texts pay neither for the longest nor for small matmuls. For classification,
regression and [CLS] vectors the rows are first packed (bertjax/predict/rows.py): several texts in a row of
up to 64 tokens, each attending to itself alone, and the last layer computed at their [CLS]
positions only. The outputs go back to the input's order. A group is what one device computes in
one call, and the groups depend on the chunk alone: the output file is the same bits on 1 or 8
devices. Two calls are in flight at once (CONCURRENT_CALLS), which fills a CPU's idle cores.

`--mode=embed` writes an [N, hidden] float32 .npy: from an embeddings workdir its queries' or its
passages' vectors (or both, two files) as it was trained to make them; from any other folder
`init_from` takes (a pre-training or fine-tuning workdir, a converted, Google or Hugging Face
folder) the pooled [CLS] vector (`--pooling=cls`, the default) or the mean of the last layer over
real tokens (`--pooling=mean`) of each row's text_a (and text_b). `--mode=search` ranks a corpus's
passages for each query by those vectors (bertjax/predict/vectors.py says both).

In Python: `Predictor.from_workdir(path)(["a text", ...])` gives the same records.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
from typing import Any, Iterable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from bertjax import cli
from bertjax.data import tokenizer as tokenizer_lib
from bertjax.errors import Refusal
from bertjax.finetune import families
from bertjax.formats import taskspec as spec_lib
from bertjax.inputs import pairs, textfiles
from bertjax.model.config import BertConfig
from bertjax.model.encoder import BertModel
from bertjax.predict import (outputs as prediction_files, rows as prediction_rows,
                             vectors as prediction_vectors)
from bertjax.predict.outputs import check_output
from bertjax.weights import reader as weights

# Rows read, ordered by length and grouped together. A fixed count, not a multiple of the devices:
# the groups (and so the bits of every output) must not depend on how many devices there are.
CHUNK_ROWS = 4096
# Positions (rows x width) one device computes per call: on a CPU 1,024 ran faster than 2,048 and
# 4,096 (docs/performance.md#prediction-on-a-cpu); an accelerator wants more (the flag).
TOKENS_PER_DEVICE = 1024
# XLA's CPU client runs the calls one thread dispatches one after another, and a call alone keeps
# 2 cores 1.1 busy; calls waited for on two threads overlap: 1.2-1.35x at the small shape
# (docs/performance.md#prediction-on-a-cpu). An accelerator queues them either way.
CONCURRENT_CALLS = 2
POOLINGS = ("cls", "mean")
MODES = ("predict", "embed", "search")


class Predictor:
  """A fine-tuned model (or, for `embed`, any encoder) with its tokenizer, on every local device."""

  def __init__(self, config: BertConfig, params, tokenizer: tokenizer_lib.Tokenizer,
               spec: spec_lib.TaskSpec | None, *, tokens_per_device: int = TOKENS_PER_DEVICE,
               devices=None, source: str = ""):
    self.config, self.tokenizer, self.spec, self.source = config, tokenizer, spec, source
    # A model whose outputs are its vectors (the embeddings family): `embed` makes them as it was
    # trained to (its pooling, its normalisation), not with a --pooling of the plain encoder's.
    self.vectors = spec is not None and families.get(spec.family).sentence is not None
    if jax.process_count() > 1:
      # Each process would read and write the whole file: one process, all its local devices.
      raise Refusal("bertjax.predict runs in one process (all of its local devices); this "
                    f"is process {jax.process_index()} of {jax.process_count()}. Run it on one "
                    "host, or split the input file across hosts.")
    devices = list(jax.local_devices() if devices is None else devices)
    if tokens_per_device < 1:
      raise Refusal(f"tokens_per_device={tokens_per_device} must be >= 1.")
    self.tokens_per_device = tokens_per_device
    self.mesh = Mesh(np.array(devices), ("data",))
    self.params = jax.device_put(params, NamedSharding(self.mesh, P()))
    self._rows = NamedSharding(self.mesh, P("data"))
    self._forward = {}  # kind -> jitted function
    self.sequences = 0  # run so far (for the progress line)
    self.truncated = 0  # rows longer than max_seq_length, cut to fit (said at the end)
    # (tokens, where recorded) of the length the model was trained at, where its folder says.
    self.trained_length: tuple[int, str] | None = None

  @functools.cached_property
  def fingerprint(self) -> str:
    """Of the weights, architecture and vocabulary (prediction_vectors.fingerprint): what a file
    of vectors records of its encoder. Computed once, when a vector's record first asks."""
    return prediction_vectors.fingerprint(self.params, self.config, self.tokenizer.fingerprint)

  # Construction ---------------------------------------------------------------------------------

  @classmethod
  def from_workdir(cls, path: str, *, checkpoint: str = "best",
                   tokens_per_device: int = TOKENS_PER_DEVICE, devices=None,
                   embed: bool = False) -> "Predictor":
    """From a fine-tuning workdir (its best checkpoint by default; "latest" or a step number), or,
    with embed=True, any weights folder bertjax reads (bertjax/weights/reader.py): its encoder, or an
    embeddings model whole."""
    source = weights.inspect_trained(path, what="--workdir", checkpoint=checkpoint)
    spec = families.spec_of(source)
    if spec is None and not embed:
      raise Refusal(_no_task(path, source))
    trained = prediction_vectors.trained_length(source, spec)
    if source.vocab_file is None:
      raise Refusal(f"{path} records no vocabulary; predict needs the one the model was "
                    "trained with (a workdir copies it in when its run starts).")
    tokenizer = tokenizer_lib.load_vocabulary(source.vocab_file, source.tokenizer_kind,
                                              source.lower)
    vectors = spec is not None and families.get(spec.family).sentence is not None
    if embed and not vectors:
      params = weights.read(source, like=None)[weights.ENCODER]
      spec = None
    else:
      params = weights.read(source)
      head = families.get(spec.family).head
      if head and head not in params:
        raise Refusal(f"{source.describe()} holds no {head!r} head for its {spec.family} "
                      f"task (subtrees: {sorted(params)}).")
    predictor = cls(source.config, params, tokenizer, spec, tokens_per_device=tokens_per_device,
                    devices=devices, source=source.describe())
    predictor.trained_length = trained
    return predictor

  # The forward pass -----------------------------------------------------------------------------

  def _function(self, kind: str):
    """The jitted forward pass of `kind` (a pooling, "head"; "packed_" + either: with the
    sequence_ids and cls_positions of packed rows, one output per [CLS] slot)."""
    if kind not in self._forward:
      if kind == "packed_cls":
        model = BertModel(self.config)

        def fn(params, ids, mask, segments, sequence_ids, cls_positions):
          _, pooled_BxSxD = model.apply({"params": params}, ids, mask, segments, None,
                                        sequence_ids, True, cls_positions)
          return {"vector": pooled_BxSxD.reshape(-1, pooled_BxSxD.shape[-1]).astype(jnp.float32)}
      elif kind == "mean":  # ("cls" always packs)
        model = BertModel(self.config)

        def fn(params, ids, mask, segments):
          seq_BxLxD, _ = model.apply({"params": params}, ids, mask, segments, deterministic=True)
          m_BxLx1 = mask[..., None].astype(jnp.float32)
          total_BxD = jnp.sum(seq_BxLxD.astype(jnp.float32) * m_BxLx1, axis=1)
          return {"vector": total_BxD / jnp.maximum(jnp.sum(m_BxLx1, axis=1), 1.0)}
      else:
        objective = families.get(self.spec.family).objective(self.spec)
        model = objective.make_model(self.config)

        def fn(params, ids, mask, segments, *packing):
          # The model's arguments as its objective names them (a bi-encoder embeds input_ids).
          args = objective.inputs({"input_ids": ids, "input_mask": mask, "segment_ids": segments})
          if not packing:
            return objective.outputs(model.apply({"params": params}, **args, deterministic=True))
          sequence_ids, cls_positions = packing  # one output per [CLS] slot: [B x S, ...]
          out = model.apply({"params": params}, **args, deterministic=True,
                            sequence_ids=sequence_ids, cls_positions=cls_positions)
          return objective.outputs(out.reshape((-1,) + out.shape[2:]))
      inputs = 5 if kind.startswith("packed_") else 3
      self._forward[kind] = jax.jit(fn, in_shardings=(NamedSharding(self.mesh, P()),)
                                    + (self._rows,) * inputs)
    return self._forward[kind]

  def packs(self, kind: str = "head") -> bool:
    """Whether `kind`'s calls pack several texts into a row (rows.py): [CLS] vectors,
    and the head of a family that reads one state per text (not a mean over the tokens)."""
    return kind == "cls" or (kind == "head" and families.get(self.spec.family).packed
                             and not (self.config.task_head == "modernbert"
                                      and self.config.classifier_pooling == "mean"))

  def _outputs(self, fn, calls: list) -> Iterator[dict]:
    """fn(params, *arrays) of each call's host arrays, on the host, in order; CONCURRENT_CALLS
    calls in flight, each waited for on a thread of its own (the same bits as one at a time)."""
    def one(arrays):
      return jax.device_get(fn(self.params, *(jax.device_put(a, self._rows) for a in arrays)))
    with concurrent.futures.ThreadPoolExecutor(CONCURRENT_CALLS) as pool:
      yield from pool.map(one, calls)

  def _run_packed(self, features: dict[str, np.ndarray], kind: str) -> dict[str, np.ndarray]:
    """run() for one output per text: texts packed into rows (prediction_rows.pack), the rows
    grouped by their used length as run() groups texts."""
    plan = list(prediction_rows.packed_calls(features, self.tokens_per_device,
                                             self.mesh.devices.size))
    parts, index = {}, []
    for (_, texts, at_out), out in zip(plan, self._outputs(self._function("packed_" + kind),
                                                           [arrays for arrays, _, _ in plan])):
      for k, v in out.items():
        parts.setdefault(k, []).append(np.asarray(v)[at_out])
      index.append(texts)
      self.sequences += len(texts)
    return prediction_rows.in_input_order(parts, index)

  def run(self, features: dict[str, np.ndarray], kind: str = "head") -> dict[str, np.ndarray]:
    """The outputs for every row of `features` (input_ids, input_mask, segment_ids [N, L]), in
    order. Rows are grouped with the rows nearest in length (length_groups); a group is one
    device's share of a call, and calls take as many groups of one width as there are devices. So
    a row is computed in the same shapes and with the same neighbours, and to the same bits,
    whatever the number of devices."""
    n, max_len = features["input_ids"].shape
    if n == 0:
      return {}
    if self.packs(kind):
      return self._run_packed(features, kind)
    plan = list(prediction_rows.grouped_calls(features, self.tokens_per_device,
                                              self.mesh.devices.size))
    parts, index = {}, []
    for (_, calls, width, capacity), out in zip(plan, self._outputs(self._function(kind),
                                                                    [p[0] for p in plan])):
      for slot, (rows, _, _) in enumerate(calls):
        index.append(rows)
        for k, v in out.items():
          v = np.asarray(v)[slot * capacity:slot * capacity + len(rows)]
          if v.ndim == 2 and k not in ("logits", "vector"):  # per token: back to [B, max_len]
            fill = -1e9 if v.dtype.kind == "f" else 0
            v = np.pad(v, ((0, 0), (0, max_len - width)), constant_values=fill)
          parts.setdefault(k, []).append(v)
      self.sequences += sum(len(rows) for rows, _, _ in calls)
    return prediction_rows.in_input_order(parts, index)

  # Rows -> records ------------------------------------------------------------------------------

  def predict_rows(self, rows: Iterable[textfiles.Row], columns: dict | None = None
                   ) -> Iterator[dict]:
    """One record per row (the module docstring), streamed a chunk at a time."""
    spec = dataclasses.replace(self.spec, **(columns or {}))
    chunk: list[textfiles.Row] = []
    for row in rows:
      if not chunk:
        _check_columns(row, spec, self.source)
      chunk.append(row)
      if len(chunk) >= CHUNK_ROWS:
        yield from self._records(chunk, spec)
        chunk = []
    if chunk:
      yield from self._records(chunk, spec)

  def __call__(self, inputs: Sequence[Any]) -> list[dict]:
    """Records for texts in memory: strings, (text_a, text_b) pairs, word lists (tagging), or
    dicts with the model's columns (span: {"question": ..., "context": ...})."""
    return list(self.predict_rows([_as_row(x, self.spec, k) for k, x in enumerate(inputs)]))

  def _records(self, rows: list[textfiles.Row], spec: spec_lib.TaskSpec) -> list[dict]:
    ids = [{"id": r["id"]} if "id" in r else {} for r in rows]
    records = families.get(spec.family).records(rows, spec, self.tokenizer, self.run)
    # A text cut to max_seq_length tokens is predicted from its beginning: marked, counted.
    self.truncated += sum(1 for r in records if r.get("truncated"))
    return [{**i, **r} for i, r in zip(ids, records)]

  # Embeddings -----------------------------------------------------------------------------------

  def embed(self, rows: Iterable[textfiles.Row | str], pooling: str = "",
            text_a: str = "text", text_b: str = "", max_seq_length: int = 128
            ) -> Iterator[np.ndarray]:
    """[n, hidden] float32 vectors, a chunk at a time, for strings or rows' text_a (and text_b):
    an embeddings model's own (its pooling and normalisation; one text a row), any other model's
    by `pooling` ("" = "cls")."""
    kind = pooling or "cls"
    if self.vectors:
      if pooling and pooling != self.spec.pooling:
        raise Refusal(f"--pooling={pooling}: {self.source} was trained to make its vectors with "
                      f"pooling={self.spec.pooling!r} (its task.json); leave --pooling out.")
      kind, text_b = "head", ""
    elif kind not in POOLINGS:
      raise Refusal(f"pooling={pooling!r}: use one of {POOLINGS}.")
    max_seq_length = min(max_seq_length, self.config.max_position_embeddings)
    chunk = []

    def flush():
      a = [r if isinstance(r, str) else textfiles.text_of(r, text_a) for r in chunk]
      b = [textfiles.text_of(r, text_b) for r in chunk] if text_b else None
      features, truncated_N = pairs.encode_pairs(a, b, self.tokenizer, max_seq_length)
      self.truncated += int(truncated_N.sum())
      return self.run(features, kind)["vector"]

    for row in rows:
      if not chunk and not isinstance(row, str):
        textfiles.require(row, [text_a] + ([text_b] if text_b else []), "--")
      chunk.append(row)
      if len(chunk) >= CHUNK_ROWS:
        yield flush()
        chunk = []
    if chunk:
      yield flush()


def _no_task(path: str, source) -> str:
  """Why predict has no task to run from `source`, and what it reads."""
  reads = ("predict runs the task of a fine-tuning workdir (python -m bertjax.finetune) or of a "
           "ModernBertFor* folder; for sentence vectors use --mode=embed.")
  if source.task_class is not None and source.task_class.architecture:
    return (f"{path} is a {source.kind} folder of {source.task_class.architecture}, a head "
            f"predict does not read: {reads} (Its encoder: --mode=embed, checkpoint.init_from.)")
  kind = "pre-training run" if source.kind == "workdir" else source.kind + " folder"
  return f"{path} is a {kind} with no task head (no {spec_lib.FILE}, no task recorded): {reads}"


def _check_columns(row: textfiles.Row, spec: spec_lib.TaskSpec, source: str) -> None:
  needed = families.get(spec.family).columns(spec, row)
  missing = [c for c in needed if c not in row]
  if missing:
    raise Refusal(f"{row.where}: no column {missing[0]!r}; the file has {sorted(row)}, the model "
                  f"({source}) reads {needed} as it was trained. Rename the columns, or name "
                  "them with --text_a / --text_b / --tokens.")


def _as_row(x, spec: spec_lib.TaskSpec, k: int) -> textfiles.Row:
  if isinstance(x, dict):
    row = textfiles.Row(x)
  elif isinstance(x, str):
    row = textfiles.Row({spec.text_a: x})
  else:
    row = textfiles.Row(families.get(spec.family).as_row(x, spec))
  row.where = f"input #{k}"
  return row


def predict_file(predictor: Predictor, input_path: str, output_path: str, fmt: str = "",
                 columns: dict | None = None) -> int:
  """Writes one JSON line per input row (every row, in order); returns the number of rows. The
  output appears whole (written beside, then renamed)."""
  made = {"mode": "predict", "model": predictor.source, "input": {"path": input_path}}
  return prediction_files.write_lines(
      output_path, made, predictor.predict_rows(textfiles.iter_rows(input_path, fmt), columns),
      prediction_files.Progress(predictor),
      f"{input_path}: no rows to predict (only a header, or blank lines).")


def run(workdir: str, input_path: str, output: str, *, mode: str = "predict",
        checkpoint: str = "best", tokens_per_device: int = TOKENS_PER_DEVICE, fmt: str = "",
        pooling: str = "", max_seq_length: int = 0, columns: dict[str, str] | None = None,
        overwrite: bool = False, corpus: str = "", corpus_vectors: str = "",
        top_k: int = 10) -> int:
  """What `python -m bertjax.predict` does with its flags (see the module docstring; columns: the
  input's column for text_a, text_b or tokens, where not the trained ones; max_seq_length: embed
  and search, 0 = the model's); prints what was done and returns the number of rows."""
  columns = columns or {}
  embed = mode == "embed"
  if mode not in MODES:
    raise Refusal(f"--mode={mode}: use one of {MODES}.")
  inputs = {"--input": input_path, "--corpus": corpus, "--corpus_vectors": corpus_vectors}
  check_output(output, inputs, overwrite=overwrite, embed=embed)
  predictor = Predictor.from_workdir(workdir, checkpoint=checkpoint,
                                     tokens_per_device=tokens_per_device, embed=mode != "predict")
  written = [output]
  if mode != "predict":
    print(f"{mode}: {prediction_vectors.vectors_line(predictor, columns, max_seq_length, pooling)}",
          flush=True)
  if embed:
    n, written = prediction_vectors.embed_file(
        predictor, input_path, output, columns=columns, max_seq_length=max_seq_length,
        pooling=pooling, fmt=fmt, check=lambda path: check_output(path, inputs,
                                                                  overwrite=overwrite, embed=True))
  elif mode == "search":
    n = prediction_vectors.search_file(
        predictor, input_path, output, corpus=corpus, top_k=top_k, pooling=pooling,
        columns=columns, max_seq_length=max_seq_length, vectors_path=corpus_vectors, fmt=fmt)
  else:
    n = predict_file(predictor, input_path, output, fmt, columns)
  print(f"{mode}: {n:,} rows of {input_path} -> {', '.join(written)} ({predictor.source})",
        flush=True)
  if predictor.truncated and mode == "predict":
    length = (predictor.spec.max_query_length if predictor.vectors  # texts embedded as queries
              else predictor.spec.max_seq_length)
    print(f"{mode}: {predictor.truncated:,} of the rows are longer than max_seq_length={length} "
          'tokens and were predicted from their beginning (marked "truncated": true)', flush=True)
  elif predictor.truncated:
    print(f"{mode}: {predictor.truncated:,} of the texts are longer than "
          f"{prediction_vectors.limits(predictor, columns, max_seq_length)} and were embedded "
          "from their beginning", flush=True)
  return n


def define_flags() -> None:
  flags.DEFINE_string("workdir", None, "A fine-tuning workdir (embed: any weights folder).",
                      required=True)
  flags.DEFINE_string("input", None, "CSV, TSV, JSON Lines or Parquet.", required=True)
  flags.DEFINE_string("output", None, "predict and search: .jsonl; embed: .npy", required=True)
  flags.DEFINE_enum("mode", "predict", list(MODES), "Predictions of the fine-tuned task, "
                    "sentence vectors, or each query's best passages of --corpus.")
  flags.DEFINE_string("checkpoint", "best", "best, latest or a step.")
  flags.DEFINE_integer("tokens_per_device", TOKENS_PER_DEVICE, "Token positions (rows x padded "
                       "width) each device takes per call: 1,024 suits a CPU; on an H200 the "
                       "accelerator check predicted with 16,384.", lower_bound=1)
  flags.DEFINE_string("format", "", "csv, tsv, jsonl or parquet ('' = from the extension).")
  flags.DEFINE_enum("pooling", None, list(POOLINGS), "embed, search: the vector of a model "
                    "that is not an embeddings one (default cls).")
  flags.DEFINE_integer("max_seq_length", 0, "embed, search: tokens kept (0: an embeddings "
                       "model's own lengths, 128 for others).", lower_bound=0)
  flags.DEFINE_string("corpus", "", "search: the passages (an id column, the passages' column).")
  flags.DEFINE_string("corpus_vectors", "", "search: the corpus's .npy from --mode=embed ('' = "
                      "encode the corpus first).")
  flags.DEFINE_integer("top_k", 10, "search: passages per query.", lower_bound=1)
  flags.DEFINE_bool("overwrite", False, "Replace an existing --output that predict did not "
                    "write (never the input itself).")
  for column in ("text_a", "text_b", "tokens"):
    flags.DEFINE_string(column, None, f"The input's column for the model's {column} (default: "
                        "as trained).")


def main(argv) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  args = flags.FLAGS
  columns = {k: args[k].value for k in ("text_a", "text_b", "tokens") if args[k].value is not None}
  cli.explained(run, args.workdir, args.input, args.output, mode=args.mode,
                checkpoint=args.checkpoint, tokens_per_device=args.tokens_per_device, fmt=args.format,
                pooling=args.pooling or "", max_seq_length=args.max_seq_length,
                columns=columns, overwrite=args.overwrite, corpus=args.corpus,
                corpus_vectors=args.corpus_vectors, top_k=args.top_k)
