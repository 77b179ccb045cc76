"""Task families as the one extension point (bertjax/finetune/families/): every registered family
is one typed record (`record.Family`), its fields filled and consistent; no table keyed by family
names, and no comparison of a family name, stands outside families/ (in bertjax/ or configs/); a
family defined here and registered in one line is taken by the task names, the fine-tuning config,
the objective, prediction and the export to Hugging Face, with no other change."""

import ast
import dataclasses
import os

import flax.linen
import jax
import numpy as np
import pytest

from bertjax.finetune import families
from bertjax.finetune.families import regression
from bertjax.finetune.families.record import Family
from bertjax.finetune.kit import objectives
from bertjax.finetune.tasks import tasks
from bertjax.formats import hf, taskspec as spec_lib
from bertjax.model.config import BertConfig
from bertjax.model.encoder import BertModel
from bertjax.predict import predictor as predict

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bertjax")
FAMILIES_DIR = os.path.join(ROOT, "finetune", "families")
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "sat", "dog", "ran", "."]


OPTIONAL = ("predicted", "sentence")  # functions a family may leave None


def test_every_family_is_one_record_filled_in():
  assert set(families.FAMILIES) >= {"classification", "regression", "tagging", "span",
                                    "embeddings"}
  functions = {"num_outputs", "objective", "columns", "as_row", "records", "load"}
  for name, family in families.FAMILIES.items():
    assert isinstance(family, Family) and family.name == name, name
    for field in dataclasses.fields(Family):  # the functions callable, the facts not
      value = getattr(family, field.name)
      assert callable(value) == (field.name in functions or (field.name in OPTIONAL
                                                             and value is not None)), field.name
    assert family.main_metrics and set(family.lower_is_better) <= set(family.main_metrics)
    spec = spec_lib.TaskSpec("t", name, ("O", "B-X", "I-X")[:family.min_labels])
    batch = family.objective(spec).dummy_batch(2)
    # A family without a head (its outputs the encoder's own vectors) names all its inputs.
    inputs = objectives.INPUTS if family.head else ()
    assert set(batch) == {*inputs, "weight", *family.batch_keys}, name
    assert (family.sentence is not None) == (not family.head) == (family.num_outputs(spec) == 0)
    assert family.check(spec) is spec
    if family.min_labels:  # one label short: a task.json written by hand
      with pytest.raises(ValueError, match=f"a {name} task needs at least {family.min_labels}"):
        family.check(dataclasses.replace(spec, labels=spec.labels[:-1]))
  with pytest.raises(ValueError, match=r"family='nope' is not one of \('classification'"):
    families.get("nope")


def _family_names(node) -> list[str]:
  return [n.value for n in node if isinstance(n, ast.Constant) and n.value in families.FAMILIES]


def _tables(path: str) -> list[str]:
  """Dicts keyed by two or more family names, tuples / lists / sets of two or more, and a
  comparison of something with a family name (`family == "span"`, `spec.family in (...)`)."""
  with open(path, encoding="utf-8") as f:
    tree = ast.parse(f.read(), path)
  found = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Dict) and len(_family_names(node.keys)) >= 2:
      found.append(f"{path}:{node.lineno}: a dict keyed by family names")
    elif isinstance(node, (ast.Tuple, ast.List, ast.Set)) and len(_family_names(node.elts)) >= 2:
      found.append(f"{path}:{node.lineno}: a list of family names")
    elif isinstance(node, ast.Compare):
      sides = [node.left, *node.comparators]
      names = _family_names(sides) + [n for side in sides if isinstance(side, (ast.Tuple,
                                                                               ast.List, ast.Set))
                                      for n in _family_names(side.elts)]
      if names:
        found.append(f"{path}:{node.lineno}: a comparison with the family name(s) {names}")
  return found


def test_no_family_table_outside_the_families():
  found = []
  for folder, _, names in [*os.walk(ROOT), *os.walk(os.path.join(os.path.dirname(ROOT),
                                                                 "configs"))]:
    if folder.startswith(FAMILIES_DIR):
      continue
    for name in names:
      path = os.path.join(folder, name)
      if name.endswith(".py"):
        found += _tables(path)
  assert not found, ("Tables or tests of family names outside bertjax/finetune/families/ (ask "
                     "the family module instead):\n" + "\n".join(found))


def test_the_check_sees_a_table():
  tree = 'OBJ = {"classification": 1, "span": 2}\nif spec.family == "tagging":\n  pass\n'
  path = os.path.join(os.environ.get("TMPDIR", "/tmp"), "families_check_probe.py")
  with open(path, "w", encoding="utf-8") as f:
    f.write(tree)
  assert len(_tables(path)) == 2
  os.remove(path)


@pytest.fixture
def toy(monkeypatch):
  """A family registered in one line: regression's record under a new name."""
  monkeypatch.setitem(families.FAMILIES, "toy", dataclasses.replace(regression.FAMILY, name="toy"))
  return "toy"


def test_a_family_registered_in_one_line_is_used_by_spec_tasks_objective_and_predict(toy,
                                                                                       tmp_path):
  spec = spec_lib.TaskSpec("toy", toy, (), 16)
  family = families.get(toy)
  assert (family.num_outputs(spec), family.head) == (1, "classifier")
  assert spec_lib.TaskSpec.from_dict(spec.to_dict()) == spec
  assert tasks.canonical("TOY") == toy and toy in tasks.names()
  # One's own task of the family: its learning rate chosen on dev, as for the four.
  from bertjax.configs import finetune as finetune_config  # pylint: disable=import-outside-toplevel
  assert finetune_config.get_config(toy).train.learning_rate is None
  assert finetune_config.get_config("rte").train.learning_rate == 2e-5  # a benchmark's recipe
  assert families.main_value(toy, {"mse": 0.5, "pearson": 0.1}, "mse") == -0.5

  from bertjax.data.tokenizer import load_tokenizer  # pylint: disable=import-outside-toplevel
  (tmp_path / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
  tokenizer = load_tokenizer(str(tmp_path / "vocab.txt"))
  config = BertConfig(vocab_size=len(VOCAB), hidden_size=16, num_layers=1, num_heads=2,
                      intermediate_size=32, max_position_embeddings=32)
  model = families.get(toy).objective(spec).make_model(config)
  ids = np.zeros((1, 8), np.int32)
  params = model.init(jax.random.PRNGKey(0), ids, ids, ids)["params"]
  predictor = predict.Predictor(config, params, tokenizer, spec, tokens_per_device=32,
                                devices=jax.devices()[:1])
  records = predictor(["the cat sat", "a dog ran .", {"text": "the dog"}])
  assert [sorted(r) for r in records] == [["value"]] * 3
  assert all(np.isfinite(r["value"]) for r in records)
  # Its export: the transformers class and head the family names, its width.
  sd, extra = hf.task_to_hf(flax.linen.unbox(params), config, head=family.head,
                            hf_class=family.hf_class, hf_head=family.hf_head,
                            outputs=family.num_outputs(spec), labels=spec.labels)
  assert extra == {"architectures": ["BertForSequenceClassification"], "num_labels": 1,
                   "problem_type": "regression"}
  assert sd["classifier.weight"].shape == (1, 16) and "bert.pooler.dense.weight" in sd


def test_a_registered_family_is_a_task_its_load_reads(toy, monkeypatch):
  import finetune_fixtures as fx  # pylint: disable=import-outside-toplevel
  from bertjax.finetune.kit.config import TaskConfig  # pylint: disable=import-outside-toplevel
  monkeypatch.setitem(families.FAMILIES, toy, dataclasses.replace(
      families.get(toy), load=lambda cfg, tokenizer: ("read", cfg.task)))
  assert tasks.load(TaskConfig.from_config(fx.ft_config("toy", "")), None) == ("read", "toy")


def test_the_headless_family_is_used_by_spec_tasks_config_objective_predict_and_export(tmp_path):
  """embeddings: no head, its outputs the encoder's vectors, made as its spec says."""
  from bertjax.configs import finetune as finetune_config  # pylint: disable=import-outside-toplevel
  from bertjax.finetune.families import embeddings  # pylint: disable=import-outside-toplevel
  from bertjax.finetune.kit.config import TaskConfig  # pylint: disable=import-outside-toplevel
  from bertjax.formats.sentence_transformers import SentenceVectors  # pylint: disable=import-outside-toplevel
  from test_contrastive import random_params  # pylint: disable=import-outside-toplevel
  name = "embeddings"
  family = families.get(name)
  config = finetune_config.get_config(name)
  assert config.train.learning_rate is None and tasks.canonical("Embeddings") == name
  config.contrastive.pooling, config.data.max_query_length = "cls", 6
  spec = embeddings.spec_of(TaskConfig.from_config(config))
  assert (spec.family, spec.pooling, spec.normalize, spec.max_query_length) == (name, "cls", True,
                                                                                6)
  assert spec_lib.TaskSpec.from_dict(spec.to_dict()) == spec
  assert family.sentence(spec) == SentenceVectors("cls", True, spec.max_seq_length)
  assert (family.head, family.hf_class, family.modernbert_class) == ("", "BertModel",
                                                                     "ModernBertModel")

  from bertjax.data.tokenizer import load_tokenizer  # pylint: disable=import-outside-toplevel
  (tmp_path / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
  tokenizer = load_tokenizer(str(tmp_path / "vocab.txt"))
  bert = BertConfig(vocab_size=len(VOCAB), hidden_size=16, num_layers=1, num_heads=2,
                    intermediate_size=32, max_position_embeddings=32)
  objective = family.objective(spec)
  model = objective.make_model(bert)
  abstract = jax.eval_shape(lambda: flax.linen.unbox(model.init(
      jax.random.PRNGKey(0), **objective.inputs(objective.dummy_batch(1)))["params"]))
  params = random_params(abstract)
  assert set(params) == {"bert"}  # nothing beside the encoder: what the export writes
  predictor = predict.Predictor(bert, params, tokenizer, spec, tokens_per_device=32,
                                devices=jax.devices()[:1])
  texts = ["the cat sat", "a dog ran . the cat sat the dog ran", {"query": "the dog"}]
  records = predictor(texts)  # the second, a query longer than max_query_length, is cut
  assert [sorted(r) for r in records] == [["vector"], ["truncated", "vector"], ["vector"]]
  vectors = np.array([r["vector"] for r in records])
  np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
  # The vectors are the [CLS] state's (the spec's pooling), not the mean's.
  ids = np.array([[2, 6, 7, 3]], np.int32)
  sequence, _ = BertModel(bert).apply({"params": params["bert"]}, ids, np.ones_like(ids), None)
  cls_vector = sequence[0, 0] / np.linalg.norm(sequence[0, 0])
  np.testing.assert_allclose(np.array(predictor(["cat sat"])[0]["vector"]), cls_vector,
                             atol=1e-5)
