"""Storage: folders named by their config key, and the check that all processes share the store."""

import dataclasses
import threading

import numpy as np
import pytest

from bertjax.data import storage
from test_data_fixtures import data_config


def _run_processes(configs):
  """Runs check_shared_storage as len(configs) threads standing in for processes; each thread's
  config is what that process sees (a separate folder = a separate host's disk)."""
  n = len(configs)
  barrier = threading.Barrier(n)
  slots = [None] * n
  results = [None] * n

  def allgather_for(p):
    def allgather(x):
      slots[p] = np.asarray(x)
      barrier.wait()
      out = np.stack(slots)
      barrier.wait()  # nobody overwrites a slot before every process has read them all
      return out
    return allgather

  def run(p):
    try:
      storage.check_shared_storage(configs[p], p, n, allgather=allgather_for(p))
    except Exception as err:  # pylint: disable=broad-except
      results[p] = err

  threads = [threading.Thread(target=run, args=(p,)) for p in range(n)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=60)
  return results


def test_one_folder_seen_by_every_process_passes(tmp_path):
  c = data_config(tmp_path, n_docs=0)
  assert _run_processes([c, c, c]) == [None, None, None]
  # The probes are removed again.
  assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".bertjax-probe")]


def test_a_folder_local_to_each_host_is_refused_on_every_process(tmp_path):
  # The same path on two hosts names two disks: simulated by two folders.
  configs = [data_config(tmp_path / f"host{p}", n_docs=0) for p in range(2)]
  errors = _run_processes(configs)
  assert all(isinstance(e, ValueError) for e in errors), errors
  assert "is not shared by the 2 processes" in str(errors[0])
  assert "--config.data.cache_dir=gs://BUCKET/bertjax-cache" in str(errors[1])
  # Shards in a shared prepared_dir do not help while the vocabulary is trained into cache_dir.
  configs = [dataclasses.replace(c, tokenizer="sentencepiece", vocab_path="",
                                 prepared_dir=str(tmp_path / "shared")) for c in configs]
  errors = _run_processes(configs)
  assert all("config.data.cache_dir=" in str(e) for e in errors), errors


def test_urls_and_single_processes_are_not_probed(tmp_path):
  def never(x):
    raise AssertionError("no collective expected")
  c = data_config(tmp_path, n_docs=0, cache_dir="gs://bucket/cache")
  storage.check_shared_storage(c, 0, 4, allgather=never)
  c = data_config(tmp_path, n_docs=0)
  storage.check_shared_storage(c, 0, 1, allgather=never)
  c = data_config(tmp_path, n_docs=0, prepared_dir="gs://bucket/prepared")  # WordPiece: no cache
  storage.check_shared_storage(c, 1, 4, allgather=never)


def test_make_dirs_names_the_config_key(tmp_path):
  (tmp_path / "file").write_text("x")
  with pytest.raises(OSError, match=r"Cannot create the folder .*file/sub \(from "
                                    r"config.data.prepared_dir\)"):
    storage.make_dirs(str(tmp_path / "file" / "sub"), "prepared_dir")
