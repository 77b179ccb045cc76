"""Where vocabularies and prepared shards are stored: folders made with errors that name the
config key, and the check that every process of a multi-host run sees the same store.

Process 0 trains the vocabulary and prepares the shards; every other process reads them. On a pod
a local path (the default `.cache/bertjax`) is a different disk on each host, so the other hosts
would find nothing, after process 0 had spent hours preparing. `check_shared_storage` finds out
before: a URL (`gs://...`) is taken as shared; a local path is shared only if every process sees
the probe file each process writes there (true for several processes on one machine, as
`launch/local.sh` runs them, or for a network file system mounted on every host).
"""

import os
import secrets

import numpy as np

from bertjax.data.config import DataConfig
from bertjax.errors import Refusal
from bertjax.files import gfile


def make_dirs(path: str, key: str):
  """`makedirs` whose error names the config key that chose `path` (e.g. `cache_dir`)."""
  import tensorflow as tf
  try:
    gfile().makedirs(path)
  except (tf.errors.OpError, OSError) as err:
    message = getattr(err, "message", None) or str(err)
    raise OSError(f"Cannot create the folder {path} (from config.data.{key}): "
                  f"{message.splitlines()[0] if message else type(err).__name__}. Is a part of "
                  f"it an existing file, or not writable? Set config.data.{key} to a folder you "
                  f"can write (gs://BUCKET/... on a pod).") from None


def shared_roots(data: DataConfig) -> dict[str, str]:
  """The folders every process reads, by config key: the prepared shards' and, for a
  SentencePiece vocabulary trained here, the cache that holds it."""
  roots = {}
  if data.prepared_dir:
    roots["prepared_dir"] = data.prepared_dir
  if not data.prepared_dir or (data.tokenizer == "sentencepiece" and not data.vocab_path):
    roots["cache_dir"] = data.cache_dir
  return roots


def _default_allgather(x: np.ndarray) -> np.ndarray:
  from jax.experimental import multihost_utils
  return np.asarray(multihost_utils.process_allgather(x))


def check_shared_storage(data: DataConfig, process_index: int, process_count: int, *,
                         allgather=None):
  """Raises, on every process alike, when a folder of `shared_roots` is not one store for all.

  Call it on every process before preparing. `allgather(x)` stacks each process's array x along
  a new first axis (default: jax's process_allgather); it also serves as the barrier.
  """
  if process_count <= 1:
    return
  allgather = allgather or _default_allgather
  gf = gfile()
  local = {k: p for k, p in shared_roots(data).items() if "://" not in p}
  if not local:
    return
  # One name for this check, chosen by process 0: files of earlier checks never count.
  nonce = int(allgather(np.array(secrets.randbits(62), np.int64))[0])
  mine = {}
  for key, root in local.items():
    make_dirs(root, key)
    mine[key] = os.path.join(root, f".bertjax-probe-{nonce:x}-{process_index}")
    with gf.GFile(mine[key], "w") as f:
      f.write(str(process_index))
  allgather(np.array(0, np.int64))  # every probe is written
  seen = np.array([len(gf.glob(os.path.join(root, f".bertjax-probe-{nonce:x}-*")))
                   for root in local.values()], np.int64)
  seen_all = allgather(seen)  # [process, root]
  for path in mine.values():
    gf.remove(path)
  for j, (key, root) in enumerate(local.items()):
    short = {p: int(n) for p, n in enumerate(seen_all[:, j]) if n != process_count}
    if short:
      raise Refusal(
          f"config.data.{key}={root!r} is not shared by the {process_count} processes of this "
          f"run: each wrote a probe file there, but some process(es) see fewer than "
          f"{process_count} ({{process: probes seen}} = {short}). Process 0 prepares the data "
          f"there and every other process reads it, so it must be one store for all hosts: on a "
          f"pod pass --config.data.{key}=gs://BUCKET/bertjax-cache (or a file system mounted on "
          f"every host).")
