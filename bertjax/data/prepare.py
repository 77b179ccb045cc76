"""Offline preparation: a corpus source -> sharded TFRecords of unmasked instances + a manifest.

  python -m bertjax.data.prepare --config=configs/base.py --config.data.source='texts/*.txt'

Stage 1 streams documents once, holds out a hash-chosen fraction for evaluation and deals the rest
round-robin into raw text shards. Stage 2 tokenizes each raw shard and builds its instances in
parallel processes (one task per shard, each with its own seed, so the output does not depend on the
number of processes). Every finished shard gets a `.json` beside it; a rerun skips those, so an
interrupted preparation resumes. The manifest (written last) records counts, repairs, the settings
and the tokenizer fingerprint; `load_manifest` refuses shards made with another tokenizer.
"""

import gzip
import hashlib
import json
import logging
import os
import random
import re
import signal
import sys
import time

import numpy as np

from bertjax.data import corpus, instances, packing, processes, storage
from bertjax.data import tokenizer as tokenizer_lib
from bertjax.data.config import DataConfig

# 2: input_ids stored as raw little-endian bytes (uint16 when the vocabulary allows) instead of an
# int64 list: three times faster to write and parsed without ragged tensors.
FORMAT_VERSION = 2
SPLITS = ("train", "eval")
# Settings that change the prepared instances; a manifest made with other values is not reused.
_SETTING_KEYS = ("source", "tfds_split", "max_seq_length", "nsp", "short_seq_prob", "dupe_factor",
                 "eval_dupe_factor", "eval_fraction", "num_shards", "num_eval_shards",
                 "prepare_seed")
# Those of them that decide the first stage (which document goes to which raw shard).
_SPLIT_KEYS = ("source", "tfds_split", "eval_fraction", "num_shards", "num_eval_shards")


def _gfile():
  import tensorflow as tf
  return tf.io.gfile


def id_dtype(vocab_size: int) -> str:
  return "uint16" if vocab_size <= 1 << 16 else "int32"


def settings_of(data: DataConfig, tok: tokenizer_lib.Tokenizer) -> dict:
  s = {k: getattr(data, k) for k in _SETTING_KEYS}
  s["tokenizer_fingerprint"] = tok.fingerprint
  s["format_version"] = FORMAT_VERSION
  s["text_version"] = corpus.TEXT_VERSION
  s["id_dtype"] = id_dtype(tok.vocab_size)
  return s


def prepared_dir(data: DataConfig, tok: tokenizer_lib.Tokenizer) -> str:
  """`config.data.prepared_dir`, or a cache folder named by the settings (new settings, new folder)."""
  if data.prepared_dir:
    return data.prepared_dir
  key = hashlib.sha256(json.dumps(settings_of(data, tok), sort_keys=True).encode())
  slug = re.sub(r"[^A-Za-z0-9]+", "_", data.source)[:40].strip("_") or "corpus"
  return os.path.join(data.cache_dir, f"{slug}-L{data.max_seq_length}-{key.hexdigest()[:12]}")


def _shard_name(split: str, k: int, n: int) -> str:
  return f"{split}-{k:05d}-of-{n:05d}"


def _num_shards(data: DataConfig, split: str) -> int:
  n = data.num_shards if split == "train" else data.num_eval_shards
  if n < 1:
    raise ValueError(f"{split} shard count must be >= 1, got {n}.")
  return n


def _refuse_other_settings(out_dir: str, found: dict, want: dict, what: str):
  """An unfinished preparation is resumed only with the settings it was started with."""
  diff = {k: (found.get(k), v) for k, v in want.items() if found.get(k) != v}
  if diff:
    raise ValueError(f"{out_dir} holds {what} made with other settings (key: (found, configured)): "
                     f"{diff}; resuming would mix the two. Delete {out_dir} to prepare anew, or "
                     f"set config.data.prepared_dir to another folder (empty: a settings-named "
                     f"folder under cache_dir).")


def _write_atomic(path: str, data: bytes):
  gf = _gfile()
  with gf.GFile(path + ".tmp", "wb") as f:
    f.write(data)
  gf.rename(path + ".tmp", path, overwrite=True)


def _split_stage(data: DataConfig, out_dir: str) -> dict:
  """Stage 1: documents -> raw/{split}-k.txt.gz; resumable as a whole (`raw/_SUCCESS`)."""
  gf = _gfile()
  raw_dir = os.path.join(out_dir, "raw")
  done_path = os.path.join(raw_dir, "_SUCCESS")
  settings = {k: getattr(data, k) for k in _SPLIT_KEYS}
  if gf.exists(done_path):
    with gf.GFile(done_path, "r") as f:
      info = json.load(f)
    _refuse_other_settings(out_dir, info.get("settings", {}), settings, "a raw split (raw/)")
    return info
  gf.makedirs(raw_dir)
  stats = corpus.CorpusStats()
  counts = {s: 0 for s in SPLITS}
  paths = {s: [os.path.join(raw_dir, _shard_name(s, k, _num_shards(data, s)) + ".txt.gz")
               for k in range(_num_shards(data, s))] for s in SPLITS}
  # Streamed straight to the raw shards: the corpus is never held in memory.
  files = {s: [gf.GFile(p + ".tmp", "wb") for p in ps] for s, ps in paths.items()}
  writers = {s: [gzip.GzipFile(fileobj=f, mode="wb", mtime=0) for f in fs]
             for s, fs in files.items()}
  for doc in corpus.read_documents(data, stats):
    split = "eval" if corpus.is_heldout(doc, data.eval_fraction) else "train"
    ws = writers[split]
    ws[counts[split] % len(ws)].write(("\n".join(doc) + "\n\n").encode("utf-8"))
    counts[split] += 1
  for split in SPLITS:
    for w, f, p in zip(writers[split], files[split], paths[split]):
      w.close()
      f.close()
      gf.rename(p + ".tmp", p, overwrite=True)
  if counts["train"] + counts["eval"] == 0:
    raise ValueError(f"Source {data.source!r} yielded no document ({stats.files} file(s), "
                     f"{stats.bytes} bytes): nothing to prepare.")
  info = {"corpus": stats.__dict__, "documents": counts, "settings": settings}
  _write_atomic(done_path, json.dumps(info).encode())
  return info


def _serialize(tokens, num_a, label, dtype: str) -> bytes:
  import tensorflow as tf
  raw = np.asarray(tokens, "<u2" if dtype == "uint16" else "<i4").tobytes()
  feature = {
      "input_ids": tf.train.Feature(bytes_list=tf.train.BytesList(value=[raw])),
      "num_a": tf.train.Feature(int64_list=tf.train.Int64List(value=[num_a])),
      "next_sentence_labels": tf.train.Feature(int64_list=tf.train.Int64List(value=[label])),
  }
  # deterministic=True sorts the feature map, so equal instances give equal bytes in every process.
  return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString(
      deterministic=True)


def _read_raw(out_dir: str, name: str) -> list[list[str]]:
  with _gfile().GFile(os.path.join(out_dir, "raw", name + ".txt.gz"), "rb") as f:
    text = gzip.decompress(f.read()).decode("utf-8")
  return [d.split("\n") for d in text.split("\n\n") if d.strip()]


def _shard_task(task, tok: tokenizer_lib.Tokenizer) -> dict:
  """Stage 2 for one shard: raw text -> tokenized documents -> instances -> TFRecord + .json."""
  import tensorflow as tf
  out_dir, split, k, n, _, s = task  # _: the tokenizer's spec, for a worker process (`_worker`)
  gf = tf.io.gfile
  name = _shard_name(split, k, n)
  record_path = os.path.join(out_dir, name + ".tfrecord")
  t0 = time.time()
  docs = _read_raw(out_dir, name)
  num_own = len(docs)
  if s["nsp"] and num_own == 1:
    # NotNext needs another document: borrow the next non-empty shard's as a source of B segments.
    for j in range(1, n):
      lent = _read_raw(out_dir, _shard_name(split, (k + j) % n, n))
      if lent:
        docs += lent
        break
    else:
      raise ValueError(f"The {split} split has a single document; NSP draws NotNext segments "
                       f"from other documents. Add documents or set nsp=False.")
  flat = [sent for d in docs for sent in d]
  ids = tok.encode_batch(flat)
  token_docs, pos = [], 0
  for d in docs:
    token_docs.append(ids[pos:pos + len(d)])
    pos += len(d)
  stats = instances.InstanceStats()
  # One seed per (split, shard): deterministic whatever the number of processes.
  rng = random.Random(f"{s['prepare_seed']}/{split}/{k}")
  dupe = s["dupe_factor"] if split == "train" else s["eval_dupe_factor"]
  per_document = []
  insts = instances.create_instances(
      token_docs, max_seq_length=s["max_seq_length"], nsp=s["nsp"],
      short_seq_prob=s["short_seq_prob"], dupe_factor=dupe, cls_id=tok.cls_id, sep_id=tok.sep_id,
      rng=rng, stats=stats, num_own=num_own, per_document=per_document)
  top = int(np.argmax(per_document)) if per_document else 0
  own_sentences = sum(len(d) for d in docs[:num_own])
  text_bytes = sum(len(x.encode()) + 1 for d in docs[:num_own] for x in d)
  with tf.io.TFRecordWriter(record_path + ".tmp") as w:
    for inst in insts:
      w.write(_serialize(*inst, s["id_dtype"]))
  gf.rename(record_path + ".tmp", record_path, overwrite=True)
  info = {"file": name + ".tfrecord", "bytes": gf.stat(record_path).length,
          "documents": num_own, "sentences": own_sentences, "text_bytes": text_bytes,
          "unk_tokens": sum(x.count(tok.unk_id) for x in ids[:own_sentences]),
          "seconds": time.time() - t0,
          # The document with the most instances, to find one that swamps the rest.
          "largest_document": {"instances": per_document[top] if per_document else 0,
                               "start": docs[top][0][:80] if docs else "", "raw_shard": name},
          "settings": s, **stats.__dict__}
  _write_atomic(os.path.join(out_dir, name + ".json"), json.dumps(info).encode())
  return info


def _run_in_processes(tasks: list, num_processes: int) -> list[dict]:
  processes.run_workers([tasks[w::num_processes] for w in range(num_processes)],
                        "from bertjax.data import prepare; prepare._worker()")
  results = []
  for t in tasks:
    with _gfile().GFile(os.path.join(t[0], _shard_name(t[1], t[2], t[3]) + ".json"), "r") as f:
      results.append(json.load(f))
  return results


def _worker():
  for task in json.loads(sys.stdin.read()):
    # A worker process gets the vocabulary's (path, kind, casing) in each task (the same in all:
    # load_vocabulary's cache builds it once) and checks it is the one the shards record.
    tok = tokenizer_lib.load_vocabulary(*task[4])
    if tok.fingerprint != task[5]["tokenizer_fingerprint"]:
      raise ValueError(f"{task[4][0]} changed while shards were prepared: {tok.fingerprint}, not "
                       f"{task[5]['tokenizer_fingerprint']}.")
    _shard_task(task, tok)


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


def prepare(data: DataConfig, tok: tokenizer_lib.Tokenizer, *,
            num_workers: int | None = None) -> dict:
  """Runs (or resumes) both stages and writes the manifest; returns it. `tok` is the tokenizer
  of `data` (tokenizer.load_tokenizer), loaded once by the caller."""
  gf = _gfile()
  out_dir = prepared_dir(data, tok)
  storage.make_dirs(out_dir, "prepared_dir" if data.prepared_dir else "cache_dir")
  try:
    with processes.sigterm_raises():
      return _prepare(data, tok, out_dir, num_workers)
  except processes.PreparationStopped:
    total = sum(_num_shards(data, split) for split in SPLITS)
    finished = len(gf.glob(os.path.join(out_dir, "*-of-*.json")))
    raise processes.PreparationStopped(
        f"Preparation in {out_dir} stopped by SIGTERM, its worker processes too, with {finished} "
        f"of {total} shard(s) finished. They are kept: run the same command again to resume "
        f"(only the other shards are made).") from None


def _prepare(data: DataConfig, tok: tokenizer_lib.Tokenizer, out_dir: str,
             num_workers: int | None) -> dict:
  gf = _gfile()
  s = settings_of(data, tok)
  t0 = time.time()
  split_info = _split_stage(data, out_dir)
  # What a worker process loads the same tokenizer from (`_worker`).
  tok_spec = (tokenizer_lib.vocab_path_of(data), data.tokenizer, data.do_lower_case)
  tasks, infos = [], {}
  for split in SPLITS:
    n = _num_shards(data, split)
    for k in range(n):
      done = os.path.join(out_dir, _shard_name(split, k, n) + ".json")
      if gf.exists(done):  # finished by an earlier, interrupted run
        with gf.GFile(done, "r") as f:
          infos[(split, k)] = json.load(f)
        _refuse_other_settings(out_dir, infos[(split, k)].get("settings", {}), s,
                               f"a finished shard ({os.path.basename(done)})")
      else:
        tasks.append((out_dir, split, k, n, tok_spec, s))
  num_workers = num_workers or data.prepare_workers or os.cpu_count() or 1
  logging.info("Preparing %d shard(s) (%d already done) in %s with %d process(es).", len(tasks),
               len(infos), out_dir, min(num_workers, max(1, len(tasks))))
  if num_workers <= 1 or len(tasks) <= 1:
    results = [_shard_task(t, tok) for t in tasks]
  else:
    results = _run_in_processes(tasks, min(num_workers, len(tasks)))
  for t, info in zip(tasks, results):
    infos[(t[1], t[2])] = info
  splits = {split: _summarize([infos[(split, k)] for k in range(_num_shards(data, split))])
            for split in SPLITS}
  docs = split_info["documents"]
  if splits["train"]["instances"] == 0:
    raise ValueError(f"Source {data.source!r} gave {docs['train']} training and "
                     f"{docs['eval']} held-out document(s) (eval_fraction "
                     f"{data.eval_fraction}) but no training instance: all held out, or "
                     f"every document empty after tokenization.")
  seconds = time.time() - t0
  text_bytes = split_info["corpus"]["bytes"]
  manifest = {"settings": s, "splits": splits, "corpus": split_info["corpus"],
              "documents": split_info["documents"], "vocab_size": tok.vocab_size,
              "seconds": seconds, "mb_per_s": text_bytes / 1e6 / max(seconds, 1e-9)}
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
          "%s): it starts %r (raw shard %s). One huge document swamps the others; check it.",
          split, big["instances"], sp["instances"], 100 * big["instances"] / sp["instances"],
          data.max_document_pair_share, big["start"], big["raw_shard"])
  corpus_stats = split_info["corpus"]
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
  gf = _gfile()
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
    raise ValueError(f"Prepared shards in {out_dir} were tokenized with "
                     f"{have.get('tokenizer_fingerprint')}, but the configured vocabulary "
                     f"{tokenizer_lib.vocab_path_of(data)} is {tok.fingerprint}. Prepare "
                     f"again into another "
                     f"prepared_dir (or leave prepared_dir empty to use a settings-named cache).")
  want = settings_of(data, tok)
  diff = {k: (have.get(k), v) for k, v in want.items() if have.get(k) != v}
  if diff:
    raise ValueError(f"Prepared shards in {out_dir} were made with other settings "
                     f"(key: (prepared, configured)): {diff}.")
  manifest["dir"] = out_dir
  if check_files:
    for split in SPLITS:
      for name, size in zip(manifest["splits"][split]["files"], manifest["splits"][split]["bytes"]):
        p = os.path.join(out_dir, name)
        actual = gf.stat(p).length if gf.exists(p) else -1
        if actual != size:
          raise ValueError(f"Shard {p} has {actual} bytes but the manifest says {size}: it is "
                           f"missing, truncated or corrupt. Delete it and its .json and "
                           f"{path}, then prepare again (only that shard is redone).")
  return manifest


def check_config(data: DataConfig, model_config=None):
  """Refuses, before any work, lengths that preparation would accept and training could not use."""
  L, M = data.max_seq_length, data.max_predictions_per_seq
  if L < 5:
    raise ValueError(f"config.data.max_seq_length={L} leaves no room for [CLS] A [SEP] B [SEP]; "
                     f"use at least 5 (128 or 512 as the original).")
  if not 1 <= M <= L:
    raise ValueError(f"config.data.max_predictions_per_seq={M} must be within 1 and "
                     f"max_seq_length={L}: it is the number of masked slots per sequence. Use "
                     f"about 0.15 x max_seq_length (20 at 128, 76 at 512).")
  packing.settings(data)  # its keys are refused here too, before anything is prepared
  if model_config is not None and L > model_config.max_position_embeddings:
    raise ValueError(f"config.data.max_seq_length={L} exceeds config.model."
                     f"max_position_embeddings={model_config.max_position_embeddings}: the model "
                     f"has no position for the tokens beyond. Lower max_seq_length or raise "
                     f"max_position_embeddings.")


def ensure_prepared(data: DataConfig, tok: tokenizer_lib.Tokenizer, *,
                    num_workers: int | None = None) -> dict:
  """Prepares shards unless a matching manifest exists (cached, resumable); returns the manifest."""
  check_config(data)
  out_dir = prepared_dir(data, tok)
  if _gfile().exists(os.path.join(out_dir, "manifest.json")):
    return load_manifest(data, tok)
  prepare(data, tok, num_workers=num_workers)
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
  try:
    m = ensure_prepared(data, tokenizer_lib.load_tokenizer(data))
  except processes.PreparationStopped as err:
    print(f"bertjax.data.prepare: {err}", file=sys.stderr, flush=True)
    sys.exit(128 + signal.SIGTERM)  # what a shell reports for SIGTERM: scripts do not go on
  print(f"prepared {m['dir']}: train {m['splits']['train']['instances']} instances in "
        f"{len(m['splits']['train']['files'])} shard(s), eval {m['splits']['eval']['instances']}; "
        f"{m['corpus']['bytes'] / 1e6:.1f} MB of text at {m['mb_per_s']:.2f} MB/s")


if __name__ == "__main__":
  from absl import flags
  from bertjax import cli
  cli.define_config_flag()
  flags.mark_flags_as_required(["config"])
  cli.run(main)
