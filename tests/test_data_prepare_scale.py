"""Preparation at scale: the same bytes from Apache Beam and the local driver, whatever the workers,
pieces of input, retries or hosts; memory bounds; a pod where every host prepares its share.

Run as a script, this file is one host of a two-process pod (see `host`).
"""

import dataclasses
import gzip
import importlib.util
import json
import os
import re
import socket
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from bertjax.data import prepare, tokenizer as tokenizer_lib
from bertjax.data.corpora import sentences
from bertjax.data.preparation import shards
from test_data_fixtures import data_config, random_documents, write_corpus

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _corpus(tmp_path) -> str:
  """Three inputs: a large plain file (cut into pieces), a small one, a gzip one."""
  os.makedirs(tmp_path, exist_ok=True)
  big = write_corpus(str(tmp_path / "a.txt"), random_documents(40, 12, seed=1))
  small = write_corpus(str(tmp_path / "b.txt"), random_documents(8, 12, seed=2))
  with open(small, "ab") as f:
    f.write(b"\nbaba \xff baba.\nbebe baba.\n")  # invalid UTF-8, counted
  text = "\n\n".join("\n".join(d) for d in random_documents(12, 12, seed=3)) + "\n"
  with gzip.open(tmp_path / "c.txt.gz", "wt") as f:
    f.write(text)
  return f"{big},{small},{tmp_path / 'c.txt.gz'}"


def _config(tmp_path, name, **kw):
  return data_config(tmp_path / "data", n_docs=0, source=_corpus(tmp_path / "corpus"),
                     prepared_dir=str(tmp_path / name), **kw)


def _prepare(c, **kw):
  return prepare.ensure_prepared(c, tokenizer_lib.load_tokenizer(c), **kw)


def _shards(d) -> dict:
  return {f: open(os.path.join(d, f), "rb").read() for f in sorted(os.listdir(d))
          if f.endswith(".tfrecord")}


def _counts(m) -> dict:
  return {s: {k: v for k, v in m["splits"][s].items() if k != "shard_seconds"}
          for s in prepare.SPLITS}


def test_pieces_of_input_give_the_same_bytes(tmp_path):
  one = _prepare(_config(tmp_path, "one", input_split_bytes=0))  # whole files, one worker
  # The large file cut into ~4 pieces at blank lines (two processes against one: in
  # test_data_prepare.py; Beam's two workers: below).
  c2 = _config(tmp_path, "two", input_split_bytes=6000)
  two = _prepare(c2)
  units = json.load(open(tmp_path / "two" / "raw" / "parts" / "00000-of-00006.json"))["unit"]
  assert units["start"] == 0 and 0 < units["end"] < os.path.getsize(tmp_path / "corpus" / "a.txt")
  want = _shards(tmp_path / "one")
  assert len(want) == 5 and _shards(tmp_path / "two") == want
  assert _counts(one) == _counts(two) and one["corpus"] == two["corpus"]
  assert one["corpus"]["files"] == 3 and one["documents"]["train"] + one["documents"]["eval"] == 61
  assert one["corpus"]["invalid_utf8_lines"] == 1
  # The same documents in one file, in reverse order: a shard's order is its documents' keys'.
  docs = [d for seed, n in ((1, 40), (2, 8), (3, 12)) for d in random_documents(n, 12, seed=seed)]
  docs.append(["baba \ufffd baba.", "bebe baba."])
  c3 = dataclasses.replace(c2, source=write_corpus(str(tmp_path / "reversed.txt"), docs[::-1]),
                           prepared_dir=str(tmp_path / "reversed"))
  _prepare(c3)
  assert _shards(tmp_path / "reversed") == want


def _record_corpus(d) -> dict:
  """The same 48 documents as Parquet (three files of four row groups), as JSON Lines (zstd), half
  Parquet and half JSON Lines, and already cut into sentences as text: sources by name."""
  d.mkdir()
  docs = random_documents(48, 8, seed=5)
  texts = [" ".join(doc[:4]) + "\n" + " ".join(doc[4:]) for doc in docs]  # two paragraphs each
  split = [sentences.split_document(t) for t in texts]
  assert sum(map(len, split)) > 4 * len(split)  # the segmenter cut them: not one line a document
  (d / "pq").mkdir()
  for k in range(3):
    pq.write_table(pa.table({"text": texts[16 * k:16 * k + 16]}), d / "pq" / f"part-{k}.parquet",
                   row_group_size=4)
  lines = [json.dumps({"text": t}).encode() + b"\n" for t in texts]
  (d / "all.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(b"".join(lines)))
  (d / "rest.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(b"".join(lines[32:])))
  return {"twin": write_corpus(str(d / "twin.txt"), split), "parquet": f"{d}/pq/*.parquet",
          "jsonl": str(d / "all.jsonl.zst"),
          "mixed": f"{d}/pq/part-[01].parquet,{d}/rest.jsonl.zst"}


def test_parquet_json_lines_and_their_text_twin_give_the_same_shards(tmp_path):
  """One corpus as Parquet over files and row groups, as zstd JSON Lines and as text already in
  sentences: the same shard bytes on the local driver, whatever the units, and on Beam's two
  workers (over Parquet and JSON Lines at once)."""
  sources = _record_corpus(tmp_path / "corpus")
  base = data_config(tmp_path / "data", n_docs=0, source=sources["twin"])

  def made(name, **kw):
    c = dataclasses.replace(base, source=sources[name], prepared_dir=str(tmp_path / name), **kw)
    m = _prepare(c)
    return _shards(tmp_path / name), m

  want, twin = made("twin")
  got, m = made("parquet", input_split_bytes=1500)  # runs of row groups: several per file
  parts = sorted(os.listdir(tmp_path / "parquet" / "raw" / "parts"))
  assert len(parts) > 2 * 3 * 2  # more units than files (a .bin and a .json each)
  assert len(want) == 5 and got == want and m["corpus"]["documents"] == 48
  assert made("jsonl")[0] == want
  if importlib.util.find_spec("apache_beam"):  # the `beam` extra (make test installs it)
    assert made("mixed", input_split_bytes=1500, prepare_engine="beam",
                prepare_workers=2)[0] == want
  assert twin["splits"]["train"]["instances"] == m["splits"]["train"]["instances"]


def test_a_damaged_parquet_file_leaves_nothing_that_looks_complete(tmp_path):
  """A row group that cannot be read is refused naming it; the pieces read before it keep their
  markers, its own has none (only a temporary file, which nothing reads), and no shard or
  manifest is written."""
  sources = _record_corpus(tmp_path / "corpus")
  damaged = tmp_path / "corpus" / "pq" / "part-2.parquet"
  data = damaged.read_bytes()
  damaged.write_bytes(data[:4] + b"\xff" * 200 + data[204:])  # its first pages; the footer reads
  c = data_config(tmp_path / "data", n_docs=0, source=sources["parquet"], input_split_bytes=1500,
                  prepared_dir=str(tmp_path / "out"))
  with pytest.raises(ValueError, match=r"part-2.parquet, row group 0: cannot be read .*"
                                       r"truncated or corrupt"):
    _prepare(c)
  parts = tmp_path / "out" / "raw" / "parts"
  units = [json.load(open(parts / f))["unit"] for f in os.listdir(parts) if f.endswith(".json")]
  assert units and all("part-2" not in u["input"] for u in units)
  assert [f for f in os.listdir(parts) if ".tmp-" in f]
  assert not [f for f in os.listdir(tmp_path / "out") if f.endswith(".json")]


def test_memory_bounds_refuse_a_shard_too_large_and_hold_a_corpus_larger(tmp_path):
  # 28 KB of text; no worker holds more than 4 KB of input or 14 KB of a shard's text.
  c = _config(tmp_path, "bounded", input_split_bytes=4000, max_shard_bytes=14_000)
  m = _prepare(c)
  assert m["corpus"]["bytes"] > 2 * 14_000
  parts = tmp_path / "bounded" / "raw" / "parts"
  markers = [json.load(open(parts / f)) for f in sorted(os.listdir(parts)) if f.endswith(".json")]
  # The gzip file (5.6 KB of text, one piece: gzip is read from its start) was written out as
  # it was read, in chunks of at most 4 KB.
  assert markers[-1]["unit"]["input"].endswith(".gz") and markers[-1]["corpus"]["bytes"] > 4000
  assert max(len(chunks) for chunks in markers[-1]["chunks"].values()) > 1
  with pytest.raises(ValueError, match=r"A train shard would hold 2[0-9],[0-9]{3} bytes of text, above "
                                       r"config.data.max_shard_bytes=14000 .* Raise num_shards"):
    _prepare(dataclasses.replace(c, num_shards=1, prepared_dir=str(tmp_path / "one_shard")))


def test_older_format_is_refused_with_what_to_do(tmp_path):
  c = data_config(tmp_path, prepared_dir=str(tmp_path / "p"))
  _prepare(c)
  path = tmp_path / "p" / "manifest.json"
  m = json.loads(path.read_text())
  m["settings"]["format_version"] = 2
  path.write_text(json.dumps(m))
  with pytest.raises(ValueError, match=r"are of format 2, this bertjax reads format 3 .*Delete"):
    prepare.load_manifest(c, tokenizer_lib.load_tokenizer(c))


def test_beam_equals_local_and_a_failed_worker_retried_changes_nothing(tmp_path, monkeypatch):
  pytest.importorskip("apache_beam")  # the `beam` extra (make test installs it)
  local = _prepare(_config(tmp_path, "local", input_split_bytes=0))
  # Two worker processes of Beam's local runner; the first shard built fails half written.
  fail_dir = tmp_path / "fail"
  fail_dir.mkdir()
  monkeypatch.setenv(shards.FAIL_ONCE_ENV, str(fail_dir))
  c = _config(tmp_path, "beam", input_split_bytes=6000, prepare_engine="beam", prepare_workers=2)
  with pytest.raises(Exception, match="fails once, half written"):
    _prepare(c)
  d = tmp_path / "beam"
  failed = next(f for f in os.listdir(fail_dir) if f != "failed")
  assert not (d / "manifest.json").exists() and not (d / f"{failed}.tfrecord").exists()
  assert [f for f in os.listdir(d) if f.startswith(f"{failed}.tfrecord.tmp-")]  # never read
  # The retry (Dataflow retries a failed bundle; here: the same command again) does only the rest.
  before = {f: os.stat(d / f).st_mtime_ns for f in os.listdir(d) if f.endswith(".json")}
  before.update({f"raw/parts/{f}": os.stat(d / "raw" / "parts" / f).st_mtime_ns
                 for f in os.listdir(d / "raw" / "parts")})
  m = _prepare(c)
  assert _shards(d) == _shards(tmp_path / "local")
  assert _counts(m) == _counts(local) and m["corpus"] == local["corpus"]
  assert {f: os.stat(d / f).st_mtime_ns for f in before} == before


def test_beam_refuses_bad_input_as_the_local_driver_does(tmp_path, capfd):
  """A refusal raised in a Beam worker comes back as its own message (no step of Beam's), with
  nothing of Beam's output (its workers' logs: 227 to 272 lines and 6 tracebacks for one refusal);
  the command then says it in one line."""
  pytest.importorskip("apache_beam")  # the `beam` extra (make test installs it)
  from bertjax.errors import Refusal  # pylint: disable=import-outside-toplevel
  c = data_config(tmp_path, prepare_engine="beam", prepare_workers=1)
  (tmp_path / "packed.txt").write_bytes(gzip.compress(b"Baba bebe.\n"))
  with pytest.raises(ValueError, match="packed.txt is gzip-compressed but its name does not end"):
    _prepare(dataclasses.replace(c, source=str(tmp_path / "packed.txt")))
  (tmp_path / "empty.txt").write_text("\n\n   \n")
  capfd.readouterr()
  with pytest.raises(Refusal) as refused:  # raised in a worker, at the step "shard tasks"
    _prepare(dataclasses.replace(c, source=str(tmp_path / "empty.txt")))
  assert re.fullmatch(r"Source '.*empty.txt' yielded no document \(1 file\(s\), \d+ bytes\): "
                      r"nothing to prepare\.", str(refused.value)), str(refused.value)
  said = capfd.readouterr().err
  assert "Traceback" not in said and "apache_beam" not in said, said[-3000:]


def test_beam_options_pass_through():
  pytest.importorskip("apache_beam")  # the `beam` extra (make test installs it)
  from bertjax.data.preparation import beam as beam_prepare
  o = beam_prepare.pipeline_options("", 3).get_all_options()
  assert o["direct_num_workers"] == 3 and o["direct_running_mode"] == "multi_processing"
  o = beam_prepare.pipeline_options("runner=DataflowRunner,project=p,region=r,"
                                    "temp_location=gs://b/tmp", 3).get_all_options()
  assert (o["runner"], o["project"], o["temp_location"]) == ("DataflowRunner", "p", "gs://b/tmp")
  assert o["direct_num_workers"] == 1  # Beam's default, untouched for another runner
  with pytest.raises(ValueError, match="'oops' is not key=value"):
    beam_prepare.pipeline_options("runner=DirectRunner,oops", 2)


def test_beams_own_refusals_of_the_options_name_the_config_key(capfd):
  """Beam's ValueError for an unknown runner named no config key; a value of the wrong type came
  after Beam's usage text (argparse's, 120 lines) and ended the process."""
  pytest.importorskip("apache_beam")  # the `beam` extra (make test installs it)
  from bertjax.data.preparation import beam as beam_prepare
  from bertjax.errors import Refusal  # pylint: disable=import-outside-toplevel
  with pytest.raises(Refusal, match=re.escape(
      "config.data.beam_pipeline_options='runner=NoSuchRunner': Unexpected pipeline runner: "
      "NoSuchRunner. Valid values are ")) as refused:
    beam_prepare.pipeline_of("runner=NoSuchRunner", 2)
  assert str(refused.value).endswith("Name one of those as runner=, or none to run here.")
  with pytest.raises(Refusal, match=re.escape(
      "config.data.beam_pipeline_options='direct_num_workers=two': Beam refuses it (argument "
      "--direct_num_workers: invalid int value: 'two'): give that option a value of its kind, "
      "or leave it out.")):
    beam_prepare.pipeline_of("direct_num_workers=two", 2)
  assert "usage:" not in capfd.readouterr().err


def host(address: str, process_id: int, config_json: str) -> None:
  """One host of a two-process pod: pretrain_job.prepare_data, recording what this host did."""
  from bertjax.data.config import DataConfig
  from bertjax.parallel import distributed
  from bertjax.pretrain import job as pretrain_job
  assert distributed.initialize(address, 2, process_id)
  done = []
  scatter, build = shards.scatter_unit, shards.build_shard
  shards.scatter_unit = lambda t, d: done.append(f"piece {t['u']}") or scatter(t, d)
  shards.build_shard = lambda t, tok: done.append(
      shards.shard_name(t["split"], t["k"], t["n"])) or build(t, tok)
  _, manifest = pretrain_job.prepare_data(DataConfig(**json.loads(config_json)))
  print("DONE " + json.dumps({"did": done, "instances": manifest["splits"]["train"]["instances"]}),
        flush=True)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def test_every_host_of_a_pod_prepares_its_share(tmp_path):
  c = _config(tmp_path, "pod", input_split_bytes=6000)
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
         "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
  address = f"127.0.0.1:{_free_port()}"
  procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), address, str(i),
                             json.dumps(dataclasses.asdict(c))], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for i in range(2)]
  outs = []
  try:
    for p in procs:
      out, err = p.communicate(timeout=300)
      assert p.returncode == 0, err[-3000:]
      outs.append(json.loads(out.split("DONE ", 1)[1].splitlines()[0]))
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  names = [shards.shard_name("train", k, 4) for k in range(4)] + [shards.shard_name("eval", 0, 1)]
  pieces = [f"piece {u}" for u in range(6)]
  # Host i: the pieces and the shards (train then eval, counted together) numbered i mod 2.
  assert outs[0]["did"] == pieces[0::2] + names[0::2]
  assert outs[1]["did"] == pieces[1::2] + names[1::2]
  assert outs[0]["instances"] == outs[1]["instances"]
  # The same bytes as one process preparing alone.
  _prepare(_config(tmp_path, "alone"))
  assert _shards(tmp_path / "pod") == _shards(tmp_path / "alone")


if __name__ == "__main__":
  host(sys.argv[1], int(sys.argv[2]), sys.argv[3])
