"""Offline preparation: determinism, resume, manifest, and bad input."""

import dataclasses
import json
import os

import pytest

from bertjax.data import pipeline, prepare, tokenizer as tokenizer_lib
from bertjax.data.preparation import processes
from test_data_fixtures import data_config, random_documents, write_corpus, write_vocab


def _prepared(c, **kwargs):
  """What a run does with its typed data config: load the tokenizer once, prepare with it."""
  return prepare.ensure_prepared(c, tokenizer_lib.load_tokenizer(c), **kwargs)


def _files(d):
  return {f: open(os.path.join(d, f), "rb").read() for f in sorted(os.listdir(d))
          if f.endswith((".tfrecord", ".json"))}


def test_deterministic_parallel_and_resumable(tmp_path, monkeypatch):
  c1 = data_config(tmp_path / "one", prepared_dir=str(tmp_path / "p1"))
  m1 = _prepared(c1)
  sp = m1["splits"]["train"]
  assert sp["instances"] == sum(sp["counts"]) > 0 and len(sp["files"]) == 4
  assert m1["settings"]["tokenizer_fingerprint"].startswith("wordpiece-")
  assert 0.4 < sp["not_next"] / sp["instances"] < 0.65
  # Two worker processes, the input read in pieces, give the same shards as one; the two workers
  # are started once for both steps (each start imports TensorFlow: seconds of CPU).
  c2 = data_config(tmp_path / "one", prepared_dir=str(tmp_path / "p2"), prepare_workers=2,
                   input_split_bytes=4000)
  started, real = [], processes.subprocess.Popen
  monkeypatch.setattr(processes.subprocess, "Popen",
                      lambda *a, **kw: started.append(a) or real(*a, **kw))
  _prepared(c2)
  monkeypatch.undo()
  assert len(started) == 2
  manifest2 = json.load(open(tmp_path / "p2" / "manifest.json"))
  assert manifest2["splits"]["train"]["instances"] == sp["instances"]
  strip = lambda fs: {k: v for k, v in fs.items() if k != "manifest.json" and not k.endswith(".json")}
  assert strip(_files(tmp_path / "p1")) == strip(_files(tmp_path / "p2"))
  # Interrupted run: one shard unfinished, no manifest. Only that shard is redone, identically.
  d = str(tmp_path / "p1")
  before = {f: os.stat(os.path.join(d, f)).st_mtime_ns for f in os.listdir(d)}
  os.remove(os.path.join(d, "manifest.json"))
  os.remove(os.path.join(d, "train-00002-of-00004.json"))
  content = open(os.path.join(d, "train-00002-of-00004.tfrecord"), "rb").read()
  with open(os.path.join(d, "train-00002-of-00004.tfrecord"), "wb") as f:
    f.write(content[:100])  # a half-written shard
  m1b = _prepared(c1)
  assert open(os.path.join(d, "train-00002-of-00004.tfrecord"), "rb").read() == content
  after = {f: os.stat(os.path.join(d, f)).st_mtime_ns for f in os.listdir(d)}
  changed = {f for f in before if before[f] != after.get(f)}
  assert changed == {"train-00002-of-00004.tfrecord", "train-00002-of-00004.json", "manifest.json"}
  timeless = lambda m: {s: {k: v for k, v in m["splits"][s].items() if k != "shard_seconds"}
                        for s in prepare.SPLITS}
  assert timeless(m1b) == timeless(m1)


def test_repairs_are_counted_in_the_manifest(tmp_path, caplog):
  docs = random_documents(20, 15)
  docs[3].insert(2, " ".join(["baba"] * 300))  # one line far longer than a sequence
  path = write_corpus(str(tmp_path / "c.txt"), docs)
  with open(path, "ab") as f:
    f.write(b"\nbaba \xff baba.\nbebe baba.\n")  # vocabulary words around an invalid byte
  c = data_config(tmp_path, n_docs=0, source=path)
  with caplog.at_level("WARNING"):
    m = _prepared(c)
  assert m["corpus"]["invalid_utf8_lines"] == 1 and m["corpus"]["invalid_utf8_chars"] == 1
  assert list(m["corpus"]["replaced_by_input"]) == [path]
  assert m["corpus"]["replaced_by_input"][path][0] == 1
  assert f"{path} (" in caplog.text  # the warning names the file and its share
  assert sum(m["splits"][s]["long_sentences_split"] for s in prepare.SPLITS) >= 1
  # The tokenizer deletes U+FFFD, as the original: every word of this corpus is in the
  # vocabulary, so not one [UNK] (a kept U+FFFD would be one).
  assert m["splits"]["train"]["unk_tokens"] + m["splits"]["eval"]["unk_tokens"] == 0


def test_empty_corpus_and_no_instances(tmp_path):
  empty = tmp_path / "empty.txt"
  empty.write_text("\n\n   \n")
  c = data_config(tmp_path, n_docs=0, source=str(empty))
  with pytest.raises(ValueError, match="yielded no document"):
    _prepared(c)
  c = data_config(tmp_path / "all_eval", eval_fraction=1.0)
  with pytest.raises(ValueError, match="no training instance"):
    _prepared(c)
  c = data_config(tmp_path / "nomatch", n_docs=0, source=str(tmp_path / "missing-*.txt"))
  with pytest.raises(FileNotFoundError, match="No file matches"):
    _prepared(c)


def test_fingerprint_and_settings_mismatch(tmp_path):
  c = data_config(tmp_path, prepared_dir=str(tmp_path / "prep"))
  _prepared(c)
  other_vocab = str(tmp_path / "other.txt")
  write_vocab(other_vocab)
  with open(other_vocab, "a") as f:
    f.write("zzextra\n")
  c_other = data_config(tmp_path, prepared_dir=str(tmp_path / "prep"), vocab_path=other_vocab)
  with pytest.raises(ValueError, match="were tokenized with wordpiece-.* but the configured"):
    _prepared(c_other)
  with pytest.raises(ValueError, match="were tokenized with"):
    pipeline.make_pipeline(c_other, tokenizer_lib.load_tokenizer(c_other), split="train",
                           global_batch_size=8)
  c_len = data_config(tmp_path, prepared_dir=str(tmp_path / "prep"), max_seq_length=128)
  with pytest.raises(ValueError, match="max_seq_length': \\(64, 128\\)"):
    prepare.load_manifest(c_len, tokenizer_lib.load_tokenizer(c_len))
  # The default, settings-named folder simply prepares anew.
  c_default = data_config(tmp_path, vocab_path=other_vocab)
  assert _prepared(c_default)["dir"] != str(tmp_path / "prep")


def test_truncated_and_corrupt_shards(tmp_path):
  c = data_config(tmp_path, prepared_dir=str(tmp_path / "prep"))
  _prepared(c)
  shard = str(tmp_path / "prep" / "train-00001-of-00004.tfrecord")
  data = open(shard, "rb").read()
  with open(shard, "wb") as f:
    f.write(data[:-50])
  with pytest.raises(ValueError, match="truncated or corrupt"):
    _prepared(c)
  # Same size, flipped bytes: caught by the record checksums while reading.
  bad = bytearray(data)
  for i in range(len(bad) // 2, len(bad) // 2 + 20):
    bad[i] ^= 0xFF
  with open(shard, "wb") as f:
    f.write(bytes(bad))
  p = pipeline.make_pipeline(c, tokenizer_lib.load_tokenizer(c), split="train",
                             global_batch_size=8)
  with pytest.raises(ValueError, match=f"{shard} is corrupt or truncated .*Delete it"):
    for _ in range(10 * p.steps_per_epoch):
      next(p)


def test_missing_manifest_is_a_clear_error(tmp_path):
  c = data_config(tmp_path)
  with pytest.raises(FileNotFoundError, match="ensure_prepared"):
    pipeline.make_pipeline(c, tokenizer_lib.load_tokenizer(c), split="train",
                           global_batch_size=8)


def test_single_document_shard_borrows_notnext_segments(tmp_path):
  # 5 documents in 4 shards (by the hash of their text): some shards hold one document.
  c = data_config(tmp_path, n_docs=5, sents_per_doc=30, eval_fraction=0.0)
  m = _prepared(c)
  sp = m["splits"]["train"]
  assert sp["documents"] == 5 and sp["not_next"] > 0
  infos = [json.load(open(os.path.join(m["dir"], f[:-len(".tfrecord")] + ".json")))
           for f in sp["files"]]
  single = [i for i in infos if i["documents"] == 1]
  assert single and all(i["instances"] > 0 and i["not_next"] > 0 for i in single)
  c1 = data_config(tmp_path / "one", n_docs=1, sents_per_doc=30, eval_fraction=0.0)
  with pytest.raises(ValueError, match="single document"):
    _prepared(c1)


def test_blank_line_after_every_sentence_warns(tmp_path, caplog):
  docs = [[s] for d in random_documents(10, 10) for s in d]  # the frequent formatting mistake
  c = data_config(tmp_path, n_docs=0, source=write_corpus(str(tmp_path / "c.txt"), docs))
  with caplog.at_level("WARNING"):
    m = _prepared(c)
  assert "Almost every document has one sentence" in caplog.text
  assert m["splits"]["train"]["not_next"] == m["splits"]["train"]["instances"]


def test_resume_refuses_a_preparation_started_with_other_settings(tmp_path):
  c = data_config(tmp_path, prepared_dir=str(tmp_path / "prep"))
  _prepared(c)
  d = tmp_path / "prep"
  # Interrupted: no manifest, one shard unfinished. Resuming at another length would mix shards.
  os.remove(d / "manifest.json")
  os.remove(d / "train-00002-of-00004.json")
  c_len = data_config(tmp_path, prepared_dir=str(d), max_seq_length=128)
  with pytest.raises(ValueError, match=r"a finished shard \(train-00000-of-00004.json\) made with "
                                       r"other settings .*'max_seq_length': \(64, 128\).*Delete"):
    _prepared(c_len)
  # Interrupted after the first step only: the pieces of input read are checked too.
  for f in os.listdir(d):
    if f.endswith(".json"):
      os.remove(d / f)
  c_frac = data_config(tmp_path, prepared_dir=str(d), eval_fraction=0.3)
  with pytest.raises(ValueError, match=r"a piece of input read into raw/parts \(00000-of-00001"
                                       r".json\) made with other settings "
                                       r".*'eval_fraction': \(0.1, 0.3\)"):
    _prepared(c_frac)
  # The same settings resume.
  assert _prepared(c)["splits"]["train"]["instances"] > 0


def test_one_document_swamping_the_pairs_warns(tmp_path, caplog):
  docs = random_documents(30, 10)
  # One line of 5,000 words (allowed here) is cut into many pieces, each a pair or more.
  docs[5].append(" ".join(["baba"] * 5000) + ".")
  c = data_config(tmp_path, n_docs=0, source=write_corpus(str(tmp_path / "c.txt"), docs),
                  max_line_chars=0, eval_fraction=0.0)
  with caplog.at_level("WARNING"):
    m = _prepared(c)
  big = m["splits"]["train"]["largest_document"]
  assert big["instances"] > 0.3 * m["splits"]["train"]["instances"]
  assert "train: one document yields" in caplog.text and "above max_document_pair_share" in caplog.text
  assert repr(docs[5][0][:80]) in caplog.text  # how to find it
  # By default such a line is refused before anything is prepared, naming the file and line.
  c = dataclasses.replace(c, max_line_chars=20_000, prepared_dir=str(tmp_path / "other"))
  with pytest.raises(ValueError, match=r"c\.txt, line 66: 25,000 characters"):
    _prepared(c)


def test_binary_file_in_the_source_is_refused(tmp_path):
  import random
  c = data_config(tmp_path)
  noise = tmp_path / "noise.txt"
  noise.write_bytes(bytes(random.Random(0).randrange(256) for _ in range(5000)))
  c = dataclasses.replace(c, source=f"{c.source},{noise}")
  with pytest.raises(ValueError, match=f"{noise}: .* not valid UTF-8"):
    _prepared(c)


def test_cache_dir_under_a_regular_file_is_named(tmp_path):
  (tmp_path / "afile").write_text("x")
  c = data_config(tmp_path, cache_dir=str(tmp_path / "afile" / "cache"))
  with pytest.raises(OSError, match=r"Cannot create the folder .*afile/cache.* \(from "
                                    r"config.data.cache_dir\)"):
    _prepared(c)
  c = data_config(tmp_path, tokenizer="sentencepiece", vocab_path="",
                  cache_dir=str(tmp_path / "afile" / "cache"))
  with pytest.raises(OSError, match=r"\(from config.data.cache_dir\)"):
    tokenizer_lib.ensure_sentencepiece(c)


def _marked_processes(marker: str) -> list[int]:
  """Live processes whose environment holds `marker` (this test's workers, nobody else's)."""
  pids = []
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{pid}/environ", "rb") as f:
        if marker.encode() not in f.read():
          continue
      with open(f"/proc/{pid}/stat") as f:
        if f.read().rsplit(")", 1)[1].split()[0] != "Z":
          pids.append(int(pid))
    except OSError:
      continue
  return pids


def test_sigterm_stops_the_workers_and_says_the_preparation_resumes(tmp_path):
  import signal
  import subprocess
  import sys
  import time
  import uuid
  c = data_config(tmp_path, n_docs=60, prepare_workers=2)
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  marker = f"BERTJAX_TEST_{uuid.uuid4().hex}"
  env = {**os.environ, marker: "1", "PYTHONPATH": root, "JAX_PLATFORMS": "cpu"}
  flags = [f"--config.data.{k}={getattr(c, k)}" for k in ("tokenizer", "vocab_path", "source", "cache_dir",
                                                  "max_seq_length", "prepare_workers")]
  proc = subprocess.Popen([sys.executable, "-m", "bertjax.data.prepare",
                           "--config=configs/base.py", *flags], cwd=root, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  deadline = time.time() + 60
  while len(_marked_processes(marker)) < 3 and proc.poll() is None and time.time() < deadline:
    time.sleep(0.05)  # the command and its 2 workers
  workers = [p for p in _marked_processes(marker) if p != proc.pid]
  assert len(workers) == 2, (workers, proc.poll())
  proc.send_signal(signal.SIGTERM)
  out, err = proc.communicate(timeout=60)
  assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
  assert "stopped by SIGTERM, its worker processes too" in err and "to resume" in err, err[-2000:]
  assert "Traceback" not in err
  assert not _marked_processes(marker)  # no worker left behind
  # Running again finishes the preparation.
  assert _prepared(c, num_workers=1)["splits"]["train"]["instances"] > 0


def test_a_workers_refusal_is_raised_by_the_parent_as_the_worker_raised_it(capfd):
  """A refusal of the input in a preparation worker process (a file not UTF-8, a missing file) is
  raised by the command's process as the worker raised it, which the command says in one line:
  it was the worker's traceback, then "1 of 2 preparation process(es) failed" and the parent's. A
  fault of the code keeps both."""
  from bertjax.errors import Refusal  # pylint: disable=import-outside-toplevel
  code = ("from bertjax.data.preparation import processes\nfrom bertjax.errors import Refusal\n"
          "def work(item):\n"
          "  if item == 'refuse':\n"
          "    raise Refusal('x.txt: 9 of 10 characters are not valid UTF-8; convert it')\n"
          "  if item == 'missing':\n"
          "    raise FileNotFoundError(2, 'No such file or directory', 'y.txt')\n"
          "  if item == 'bug':\n"
          "    raise ValueError('too many values to unpack (expected 2)')\n"
          "processes.serve(work)\n")
  with processes.Workers(2, code) as workers:
    with pytest.raises(Refusal) as refused:
      workers.round(["ok", "refuse"])
    assert str(refused.value) == "x.txt: 9 of 10 characters are not valid UTF-8; convert it"
    workers.round(["ok", "ok"])  # both still serve
    with pytest.raises(FileNotFoundError) as missing:
      workers.round(["missing"])
    assert missing.value.filename == "y.txt" and missing.value.errno == 2
  assert "Traceback" not in capfd.readouterr().err
  with processes.Workers(1, code) as workers:
    with pytest.raises(RuntimeError, match=r"1 of 1 preparation process\(es\) failed"):
      workers.round(["bug"])
  err = capfd.readouterr().err
  assert "Traceback" in err and "ValueError: too many values to unpack" in err


@pytest.mark.parametrize("flags, message", [
    (["--config.data.max_predictions_per_seq=200"],
     "max_predictions_per_seq=200 must be within 1 and max_seq_length=128"),
    (["--config.data.max_seq_length=1024", "--config.data.max_predictions_per_seq=150"],
     "max_seq_length=1024 exceeds config.model.max_position_embeddings=512"),
])
def test_prepare_command_validates_lengths_first(tmp_path, flags, message):
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  done = subprocess.run([sys.executable, "-m", "bertjax.data.prepare", "--config=configs/base.py",
                         f"--config.data.cache_dir={tmp_path / 'cache'}", *flags], cwd=root,
                        env={**os.environ, "PYTHONPATH": root}, capture_output=True, text=True,
                        timeout=120)
  assert done.returncode != 0 and message in done.stderr, done.stderr[-2000:]
  assert not (tmp_path / "cache").exists()  # refused before any work


def test_a_change_to_the_text_processing_moves_both_caches(tmp_path, monkeypatch):
  from bertjax.data import corpus as corpus_lib  # pylint: disable=import-outside-toplevel
  # The cached vocabulary is named by the source.
  c = data_config(tmp_path, tokenizer="sentencepiece", vocab_path="")
  tok = tokenizer_lib.load_tokenizer(data_config(tmp_path))
  before = (tokenizer_lib.vocab_path_of(c), prepare.prepared_dir(c, tok))
  monkeypatch.setattr(corpus_lib, "TEXT_VERSION", corpus_lib.TEXT_VERSION + 1)
  after = (tokenizer_lib.vocab_path_of(c), prepare.prepared_dir(c, tok))
  # Documents split anew must not meet a vocabulary or shards made from the old sentences.
  assert before[0] != after[0] and before[1] != after[1]
