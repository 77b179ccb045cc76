"""The two steps of preparation, each a function of its inputs alone. Both drivers (local processes
in data/prepare.py, Apache Beam in beam.py) run only these, so their output is the same bytes
whatever runs them, in whatever order, bundling or number of workers.

scatter_unit: one piece of input (a byte range of a file cut at a blank line, a gzip file, ...) ->
  its documents, each given to a split and a shard by a hash of its text (never by arrival order),
  written as one part file per piece (compressed chunks, each of one shard) and a marker.
build_shard: one shard's chunks from every part -> documents sorted by their hash -> tokens -> NSP
  instances drawn with the seed (prepare_seed, split, shard) -> TFRecord and .json.
Every file is written whole under a temporary name and renamed, so a retried task writes the same
bytes and a killed one leaves nothing a later run would read; the marker or .json comes last.

Memory per worker: a scatter task buffers at most `input_split_bytes` of text before writing it
out; a build task holds one shard (at most `max_shard_bytes` of text, refused above that before any
shard is built) with its tokens and instances.
"""

import hashlib
import json
import os
import random
import time
import uuid
import zlib

import numpy as np

from bertjax.data import corpus
from bertjax.data.config import DataConfig
from bertjax.data.preparation import instances
from bertjax.errors import Refusal

SPLITS = ("train", "eval")
# Settings that decide which document goes to which shard (checked when a run resumes).
SPLIT_KEYS = ("source", "tfds_split", "eval_fraction", "num_shards", "num_eval_shards")
# A test's hook: a folder where the first build task to get there (a file named after its shard
# remembers which) fails after writing half of its shard, as a worker that dies mid-write.
FAIL_ONCE_ENV = "BERTJAX_PREPARE_FAIL_ONCE_DIR"


def gfile():
  import tensorflow as tf
  return tf.io.gfile


def temporary(path: str) -> str:
  """A name of its own for each attempt: two attempts at one task (a retry beside a straggler)
  never write into each other's file; the last rename wins, with the same bytes."""
  return f"{path}.tmp-{uuid.uuid4().hex[:12]}"


def write_atomic(path: str, data: bytes):
  gf = gfile()
  tmp = temporary(path)
  with gf.GFile(tmp, "wb") as f:
    f.write(data)
  gf.rename(tmp, path, overwrite=True)


def shard_name(split: str, k: int, n: int) -> str:
  return f"{split}-{k:05d}-of-{n:05d}"


def num_shards(data: DataConfig | dict, split: str) -> int:
  get = data.get if isinstance(data, dict) else lambda key: getattr(data, key)
  n = get("num_shards") if split == "train" else get("num_eval_shards")
  if n < 1:
    raise Refusal(f"{split} shard count must be >= 1, got {n}.")
  return n


def part_name(u: int, num_units: int) -> str:
  return os.path.join("raw", "parts", f"{u:05d}-of-{num_units:05d}")


def document_key(doc: corpus.Document) -> bytes:
  """The stable key of a document: a hash of its text (corpus.is_heldout hashes the same)."""
  return hashlib.sha1("\n".join(doc).encode("utf-8", errors="replace")).digest()


def assign(key: bytes, eval_fraction: float, n_train: int, n_eval: int) -> tuple[str, int]:
  """(split, shard) of a document: the first 8 bytes of its key choose the split as
  corpus.is_heldout does, the next 8 the shard."""
  held = int.from_bytes(key[:8], "big") < eval_fraction * 2.0**64
  return ("eval", int.from_bytes(key[8:16], "big") % n_eval) if held else \
      ("train", int.from_bytes(key[8:16], "big") % n_train)


def scatter_unit(task: dict, data: DataConfig) -> dict:
  """Step 1 for one piece of input; returns (and writes as `<part>.json`) its marker."""
  out_dir, u, units = task["out_dir"], task["u"], task["num_units"]
  unit, settings = task["unit"], task["split_settings"]
  path = os.path.join(out_dir, part_name(u, units))
  stats = corpus.CorpusStats()
  n = {s: num_shards(settings, s) for s in SPLITS}
  buffers, buffered = {}, 0
  # shard "split/k" -> [[offset, compressed length, documents, text bytes], ...]
  chunks: dict[str, list] = {}
  gf = gfile()
  gf.makedirs(os.path.dirname(path))
  tmp = temporary(path + ".bin")
  with gf.GFile(tmp, "wb") as out:
    out.write(b"")  # GFile creates the file at its first write: a piece without documents too
    offset = 0

    def flush():
      nonlocal offset
      for shard in sorted(buffers):
        docs = buffers[shard]
        text = "".join(docs).encode("utf-8")
        packed = zlib.compress(text, 1)  # fast: these bytes are read once, by build_shard
        out.write(packed)
        chunks.setdefault(shard, []).append([offset, len(packed), len(docs), len(text)])
        offset += len(packed)
      buffers.clear()

    for doc in corpus.unit_documents(unit, data, stats):
      split, k = assign(document_key(doc), settings["eval_fraction"], n["train"], n["eval"])
      text = "\n".join(doc) + "\n\n"
      buffers.setdefault(f"{split}/{k}", []).append(text)
      buffered += len(text)
      if buffered >= data.input_split_bytes:  # the bound on what a reader holds
        flush()
        buffered = 0
    flush()
  gf.rename(tmp, path + ".bin", overwrite=True)
  marker = {"unit": unit, "settings": settings, "corpus": stats.__dict__, "chunks": chunks}
  write_atomic(path + ".json", json.dumps(marker, sort_keys=True).encode())
  return marker


def merge_corpus_stats(markers: list[dict]) -> dict:
  out = corpus.CorpusStats().__dict__
  for m in markers:
    for key, value in m["corpus"].items():
      if key == "replaced_by_input":
        for name, (replaced, chars) in value.items():
          r, c = out[key].get(name, [0, 0])
          out[key][name] = [r + replaced, c + chars]
      else:
        out[key] += value
  return out


def shard_tasks(out_dir: str, markers: list[dict], num_units: int, settings: dict, tok_spec,
                max_shard_bytes: int, source: str) -> list[dict]:
  """The build tasks of every shard (train then eval), from the markers of all pieces; refuses a
  shard above `max_shard_bytes` and a corpus without documents before anything is built."""
  tasks = []
  total_docs = sum(m["corpus"]["documents"] for m in markers)
  if total_docs == 0:
    files = sum(m["corpus"]["files"] for m in markers)
    text = sum(m["corpus"]["bytes"] for m in markers)
    raise Refusal(f"Source {source!r} yielded no document ({files} file(s), {text} bytes): "
                  f"nothing to prepare.")
  for split in SPLITS:
    n = num_shards(settings, split)
    chunks = [[] for _ in range(n)]
    docs, text = [0] * n, [0] * n
    for u, m in enumerate(markers):
      for k in range(n):
        for off, length, count, size in m["chunks"].get(f"{split}/{k}", []):
          chunks[k].append([part_name(u, num_units) + ".bin", off, length])
          docs[k] += count
          text[k] += size
    biggest = max(text)
    if biggest > max_shard_bytes:
      need = -(-sum(text) // max_shard_bytes)
      raise Refusal(f"A {split} shard would hold {biggest:,} bytes of text, above "
                    f"config.data.max_shard_bytes={max_shard_bytes} (what one worker holds "
                    f"while building it). Raise num_{'eval_' if split == 'eval' else ''}shards "
                    f"to about {2 * need} or more, or raise max_shard_bytes.")
    for k in range(n):
      lend = []
      if docs[k] == 1:  # NotNext needs another document: the next non-empty shard lends its own
        lend = next((chunks[(k + j) % n] for j in range(1, n) if docs[(k + j) % n]), [])
      tasks.append({"out_dir": out_dir, "split": split, "k": k, "n": n, "chunks": chunks[k],
                    "lend": lend, "tok": tok_spec, "settings": settings})
  return tasks


def _read_chunks(out_dir: str, chunks: list) -> list[corpus.Document]:
  gf = gfile()
  texts = []
  for name, off, length in chunks:
    with gf.GFile(os.path.join(out_dir, name), "rb") as f:
      f.seek(off)
      texts.append(zlib.decompress(f.read(length)).decode("utf-8"))
  docs = [d.split("\n") for t in texts for d in t.split("\n\n") if d]
  # The shard's order: by key (a document's text decides; identical texts tie harmlessly).
  return [d for _, d in sorted(((document_key(d), d) for d in docs), key=lambda kd: kd[0])]


def serialize(tokens, num_a, label, dtype: str) -> bytes:
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


def _first_failure(fail_dir: str, name: str) -> bool:
  try:
    os.close(os.open(os.path.join(fail_dir, "failed"), os.O_CREAT | os.O_EXCL))
  except FileExistsError:
    return False
  os.close(os.open(os.path.join(fail_dir, name), os.O_CREAT))
  return True


def build_shard(task: dict, tok) -> dict:
  """Step 2 for one shard: its documents -> tokens -> instances -> TFRecord + .json."""
  import tensorflow as tf
  out_dir, split, k, n, s = task["out_dir"], task["split"], task["k"], task["n"], task["settings"]
  gf = gfile()
  name = shard_name(split, k, n)
  record_path = os.path.join(out_dir, name + ".tfrecord")
  t0 = time.time()
  docs = _read_chunks(out_dir, task["chunks"])
  num_own = len(docs)
  if s["nsp"] and num_own == 1:
    docs += _read_chunks(out_dir, task["lend"])
    if len(docs) == 1:
      raise Refusal(f"The {split} split has a single document; NSP draws NotNext segments "
                    f"from other documents. Add documents or set nsp=False.")
  flat = [sent for d in docs for sent in d]
  ids = tok.encode_batch(flat)
  token_docs, pos = [], 0
  for d in docs:
    token_docs.append(ids[pos:pos + len(d)])
    pos += len(d)
  stats = instances.InstanceStats()
  # One seed per (split, shard): the same draws whoever builds the shard, whenever.
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
  fail_dir = os.environ.get(FAIL_ONCE_ENV)
  tmp = temporary(record_path)
  with tf.io.TFRecordWriter(tmp) as w:
    for i, inst in enumerate(insts):
      w.write(serialize(*inst, s["id_dtype"]))
      if fail_dir and i == len(insts) // 2 and _first_failure(fail_dir, name):
        raise RuntimeError(f"{FAIL_ONCE_ENV}: {name} fails once, half written")
  gf.rename(tmp, record_path, overwrite=True)
  info = {"file": name + ".tfrecord", "bytes": gf.stat(record_path).length,
          "documents": num_own, "sentences": own_sentences, "text_bytes": text_bytes,
          "unk_tokens": sum(x.count(tok.unk_id) for x in ids[:own_sentences]),
          "seconds": time.time() - t0,
          # The document with the most instances, to find one that swamps the rest.
          "largest_document": {"instances": per_document[top] if per_document else 0,
                               "start": docs[top][0][:80] if docs else "", "shard": name},
          "settings": s, **stats.__dict__}
  write_atomic(os.path.join(out_dir, name + ".json"), json.dumps(info).encode())
  return info
