"""load_pretrained: the encoder of a workdir or a convert.hf folder, plain, boxed or sharded, the
layers restacked on request, and no TensorFlow imported on the way."""

import dataclasses
import os
import subprocess
import sys
import textwrap

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bertjax.formats import converted as converted_folder
from bertjax.model.config import BertConfig
from bertjax.model.encoder import BertModel
from bertjax.model.heads import BertForPreTraining, BertForSequenceClassification
from bertjax.parallel import sharding
from bertjax.training import checkpoint as checkpoint_lib
from bertjax.weights.pretrained import load_pretrained

TINY = BertConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                  intermediate_size=64, max_position_embeddings=16)
IDS = jnp.zeros((1, 4), jnp.int32)


def _params(model, seed):
  """Random values in the model's tree (no init to run: the values only have to differ)."""
  shapes = jax.eval_shape(lambda: nn.unbox(model.init(jax.random.key(0), IDS)["params"]))
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda s: rng.normal(size=s.shape).astype(s.dtype), shapes)


def _save_run(folder, steps_and_params):
  """Checkpoints as bertjax's loop writes them: items params and opt_state, the model in meta."""
  ckpt = checkpoint_lib.Checkpointer(str(folder / "checkpoints"), ("params", "opt_state"),
                                     save_every=1, keep=5, async_save=False)
  for step, params in steps_and_params:
    opt_state = {"mu": jax.tree.map(np.zeros_like, params)}
    ckpt.save(step, {"params": params, "opt_state": opt_state},
              {**checkpoint_lib.Expected(model=TINY).meta(), "step": step}, force=True)
  ckpt.close()


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
  """A pre-training run (two checkpoints), a fine-tuning run and a convert.hf folder."""
  root = tmp_path_factory.mktemp("pretrained")
  older, newer = _params(BertForPreTraining(TINY), 1), _params(BertForPreTraining(TINY), 2)
  _save_run(root / "pretraining", [(3, older), (7, newer)])
  tuned = _params(BertForSequenceClassification(TINY, num_labels=3), 3)
  _save_run(root / "finetuning", [(5, tuned)])
  converted = _params(BertForPreTraining(TINY), 4)
  converted_folder.save_params(str(root / "converted"), converted, TINY)
  return {"pretraining": (root / "pretraining", newer["bert"]),
          "finetuning": (root / "finetuning", tuned["bert"]),
          "converted": (root / "converted", converted["bert"])}


def _assert_same(got, want):
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(g), w)


@pytest.mark.parametrize("kind", ["pretraining", "finetuning", "converted"])
def test_loads_the_stored_encoder_and_its_config(sources, kind):
  path, want = sources[kind]
  config, encoder = load_pretrained(str(path))
  assert config == TINY
  _assert_same(encoder, want)  # the newest checkpoint's, exactly
  if kind != "converted":  # the checkpoints folder itself is accepted too
    _assert_same(load_pretrained(str(path / "checkpoints"))[1], want)


def test_boxed_and_sharded(sources):
  path, want = sources["pretraining"]
  abstract = jax.eval_shape(lambda: BertModel(TINY).init(jax.random.key(0), IDS)["params"])
  names = nn.get_partition_spec(abstract)
  _, boxed = load_pretrained(str(path), boxed=True)
  assert nn.get_partition_spec(boxed) == names
  _assert_same(nn.unbox(boxed), want)

  mesh = sharding.create_mesh(sharding.MeshConfig(ici_data=2, ici_fsdp=2, ici_tensor=2))
  _, placed = load_pretrained(str(path), mesh=mesh)
  expected = sharding.logical_shardings(abstract, mesh, sharding.DEFAULT_RULES)
  assert jax.tree.map(lambda x: x.sharding, placed) == expected
  kernel = placed["encoder"]["layer_0"]["mlp"]["intermediate"]["kernel"]
  assert kernel.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")
  _assert_same(placed, want)


def test_layers_restacked_on_request(sources):
  path, want = sources["converted"]
  config, scanned = load_pretrained(str(path), scan_layers=True)
  assert config == dataclasses.replace(TINY, scan_layers=True)
  stacked = scanned["encoder"]["layers"]["layer"]
  for i in range(TINY.num_layers):
    _assert_same(jax.tree.map(lambda x, i=i: x[i], stacked), want["encoder"][f"layer_{i}"])
  # ... and back, here onto a mesh (the "layers" axis stays whole).
  mesh = sharding.create_mesh(sharding.MeshConfig(ici_data=2, ici_fsdp=4))
  scanned_dir = path.parent / "converted_scanned"
  converted_folder.save_params(str(scanned_dir), {"bert": jax.tree.map(np.asarray, scanned), "mlm": {},
                                    "nsp": {}}, config)
  config, unrolled = load_pretrained(str(scanned_dir), scan_layers=False, mesh=mesh)
  assert not config.scan_layers
  _assert_same(unrolled, want)
  assert unrolled["encoder"]["layer_1"]["attention"]["query"]["kernel"].sharding.spec == (
      jax.sharding.PartitionSpec("fsdp", "tensor", None))


def test_what_is_not_a_pretrained_encoder_is_named(tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    load_pretrained(str(tmp_path / "nowhere"))
  with pytest.raises(FileNotFoundError, match=r"expected a bertjax workdir \(with checkpoints/\)"
                     r", a folder written by `python -m bertjax.convert.hf import`"):
    load_pretrained(str(tmp_path))
  (tmp_path / "checkpoints").mkdir()
  with pytest.raises(FileNotFoundError, match="holds no checkpoint"):
    load_pretrained(str(tmp_path))
  with pytest.raises(ValueError, match="Explicit axes"):
    load_pretrained(str(tmp_path), mesh=jax.make_mesh((8,), ("data",)))


def _assert_loads_without_tensorflow(paths):
  # In a fresh interpreter: pytest's may hold TensorFlow already (other tests import it).
  script = textwrap.dedent(f"""
      import sys
      import bertjax.model, bertjax.heads, bertjax.sharding, bertjax.pretrained, bertjax.nnx
      for path in {[str(p) for p in paths]!r}:
        bertjax.pretrained.load_pretrained(path)
      print(sorted(m for m in sys.modules if m.split(".")[0] == "tensorflow"))
  """)
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
  result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, timeout=300, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.strip().splitlines()[-1] == "[]"


def test_loading_imports_no_tensorflow(sources):
  _assert_loads_without_tensorflow([sources[k][0] for k in ("pretraining", "converted")])


def test_a_google_folder_loads_without_tensorflow(tmp_path):
  # The folder is written with TensorFlow's own writer here; reading it must not need TensorFlow.
  import google_fixtures as gf  # pylint: disable=import-outside-toplevel
  from bertjax.formats import google  # pylint: disable=import-outside-toplevel
  variables = gf.random_variables(gf.GOOGLE_CONFIG, seed=5)
  folder = gf.google_folder(tmp_path, variables=variables, extra=gf.slots(variables))
  config, encoder = load_pretrained(folder)
  assert config == google.config_from_google(gf.GOOGLE_CONFIG)
  # Leaves read straight from the original names (not through the converter's table) ...
  np.testing.assert_array_equal(encoder["embeddings"]["word_embeddings"]["embedding"],
                                variables["bert/embeddings/word_embeddings"])
  h, n = gf.GOOGLE_CONFIG["hidden_size"], gf.GOOGLE_CONFIG["num_attention_heads"]
  np.testing.assert_array_equal(
      encoder["encoder"]["layer_1"]["attention"]["query"]["kernel"],
      variables["bert/encoder/layer_1/attention/self/query/kernel"].reshape(h, n, h // n))
  # ... and the whole encoder as the converter maps it, also sharded on a mesh.
  want = google.params_from_google(variables, config)["bert"]
  _assert_same(encoder, want)
  mesh = sharding.create_mesh(sharding.MeshConfig(ici_data=2, ici_fsdp=2, ici_tensor=2),
                              jax.devices()[:8])
  _, placed = load_pretrained(folder, mesh=mesh)
  _assert_same(placed, want)
  qkv = placed["encoder"]["layer_0"]["attention"]["query"]["kernel"]
  assert qkv.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor", None), qkv.sharding
  _assert_loads_without_tensorflow([folder])
