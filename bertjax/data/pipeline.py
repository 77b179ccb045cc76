"""Per-host tf.data input: prepared shards -> shuffled, masked, fixed-shape numpy batches.

Order is a pure function of (seed, epoch): shards are permuted every epoch and sequences are
permuted within windows of `shuffle_window` by stateless random ops; masks are hashes of (seed,
epoch, sequence id, position). So a pipeline started at step N yields exactly what an uninterrupted
one yields from its N-th batch on, and reaches step N by skipping whole files, not by replaying.

Host sharding: with at least as many shard files as processes, the epoch's files (in that epoch's
permutation) form one stream of N records and process p reads records [p N / P, (p + 1) N / P):
equal ranges that may start or end inside a file, so at most about one global batch per epoch is
left for a later epoch, whatever the shard sizes. With fewer files than processes, every process
reads the whole stream and keeps its rows of each global batch (complete, but each host reads
everything).

Packing (`data.packing`, training only; bertjax/data/packing.py has the row layout): each window
of sequences is masked as above, then packed into rows by best-fit decreasing and the rows
permuted; the rows of consecutive windows and epochs form one stream that is cut into batches. A
host reads every record of its range (files) or of the epoch (rows mode), so nothing waits for a
later epoch, and hosts no longer share epoch boundaries (their ranges pack into different numbers
of rows). A restart at step N must know how many rows the earlier windows made: it reads the
lengths of the records before it (no masking; a pass over this host's share of each earlier
epoch) and packs them again, then starts at the window that holds row N x batch.
"""

import dataclasses
import functools
import logging
import os

import numpy as np
import tensorflow as tf

from bertjax.data import masking, packing, prepare
from bertjax.data import tokenizer as tokenizer_lib
from bertjax.data.config import DataConfig
from bertjax.errors import Refusal

FEATURES = ("input_ids", "input_mask", "segment_ids", "masked_lm_positions", "masked_lm_ids",
            "masked_lm_weights", "next_sentence_labels")


@dataclasses.dataclass(frozen=True)
class EpochPlan:
  """What one host reads in one epoch."""
  files: tuple  # paths, in reading order
  bases: tuple  # global id of each file's first record (ids are fixed across epochs)
  counts: tuple  # records per file
  steps: int  # batches this epoch (equal on every host)
  rows_mode: bool  # True: read everything, keep this host's rows of each global batch
  skip: int = 0  # records of the first file that precede this host's range


def _permutation(n: int, seed: int, epoch: int) -> np.ndarray:
  return np.random.default_rng([seed, epoch, 0x5EED]).permutation(n)


def epoch_plan(manifest: dict, split: str, *, epoch: int, seed: int, shuffle: bool,
               global_batch_size: int, process_index: int, process_count: int) -> EpochPlan:
  sp = manifest["splits"][split]
  files = [os.path.join(manifest["dir"], f) for f in sp["files"]]
  counts = list(sp["counts"])
  bases = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(int).tolist()
  order = _permutation(len(files), seed, epoch) if shuffle else np.arange(len(files))
  host_batch = global_batch_size // process_count
  total = sum(counts)
  if len(files) < process_count:
    return EpochPlan(tuple(files[i] for i in order), tuple(bases[i] for i in order),
                     tuple(counts[i] for i in order), total // global_batch_size, True)
  # Equal record ranges, not whole files per host: with 16 files on 12 hosts, whole files would
  # stop every host at a one-file host's count and leave about a quarter of the epoch unread.
  lo = process_index * total // process_count
  hi = (process_index + 1) * total // process_count
  steps = (total // process_count) // host_batch  # the shortest range's batches
  ends = np.cumsum([counts[i] for i in order])
  mine = [i for i, end in zip(order, ends) if end > lo and end - counts[i] < hi]
  first_start = int(ends[list(order).index(mine[0])] - counts[mine[0]]) if mine else 0
  return EpochPlan(tuple(files[i] for i in mine), tuple(bases[i] for i in mine),
                   tuple(counts[i] for i in mine), steps, False, skip=lo - first_start)


def _plain(fn):
  """fn as tf.data traces it, without AutoGraph's rewrite: the input functions branch on Python
  values alone, and the rewrite (parsing and converting each function and all it calls) took
  ~1.2 s of each pipeline's start."""
  return tf.autograph.experimental.do_not_convert(fn)


def _windows(plan: EpochPlan, skip: int, *, window: int, shuffle: bool, seed: int,
             epoch: int) -> tf.data.Dataset:
  """Blocks of (global ids, serialized examples): each file cut into windows of `window` records,
  permuted within each window when shuffling; the first `skip` records of the stream left out.

  Whole blocks, not single records, flow through tf.data: per-record dataset ops would cost more
  than parsing and masking together.
  """
  files, bases, starts, drops = [], [], [], []
  for f, b, c in zip(plan.files, plan.bases, plan.counts):
    if skip >= c:
      skip -= c
      continue
    # Windows are aligned to the file's start, so a restart skips whole windows unread and
    # drops the rest of the offset from the first window after permuting it.
    files.append(f)
    bases.append(b)
    starts.append(skip // window * window)
    drops.append(skip % window)
    skip = 0
  if not files:
    return tf.data.Dataset.from_tensor_slices((tf.zeros([0, 0], tf.int64), tf.zeros([0, 0], tf.string)))
  epoch_seed = tf.constant(seed * 1_000_003 + epoch, tf.int64)

  def read(path, base, start, drop):
    def block(w, recs):
      ids = base + start + w * window + tf.range(tf.shape(recs, out_type=tf.int64)[0])
      if shuffle:
        # Keyed by the record id of the window's start: the same permutation after a restart.
        perm = tf.random.experimental.stateless_shuffle(
            tf.range(tf.shape(ids)[0]), seed=tf.stack([epoch_seed, ids[0]]))
        ids, recs = tf.gather(ids, perm), tf.gather(recs, perm)
      cut = tf.where(w == 0, drop, 0)
      return ids[cut:], recs[cut:]
    ds = tf.data.TFRecordDataset(path, buffer_size=1 << 20).skip(start).batch(window)
    return ds.enumerate().map(_plain(block))

  return tf.data.Dataset.from_tensor_slices(
      (tf.constant(files), tf.constant(bases, tf.int64), tf.constant(starts, tf.int64),
       tf.constant(drops, tf.int64))).flat_map(_plain(read))


def _epoch_dataset(plan: EpochPlan, *, epoch: int, skip_steps: int, seed: int, shuffle: bool,
                   window: int, host_batch: int, process_index: int, process_count: int,
                   parse_and_mask) -> tf.data.Dataset:
  per_step = host_batch * process_count if plan.rows_mode else host_batch
  ds = _windows(plan, plan.skip + skip_steps * per_step, window=window, shuffle=shuffle, seed=seed,
                epoch=epoch)
  ds = ds.rebatch(host_batch, drop_remainder=True)
  if plan.rows_mode:
    ds = ds.shard(process_count, process_index)
  ds = ds.take(plan.steps - skip_steps)
  ds = ds.map(_plain(lambda ids, recs: parse_and_mask(ids, recs, tf.constant(epoch, tf.int64))),
              num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
  return ds


class Pipeline:
  """Iterator of host-local batches (dicts of numpy arrays); infinite for train, one pass for eval."""

  def __init__(self, data: DataConfig, tok: tokenizer_lib.Tokenizer, *, split: str,
               global_batch_size: int, process_index: int = 0, process_count: int = 1,
               seed: int = 0, start_step: int = 0, manifest=None,
               include_example_ids: bool = False):
    if split not in prepare.SPLITS:
      raise ValueError(f"split must be one of {prepare.SPLITS}, got {split!r}.")
    if process_count < 1 or not 0 <= process_index < process_count:
      raise ValueError(f"process_index {process_index} is not within process_count {process_count}.")
    if global_batch_size <= 0 or global_batch_size % process_count:
      raise Refusal(f"global_batch_size {global_batch_size} must be a positive multiple of "
                    f"process_count {process_count}.")
    if start_step < 0:
      raise ValueError(f"start_step must be >= 0, got {start_step}.")
    # Shard sizes were checked by ensure_prepared; damage found while reading is reported then.
    self.manifest = manifest or prepare.load_manifest(data, tok, check_files=False)
    self.split, self.seed, self.start_step = split, seed, start_step
    self.shuffle = split == "train"
    self.global_batch_size, self.host_batch = global_batch_size, global_batch_size // process_count
    self.process_index, self.process_count = process_index, process_count
    self.window = data.shuffle_window
    self.prefetch = data.prefetch_batches
    self.L = data.max_seq_length
    on, self.max_per_row = packing.settings(data)
    # Evaluation stays one sequence per row: the same fixed held-out batches, packed run or not.
    self.packing = on and self.shuffle
    self.include_example_ids = include_example_ids
    self.fill = packing.FillStats()  # what packing has produced so far (benchmark, logs)
    spec = masking.spec_from_tokenizer(tok, data)
    id_dtype = self.manifest["settings"]["id_dtype"]
    self._parse_and_mask = _make_parse_and_mask(spec, self.L, seed,
                                                include_example_ids or self.packing, id_dtype)
    self._lengths = _make_lengths(self.L, id_dtype)
    n = self.manifest["splits"][split]["instances"]
    first = self.plan(0)
    if first.steps == 0:
      raise Refusal(f"The {split} split holds {n} sequence(s) in "
                    f"{len(self.manifest['splits'][split]['files'])} shard(s): not one batch of "
                    f"{self.host_batch} per host x {process_count} host(s). Use a smaller batch, "
                    f"more data or (for eval) a larger eval_fraction.")
    self.steps_per_epoch = first.steps
    dropped = n - first.steps * global_batch_size
    if dropped and process_index == 0 and not self.packing:  # packing reads every record
      # Per epoch, not for good: later epochs reorder the shards, so other sequences wait then.
      log = logging.warning if dropped > 0.01 * n else logging.info
      log("%s: %d of %d sequences (%.2f%%) per epoch do not fill a global batch of %d on %d "
          "host(s) and wait for a later epoch.", split, dropped, n, 100 * dropped / n,
          global_batch_size, process_count)
    self._iter = self._packed_batches() if self.packing else self._batches()

  def plan(self, epoch: int) -> EpochPlan:
    return epoch_plan(self.manifest, self.split, epoch=epoch, seed=self.seed, shuffle=self.shuffle,
                      global_batch_size=self.global_batch_size, process_index=self.process_index,
                      process_count=self.process_count)

  def _batches(self):
    epoch, skip = 0, self.start_step
    while True:
      plan = self.plan(epoch)
      if skip < plan.steps:
        break
      if not self.shuffle:
        return  # eval is one pass: a start beyond it yields nothing
      skip -= plan.steps
      epoch += 1
    while True:
      ds = _epoch_dataset(plan, epoch=epoch, skip_steps=skip, seed=self.seed, shuffle=self.shuffle,
                          window=self.window, host_batch=self.host_batch,
                          process_index=self.process_index, process_count=self.process_count,
                          parse_and_mask=self._parse_and_mask).prefetch(self.prefetch)
      try:
        yield from ds.as_numpy_iterator()
      except tf.errors.DataLossError as e:
        raise self._damaged(plan, e) from None
      if not self.shuffle:
        return
      epoch, skip = epoch + 1, 0
      plan = self.plan(epoch)

  def _damaged(self, plan: EpochPlan, e: tf.errors.DataLossError) -> Refusal:
    bad = _first_damaged(plan.files) or f"A {self.split} shard in {self.manifest['dir']}"
    return Refusal(f"{bad} is corrupt or truncated ({e.message.splitlines()[0]}). Delete it, "
                   f"its .json and {self.manifest['dir']}/manifest.json, then prepare again "
                   f"(only that shard is redone).")

  # --- packing (module docstring) -----------------------------------------------------------------

  def _budget(self, plan: EpochPlan) -> int:
    """Records this host packs per epoch: its range (the shortest host's length, so that ranges
    stay disjoint) or, in rows mode, every record."""
    total = self.manifest["splits"][self.split]["instances"]
    return total if plan.rows_mode else total // self.process_count

  def _window_of(self, plan: EpochPlan, example_id: int) -> tuple[int, int]:
    """(offset in the epoch's stream of records, global id) of the start of the window that holds
    record `example_id`: windows are aligned to file starts."""
    stream = 0
    for base, count in zip(plan.bases, plan.counts):
      if base <= example_id < base + count:
        inside = (example_id - base) // self.window * self.window
        return stream + inside, base + inside
      stream += count
    raise AssertionError(f"record {example_id} is in none of the epoch's files")

  def _epoch_blocks(self, plan: EpochPlan, epoch: int, fn, start: int, records_before: int):
    """(window offset, window key, block) of this host's windows of one epoch, from the window at
    stream offset `start`, after `records_before` records of the epoch's budget were used."""
    left = self._budget(plan) - records_before
    ds = _windows(plan, max(plan.skip, start), window=self.window, shuffle=self.shuffle,
                  seed=self.seed, epoch=epoch)
    call = _plain(lambda ids, recs: fn(ids, recs, tf.constant(epoch, tf.int64)))
    ds = ds.map(call, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True).prefetch(2)
    blocks = ds.as_numpy_iterator()
    while left > 0:
      try:
        block = next(blocks)
      except StopIteration:
        return
      except tf.errors.DataLossError as e:
        raise self._damaged(plan, e) from None
      n = len(block["example_ids"])
      if n == 0:
        continue
      if n > left:  # the end of this host's range: the next host takes the rest of the window
        block = {k: v[:left] for k, v in block.items()}
      left -= len(block["example_ids"])
      yield self._window_of(plan, int(block["example_ids"][0])) + (block,)

  def epoch_rows(self, epoch: int) -> list[tuple[int, int, int]]:
    """(window offset, records, rows) of each window this host packs in `epoch`, from the lengths
    alone: what a restart counts to find its first window."""
    out = []
    for offset, _, block in self._epoch_blocks(self.plan(epoch), epoch, self._lengths, 0, 0):
      lengths = block["lengths"]
      out.append((offset, len(lengths),
                  packing.best_fit_decreasing(lengths, self.L, self.max_per_row)[3]))
    return out

  def _packed_batches(self):
    rows_mode = self.plan(0).rows_mode
    per_step = self.global_batch_size if rows_mode else self.host_batch
    skip_rows, epoch, start, records_before = self.start_step * per_step, 0, 0, 0
    while skip_rows:  # whole epochs, then whole windows, counted from lengths
      windows = self.epoch_rows(epoch)
      total = sum(rows for _, _, rows in windows)
      if skip_rows >= total:
        skip_rows, epoch = skip_rows - total, epoch + 1
        continue
      for offset, records, rows in windows:
        if skip_rows < rows:
          start = offset
          break
        skip_rows -= rows
        records_before += records
      break
    pending, pos = [], 0  # packed row blocks not yet batched; rows of pending[0] already used
    available = 0
    while True:
      plan, stats = self.plan(epoch), packing.FillStats()
      for _, key, block in self._epoch_blocks(plan, epoch, self._parse_and_mask, start,
                                               records_before):
        rows = packing.pack(block, max_per_row=self.max_per_row,
                            rng=np.random.default_rng([self.seed, epoch, key, 0xBAC]))
        n_rows = len(rows["input_ids"])
        stats.add(len(block["example_ids"]), n_rows, int(block["input_mask"].sum()))
        if self.fill.rows == 0 and stats.rows == n_rows and self.process_index == 0:
          # Soon after the start, not only at the end of an epoch (hours on a large corpus).
          logging.info("packing, first window: %s", stats.describe(self.L))
        if skip_rows:  # the restart's first window: rows of steps already taken
          rows = {k: v[skip_rows:] for k, v in rows.items()}
          n_rows, skip_rows = n_rows - skip_rows, 0
        if not self.include_example_ids:
          rows.pop("example_ids")
        pending.append(rows)
        available += n_rows
        while available >= per_step:
          parts, need = [], per_step
          while need:
            take = min(need, len(pending[0]["input_ids"]) - pos)
            parts.append({k: v[pos:pos + take] for k, v in pending[0].items()})
            pos, need = pos + take, need - take
            if pos == len(pending[0]["input_ids"]):
              pending.pop(0)
              pos = 0
          available -= per_step
          batch = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
          if rows_mode:
            lo = self.process_index * self.host_batch
            batch = {k: v[lo:lo + self.host_batch] for k, v in batch.items()}
          yield batch
      self.fill.add(stats.sequences, stats.rows, stats.tokens)
      if self.process_index == 0:
        logging.info("packing, epoch %d%s: %s", epoch, " (from a restart)" if start else "",
                     stats.describe(self.L))
      epoch, start, records_before = epoch + 1, 0, 0

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    return next(self._iter)


def _first_damaged(files) -> str | None:
  """The first of `files` whose records fail their checksums (read again, only after an error)."""
  for path in files:
    try:
      for _ in tf.data.TFRecordDataset(path, buffer_size=1 << 20).batch(4096):
        pass
    except tf.errors.DataLossError:
      return path
  return None


@functools.lru_cache(maxsize=8)  # pipelines of the same settings share one traced function
def _make_parse_and_mask(spec: masking.MaskingSpec, L: int, seed: int, include_ids: bool,
                         id_dtype: str):
  raw_dtype = tf.uint16 if id_dtype == "uint16" else tf.int32
  schema = {"input_ids": tf.io.FixedLenFeature([], tf.string),
            "num_a": tf.io.FixedLenFeature([], tf.int64),
            "next_sentence_labels": tf.io.FixedLenFeature([], tf.int64)}

  # Traced once (fixed signature) and called from every epoch's dataset; tracing the masking graph
  # anew per epoch would cost about a second each time. No autograph (no tensor-dependent Python
  # control flow here): its cache of converted functions once handed this function the closure
  # of `_make_lengths`' one (a KeyError on 'num_a', once, in tests/test_loop.py).
  @tf.function(input_signature=[tf.TensorSpec([None], tf.int64), tf.TensorSpec([None], tf.string),
                                tf.TensorSpec([], tf.int64)], autograph=False)
  def parse_and_mask(ids_B, records_B, epoch):
    ex = tf.io.parse_example(records_B, schema)
    # Shorter sequences are zero-filled: padding comes for free.
    input_ids_BxL = tf.cast(tf.io.decode_raw(ex["input_ids"], raw_dtype, little_endian=True,
                                             fixed_length=L * raw_dtype.size), tf.int32)
    pos_1xL = tf.range(L, dtype=tf.int32)[None, :]
    input_mask_BxL = real_positions(input_ids_BxL)
    segment_ids_BxL = tf.cast(pos_1xL >= tf.cast(ex["num_a"], tf.int32)[:, None],
                              tf.int32) * input_mask_BxL
    masked_BxL, positions_BxM, labels_BxM, weights_BxM = masking.mask_batch(
        input_ids_BxL, input_mask_BxL, ids_B, seed=seed, epoch=epoch, spec=spec)
    out = {"input_ids": masked_BxL, "input_mask": input_mask_BxL,
           "segment_ids": segment_ids_BxL, "masked_lm_positions": positions_BxM,
           "masked_lm_ids": labels_BxM, "masked_lm_weights": weights_BxM,
           "next_sentence_labels": tf.cast(ex["next_sentence_labels"], tf.int32)}
    if include_ids:  # which prepared sequence each row is (tests, debugging)
      out["example_ids"] = ids_B
    return out

  return parse_and_mask


def real_positions(ids_BxL):
  """input_mask of zero-filled rows: every position up to the last non-zero id (a sequence's
  closing [SEP]). Where [PAD] is 0 no zero lies inside a sequence, so this is `ids != 0`; a
  tokenizer.json's id 0 may be a real piece (its [PAD] elsewhere), kept here."""
  nonzero_BxL = tf.cast(tf.not_equal(ids_BxL, 0), tf.int32)
  return tf.cast(tf.cumsum(nonzero_BxL, axis=1, reverse=True) > 0, tf.int32)


@functools.lru_cache(maxsize=8)
def _make_lengths(L: int, id_dtype: str):
  raw_dtype = tf.uint16 if id_dtype == "uint16" else tf.int32
  schema = {"input_ids": tf.io.FixedLenFeature([], tf.string)}

  @tf.function(input_signature=[tf.TensorSpec([None], tf.int64), tf.TensorSpec([None], tf.string),
                                tf.TensorSpec([], tf.int64)], autograph=False)
  def lengths(ids_B, records_B, epoch):
    del epoch
    ids_BxL = tf.io.decode_raw(tf.io.parse_example(records_B, schema)["input_ids"], raw_dtype,
                               little_endian=True, fixed_length=L * raw_dtype.size)
    # Counted as the masking counts input_mask, so both passes pack alike.
    return {"example_ids": ids_B,
            "lengths": tf.reduce_sum(tf.cast(real_positions(ids_BxL), tf.int64), axis=1)}

  return lengths


def make_pipeline(data: DataConfig, tok: tokenizer_lib.Tokenizer, *, split: str,
                  global_batch_size: int, process_index: int = 0, process_count: int = 1,
                  seed: int = 0, start_step: int = 0, include_example_ids: bool = False
                  ) -> Pipeline:
  """This host's slice of each global batch, from batch `start_step` on (see the module doc);
  `tok` is `data`'s tokenizer, loaded once where the run starts."""
  return Pipeline(data, tok, split=split, global_batch_size=global_batch_size,
                  process_index=process_index, process_count=process_count, seed=seed,
                  start_step=start_step, include_example_ids=include_example_ids)
