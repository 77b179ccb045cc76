"""Offline preparation: a corpus source -> sharded TFRecords of unmasked instances + a manifest.

  python -m bertjax.data.prepare --config=configs/base.py --config.data.source='texts/*.txt'

The source is planned as pieces of input (files, large files cut into byte ranges at blank lines).
Step 1 reads each piece and files its documents under the shard a hash of their text chooses; step 2
builds each shard: its documents sorted by that hash, tokenized, paired with a seed of its own
(preparation/shards.py holds both steps). This module is the local driver: both steps run in
processes of this machine, or of each host of a pod (host i: pieces and shards i mod hosts);
preparation/beam.py is the other driver, and writes the same bytes. A finished piece or shard
keeps a `.json` beside it; a rerun skips those, so an interrupted preparation resumes. The manifest (written last) records counts,
repairs, the settings and the tokenizer fingerprint; `load_manifest` refuses shards made with
another tokenizer or an older format.
"""

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import os
import re
import time

from bertjax.data import corpus, packing, storage, tokenizer as tokenizer_lib
from bertjax.data.config import DataConfig
from bertjax.data.preparation import processes, shards
from bertjax.data.template import Template
from bertjax.errors import Refusal
from bertjax.files import gfile

# 2: input_ids stored as raw little-endian bytes (uint16 when the vocabulary allows) instead of an
# int64 list: three times faster to write and parsed without ragged tensors.
# 3: documents go to shards by a hash of their text (not round-robin in reading order) and are
# sorted by it within a shard, so any number of readers, workers or hosts gives the same shards.
FORMAT_VERSION = 3
SPLITS = shards.SPLITS
# Settings that change the prepared instances; a manifest made with other values is not reused.
_SETTING_KEYS = ("source", "tfds_split", "max_seq_length", "nsp", "short_seq_prob", "dupe_factor",
                 "eval_dupe_factor", "eval_fraction", "num_shards", "num_eval_shards",
                 "prepare_seed")


def id_dtype(vocab_size: int) -> str:
  return "uint16" if vocab_size <= 1 << 16 else "int32"


def settings_of(data: DataConfig, tok: tokenizer_lib.Tokenizer) -> dict:
  s = {k: getattr(data, k) for k in _SETTING_KEYS}
  s["tokenizer_fingerprint"] = tok.fingerprint
  s["format_version"] = FORMAT_VERSION
  s.update(corpus.text_settings(data))
  s["id_dtype"] = id_dtype(tok.vocab_size)
  return s


def prepared_dir(data: DataConfig, tok: tokenizer_lib.Tokenizer) -> str:
  """`config.data.prepared_dir`, or a cache folder named by the settings (new settings, new folder)."""
  if data.prepared_dir:
    return data.prepared_dir
  key = hashlib.sha256(json.dumps(settings_of(data, tok), sort_keys=True).encode())
  slug = re.sub(r"[^A-Za-z0-9]+", "_", data.source)[:40].strip("_") or "corpus"
  return os.path.join(data.cache_dir, f"{slug}-L{data.max_seq_length}-{key.hexdigest()[:12]}")


def _num_shards(data: DataConfig, split: str) -> int:
  return shards.num_shards(data, split)


def _refuse_other_settings(out_dir: str, found: dict, want: dict, what: str):
  """An unfinished preparation is resumed only with the settings it was started with."""
  diff = {k: (found.get(k), v) for k, v in want.items() if found.get(k) != v}
  if diff:
    raise Refusal(f"{out_dir} holds {what} made with other settings (key: (found, configured)): "
                  f"{diff}; resuming would mix the two. Delete {out_dir} to prepare anew, or "
                  f"set config.data.prepared_dir to another folder (empty: a settings-named "
                  f"folder under cache_dir).")


_write_atomic = shards.write_atomic


def _summarize(infos: list[dict]) -> dict:
  keys = ("documents", "sentences", "text_bytes", "unk_tokens", "instances", "not_next", "tokens",
          "truncated_tokens", "long_sentences_split")
  out = {k: sum(i[k] for i in infos) for k in keys}
  out["files"] = [i["file"] for i in infos]
  out["counts"] = [i["instances"] for i in infos]
  out["bytes"] = [i["bytes"] for i in infos]
  out["shard_seconds"] = sum(i["seconds"] for i in infos)  # summed over processes
  out["largest_document"] = max((i["largest_document"] for i in infos),
                                key=lambda d: d["instances"])
  return out


def prepare(data: DataConfig, tok: tokenizer_lib.Tokenizer, *, num_workers: int | None = None,
            host_index: int = 0, host_count: int = 1, barrier=None) -> dict:
  """Runs (or resumes) both steps and writes the manifest; returns it. `tok` is the tokenizer
  of `data` (tokenizer.load_tokenizer), loaded once by the caller. On a pod every host calls it
  with its index, the host count and a barrier (`barrier(name)` returns once all hosts called it):
  host i does the pieces of input and the shards numbered i mod host_count."""
  gf = gfile()
  out_dir = prepared_dir(data, tok)
  storage.make_dirs(out_dir, "prepared_dir" if data.prepared_dir else "cache_dir")
  # On a pod, jax's preemption notifier owns SIGTERM (bertjax/training/control.py): a Python handler here
  # would replace it for the rest of the run, and a notice would then kill the host outright.
  # There the hosts finish preparing and stop at the first step.
  stoppable = processes.sigterm_raises() if host_count == 1 else contextlib.nullcontext()
  try:
    with stoppable:
      return _prepare(data, tok, out_dir, num_workers, host_index, host_count,
                      barrier or (lambda name: None))
  except processes.PreparationStopped:
    total = sum(_num_shards(data, split) for split in SPLITS)
    finished = len(gf.glob(os.path.join(out_dir, "*-of-*.json")))
    raise processes.PreparationStopped(
        f"Preparation in {out_dir} stopped by SIGTERM, its worker processes too, with {finished} "
        f"of {total} shard(s) finished. They are kept: run the same command again to resume "
        f"(only the other shards are made).") from None


def split_settings(data: DataConfig) -> dict:
  return {**{k: getattr(data, k) for k in shards.SPLIT_KEYS}, "format_version": FORMAT_VERSION,
          **corpus.text_settings(data)}


def read_markers(out_dir: str, units: list[dict], want: dict) -> list[dict | None]:
  """The marker of each piece of input already scattered (None: not yet, or another piece)."""
  gf = gfile()
  found = set(gf.glob(os.path.join(out_dir, "raw", "parts", "*.json")))
  markers = []
  for u, unit in enumerate(units):
    path = os.path.join(out_dir, shards.part_name(u, len(units)) + ".json")
    m = None
    if path in found:
      with gf.GFile(path, "r") as f:
        m = json.load(f)
      _refuse_other_settings(out_dir, m.get("settings", {}), want,
                             f"a piece of input read into raw/parts ({os.path.basename(path)})")
      m = m if m["unit"] == unit else None  # planned otherwise (another input_split_bytes)
    markers.append(m)
  return markers


def scatter_tasks(out_dir: str, data: DataConfig, units: list[dict], host: int = 0,
                  hosts: int = 1) -> list[dict]:
  """The step-1 tasks of the pieces not yet read that are this host's (numbered host mod hosts)."""
  want = split_settings(data)
  markers = read_markers(out_dir, units, want)
  return [{"out_dir": out_dir, "u": u, "num_units": len(units), "unit": unit,
           "split_settings": want}
          for u, (unit, m) in enumerate(zip(units, markers)) if m is None and u % hosts == host]


def build_tasks(out_dir: str, data: DataConfig, units: list[dict], s: dict, tok_spec) -> list:
  """Every shard's build task, once every piece of input is scattered (both drivers call it)."""
  markers = read_markers(out_dir, units, split_settings(data))
  missing = [u for u, m in enumerate(markers) if m is None]
  if missing:
    raise RuntimeError(f"{len(missing)} piece(s) of input (first: {units[missing[0]]}) were not "
                       f"read into {out_dir}/raw/parts: a host or worker failed before; see its "
                       f"error, then run again to resume.")
  return shards.shard_tasks(out_dir, markers, len(units), s, tok_spec, data.max_shard_bytes,
                            data.source)


def build_tasks_after(scattered: list, *, data: DataConfig, out_dir: str, units: list[dict],
                      settings: dict, tok_spec) -> list:
  """Beam's step after every piece is read (`scattered` is only its barrier: the markers on
  storage say everything): the build task of every shard not yet built."""
  del scattered
  done = finished_shards(out_dir)
  return [t for t in build_tasks(out_dir, data, units, settings, tok_spec)
          if shards.shard_name(t["split"], t["k"], t["n"]) + ".json" not in done]


def finished_shards(out_dir: str) -> set[str]:
  return {os.path.basename(p) for p in gfile().glob(os.path.join(out_dir, "*-of-*.json"))}


def _run(tasks: list, workers: processes.Workers | None, data: DataConfig, tok) -> None:
  """(kind, task) pairs run here (no workers, or one task) or spread over the workers."""
  if workers is None or len(tasks) <= 1:
    for kind, task in tasks:
      run_task(kind, task, data, tok)
    return
  n = min(workers.count, len(tasks))
  workers.round([[dataclasses.asdict(data), tasks[w::n]] for w in range(n)])


def run_task(kind: str, task: dict, data: DataConfig, tok=None):
  if kind == "scatter":
    return shards.scatter_unit(task, data)
  # A worker gets the vocabulary's (path, kind, casing) in each task (load_vocabulary's cache
  # builds it once) and checks it is the one the shards record.
  tok = tok or tokenizer_lib.load_vocabulary(*task["tok"])
  if tok.fingerprint != task["settings"]["tokenizer_fingerprint"]:
    raise Refusal(f"{task['tok'][0]} changed while shards were prepared: {tok.fingerprint}, "
                  f"not {task['settings']['tokenizer_fingerprint']}.")
  return shards.build_shard(task, tok)


def _worker():
  def work(item):
    data, tasks = item
    data = DataConfig(**data)
    for kind, task in tasks:
      run_task(kind, task, data)
  processes.serve(work)


def _prepare(data: DataConfig, tok: tokenizer_lib.Tokenizer, out_dir: str,
             num_workers: int | None, host: int, hosts: int, barrier) -> dict:
  gf = gfile()
  s = settings_of(data, tok)
  t0 = time.time()
  # What a worker loads the same tokenizer from.
  tok_spec = (tokenizer_lib.vocab_path_of(data), data.tokenizer, data.do_lower_case)
  units = corpus.plan_inputs(data.source, data.input_split_bytes, data.text_column)
  scatter = scatter_tasks(out_dir, data, units, host, hosts)
  num_workers = num_workers or data.prepare_workers or os.cpu_count() or 1
  if data.prepare_engine == "beam":
    if host == 0:  # the engine spreads the work; the other hosts only wait
      # lazy: apache-beam is the optional `beam` extra, imported only when asked for
      from bertjax.data.preparation import beam as beam_prepare  # pylint: disable=import-outside-toplevel
      steps = (functools.partial(build_tasks_after, data=data, out_dir=out_dir, units=units,
                                 settings=s, tok_spec=tok_spec),
               functools.partial(run_task, "build", data=None))
      beam_prepare.run(data, out_dir, scatter_tasks(out_dir, data, units), steps, num_workers)
    barrier("bertjax data: pieces of input read")
  elif data.prepare_engine == "local":
    # One set of worker processes for both steps: each starts (and imports TensorFlow) once.
    pool = (processes.Workers(num_workers, "from bertjax.data import prepare; prepare._worker()")
            if num_workers > 1 else None)
    with pool or contextlib.nullcontext():
      logging.info("Reading %d of %d piece(s) of input in %s with %d process(es).", len(scatter),
                   len(units), out_dir, min(num_workers, max(1, len(scatter))))
      _run([("scatter", t) for t in scatter], pool, data, tok)
      # Every host's pieces are read before any shard is built (a shard gathers from all pieces).
      barrier("bertjax data: pieces of input read")
      done = finished_shards(out_dir)
      tasks = [t for g, t in enumerate(build_tasks(out_dir, data, units, s, tok_spec))
               if g % hosts == host and shards.shard_name(t["split"], t["k"], t["n"]) + ".json"
               not in done]
      logging.info("Building %d shard(s) in %s with %d process(es).", len(tasks), out_dir,
                   min(num_workers, max(1, len(tasks))))
      _run([("build", t) for t in tasks], pool, data, tok)
  else:
    raise Refusal(f"config.data.prepare_engine={data.prepare_engine!r}: use 'local' (processes "
                  f"of this machine, or of each pod host) or 'beam' (Apache Beam).")
  # The one wait of a pod: for the other hosts' last shards.
  barrier("bertjax data: shards built")
  if host == 0:
    manifest = _write_manifest(data, tok, out_dir, units, s, t0)
  barrier("bertjax data: manifest written")
  if host != 0:
    with gf.GFile(os.path.join(out_dir, "manifest.json"), "r") as f:
      manifest = json.load(f)
  return manifest


def _write_manifest(data, tok, out_dir, units, s, t0) -> dict:
  gf = gfile()
  markers = read_markers(out_dir, units, split_settings(data))
  infos = {}
  for split in SPLITS:
    n = _num_shards(data, split)
    for k in range(n):
      done = os.path.join(out_dir, shards.shard_name(split, k, n) + ".json")
      if not gf.exists(done):
        raise RuntimeError(f"Shard {done} was not built: a host or worker failed; see its error, "
                           f"then run again to resume (only the missing shards are built).")
      with gf.GFile(done, "r") as f:
        infos[(split, k)] = json.load(f)
      _refuse_other_settings(out_dir, infos[(split, k)].get("settings", {}), s,
                             f"a finished shard ({os.path.basename(done)})")
  splits = {split: _summarize([infos[(split, k)] for k in range(_num_shards(data, split))])
            for split in SPLITS}
  docs = {split: splits[split]["documents"] for split in SPLITS}
  if splits["train"]["instances"] == 0:
    raise Refusal(f"Source {data.source!r} gave {docs['train']} training and "
                  f"{docs['eval']} held-out document(s) (eval_fraction "
                  f"{data.eval_fraction}) but no training instance: all held out, or "
                  f"every document empty after tokenization.")
  seconds = time.time() - t0
  corpus_stats = shards.merge_corpus_stats(markers)
  manifest = {"settings": s, "splits": splits, "corpus": corpus_stats, "documents": docs,
              "vocab_size": tok.vocab_size, "seconds": seconds,
              "mb_per_s": corpus_stats["bytes"] / 1e6 / max(seconds, 1e-9)}
  _write_atomic(os.path.join(out_dir, "manifest.json"), json.dumps(manifest, indent=1).encode())
  for split in SPLITS:
    sp = splits[split]
    logging.info("%s: %d documents -> %d instances (%.1f%% NotNext), %d long sentence(s) split, "
                 "%d [UNK] token(s)", split, sp["documents"], sp["instances"],
                 100 * sp["not_next"] / max(sp["instances"], 1), sp["long_sentences_split"],
                 sp["unk_tokens"])
    big = sp["largest_document"]
    if sp["instances"] and big["instances"] > data.max_document_pair_share * sp["instances"]:
      logging.warning(
          "%s: one document yields %d of the %d instances (%.1f%%, above max_document_pair_share "
          "%s): it starts %r (shard %s). One huge document swamps the others; check it.",
          split, big["instances"], sp["instances"], 100 * big["instances"] / sp["instances"],
          data.max_document_pair_share, big["start"], big["shard"])
  if corpus_stats["invalid_utf8_lines"]:
    worst = sorted(corpus_stats["replaced_by_input"].items(), key=lambda kv: -kv[1][0] / kv[1][1])
    logging.warning("%d line(s) had invalid UTF-8; %d character(s) were replaced by U+FFFD, in "
                    "%d input(s) (replaced share): %s", corpus_stats["invalid_utf8_lines"],
                    corpus_stats["invalid_utf8_chars"], len(worst),
                    ", ".join(f"{name} ({r / c:.3%})" for name, (r, c) in worst[:10]))
  if s["nsp"] and corpus_stats["sentences"] <= 1.1 * corpus_stats["documents"]:
    logging.warning("Almost every document has one sentence: NSP pairs will nearly all be NotNext. "
                    "The format wants one sentence per line and a blank line only between documents.")
  return manifest


def load_manifest(data: DataConfig, tok: tokenizer_lib.Tokenizer, *,
                  check_files: bool = True) -> dict:
  """The manifest of prepared shards; errors if absent, made with other settings, or damaged."""
  gf = gfile()
  out_dir = prepared_dir(data, tok)
  path = os.path.join(out_dir, "manifest.json")
  if not gf.exists(path):
    raise FileNotFoundError(f"No prepared data at {out_dir} (no manifest.json): call "
                            f"bertjax.data.prepare.ensure_prepared(data, tok) or run "
                            f"`python -m bertjax.data.prepare --config=...`.")
  with gf.GFile(path, "r") as f:
    manifest = json.load(f)
  have = manifest["settings"]
  if have.get("tokenizer_fingerprint") != tok.fingerprint:
    raise Refusal(f"Prepared shards in {out_dir} were tokenized with "
                  f"{have.get('tokenizer_fingerprint')}, but the configured vocabulary "
                  f"{tokenizer_lib.vocab_path_of(data)} is {tok.fingerprint}. Prepare "
                  f"again into another "
                  f"prepared_dir (or leave prepared_dir empty to use a settings-named cache).")
  if have.get("format_version") != FORMAT_VERSION:
    raise Refusal(f"Prepared shards in {out_dir} are of format {have.get('format_version')}, "
                  f"this bertjax reads format {FORMAT_VERSION} (documents now go to shards by "
                  f"a hash of their text). Delete {out_dir} and prepare again, or leave "
                  f"prepared_dir empty (a settings-named cache folder is prepared anew).")
  want = settings_of(data, tok)
  diff = {k: (have.get(k), v) for k, v in want.items() if have.get(k) != v}
  if diff:
    raise Refusal(f"Prepared shards in {out_dir} were made with other settings "
                  f"(key: (prepared, configured)): {diff}.")
  manifest["dir"] = out_dir
  if check_files:
    for split in SPLITS:
      for name, size in zip(manifest["splits"][split]["files"], manifest["splits"][split]["bytes"]):
        p = os.path.join(out_dir, name)
        actual = gf.stat(p).length if gf.exists(p) else -1
        if actual != size:
          raise Refusal(f"Shard {p} has {actual} bytes but the manifest says {size}: it is "
                        f"missing, truncated or corrupt. Delete it and its .json and "
                        f"{path}, then prepare again (only that shard is redone).")
  return manifest


def check_config(data: DataConfig, model_config=None):
  """Refuses, before any work, lengths that preparation would accept and training could not use."""
  L, M = data.max_seq_length, data.max_predictions_per_seq
  if L < 5:
    raise Refusal(f"config.data.max_seq_length={L} leaves no room for [CLS] A [SEP] B [SEP]; "
                  f"use at least 5 (128 or 512 as the original).")
  if not 1 <= M <= L:
    raise Refusal(f"config.data.max_predictions_per_seq={M} must be within 1 and "
                  f"max_seq_length={L}: it is the number of masked slots per sequence. Use "
                  f"about 0.15 x max_seq_length (20 at 128, 76 at 512).")
  packing.settings(data)  # its keys are refused here too, before anything is prepared
  if model_config is not None and L > model_config.max_position_embeddings:
    raise Refusal(f"config.data.max_seq_length={L} exceeds config.model."
                  f"max_position_embeddings={model_config.max_position_embeddings}: the model "
                  f"has no position for the tokens beyond. Lower max_seq_length or raise "
                  f"max_position_embeddings.")


def check_layout(data: DataConfig, tok: tokenizer_lib.Tokenizer) -> None:
  """Refuses a tokenizer whose template frames rows otherwise than preparation builds them
  (BERT's `[CLS] A [SEP] B [SEP]` with NSP, `[CLS] A [SEP]` without): fine-tuning and prediction
  frame with the template, and an encoder would be fine-tuned on a layout it was not pre-trained
  on. A tokenizer.json without a post-processor has BERT's (bertjax/data/hf_tokenizer.py)."""
  bert = Template.bert(tok.cls_id, tok.sep_id)
  if tok.template.items(data.nsp) != bert.items(data.nsp):
    raise Refusal(
        f"config.data.vocab_path={tokenizer_lib.vocab_path_of(data)} frames "
        f"{'a pair' if data.nsp else 'a text'} as {tok.template.text(data.nsp, tok.pieces)!r} "
        f"(its post-processor), pre-training's rows as BERT's "
        f"{bert.text(data.nsp, tok.pieces)!r}: the encoder would be fine-tuned on rows framed "
        f"otherwise than it was pre-trained on. Give a tokenizer.json whose post-processor is "
        f"BERT's TemplateProcessing (single='[CLS] $A [SEP]', pair='[CLS] $A [SEP] $B:1 "
        f"[SEP]:1') or that has none (bertjax then frames rows as BERT's).")


def ensure_prepared(data: DataConfig, tok: tokenizer_lib.Tokenizer, *,
                    num_workers: int | None = None, **pod) -> dict:
  """Prepares shards unless a matching manifest exists (cached, resumable); returns the manifest.
  `pod`: host_index, host_count and barrier (`prepare`), where every host of a pod prepares."""
  check_config(data)
  check_layout(data, tok)
  out_dir = prepared_dir(data, tok)
  if gfile().exists(os.path.join(out_dir, "manifest.json")):
    return load_manifest(data, tok)
  prepare(data, tok, num_workers=num_workers, **pod)
  return load_manifest(data, tok)


def main(argv):
  del argv
  from absl import flags
  logging.getLogger().setLevel(logging.INFO)
  config = flags.FLAGS.config
  data = DataConfig.from_config(config.data)
  check_config(data, config.model)
  if data.tokenizer == "sentencepiece":
    tokenizer_lib.ensure_sentencepiece(data)
  # A refusal, and SIGTERM's stop, end the command in one line (cli.run runs main under
  # cli.explained).
  m = ensure_prepared(data, tokenizer_lib.load_tokenizer(data))
  print(f"prepared {m['dir']}: train {m['splits']['train']['instances']} instances in "
        f"{len(m['splits']['train']['files'])} shard(s), eval {m['splits']['eval']['instances']}; "
        f"{m['corpus']['bytes'] / 1e6:.1f} MB of text at {m['mb_per_s']:.2f} MB/s")


if __name__ == "__main__":
  from absl import flags
  from bertjax import cli
  cli.define_config_flag()
  flags.mark_flags_as_required(["config"])
  cli.run(main)
