"""What reads no tf.data and no TensorFlow file runs where TensorFlow is absent: fine-tuning (its
TensorBoard events written by metrics.EventFile), prediction (on CSV and JSON Lines), the Hugging
Face and ModernBERT converters, Google's import (its checkpoint is read by formats/tf_bundle.py),
`load_pretrained` and the benchmark.

Each runs as its user runs it, in a fresh interpreter whose `import tensorflow` (and
`tensorflow_datasets`) raises ImportError, as on a GPU or TPU host without TensorFlow. The inputs
are tiny: a 2-layer fine-tuned model (classification, its task.json), Hugging Face and ModernBERT
folders written by bertjax's own formats, a Google folder written by TensorFlow (in pytest's
process, google_fixtures) and the pre-training workdir of tests/fixtures.
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from bertjax.benchmark import predict as benchmark_predict
from bertjax.formats import hf, modernbert
from bertjax.model.config import BertConfig
from bertjax.model.heads import BertForPreTraining
from conftest import xla_flags
from google_fixtures import google_folder
from test_launch_local_finetune import _pair_task

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKDIR = os.path.join(ROOT, "tests", "fixtures", "workdir_b49986a", "workdir")
ABSENT = 'raise ImportError("TensorFlow is absent here (tests/test_without_tensorflow.py)")\n'


def _encoder_and_mlm(config: BertConfig, with_nsp: bool = True) -> dict:
  """The pre-training model's parameters, of its init's shapes (traced, not run: op by op, the
  init is seconds of compiling), drawn on the host: N(0, 0.02), norm scales 1."""
  ids = jnp.zeros((1, 8), jnp.int32)
  shapes = jax.eval_shape(BertForPreTraining(config).init, jax.random.key(0), ids)["params"]
  shapes = jax.tree.map(lambda x: x.unbox() if hasattr(x, "unbox") else x, shapes,
                        is_leaf=lambda x: hasattr(x, "unbox"))
  rng = np.random.default_rng(0)
  params = jax.tree_util.tree_map_with_path(
      lambda path, s: ((1.0 if jax.tree_util.keystr(path[-1:]) == "['scale']" else 0.0)
                       + 0.02 * rng.normal(size=s.shape)).astype(s.dtype), shapes)
  return params if with_nsp else {k: params[k] for k in ("bert", "mlm")}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
  root = tmp_path_factory.mktemp("without_tensorflow")
  for package in ("tensorflow", "tensorflow_datasets"):
    os.makedirs(root / "absent" / package)
    (root / "absent" / package / "__init__.py").write_text(ABSENT)
  tuned = benchmark_predict._tiny_workdir(str(root))  # pylint: disable=protected-access
  (root / "in.csv").write_text("text\nalpha beta gamma\n\"delta, epsilon\"\n")
  (root / "in.jsonl").write_text('{"text": "zeta eta"}\n{"text": "theta alpha"}\n')
  vocab = (root / "vocab.txt").read_text()
  bert = BertConfig(vocab_size=13, hidden_size=32, num_layers=2, num_heads=2,
                    intermediate_size=64, max_position_embeddings=64)
  hf.save_hf_dir(str(root / "hf"), _encoder_and_mlm(bert), bert)
  (root / "hf" / "vocab.txt").write_text(vocab)
  modern = modernbert.config_from_modernbert(dict(
      vocab_size=13, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
      num_attention_heads=2, max_position_embeddings=64, global_attn_every_n_layers=2,
      local_attention=8))
  modernbert.save_dir(str(root / "modernbert"), _encoder_and_mlm(modern, with_nsp=False), modern)
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "PYTHONPATH": os.pathsep.join([str(root / "absent"), ROOT])}
  return dict(root=root, tuned=tuned, hf=str(root / "hf"), modernbert=str(root / "modernbert"),
              env=env)


def _run(folders, *args: str, env=None) -> str:
  done = subprocess.run([sys.executable, *args], cwd=folders["root"],
                        env={**folders["env"], **(env or {})},
                        capture_output=True, text=True, timeout=300, check=False)
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
  return done.stdout


def test_tensorflow_is_absent_in_these_runs(folders):
  done = subprocess.run([sys.executable, "-c", "import tensorflow"], env=folders["env"],
                        capture_output=True, text=True, timeout=60, check=False)
  assert done.returncode == 1 and "TensorFlow is absent here" in done.stderr, done.stderr


@pytest.mark.parametrize("fmt", ["csv", "jsonl"])
def test_predict(folders, fmt):
  out = str(folders["root"] / f"predicted-{fmt}.jsonl")
  said = _run(folders, "-m", "bertjax.predict", f"--workdir={folders['tuned']}",
              f"--input={folders['root'] / f'in.{fmt}'}", f"--output={out}")
  assert "predict: 2 rows" in said, said
  assert len(open(out).read().splitlines()) == 2


def test_hugging_face_import_and_export(folders):
  out = str(folders["root"] / "hf_imported")
  assert _run(folders, "-m", "bertjax.convert.hf", "import", f"--weights={folders['hf']}",
              f"--output={out}").startswith("Imported")
  said = _run(folders, "-m", "bertjax.convert.hf", "export", f"--weights={folders['tuned']}",
              f"--output={folders['root'] / 'hf_exported'}")
  assert "BertForSequenceClassification, 2 labels" in said, said


def test_modernbert_import_and_export(folders):
  out = str(folders["root"] / "modernbert_imported")
  assert _run(folders, "-m", "bertjax.convert.modernbert", "import",
              f"--weights={folders['modernbert']}", f"--output={out}").startswith("Imported")
  assert _run(folders, "-m", "bertjax.convert.modernbert", "export", f"--weights={out}",
              f"--output={folders['root'] / 'modernbert_exported'}").startswith("Exported")


def test_google_import(folders):
  folder = google_folder(folders["root"] / "google")
  said = _run(folders, "-m", "bertjax.convert.google", "import", f"--weights={folder}",
              f"--output={folders['root'] / 'google_imported'}")
  assert said.startswith("Imported"), said


def test_load_pretrained(folders):
  paths = [WORKDIR, folders["tuned"], folders["hf"], folders["modernbert"]]
  said = _run(folders, "-c", "import sys\nfrom bertjax.pretrained import load_pretrained\n"
              "for path in sys.argv[1:]:\n"
              "  config, params = load_pretrained(path)\n"
              "  print('encoder' in params and 'embeddings' in params, config.hidden_size)\n",
              *paths)
  assert said.count("True ") == len(paths), said


def test_fine_tuning_writes_tensorboard_events_tensorboard_reads(folders):
  root = folders["root"]
  _pair_task(root / "task", n_train=32, n_dev=8)
  workdir = root / "tuned_here"
  said = _run(folders, "-m", "bertjax.finetune", "--config=configs/finetune.py:next",
              f"--workdir={workdir}", "--config.checkpoint.init_from=",
              f"--config.data.vocab_path={root / 'vocab.txt'}",
              f"--config.data.data_dir={root / 'task'}", "--config.model.vocab_size=13",
              "--config.model.hidden_size=32", "--config.model.num_layers=1",
              "--config.model.num_heads=2", "--config.model.intermediate_size=64",
              "--config.model.max_position_embeddings=32", "--config.model.type_vocab_size=2",
              "--config.data.max_seq_length=32", "--config.train.batch_size=8",
              "--config.train.num_epochs=1", "--config.train.log_every_steps=2")
  assert "NEXT: best dev accuracy" in said, said
  logged = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  losses = [(r["step"], r["train/loss"]) for r in logged if "train/loss" in r]
  assert [step for step, _ in losses] == [2, 4]
  events = EventAccumulator(str(workdir / "tensorboard"))
  events.Reload()
  shown = events.Scalars("train/loss")
  assert [e.step for e in shown] == [2, 4]
  assert [e.value for e in shown] == pytest.approx([loss for _, loss in losses], rel=1e-6)
  assert "eval/accuracy" in events.Tags()["scalars"], events.Tags()


def test_benchmark(folders):
  # On one device (the 8 emulated ones partition the step: a compile several times the cost),
  # the tiny config at the vocabulary of tests/test_benchmark.py's models.
  said = _run(folders, "-m", "bertjax.benchmark", f"--config={ROOT}/configs/tiny.py", "--steps=1",
              "--warmup_steps=0", "--config.train.batch_size=8", "--config.model.vocab_size=1000",
              env={"XLA_FLAGS": xla_flags(1)})
  assert "sequences_per_s" in said and "1 x cpu" in said, said
