"""Shared helpers of the fine-tuning run tests (no tests here): a tiny pre-trained workdir, small
synthetic tasks of each family in their real file formats, and fine-tuning configs sized for a CPU.

Every task's labels follow from its text by a rule a 2-layer, 32-wide model learns in a few
epochs, so a score far above chance shows the whole path works: files -> features -> the head and
its loss -> the sharded step -> scoring -> prediction files.
"""

import dataclasses
import fcntl
import json
import os
import random
import shutil
import signal
import tempfile

import jax
import pytest

from bertjax.configs import finetune as finetune_config, tiny
from bertjax.pretrain import job as pretrain_job
from bertjax.training import train
from test_data_fixtures import WORDS, data_section

# Words with a role in the tasks; the others are filler.
KEYS = WORDS[:3]  # RTE: "entailment" iff sentence B holds one of these
COUNTED = WORDS[3:6]  # STS-B: the score is how many of these the pair holds
ANSWERS = WORDS[6:12]  # SQuAD: the answer is the one of these in the context
QUESTION = " ".join(WORDS[12:14])
FIRST_NAMES = WORDS[14:24]  # CoNLL: a person is a first name (B-PER) ...
SURNAMES = WORDS[24:34]  # ... and at times a surname after it (I-PER)
PLACES = WORDS[34:40]  # CoNLL: locations (B-LOC)
FILLER = WORDS[40:]

SEQ = 32  # max_seq_length of every fine-tuning run here


def pretrain(root: str, steps: int = 30) -> str:
  """A tiny pre-training run (hidden 32, 2 layers) on a synthetic corpus, as `root`/pretrained
  (and its corpus as `root`/data); returns that workdir.

  The run is made once per run of the suite and copied: the modules that need it run in separate
  pytest-xdist workers, which share the run's name (the first to ask builds under a lock, the others
  wait for it), so the suite pays for one run, not one per module."""
  run_id = os.environ.get("BERTJAX_TEST_RUN")  # tests/conftest.py: the run's name
  if not run_id:
    return _pretrain(root, steps)
  shared = os.path.join(tempfile.gettempdir(), f"bertjax-tests-{run_id}", f"pretrain-{steps}")
  os.makedirs(os.path.dirname(shared), exist_ok=True)
  with open(shared + ".lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not os.path.exists(os.path.join(shared, "done")):
      shutil.rmtree(shared, ignore_errors=True)
      _pretrain(shared, steps)
      open(os.path.join(shared, "done"), "w").close()
  for name in ("data", "pretrained"):
    shutil.copytree(os.path.join(shared, name), os.path.join(root, name))
  return os.path.join(root, "pretrained")


def _pretrain(root: str, steps: int) -> str:
  """The run itself. It runs on one device (a third faster to compile and save than on 8), so
  fine-tuning on the 8-device mesh also restores its encoder onto another mesh."""
  config = tiny.get_config()
  config.data = data_section(os.path.join(root, "data"), n_docs=30, sents_per_doc=12)
  m = config.model
  m.hidden_size, m.num_layers, m.num_heads, m.intermediate_size = 32, 2, 2, 64
  m.max_position_embeddings = 64
  t = config.train
  t.batch_size, t.num_train_steps, t.warmup_steps, t.learning_rate = 8, steps, 3, 1e-3
  t.log_every_steps, t.eval_every_steps, t.eval_sequences = steps, 0, 8
  config.checkpoint.save_every_steps = steps
  workdir = os.path.join(root, "pretrained")
  real = train.from_config
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(train, "from_config", lambda config, devices=None, **kw: real(
        config, jax.devices()[:1], **kw))
    pretrain_job.train_and_evaluate(config, workdir)
  return workdir


def ft_config(task: str, init_from: str, **train_overrides):
  """configs/finetune.py for `task` at the size of these tests (batch 16, 3 epochs, 1e-3)."""
  config = finetune_config.get_config(task)
  config.checkpoint.init_from = init_from
  config.data.max_seq_length = SEQ
  config.data.doc_stride, config.data.max_query_length = 16, 8
  t = config.train
  t.batch_size, t.num_epochs, t.learning_rate, t.log_every_steps = 16, 3, 1e-3, 1000
  for k, v in train_overrides.items():
    t[k] = v
  return config


def save_at_end(config):
  """Checkpoints at the run's end only (a run saves its last step whatever the cadence): for a run
  whose test reads no earlier checkpoint. On 8 devices a save costs about a second of CPU, more
  than six training steps here; best/ still saves every better epoch."""
  config.checkpoint.save_every_steps = 10**9
  return config


def _words(rng, low, high, pool=FILLER):
  return [rng.choice(pool) for _ in range(rng.randint(low, high))]


def _insert(rng, words, word):
  words.insert(rng.randrange(len(words) + 1), word)


def write_file(path, text):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w", encoding="utf-8") as f:
    f.write(text)
  return path


# GLUE: RTE (pair classification, label names) and STS-B (regression) ---------------------------

def rte_rows(n, seed):
  """(sentence1, sentence2, label): entailment iff sentence2 holds a key word; half of the others
  hold one in sentence1, so the segment matters."""
  rng = random.Random(seed)
  rows = []
  for i in range(n):
    a, b = _words(rng, 3, 8), _words(rng, 3, 8)
    positive = i % 2 == 0
    if positive:
      _insert(rng, b, rng.choice(KEYS))
    elif rng.random() < 0.5:
      _insert(rng, a, rng.choice(KEYS))
    rows.append((" ".join(a), " ".join(b), "entailment" if positive else "not_entailment"))
  rng.shuffle(rows)
  return rows


def write_rte(data_dir, n_train=256, n_dev=64, n_test=24, seed=0):
  head = "index\tsentence1\tsentence2\tlabel\n"
  for split, n, s in (("train", n_train, seed), ("dev", n_dev, seed + 1)):
    write_file(os.path.join(data_dir, "RTE", f"{split}.tsv"), head + "".join(
        f"{i}\t{a}\t{b}\t{y}\n" for i, (a, b, y) in enumerate(rte_rows(n, s))))
  test = rte_rows(n_test, seed + 2)
  # Test indices out of order, as a check that the submission is sorted by index.
  write_file(os.path.join(data_dir, "RTE", "test.tsv"), "index\tsentence1\tsentence2\n" + "".join(
      f"{n_test - 1 - i}\t{a}\t{b}\n" for i, (a, b, _) in enumerate(test)))
  return test[::-1]  # by index


STSB_HEAD = "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2"


def stsb_rows(n, seed):
  """(sentence1, sentence2, score): the score is the number of counted words in the pair."""
  rng = random.Random(seed)
  rows = []
  for _ in range(n):
    a, b = _words(rng, 3, 7), _words(rng, 3, 7)
    k = rng.randint(0, 5)
    for _ in range(k):
      _insert(rng, rng.choice((a, b)), rng.choice(COUNTED))
    rows.append((" ".join(a), " ".join(b), float(k)))
  return rows


def write_stsb(data_dir, n_train=256, n_dev=64, n_test=16, seed=0):
  def row(i, a, b):
    return f"{i}\tmain-captions\tMSRvid\t2012test\t{i:04d}\tnone\tnone\t{a}\t{b}"
  for split, n, s in (("train", n_train, seed), ("dev", n_dev, seed + 1)):
    write_file(os.path.join(data_dir, "STS-B", f"{split}.tsv"), STSB_HEAD + "\tscore\n" + "".join(
        f"{row(i, a, b)}\t{y:.3f}\n" for i, (a, b, y) in enumerate(stsb_rows(n, s))))
  test = stsb_rows(n_test, seed + 2)
  write_file(os.path.join(data_dir, "STS-B", "test.tsv"), STSB_HEAD + "\n" + "".join(
      f"{row(i, a, b)}\n" for i, (a, b, _) in enumerate(test)))
  return test


# SQuAD v1.1 -------------------------------------------------------------------------------------

def squad_paragraphs(n, seed, prefix, length=(10, 40)):
  """Contexts of filler words, longer than one window at times, holding one answer word."""
  rng = random.Random(seed)
  paragraphs = []
  for i in range(n):
    words = _words(rng, *length)
    at = rng.randrange(len(words) + 1)
    answer = rng.choice(ANSWERS)
    words.insert(at, answer)
    # Capitalised, with a full stop: the offset counts characters of this text.
    context = " ".join(words).capitalize() + "."
    start = len(" ".join(words[:at])) + (at > 0)
    assert context[start:start + len(answer)].lower() == answer
    answer = context[start:start + len(answer)]
    paragraphs.append({"context": context, "qas": [
        {"id": f"{prefix}{i}", "question": QUESTION, "answers": [
            {"text": answer, "answer_start": start}]}]})
  return paragraphs


def write_squad(path, paragraphs):
  return write_file(path, json.dumps({"version": "1.1", "data": [{"title": "synthetic",
                                                                "paragraphs": paragraphs}]}))


# CoNLL-2003 -------------------------------------------------------------------------------------

def conll_sentences(n, seed):
  """[(word, tag)] per sentence: a first name, and a surname after it, are a person, a place is a
  location, the rest O. Tags in IOB1, as the original files."""
  rng = random.Random(seed)
  sentences = []
  for _ in range(n):
    words = []
    for _ in range(rng.randint(1, 2)):  # filler between entities: never two in a row
      words += [(w, "O") for w in _words(rng, 1, 3)]
      if rng.random() < 0.7:
        person = [rng.choice(FIRST_NAMES)] + [rng.choice(SURNAMES)] * (rng.random() < 0.5)
        words += [(w.capitalize(), "I-PER") for w in person]
      else:
        words.append((rng.choice(PLACES).capitalize(), "I-LOC"))
    words += [(w, "O") for w in _words(rng, 0, 3)]
    sentences.append(words)
  return sentences


def write_conll(path, sentences):
  body = "".join("".join(f"{w} NN I-NP {t}\n" for w, t in s) + "\n" for s in sentences)
  return write_file(path, "-DOCSTART- -X- O O\n\n" + body)


def write_tiny_next(folder, n=24):
  """A NEXT task of n identical pairs per split (labels alternate): runs, nothing to learn."""
  os.makedirs(folder / "NEXT")
  for split in ("train", "dev"):
    rows = [f"{i}\tthe cat sat\ta dog ran\t{i % 2}" for i in range(n)]
    (folder / "NEXT" / f"{split}.tsv").write_text(
        "index\tsentence1\tsentence2\tlabel\n" + "\n".join(rows) + "\n")


def tiny_next_config(init_from, data_dir):
  """NEXT at length 16, one epoch of batch 8 and no dropout."""
  config = finetune_config.get_config("next")
  config.checkpoint.init_from, config.data.data_dir = init_from, data_dir
  config.data.max_seq_length = 16
  t = config.train
  t.batch_size, t.num_epochs, t.learning_rate, t.log_every_steps = 8, 1, 1e-3, 1
  config.model.hidden_dropout = config.model.attention_dropout = 0.0
  return config


# What a run starts from -------------------------------------------------------------------------

class Abort(Exception):
  """Ends a run at its first training step (what it starts from is all a test needs)."""


class Builds:
  """Wraps train.build: on `devices` if given; records each Training, the mesh, and the parameters
  the first training step starts from (read before the step, which donates them): init_from's
  weights as the run received them, whatever the steps then do."""

  def __init__(self, monkeypatch, devices=None, abort_at_first_step=False):
    self.trainings, self.first_params = [], None
    real = train.build

    def build(*args, **kwargs):
      if devices is not None:
        kwargs["devices"] = devices
      training = real(*args, **kwargs)
      self.trainings.append(training)

      def step(state, batch, rng):
        if self.first_params is None:
          self.first_params = jax.device_get(state.params)
          if abort_at_first_step:
            raise Abort()
        return training.train_step(state, batch, rng)
      return dataclasses.replace(training, train_step=step)

    monkeypatch.setattr(train, "build", build)

  @property
  def mesh_shape(self):
    return dict(self.trainings[-1].mesh.shape)


# Prediction records compared across calls ------------------------------------------------------

# Prediction promises the same file on 1 and 8 devices (the same calls), not the same bits whatever
# else shares a call: a row predicted beside other rows runs in another program shape, whose
# vectorised loops may sum in another order on another CPU (seen: 0.670143 against 0.670142 on an
# AVX2 machine). A rounded score may move by its last printed digit; everything else is exact.
RECORD_ATOL = 1e-5


def assert_same_records(got, want, atol=RECORD_ATOL, where="record"):
  """Records equal but for floats, which agree within atol: keys, strings, ints, labels exact."""
  if isinstance(want, dict):
    assert isinstance(got, dict) and sorted(got) == sorted(want), (where, got, want)
    for key in want:
      assert_same_records(got[key], want[key], atol, f"{where}.{key}")
  elif isinstance(want, (list, tuple)):
    assert isinstance(got, (list, tuple)) and len(got) == len(want), (where, got, want)
    for k, (g, w) in enumerate(zip(got, want)):
      assert_same_records(g, w, atol, f"{where}[{k}]")
  elif isinstance(want, float):
    assert isinstance(got, float) and abs(got - want) <= atol, (where, got, want)
  else:
    assert type(got) is type(want) and got == want, (where, got, want)


# Embeddings: queries and passages that share no word ----------------------------------------------

ASKED = WORDS[40:64]  # query k names topic k by ASKED[k] ...
ANSWERED = WORDS[64:88]  # ... and its passages by ANSWERED[k]: a pairing only training shows
PASSAGE_FILLER = WORDS[88:]


def _passage(rng, k):
  words = _words(rng, 2, 4, PASSAGE_FILLER)
  _insert(rng, words, ANSWERED[k])
  return " ".join(words)


def _query(rng, k):
  words = _words(rng, 0, 2, PASSAGE_FILLER)
  _insert(rng, words, ASKED[k])
  return " ".join(words)


def retrieval_rows(n, seed):
  """{"id", "query", "positive", "negative"}: a query's topic word is not its passage's, so an
  untrained encoder ranks at chance and a trained one must learn the pairing; the hard negative
  is a passage of another topic."""
  rng = random.Random(seed)
  rows = []
  for i in range(n):
    k = i % len(ASKED)
    other = (k + rng.randrange(1, len(ASKED))) % len(ASKED)
    rows.append({"id": f"q{seed}-{i}", "query": _query(rng, k), "positive": _passage(rng, k),
                 "negative": _passage(rng, other)})
  rng.shuffle(rows)
  return rows


def retrieval_corpus(seed, per_topic=2):
  """(corpus rows {"id", "text"}, judged queries {"id", "query", "positive": ids}): a query per
  topic, its topic's passages relevant."""
  rng = random.Random(seed)
  corpus = [{"id": f"c{k}-{j}", "text": _passage(rng, k)}
            for k in range(len(ASKED)) for j in range(per_topic)]
  rng.shuffle(corpus)
  queries = [{"id": f"t{k}", "query": _query(rng, k),
              "positive": ",".join(f"c{k}-{j}" for j in range(per_topic))}
             for k in range(len(ASKED))]
  return corpus, queries


def sigterm_at(monkeypatch, at_step):
  """Training batches as the run makes them, with a SIGTERM while the batch of step `at_step` is
  handed over (a preemption notice between two steps)."""
  from bertjax.finetune.job import run  # pylint: disable=import-outside-toplevel

  real = run.train_batches

  def batches(*args, **kwargs):
    for step, batch in enumerate(real(*args, **kwargs), args[3]):
      if step + 1 == at_step:
        os.kill(os.getpid(), signal.SIGTERM)
      yield batch
  monkeypatch.setattr(run, "train_batches", batches)
