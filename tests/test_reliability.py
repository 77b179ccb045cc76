"""Reliability of a workdir and the edges, at unit level (docs/reliability.md lists each case):
a kill at any instant never blocks the rerun, damaged files are named (and skipped where a
readable one is older), a second run on a workdir is refused, a bad input fails in one line before
any work.

No full runs: each case drives the piece that decides it (the Evaluations record, a Checkpointer,
a config check), so the whole file takes seconds.
"""


import dataclasses
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from bertjax import errors, files
from bertjax.data.config import DataConfig
from bertjax.finetune.job import init_from, run
from bertjax.finetune.kit.config import FinetuneDataConfig, TaskConfig
from bertjax.model.config import BertConfig
from bertjax.training import checkpoint as checkpoint_lib
from bertjax.weights import reader as weights


# 1. Fine-tuning workdir: a kill between any two writes ------------------------------------------

PARAMS = {"w": jnp.arange(4, dtype=jnp.float32)}


def _evaluations(workdir, start):
  evaluations = run.Evaluations(str(workdir), {"task": "rte"})
  evaluations.begin(start)
  return evaluations


def test_a_best_step_without_its_record_is_evaluated_again(tmp_path):
  # A kill after best/'s save of step 2 and before evaluations.json records it: the rerun
  # restores checkpoints/2, owes step 2's evaluation and must save best/2 again (not die with
  # StepAlreadyExistsError).
  first = _evaluations(tmp_path, 0)
  first.add(1, 1.0, {"main": 0.5}, PARAMS)
  records = files.read_json(str(tmp_path / "evaluations.json"))
  first.add(2, 2.0, {"main": 0.7}, PARAMS)
  first.close()
  files.write_json(str(tmp_path / "evaluations.json"), records)  # the kill: step 2 unrecorded

  rerun = _evaluations(tmp_path, 2)
  assert not rerun.done(2)
  rerun.add(2, 2.0, {"main": 0.7}, PARAMS)
  rerun.close()
  assert [r["step"] for r in files.read_json(str(tmp_path / "evaluations.json"))] == [1, 2]
  assert rerun.best.all_steps() == [2]


def test_a_damaged_evaluations_record_is_rebuilt_from_best(tmp_path, capsys):
  # Written atomically now; one cut short (an older bertjax, a disk fault) keeps what best/
  # records instead of stopping every rerun.
  first = _evaluations(tmp_path, 0)
  first.add(1, 1.0, {"main": 0.5}, PARAMS)
  first.add(2, 2.0, {"main": 0.4}, PARAMS)
  first.close()
  with open(tmp_path / "evaluations.json", "r+") as f:
    f.truncate(20)
  rerun = _evaluations(tmp_path, 2)
  rerun.close()
  out = capsys.readouterr().out
  assert "evaluations.json" in out and "is not valid JSON" in out and "best/" in out
  assert [(r["step"], r["scores"]["main"]) for r in rerun.records] == [(1, 0.5)]
  assert rerun.best.all_steps() == [1]


@pytest.mark.parametrize("name", ["results.json", "config.json"])
def test_a_damaged_derived_file_does_not_stop_the_rerun(tmp_path, name, capsys):
  # results.json and config.json are rewritten by every run: one cut short by a kill is
  # rebuilt, not trusted and not fatal.
  (tmp_path / name).write_text('{"task": "rt')
  run._check_task(str(tmp_path), "rte")
  assert f"{tmp_path / name}" in capsys.readouterr().out
  # A readable one of another task is still refused.
  files.write_json(str(tmp_path / name), {"task": "cola"})
  with pytest.raises(ValueError, match="holds a cola run"):
    run._check_task(str(tmp_path), "rte")


def test_prediction_files_are_written_atomically(tmp_path, monkeypatch):
  # Every file of the workdir goes through files.write_text (temp file + rename): a kill during
  # the write leaves the previous file whole.
  from bertjax.finetune.kit import squad_postprocess
  written = []
  real = files.write_text
  monkeypatch.setattr(files, "write_text", lambda path, text: (written.append(path),
                                                                real(path, text)))
  result = squad_postprocess.SquadPredictions({"q": "a"}, {"q": [{"text": "a"}]}, {"q": -1.0})
  paths = squad_postprocess.write_predictions(result, str(tmp_path / "predictions"))
  assert written == paths and len(paths) == 3
  assert sorted(os.listdir(tmp_path / "predictions")) == [
      "nbest_predictions.json", "null_odds.json", "predictions.json"]


def _users_files(root):
  """What a user keeps beside a prediction: the docs' corpus layout, a data file, an array of
  their own, notes; each a file prediction's old rule took for its own output (the first by its
  keys, the second by them too, the array as any 2-D float32 .npy)."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  made = {"corpus": root / "corpus.jsonl", "data": root / "data.jsonl", "mine": root / "mine.npy"}
  made["corpus"].write_text('{"id": "p1", "text": "a passage"}\n')
  made["data"].write_text('{"text": "a text", "label": "pos"}\n')
  np.save(made["mine"], np.ones((3, 4), np.float32))
  return {k: str(v) for k, v in made.items()}


@pytest.mark.parametrize("mode", ["predict", "embed", "search"])
def test_prediction_writes_over_no_file_it_did_not_write_nor_any_of_its_inputs(tmp_path, mode):
  """Refused before any model is read (the workdir here is none): an output that is one of the
  run's inputs (even with --overwrite), or a file of the user's (without it), whatever it holds."""
  from bertjax.predict import predictor as predict_lib  # pylint: disable=import-outside-toplevel
  user = _users_files(tmp_path)
  before = {k: open(v, "rb").read() for k, v in user.items()}
  run = lambda output, **kw: predict_lib.run(
      str(tmp_path / "no_workdir"), user["data"], output, mode=mode, **(
          {"corpus": user["corpus"], "corpus_vectors": user["mine"]} if mode == "search" else {}),
      **kw)
  inputs = {"data": "the input file"}
  if mode == "search":
    inputs.update(corpus="the corpus", mine="the corpus's vectors")
  for name, said in inputs.items():
    with pytest.raises(errors.Refusal, match=rf"--output={re.escape(user[name])} is {said} "
                                             r"\(--\w+=.*\): the output would replace it"):
      run(user[name], overwrite=True)
  for name in set(user) - set(inputs):
    with pytest.raises(errors.Refusal, match=r"exists and is not a file bertjax.predict wrote \(no "
                                             r".*\.bertjax\.json beside it.*--overwrite"):
      run(user[name])
  # A record that does not describe the file (the user replaced prediction's output): not ours.
  out = tmp_path / ("out.npy" if mode == "embed" else "out.jsonl")
  out.write_text("the user's now\n")
  (tmp_path / (out.name + ".bertjax.json")).write_text(
      '{"written_by": "bertjax.predict", "sha256": "0000"}')
  with pytest.raises(errors.Refusal, match="is not a file bertjax.predict wrote"):
    run(str(out))
  # Nor a file of the user's under the name of the record an output gets beside it.
  fresh = tmp_path / ("fresh.npy" if mode == "embed" else "fresh.jsonl")
  (tmp_path / (fresh.name + ".bertjax.json")).write_text('{"my": "notes"}')
  with pytest.raises(errors.Refusal, match=r"fresh.\w+.bertjax.json exists and is not a record"):
    run(str(fresh))
  assert {k: open(v, "rb").read() for k, v in user.items()} == before


def test_a_full_disk_is_known_however_a_library_says_it():
  # The run's one line (tests/test_finetune_chaos.py end to end) rests on recognising a full disk
  # wherever the write was: an OSError down orbax's chain of errors raised again at each wait,
  # tensorstore's ValueError; and on dropping tensorstore's late callbacks into orbax's closed
  # event loop, dozens of tracebacks after the failed save.
  import errno
  import types
  from bertjax import cli

  def chained(first, then):
    try:
      try:
        raise first
      except Exception:  # pylint: disable=broad-except
        raise then  # pylint: disable=raise-missing-from
    except Exception as err:  # pylint: disable=broad-except
      return err
  full = OSError(errno.ENOSPC, "No space left on device", "ckpt/8.orbax-checkpoint-tmp")
  assert files.is_disk_full(chained(full, RuntimeError("Save Finalize thread failed")))
  assert files.is_disk_full(ValueError(
      'RESOURCE_EXHAUSTED: Error writing local file "manifest.ocdbt": Failed to write 115 bytes '
      "to file 11: No space left on device [os_error_code='28']"))
  assert not files.is_disk_full(chained(PermissionError(errno.EACCES, "denied"), OSError("x")))
  with pytest.raises(errors.DiskFullError, match="^W: the disk is full .*; kept. Free space"):
    with files.disk_full_said("W", lambda: "kept"):
      raise chained(full, OSError("again"))
  with pytest.raises(KeyError):
    with files.disk_full_said("W", lambda: "kept"):
      raise KeyError("not a full disk")
  # A failed write (EIO, issue 38), and a library's error that names no file.
  eio = OSError(errno.EIO, "Input/output error", "w/evaluations.json.tmp-1")
  assert files.storage_fault(chained(eio, RuntimeError("x"))) == (errno.EIO,
                                                                   "w/evaluations.json.tmp-1")
  assert not files.is_disk_full(eio)
  with pytest.raises(errors.DiskFullError, match=r"^W: a write failed with an input/output error "
                     r"\(EIO.*\) at w/evaluations.json.tmp-1; kept. Check the disk"):
    with files.disk_full_said("W", lambda: "kept"):
      raise eio
  with pytest.raises(OSError, match=r"No space left on device.*'w/model.safetensors'"):
    with files.writing("w/model.safetensors"):
      raise RuntimeError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, "
                         'message: "No space left on device" })')

  passed = []
  hook = cli.late_write_callbacks_dropped(passed.append)
  late = types.SimpleNamespace(exc_value=RuntimeError("Event loop is closed"))
  other = types.SimpleNamespace(exc_value=RuntimeError("something else"))
  hook(late)
  hook(other)
  assert passed == [other]


# 2. A damaged newest checkpoint ----------------------------------------------------------------

def _two_steps(directory):
  """A run's checkpoints of steps 1 and 2 (params with an encoder subtree, a model record)."""
  ckpt = checkpoint_lib.Checkpointer(str(directory), ("params",), save_every=1, keep=3,
                                     async_save=False)
  meta = {"model": dataclasses.asdict(BertConfig(vocab_size=64, hidden_size=8, num_layers=1,
                                                 num_heads=1, intermediate_size=8))}
  for step in (1, 2):
    ckpt.save(step, {"params": {"bert": {"w": jnp.arange(4096.0) * step}}}, meta)
  ckpt.wait()
  return ckpt


def _damage(step_dir, how):
  if how == "meta":
    record = step_dir / "meta" / "metadata"
    record.write_text(record.read_text()[:10])
    return
  biggest = max((p for p in (step_dir / "params").rglob("*") if p.is_file()),
                key=lambda p: p.stat().st_size)
  if how == "cut":
    biggest.write_bytes(biggest.read_bytes()[:biggest.stat().st_size // 2])
  else:
    biggest.unlink()


DAMAGE = {"cut": "OUT_OF_RANGE: .*/2/params/ is missing or cut short",
          "deleted": "FAILED_PRECONDITION: .*/2/params/ is missing or cut short",
          "meta": r"/2/meta/metadata \(step 2's record\) is not valid JSON"}


@pytest.mark.parametrize("how", list(DAMAGE))
def test_resume_falls_back_past_a_damaged_newest_checkpoint(tmp_path, how, capsys):
  ckpt = _two_steps(tmp_path / "checkpoints")
  _damage(tmp_path / "checkpoints" / "2", how)
  like = {"params": {"bert": {"w": jax.ShapeDtypeStruct((4096,), jnp.float32)}}}
  step, items, _ = ckpt.restore_latest(like)
  ckpt.close()
  assert step == 1 and float(items["params"]["bert"]["w"][1]) == 1.0
  out = capsys.readouterr().out
  assert re.search(f"skipping checkpoint step 2, damaged \\(.*{DAMAGE[how]}.*\\); trying step 1",
                   out), out


@pytest.mark.parametrize("how", list(DAMAGE))
def test_a_reader_of_another_run_names_the_damaged_step_and_the_older_one(tmp_path, how):
  _two_steps(tmp_path / "checkpoints").close()
  _damage(tmp_path / "checkpoints" / "2", how)
  with pytest.raises(errors.CheckpointDamagedError) as err:
    weights.read(weights.inspect(str(tmp_path), what="checkpoint.init_from"))
  message = str(err.value)
  assert "\n" not in message and re.search(
      f"step 2 is damaged \\(.*{DAMAGE[how]}.*\\)\\. Step 1 is the newest before it: move "
      f"{tmp_path}/checkpoints/2 away to use it", message), message


@pytest.mark.parametrize("name", ["tokenizer.json", "bert_config.json"])
def test_a_truncated_record_is_named_in_one_line(tmp_path, name):
  # A run's vocabulary record, a converted folder's model config: cut short by a kill or a full
  # disk, they are named (not a bare JSONDecodeError).
  from bertjax.formats import converted
  if name == "tokenizer.json":
    _two_steps(tmp_path / "checkpoints").close()
    read = lambda: weights.inspect(str(tmp_path))
  else:
    converted.save_params(str(tmp_path), {"bert": {"w": jnp.ones(3)}}, BertConfig(vocab_size=64))
    read = lambda: converted.read_config(str(tmp_path))
  (tmp_path / name).write_text('{"file": "vo')
  with pytest.raises(errors.DamagedFileError) as err:
    read()
  assert str(err.value).startswith(f"{tmp_path / name} (") and "\n" not in str(err.value)


# 2b. One run per workdir -----------------------------------------------------------------------

HOLD = ("import sys, time\nfrom bertjax import files\nfiles.lock_workdir(sys.argv[1])\n"
        "print('held', flush=True)\ntime.sleep(60)\n")


def _holder(workdir):
  proc = subprocess.Popen([sys.executable, "-c", HOLD, str(workdir)], stdout=subprocess.PIPE,
                          text=True)
  assert proc.stdout.readline() == "held\n"
  return proc


def test_a_second_run_is_refused_and_a_dead_holders_lock_taken_over(tmp_path):
  holder = _holder(tmp_path)
  try:
    # The command itself, refused in one line before any work.
    done = subprocess.run([sys.executable, "-m", "bertjax.pretrain", "--config=configs/tiny.py",
                           f"--workdir={tmp_path}"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == done.stderr.strip(), done.stderr
    assert re.fullmatch(f"bertjax: --workdir={tmp_path} is in use by pid {holder.pid} on .*: one "
                        "run per workdir. .*another --workdir.\n", done.stderr), done.stderr
  finally:
    holder.kill()  # SIGKILL: no clean exit, the lock file still names it
    holder.wait()
  note = files.lock_workdir(str(tmp_path))
  assert note is not None and re.fullmatch(
      f"took over {tmp_path}/.lock of pid {holder.pid} on .*: that process is no longer running",
      note), note
  assert files.lock_workdir(str(tmp_path)) is None  # the same process again: its own lock


# 3 and 4. Bad input refused before any work, in one line --------------------------------------

BAD_NUMBERS = {
    "learning_rate_negative": ("rte", {"train.learning_rate": -1e-5},
                               r"train.learning_rate=-1e-05 must be > 0$"),
    "learning_rate_zero": ("rte", {"train.learning_rate": 0.0},
                           r"train.learning_rate=0.0 must be > 0$"),
    "seq_length": ("rte", {"data.max_seq_length": 0}, r"data.max_seq_length=0 must be >= 8"),
    "stride": ("squad_v1.1", {"data.doc_stride": 0}, r"data.doc_stride=0 must be >= 1"),
    "query_longer_than_window": ("squad_v1.1", {"data.max_query_length": 40},
                                 r"data.max_query_length=40 must be in \[1, data.max_seq_length"
                                 r" - 4 = 28\]"),
    "n_best": ("squad_v2.0", {"eval.n_best_size": 0}, r"eval.n_best_size=0 must be >= 1"),
    "answer_length": ("squad_v1.1", {"eval.max_answer_length": -3},
                      r"eval.max_answer_length=-3 must be >= 1"),
}


@pytest.mark.parametrize("case", list(BAD_NUMBERS))
def test_bad_fine_tuning_numbers_are_refused(case):
  import finetune_fixtures as fx
  task, values, message = BAD_NUMBERS[case]
  config = fx.ft_config(task, "")
  for key, value in values.items():
    section, name = key.split(".")
    config[section][name] = value
  with pytest.raises(ValueError, match="^Invalid config: " + message):
    run.FinetuneConfig.from_config(config)


def test_good_fine_tuning_numbers_pass():
  import finetune_fixtures as fx
  for task in ("rte", "squad_v1.1", "conll2003"):
    run.FinetuneConfig.from_config(fx.ft_config(task, ""))


def test_a_misspelled_fine_tuning_key_is_named_in_one_line(tmp_path):
  done = subprocess.run(
      [sys.executable, "-m", "bertjax.finetune", "--config=configs/finetune.py:rte",
       f"--workdir={tmp_path}", "--config.train.learning_rat=1e-5"],
      capture_output=True, text=True, timeout=60, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert done.returncode == 1
  assert done.stderr.strip().splitlines()[-1] == (
      "bertjax: --config.train.learning_rat: the config has no key 'learning_rat'; did you mean "
      "'learning_rate'? (every key and its meaning: configs/base.py)."), done.stderr
  assert "Traceback" not in done.stderr


def test_squad_v1_given_a_v2_file_is_refused_before_any_step(tmp_path):
  import finetune_fixtures as fx
  from bertjax.data import tokenizer as tokenizer_lib
  from bertjax.finetune.tasks import tasks
  from test_data_fixtures import write_vocab
  paragraphs = fx.squad_paragraphs(4, 0, "q")
  paragraphs[2]["qas"].append({"id": "no-answer", "question": fx.QUESTION, "answers": [],
                               "is_impossible": True})
  config = fx.ft_config("squad_v1.1", "")
  config.data.train_file = fx.write_squad(str(tmp_path / "train-v2.0.json"), paragraphs)
  config.data.dev_file = fx.write_squad(str(tmp_path / "dev-v2.0.json"), paragraphs)
  tokenizer = tokenizer_lib.load_vocabulary(write_vocab(str(tmp_path / "vocab.txt")),
                                            "wordpiece", True)
  with pytest.raises(ValueError, match=r"train-v2.0.json: 1 question\(s\) marked is_impossible "
                     r"\(e.g. id 'no-answer'\): a SQuAD v2.0 file. Fine-tune it with "
                     r"configs/finetune.py:squad_v2.0"):
    tasks.load(TaskConfig.from_config(config), tokenizer)
  config.task = "squad_v2.0"
  assert len(tasks.load(TaskConfig.from_config(config), tokenizer).evals) == 1  # v2.0's file


def test_a_batch_larger_than_the_training_set_is_said():
  # Legal (a tiny task), never silent.
  assert run.run_notes(32, 32) == []
  assert run.run_notes(32, 10) == [
      "train.batch_size=32 is larger than the 10 training examples: each batch repeats them (up "
      "to 4 times) and an epoch is one step; lower train.batch_size to see each example once per "
      "step"]


def test_a_conll_file_without_blank_lines_is_warned_about(tmp_path, caplog):
  import finetune_fixtures as fx
  from bertjax.finetune.tasks import ner
  sentences = fx.conll_sentences(200, 0)
  path = fx.write_conll(str(tmp_path / "eng.train"), sentences)
  with open(path) as f:
    run_together = "".join(line for line in f if line.strip())  # every blank line gone
  (tmp_path / "eng.run").write_text(run_together)
  with caplog.at_level("WARNING"):
    ner.read_conll(str(tmp_path / "eng.train"))
    assert not caplog.records
    assert len(ner.read_conll(str(tmp_path / "eng.run"))) == 1
  assert re.search(r"eng.run: a sentence of \d+ words \(at .*eng.run:2\): are the blank lines "
                   r"between sentences missing\? A CoNLL file holds one word per line and a blank "
                   r"line after each sentence.", caplog.text), caplog.text


def test_gelu_new_is_gelu_tanh():
  from bertjax.formats import google
  config = {"vocab_size": 64, "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1,
            "intermediate_size": 8}
  assert google.config_from_google({**config, "hidden_act": "gelu_new"}).hidden_act == "gelu_tanh"
  with pytest.raises(ValueError, match="'gelu_new' and 'gelu_pytorch_tanh' its 'gelu_tanh'"):
    google.config_from_google({**config, "hidden_act": "relu"})


@pytest.mark.parametrize("args, message", [
    (["--num-slices=0"], "--num-slices=0 must be at least 1"),
    (["--", "--config.train.batch_sise=256"],
     "--config.train.batch_sise: the config has no key 'batch_sise'; did you mean 'batch_size'?"),
])
def test_the_tpu_launcher_refuses_before_creating_anything(tmp_path, args, message):
  done = subprocess.run(
      [sys.executable, "-m", "launch.tpu", "up", "--name=bert", "--zone=us-east5-a", "--project=p",
       "--accelerator-type=v5litepod-8", "--config=configs/tiny.py", "--workdir=gs://b/run",
       "--dry-run", *args], capture_output=True, text=True, timeout=60,
      env={**os.environ, "BERTJAX_TPU_STATE": str(tmp_path / "state"), "JAX_PLATFORMS": "cpu"},
      cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  assert done.returncode != 0 and message in done.stderr, done.stderr
  assert "gcloud" not in done.stdout  # nothing created, not even in the dry run's plan


def test_sigterm_during_data_preparation_exits_143(capsys):
  # What bertjax.pretrain does when ensure_prepared raises on SIGTERM: the README's 143 and the
  # preparation's own line, no traceback.
  from bertjax import cli
  from bertjax.data.preparation import processes

  def preparing():
    raise processes.PreparationStopped("Preparation in D stopped by SIGTERM, ... run the same "
                                       "command again to resume")
  with pytest.raises(SystemExit) as done:
    cli.explained(preparing)
  assert done.value.code == 143
  assert capsys.readouterr().err == ("bertjax: Preparation in D stopped by SIGTERM, ... run the "
                                     "same command again to resume\n")


def test_fine_tuning_keeps_the_casing_a_hugging_face_folder_records(tmp_path):
  # tokenizer_config.json's do_lower_case=false becomes the source's casing (tests/test_weights);
  # fine-tuning from it must not lower-case (data.do_lower_case left unset), and says it when set.
  import finetune_fixtures as fx
  from test_data_fixtures import write_vocab
  vocab = write_vocab(str(tmp_path / "vocab.txt"))
  source = weights.Weights(str(tmp_path), "huggingface", BertConfig(vocab_size=512), ("bert",),
                           vocab_file=vocab, tokenizer_kind="wordpiece", do_lower_case=False,
                           casing_why="tokenizer_config.json")
  config = fx.ft_config("rte", str(tmp_path))
  assert config.data.do_lower_case is None
  data = FinetuneDataConfig.from_config(config.data)
  tokenizer, path, lower = init_from.resolve_tokenizer(data, source, allow_other_vocab=False)
  assert (path, lower) == (vocab, False)
  word = next(w for w in open(vocab).read().split()
              if w.isalpha() and w.islower() and len(w) > 2)  # a whole lower-case word
  assert tokenizer.tokenize(word.upper()) != tokenizer.tokenize(word)
  data = dataclasses.replace(data, do_lower_case=True)  # the user's choice wins
  assert init_from.resolve_tokenizer(data, source, allow_other_vocab=False)[2] is True


# 3. SQuAD answers are text of their contexts, whatever the script -------------------------------

UNICODE_PIECES = ["東京", "대한민국", "😀", "🇫🇷", "e\u0301", "Café", "Ἀθῆναι", "שָׁלוֹם", "\u00a0", "  ",
                  "ß", "İ", "ﬁ", "Ⅻ", "\u200b", "a\u0308\u0301", "\t", "x"]


def _random_context(rng, pool):
  return "".join(rng.choice(pool) + rng.choice([" ", "", ",", "\u00a0"])
                 for _ in range(rng.randint(1, 30)))


def _every_answer_is_a_substring(tokenizer, pool):
  """A property over random contexts drawn from `pool`, with random logits: every n-best text (and
  so every prediction) is a substring of the context, without surrounding whitespace. The
  original's nonce "empty" (no candidate among the top n-best, frequent on short contexts) was
  none."""
  import random
  import numpy as np
  from bertjax.finetune.kit import squad_postprocess
  from bertjax.inputs import questions
  rng = random.Random(0)
  for trial in range(150):
    context = _random_context(rng, pool)
    example = questions.SquadExample(f"q{trial}", "what", context, (), (), False, None)
    features = questions.make_features([example], tokenizer, max_seq_length=32, doc_stride=8,
                                       max_query_length=4)
    logits = np.random.default_rng(trial).normal(size=(2, *features["input_ids"].shape))
    for version_2 in (False, True):
      result = squad_postprocess.postprocess([example], features, *logits,
                                             version_2_with_negative=version_2)
      for entry in result.nbest[example.qas_id]:
        text = entry["text"]
        assert text in context and text == text.strip(), (context, text)


@pytest.mark.parametrize("lower", [True, False])
def test_every_squad_answer_is_an_exact_substring_of_its_context(tmp_path, lower):
  # CJK, Hangul, emoji, combining marks, Greek, Hebrew, odd spaces and vocabulary words, under a
  # WordPiece vocabulary (the characters outside it are [UNK] pieces).
  from bertjax.data import tokenizer as tokenizer_lib
  from test_data_fixtures import write_vocab
  vocab = write_vocab(str(tmp_path / "vocab.txt"))
  pool = UNICODE_PIECES + [w for w in open(vocab).read().split() if w.isalpha()][:40]
  _every_answer_is_a_substring(tokenizer_lib.load_vocabulary(vocab, "wordpiece", lower), pool)


@pytest.mark.parametrize("lower", [True, False])
def test_every_squad_answer_is_an_exact_substring_of_its_context_with_sentencepiece(tmp_path,
                                                                                   lower):
  # The same contexts under a SentencePiece vocabulary of a few hundred pieces, trained here on
  # such contexts less a few characters (then unknown pieces). Its NFKC normalisation rewrites
  # text (the ligature, the Roman numeral, full-width forms) and its pieces carry the space before
  # a word: the answer is still the context's own characters.
  import random
  from bertjax.data import tokenizer as tokenizer_lib
  from test_data_fixtures import WORDS
  pool = UNICODE_PIECES + ["\uff21\uff22", "\u00bd"] + WORDS[:40]
  unseen = {"\u216b", "\u05e9\u05b8\u05c1\u05dc\u05d5\u05b9\u05dd", "\U0001f1eb\U0001f1f7"}
  rng = random.Random(1)
  corpus = [_random_context(rng, [p for p in pool if p not in unseen]) for _ in range(600)]
  model = tokenizer_lib.train_sentencepiece(corpus, vocab_size=300, do_lower_case=lower,
                                            output=str(tmp_path / "spm"))
  tokenizer = tokenizer_lib.load_vocabulary(model, "sentencepiece")
  assert tokenizer.unk_id in tokenizer.encode("\u216b \u05e9\u05b8\u05c1\u05dc\u05d5\u05b9\u05dd")
  _every_answer_is_a_substring(tokenizer, pool)


def test_a_google_folder_of_several_checkpoints_names_the_newest_and_a_fix_that_works(tmp_path):
  from bertjax.formats import tf_bundle
  for step in (200, 1000):
    (tmp_path / f"model.ckpt-{step}.index").write_bytes(b"")
  with pytest.raises(FileNotFoundError) as err:
    tf_bundle.resolve_prefix(str(tmp_path))
  assert str(err.value).endswith(
      f"write {tmp_path}/checkpoint holding the line model_checkpoint_path: \"model.ckpt-1000\" "
      "(the newest; or name another), or move the others away")
  (tmp_path / "checkpoint").write_text('model_checkpoint_path: "model.ckpt-1000"\n')
  assert tf_bundle.resolve_prefix(str(tmp_path)) == str(tmp_path / "model.ckpt-1000")


def test_convert_google_takes_the_checkpoint_a_prefix_names(tmp_path, capsys):
  # --weights=DIR/model.ckpt-1000 (a prefix, as TensorFlow names a checkpoint) was taken for a
  # folder and refused; it reads that checkpoint, even beside others and without a `checkpoint`
  # file, with the folder's bert_config.json and vocab.txt.
  import numpy as np
  from bertjax.convert import google
  from bertjax.formats import converted
  from google_fixtures import GOOGLE_CONFIG, google_folder, random_variables, save
  first = random_variables(GOOGLE_CONFIG, seed=0)
  folder = google_folder(tmp_path, variables=first)  # bert_model.ckpt
  later = random_variables(GOOGLE_CONFIG, seed=1)
  save(os.path.join(folder, "model.ckpt-1000"), later)
  for given, prefix, want in (
      ("model.ckpt-1000", "model.ckpt-1000", later),
      ("bert_model.ckpt.index", "bert_model.ckpt", first)):
    out = str(tmp_path / given)
    print(google.import_folder(os.path.join(folder, given), out))  # the command prints this line
    assert capsys.readouterr().out.startswith(f"Imported {os.path.join(folder, prefix)} -> {out} ")
    _, params = converted.load_params(out)
    np.testing.assert_array_equal(params["bert"]["embeddings"]["word_embeddings"]["embedding"],
                                  want["bert/embeddings/word_embeddings"])


def test_a_run_classifier_output_gives_its_encoder_and_no_pretraining_heads(tmp_path):
  # run_classifier.py's output: bert/* and its classifier (output_weights, output_bias) with
  # Adam's slots, no cls/*. Fine-tuning's init_from takes its encoder; asked for the pre-training
  # heads, it says in one line that it has none (was: a list of missing variables and "use the
  # bert_config.json released with this checkpoint").
  import numpy as np
  from bertjax.formats import google, tf_bundle
  from google_fixtures import GOOGLE_CONFIG, random_variables, save, slots
  from test_data_fixtures import write_vocab
  variables = {k: v for k, v in random_variables(GOOGLE_CONFIG).items()
               if not k.startswith("cls/")}
  variables.update(output_weights=np.ones((2, 128), np.float32),
                   output_bias=np.zeros(2, np.float32))
  folder = tmp_path / "rte_output"
  os.makedirs(folder)
  save(str(folder / "model.ckpt-1000"), {**variables, **slots(variables)})
  (folder / "checkpoint").write_text('model_checkpoint_path: "model.ckpt-1000"\n')
  files.write_json(str(folder / "bert_config.json"), GOOGLE_CONFIG)
  write_vocab(str(folder / "vocab.txt"))

  source = weights.inspect(str(folder), what="checkpoint.init_from")
  assert (source.kind, source.subtrees) == ("google", ("bert",))
  fresh = jax.tree.map(np.zeros_like, weights.read(source))
  fresh["classifier"] = {"kernel": np.zeros((128, 2), np.float32)}
  started = init_from._encoder_loader(source)(fresh)  # what fine-tuning's first step starts from
  np.testing.assert_array_equal(started["bert"]["embeddings"]["word_embeddings"]["embedding"],
                                variables["bert/embeddings/word_embeddings"])
  np.testing.assert_array_equal(started["bert"]["pooler"]["dense"]["kernel"],
                                variables["bert/pooler/dense/kernel"])

  with pytest.raises(ValueError) as err:
    google.params_from_google(tf_bundle.CheckpointReader(str(folder)), source.config,
                              heads=("mlm", "nsp"))
  assert "\n" not in str(err.value) and str(err.value).startswith(
      "The checkpoint holds no cls/predictions/* and no cls/seq_relationship/* (the pre-training "
      "head(s) ['mlm', 'nsp']): it is a fine-tuned or encoder-only checkpoint, from which only "
      "the encoder (bert/*) can be taken"), str(err.value)
  with pytest.raises(errors.CheckpointMismatchError,
                     match=r"holds the parameters \['bert'\], not \['mlm', 'nsp'\]"):
    weights.read(source, like={"bert": {}, "mlm": {}, "nsp": {}})


def test_pre_training_says_when_init_froms_casing_replaces_the_configs(tmp_path, capsys):
  from bertjax.configs import tiny
  from bertjax.pretrain import job as pretrain_job
  source = weights.Weights(str(tmp_path), "google", BertConfig(vocab_size=512), ("bert",),
                           vocab_file=str(tmp_path / "vocab.txt"), tokenizer_kind="wordpiece",
                           do_lower_case=False, casing_why="the name cased_L-2 says cased")
  config = tiny.get_config()
  config.data.vocab_path, config.data.do_lower_case = "", True
  data = DataConfig.from_config(config.data)
  taken = pretrain_job._init_vocabulary(data, source)
  assert (taken.do_lower_case, taken.vocab_path) == (False, str(tmp_path / "vocab.txt"))
  assert data.do_lower_case is True  # the run's typed copy is replaced, not changed
  assert ("config.data.do_lower_case=True is replaced by init_from's casing (False); to use "
          "another, set config.data.vocab_path too") in capsys.readouterr().out
  pretrain_job._init_vocabulary(dataclasses.replace(data, do_lower_case=False), source)
  assert "is replaced" not in capsys.readouterr().out
