"""Properties of the encoder: sizes, init, padding, packing, scan/remat, dtypes, sharding, errors."""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding

from bertjax.configs import base
from bertjax.model import losses
from bertjax.model.attention import attention_with_dropout
from bertjax.model.config import BertConfig
from bertjax.model.encoder import BertModel, positions_from_sequence_ids
from bertjax.model.heads import BertForPreTraining
from bertjax.training import train

SMALL = BertConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64,
                   max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0)


def _inputs(batch=2, length=16, seed=0, vocab=64):
  rng = np.random.default_rng(seed)
  ids = rng.integers(5, vocab, (batch, length)).astype(np.int32)
  mask = np.ones((batch, length), np.int32)
  seg = np.zeros((batch, length), np.int32)
  seg[:, length // 2:] = 1
  return ids, mask, seg


def _count(tree):
  return int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(tree)))


# A model's init and apply, each one compiled program (cached by module, config and shapes) rather
# than hundreds of operations dispatched one by one.
@functools.partial(jax.jit, static_argnums=(0, 1))
def _jit_init(module_cls, cfg, key, *args, **kw):
  return module_cls(cfg).init(key, *args, **kw)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _jit_apply(module_cls, cfg, deterministic, params, *args, **kw):
  return module_cls(cfg).apply({"params": params}, *args, deterministic=deterministic, **kw)


def _apply(cfg, params, *args, module_cls=BertModel, deterministic=True, **kw):
  return _jit_apply(module_cls, cfg, deterministic, params, *args, **kw)


def _init(cfg, ids, module_cls=BertModel, **kw):
  return _jit_init(module_cls, cfg, jax.random.key(0), ids, **kw)["params"]


@pytest.mark.parametrize("sizes,encoder_count,pretraining_count", [
    (dict(), 109_482_240, 110_106_428),
    (dict(hidden_size=1024, num_layers=24, num_heads=16, intermediate_size=4096),
     335_141_888, 336_226_108),
])
@pytest.mark.parametrize("scan", [False, True])
def test_parameter_counts_match_the_release(sizes, encoder_count, pretraining_count, scan):
  cfg = BertConfig(**sizes, scan_layers=scan)
  ids = jnp.ones((1, 8), jnp.int32)
  encoder = jax.eval_shape(lambda: BertModel(cfg).init(jax.random.key(0), ids))
  full = jax.eval_shape(lambda: BertForPreTraining(cfg).init(
      jax.random.key(0), ids, masked_lm_positions=jnp.zeros((1, 2), jnp.int32)))
  assert _count(nn.unbox(encoder["params"])) == encoder_count
  assert _count(nn.unbox(full["params"])) == pretraining_count


def test_initialisation_follows_the_original():
  cfg = dataclasses.replace(SMALL, hidden_size=256, num_heads=4, intermediate_size=512)
  params = nn.unbox(_init(cfg, jnp.ones((1, 8), jnp.int32)))
  flat = {"/".join(p.key for p in path): v
          for path, v in jax.tree_util.tree_flatten_with_path(params)[0]}
  kernel = np.asarray(flat["encoder/layer_0/mlp/intermediate/kernel"])
  # Truncated at 2 sigma of 0.02: sample stddev 0.02 * 0.8796.
  assert abs(kernel.std() - 0.02 * 0.8796) < 5e-4
  assert np.abs(kernel).max() <= 0.04 + 1e-6
  for name, value in flat.items():
    if name.endswith("bias"):
      assert not np.any(value), name
    if name.endswith("scale"):
      assert np.all(np.asarray(value) == 1.0), name


def test_gelu_is_the_exact_erf_form_with_its_derivative():
  """Against x·Φ(x) and its derivative Φ(x) + x·φ(x) in float64, over the range layers see."""
  import math  # pylint: disable=import-outside-toplevel
  from bertjax.model.config import gelu  # pylint: disable=import-outside-toplevel
  xs = np.linspace(-8, 8, 1601)
  phi = np.array([0.5 * math.erfc(-v / math.sqrt(2)) for v in xs])
  density = np.exp(-xs ** 2 / 2) / math.sqrt(2 * math.pi)
  x = jnp.asarray(xs, jnp.float32)
  np.testing.assert_allclose(gelu(x), xs * phi, atol=2e-6, rtol=1e-6)
  np.testing.assert_allclose(jax.vmap(jax.grad(gelu))(x), phi + xs * density, atol=2e-6, rtol=1e-6)
  # The tanh form is an option of its own, not what "gelu" computes: they differ by ~1e-3 near 2.
  assert float(jnp.max(jnp.abs(gelu(x) - jax.nn.gelu(x, approximate=True)))) > 1e-4


def test_a_sinusoidal_start_makes_each_offset_one_linear_map_of_the_table():
  # 64 positions of width 16: the fit below is over-determined, so it can fail.
  normal = dataclasses.replace(SMALL, hidden_size=16, num_heads=2, intermediate_size=32,
                               max_position_embeddings=64, initializer_range=0.1)
  sine = dataclasses.replace(normal, position_init="sinusoidal")

  def table(cfg, seed):
    params = BertModel(cfg).init(jax.random.key(seed), jnp.ones((1, 8), jnp.int32))["params"]
    return np.asarray(nn.unbox(params)["embeddings"]["position_embeddings"]["embedding"],
                      np.float64)

  np.testing.assert_array_equal(table(sine, 0), table(sine, 1))  # a fixed start, whatever the seed
  # Its size is the other tables': root mean square initializer_range over the fast columns.
  assert abs(np.sqrt(np.mean(table(sine, 0)[:, :4] ** 2)) - 0.1) < 0.01
  # Why it is there: one matrix takes every position to the next, so "the token before" is the
  # same direction of attention at every position. A random table has no such map.
  for cfg, exact in ((sine, True), (normal, False)):
    t = table(cfg, 0)
    shift, *_ = np.linalg.lstsq(t[:-1], t[1:], rcond=None)
    residual = np.linalg.norm(t[:-1] @ shift - t[1:]) / np.linalg.norm(t[1:])
    assert (residual < 1e-6) == exact, (cfg.position_init, residual)


@pytest.mark.parametrize("scan", [False, True])
def test_a_shared_query_key_start_copies_w_q_into_w_k_and_orders_attention_by_position(scan):
  cfg = dataclasses.replace(SMALL, hidden_size=16, num_heads=2, intermediate_size=32,
                            max_position_embeddings=64, initializer_range=0.25,
                            position_init="sinusoidal", scan_layers=scan)
  shared = dataclasses.replace(cfg, query_key_init="shared")

  def attention(c):
    params = nn.unbox(BertModel(c).init(jax.random.key(0), jnp.ones((1, 8), jnp.int32))["params"])
    layer = (jax.tree.map(lambda a: a[0], params["encoder"]["layers"]["layer"]) if scan
             else params["encoder"]["layer_0"])
    return params, layer["attention"]

  params, att = attention(shared)
  indep_params, indep = attention(cfg)
  np.testing.assert_array_equal(att["key"]["kernel"], att["query"]["kernel"])
  # Only W_K changes: every other parameter is the one the independent start draws.
  np.testing.assert_array_equal(att["query"]["kernel"], indep["query"]["kernel"])
  assert not np.array_equal(indep["key"]["kernel"], indep["query"]["kernel"])
  differ = [jax.tree_util.keystr(path) for (path, a), b in zip(
      jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(indep_params))
      if not np.array_equal(a, b)]
  assert differ and all(p.endswith("['key']['kernel']") for p in differ), differ

  # Why: q_i . k_j = x_i^T W W^T x_j is largest near i. Scores of the position table alone
  # (one head) fall with distance from the diagonal; independent W_Q, W_K give no such order.
  table = params["embeddings"]["position_embeddings"]["embedding"]

  def near_minus_far(a):
    w_q = a["query"]["kernel"][:, 0, :]
    w_k = a["key"]["kernel"][:, 0, :]
    scores = (table @ w_q) @ (table @ w_k).T
    offsets = np.abs(np.arange(64)[:, None] - np.arange(64)[None, :])
    return scores[(offsets >= 1) & (offsets <= 2)].mean() - scores[offsets >= 16].mean()

  assert near_minus_far(att) > 0.5 * abs(near_minus_far(indep)) + 1e-3
  assert near_minus_far(att) > 0


def test_every_parameter_carries_logical_axis_names():
  cfg = dataclasses.replace(SMALL, scan_layers=True)
  # Shapes and names alone: nothing is computed.
  variables = jax.eval_shape(lambda: BertForPreTraining(cfg).init(
      jax.random.key(0), jnp.ones((1, 8), jnp.int32),
      masked_lm_positions=jnp.zeros((1, 2), jnp.int32)))
  boxes = jax.tree_util.tree_leaves(variables["params"],
                                    is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
  assert boxes and all(isinstance(b, nn.LogicallyPartitioned) for b in boxes)
  for box in boxes:
    assert len(box.names) == box.value.ndim
  specs = nn.get_partition_spec(variables)["params"]
  assert specs["bert"]["encoder"]["layers"]["layer"]["mlp"]["intermediate"]["kernel"] == (
      jax.sharding.PartitionSpec("layers", "embed", "mlp"))


def test_padding_does_not_change_real_positions():
  ids, mask, seg = _inputs(batch=1, length=16)
  params = _init(SMALL, ids)
  real = 10
  mask[:, real:] = 0
  out_a = _apply(SMALL, params, ids, mask, seg)
  ids_b = ids.copy()
  ids_b[:, real:] = np.random.default_rng(7).integers(5, 64, (1, 16 - real))
  out_b = _apply(SMALL, params, ids_b, mask, seg)
  np.testing.assert_allclose(out_a[0][:, :real], out_b[0][:, :real], atol=1e-6)
  np.testing.assert_allclose(out_a[1], out_b[1], atol=1e-6)
  # Real positions alone (no padding at all) give the same outputs.
  alone = _apply(SMALL, params, ids[:, :real], mask[:, :real], seg[:, :real])
  np.testing.assert_allclose(out_a[0][:, :real], alone[0], atol=1e-5)


def test_packed_sequences_equal_each_sequence_alone():
  params = _init(SMALL, jnp.ones((1, 16), jnp.int32))
  rng = np.random.default_rng(3)
  a = rng.integers(5, 64, (1, 7)).astype(np.int32)
  b = rng.integers(5, 64, (1, 6)).astype(np.int32)
  seg_a = np.array([[0, 0, 0, 0, 1, 1, 1]], np.int32)
  seg_b = np.array([[0, 0, 0, 1, 1, 1]], np.int32)
  pad = 3
  packed_ids = np.concatenate([a, b, np.zeros((1, pad), np.int32)], axis=1)
  packed_seg = np.concatenate([seg_a, seg_b, np.zeros((1, pad), np.int32)], axis=1)
  packed_mask = np.concatenate([np.ones((1, 13), np.int32), np.zeros((1, pad), np.int32)], 1)
  seq_ids = np.array([[1] * 7 + [2] * 6 + [0] * pad], np.int32)
  packed, _ = _apply(SMALL, params, packed_ids, packed_mask, packed_seg, sequence_ids=seq_ids)
  alone_a, _ = _apply(SMALL, params, a, np.ones_like(a), seg_a)
  alone_b, _ = _apply(SMALL, params, b, np.ones_like(b), seg_b)
  np.testing.assert_allclose(packed[:, :7], alone_a, atol=1e-5)
  np.testing.assert_allclose(packed[:, 7:13], alone_b, atol=1e-5)


def test_positions_restart_for_each_packed_sequence():
  ids = jnp.array([[1, 1, 1, 2, 2, 3, 0, 0]])
  np.testing.assert_array_equal(positions_from_sequence_ids(ids), [[0, 1, 2, 0, 1, 0, 0, 1]])


def _loss_fn(cfg, ids, mask, seg, positions):
  def loss(params):
    mlm, nsp = BertForPreTraining(cfg).apply({"params": params}, ids, mask, seg, positions)
    return jnp.sum(mlm ** 2) * 1e-3 + jnp.sum(nsp ** 2)
  return loss


def _stack_layers(params, num_layers):
  """Unrolled `layer_i` parameters stacked into the scanned layout."""
  enc = params["bert"]["encoder"]
  stacked = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs),
                                   *[enc[f"layer_{i}"] for i in range(num_layers)])
  out = jax.tree_util.tree_map(lambda x: x, params)
  out["bert"]["encoder"] = {"layers": {"layer": stacked}}
  return out


def _scan_inputs():
  ids, mask, seg = _inputs()
  mask[1, 12:] = 0
  positions = np.array([[1, 3, 5], [2, 4, 6]], np.int32)
  return ids, mask, seg, positions


@functools.lru_cache(maxsize=None)
def _plain_loss_and_grads():
  """The unrolled, un-rematerialised model's loss and gradients: the reference of every variant,
  computed once (one compiled program rather than every operation dispatched on its own)."""
  ids, mask, seg, positions = _scan_inputs()
  plain_params = nn.unbox(_init(SMALL, ids, BertForPreTraining, masked_lm_positions=positions))
  loss, grads = jax.jit(jax.value_and_grad(_loss_fn(SMALL, ids, mask, seg, positions)))(
      plain_params)
  return plain_params, loss, grads


@pytest.mark.parametrize("variant", [dict(scan_layers=True), dict(remat_policy="full"),
                                     dict(remat_policy="dots"),
                                     dict(scan_layers=True, remat_policy="dots_all"),
                                     dict(scan_layers=True, scan_unroll=2)])
def test_scan_and_remat_compute_the_same_function_and_gradients(variant):
  ids, mask, seg, positions = _scan_inputs()
  plain_params, loss_plain, grads_plain = _plain_loss_and_grads()
  cfg = dataclasses.replace(SMALL, **variant)
  params = (_stack_layers(plain_params, SMALL.num_layers) if cfg.scan_layers else plain_params)
  loss_var, grads_var = jax.jit(jax.value_and_grad(_loss_fn(cfg, ids, mask, seg, positions)))(
      params)
  np.testing.assert_allclose(loss_var, loss_plain, rtol=1e-6, atol=1e-6)
  if cfg.scan_layers:
    grads_plain = _stack_layers(grads_plain, SMALL.num_layers)
  jax.tree_util.tree_map(
      lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6), grads_var, grads_plain)


def _eqns(jaxpr):
  """Every equation of a jaxpr, those of sub-jaxprs (scan, remat, pjit) included."""
  for eqn in jaxpr.eqns:
    yield eqn
    for value in eqn.params.values():
      for inner in (value if isinstance(value, (tuple, list)) else (value,)):
        inner = getattr(inner, "jaxpr", inner)
        if hasattr(inner, "eqns"):
          yield from _eqns(inner)


@pytest.mark.parametrize("scan", [False, True])
def test_remat_prevents_cse_unless_the_layers_are_scanned(scan):
  # Unrolled, prevent_cse=False lets XLA merge the recomputation into the forward pass and the
  # remat saves nothing; inside nn.scan the loop already prevents that, and the flag costs speed.
  cfg = dataclasses.replace(SMALL, scan_layers=scan, remat_policy="full")
  ids = jnp.ones((1, 8), jnp.int32)
  params = jax.eval_shape(lambda: BertModel(cfg).init(jax.random.key(0), ids))
  jaxpr = jax.make_jaxpr(lambda p: BertModel(cfg).apply(p, ids))(params)
  flags = [e.params["prevent_cse"] for e in _eqns(jaxpr.jaxpr) if "prevent_cse" in e.params]
  assert flags == ([False] if scan else [True] * SMALL.num_layers)


@pytest.mark.parametrize("mlp_type", ["dense", "gated"])
def test_mlp_keeps_its_pre_activation_alone_when_nothing_is_rematerialised(mlp_type):
  # mlp_impl "xla_remade" under remat "none": the backward keeps the products h (and the
  # gate's) and makes the GELU again from h. Differentiated as written ("xla") it also keeps
  # GELU(h) and erf's own intermediates, F-wide each, which XLA writes to HBM
  # (docs/performance.md, "The MLP's activation made again"). The gradients are the same.
  from bertjax.model.mlp import Mlp
  cfg = dataclasses.replace(SMALL, mlp_type=mlp_type, mlp_impl="xla_remade")
  x = jax.random.normal(jax.random.key(1), (2, 8, cfg.hidden_size))
  params = nn.unbox(Mlp(cfg).init(jax.random.key(0), x))
  loss = lambda c: lambda p, x: jnp.sum(jnp.sin(Mlp(c).apply(p, x)))
  pullback = jax.eval_shape(lambda p, x: jax.vjp(loss(cfg), p, x)[1], params, x)
  wide = [r for r in jax.tree.leaves(pullback) if r.shape == (2, 8, cfg.intermediate_size)]
  assert len(wide) == (1 if mlp_type == "dense" else 2)
  as_written = dataclasses.replace(cfg, mlp_impl="xla")
  got, want = (jax.grad(loss(c), argnums=(0, 1))(params, x) for c in (cfg, as_written))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, want)
  # Under a remat policy the layer's own remat makes the activation again: no second one inside
  # it (which moved 8-13% more bytes, BERT-Base L 512 on v5p-8 and v5e-8).
  remats = lambda c: [e for e in _eqns(jax.make_jaxpr(lambda x: Mlp(c).apply(params, x))(x).jaxpr)
                      if "prevent_cse" in e.params]
  assert len(remats(cfg)) == 1
  assert remats(dataclasses.replace(cfg, remat_policy="dots")) == []


@pytest.mark.parametrize("deterministic", [True, False])
def test_bfloat16_compute_keeps_the_float32_parts_float32(deterministic):
  # The dtype policy: parameters, softmax, LayerNorm statistics, logits and losses in float32,
  # matmuls in bfloat16. Both attention paths: the fused one (no dropout) and the dropout one.
  cfg = dataclasses.replace(SMALL, vocab_size=96, dtype="bfloat16", hidden_dropout=0.1,
                            attention_dropout=0.1, scan_layers=True)
  model = BertForPreTraining(cfg)
  batch = train.dummy_batch(2, 8, 3)
  params = nn.unbox(_jit_init(BertForPreTraining, cfg, jax.random.key(0),
                              **train.model_inputs(batch))["params"])
  assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}

  def forward(p):
    mlm, nsp = model.apply({"params": p}, **train.model_inputs(batch),
                           deterministic=deterministic, rngs={"dropout": jax.random.key(1)})
    metrics = losses.pretraining_metrics(mlm, nsp, batch)
    return mlm, nsp, metrics, losses.total_loss(metrics)

  jaxpr = jax.make_jaxpr(forward)(params)
  mlm, nsp, metrics, loss = jax.eval_shape(forward, params)
  assert mlm.dtype == nsp.dtype == loss.dtype == jnp.float32
  assert {x.dtype for x in jax.tree.leaves(metrics)} == {jnp.dtype(jnp.float32)}
  eqns = list(_eqns(jaxpr.jaxpr))
  assert any(e.invars[0].aval.dtype == jnp.bfloat16  # the matmuls do run in bfloat16
             for e in eqns if e.primitive.name == "dot_general")
  # Softmax (max, exp, sum), LayerNorm statistics (sums, rsqrt), cross-entropy (logsumexp).
  reductions = [e for e in eqns if e.primitive.name in
                ("exp", "log", "reduce_max", "reduce_sum", "rsqrt")]
  assert {e.primitive.name for e in reductions} == {"exp", "log", "reduce_max", "reduce_sum",
                                                    "rsqrt"}
  for e in reductions:
    assert e.invars[0].aval.dtype == jnp.float32, e
  # Matmuls that produce logits (last dimension V or 2) accumulate and return float32.
  logit_dots = [e for e in eqns if e.primitive.name == "dot_general"
                and e.outvars[0].aval.shape[-1] in (cfg.vocab_size, 2)]
  assert len(logit_dots) == 2
  for e in logit_dots:
    assert e.outvars[0].aval.dtype == jnp.float32, e


def test_dropout_is_active_in_training_and_seeded():
  cfg = dataclasses.replace(SMALL, hidden_dropout=0.1, attention_dropout=0.1, scan_layers=True)
  ids, mask, seg = _inputs()
  params = _init(cfg, ids)
  eval_out = _apply(cfg, params, ids, mask, seg)[0]
  run = lambda seed: _apply(cfg, params, ids, mask, seg, deterministic=False,
                            rngs={"dropout": jax.random.key(seed)})[0]
  assert not np.allclose(run(0), eval_out, atol=1e-3)
  np.testing.assert_array_equal(run(0), run(0))
  assert not np.allclose(run(0), run(1), atol=1e-3)


def test_attention_dropout_path_matches_fused_attention_at_rate_zero():
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.normal(size=(2, 8, 4, 16)), jnp.float32) for _ in range(3))
  mask = jnp.asarray(rng.random((2, 1, 8, 8)) > 0.3) | jnp.eye(8, dtype=bool)
  ours = attention_with_dropout(q, k, v, mask, 0.0, jax.random.key(0))
  ref = jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")
  np.testing.assert_allclose(ours, ref, atol=1e-6)


def test_bfloat16_compute_stays_close_to_float32():
  ids, mask, seg = _inputs(batch=4, length=32)
  mask[2, 20:] = 0
  positions = np.tile(np.arange(0, 32, 4, dtype=np.int32), (4, 1))
  params = _init(SMALL, ids, BertForPreTraining, masked_lm_positions=positions)
  bf16 = dataclasses.replace(SMALL, dtype="bfloat16")
  mlm32, nsp32 = _apply(SMALL, params, ids, mask, seg, positions, module_cls=BertForPreTraining)
  mlm16, nsp16 = _apply(bf16, params, ids, mask, seg, positions, module_cls=BertForPreTraining)
  assert mlm16.dtype == jnp.float32 and nsp16.dtype == jnp.float32
  assert float(jnp.max(jnp.abs(mlm16 - mlm32))) < 2e-2
  assert float(jnp.max(jnp.abs(nsp16 - nsp32))) < 2e-2
  seq16, _ = _apply(bf16, params["bert"], ids, mask, seg)
  assert seq16.dtype == jnp.bfloat16


def test_sharded_forward_equals_single_device():
  devices = np.array(jax.devices()[:8]).reshape(1, 4, 2)
  mesh = Mesh(devices, ("data", "fsdp", "tensor"))
  rules = base.get_config().mesh.logical_axis_rules
  ids, mask, seg = _inputs(batch=8, length=16)
  positions = np.tile(np.array([1, 5, 9, 13], np.int32), (8, 1))
  cfg = dataclasses.replace(SMALL, scan_layers=True)
  model = BertForPreTraining(cfg)
  variables = model.init(jax.random.key(0), ids, masked_lm_positions=positions)
  params = nn.unbox(variables["params"])
  expected = model.apply({"params": params}, ids, mask, seg, positions)
  specs = nn.get_partition_spec(variables)["params"]
  shardings = nn.logical_to_mesh_sharding(specs, mesh, rules)
  sharded_params = jax.device_put(params, shardings)
  kernel = sharded_params["bert"]["encoder"]["layers"]["layer"]["mlp"]["intermediate"]["kernel"]
  assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")
  assert len(kernel.addressable_shards) == 8 and kernel.addressable_shards[0].data.shape == (
      2, 8, 32)
  batch_sharding = NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp")))

  @jax.jit
  def forward(p, i, m, s, pos):
    with nn.logical_axis_rules(rules):
      return model.apply({"params": p}, i, m, s, pos)

  with jax.set_mesh(mesh):
    got = forward(sharded_params, *(jax.device_put(x, batch_sharding)
                                    for x in (ids, mask, seg, positions)))
  np.testing.assert_allclose(got[0], expected[0], atol=1e-5)
  np.testing.assert_allclose(got[1], expected[1], atol=1e-5)


def test_config_errors_name_the_problem():
  with pytest.raises(ValueError, match="hidden_size=100 is not divisible by num_heads=12"):
    BertConfig(hidden_size=100)
  with pytest.raises(ValueError, match="hidden_act='relu'"):
    BertConfig(hidden_act="relu")
  with pytest.raises(ValueError, match="remat_policy='some'"):
    BertConfig(remat_policy="some")
  with pytest.raises(ValueError, match=r"Unknown BertConfig keys \['hiden_size'\]"):
    BertConfig.from_dict({"hiden_size": 768})
  with pytest.raises(ValueError, match="attention_dropout=0.0"):
    BertConfig(attention_impl="cudnn", attention_dropout=0.1)
  with pytest.raises(ValueError, match=r"position_init='sine'; choose one of \('normal', "):
    BertConfig(position_init="sine")
  with pytest.raises(ValueError, match=r"query_key_init='tied'; choose one of \('independent', "):
    BertConfig(query_key_init="tied")


def test_sequence_longer_than_position_table_is_refused():
  with pytest.raises(ValueError, match="Sequence length 80 exceeds max_position_embeddings=64"):
    _init(SMALL, jnp.ones((1, 80), jnp.int32))


def test_config_files_only_override_and_are_locked():
  from bertjax.configs import bert_base, bert_large, tiny  # pylint: disable=import-outside-toplevel
  for module, layers, hidden in ((bert_base, 12, 768), (bert_large, 24, 1024), (tiny, 2, 128)):
    config = module.get_config()
    assert set(config.keys()) == set(base.get_config().keys())
    cfg = BertConfig.from_dict(config.model, vocab_size=30522)
    assert (cfg.num_layers, cfg.hidden_size) == (layers, hidden)
    if module is not tiny:  # the accelerator configs: bfloat16 matmuls, straight layers
      assert (cfg.dtype, cfg.param_dtype, cfg.scan_layers) == ("bfloat16", "float32", False)
    assert module.__doc__ and "python -m bertjax.pretrain" in module.__doc__
  locked = base.get_config()
  locked.lock()
  with pytest.raises(AttributeError, match="hiden_size"):
    locked.model.hiden_size = 3


def test_two_phase_recipe_in_the_configs():
  from bertjax.configs import bert_base, bert_large  # pylint: disable=import-outside-toplevel
  one, two = bert_large.get_config(), bert_large.get_config("phase=2")
  assert (one.data.max_seq_length, two.data.max_seq_length) == (128, 512)
  assert two.data.max_predictions_per_seq == 76
  assert one.train.num_train_steps + two.train.num_train_steps == 1_000_000
  # Phase 2 loads phase 1's parameters: the models are the same (every activation kept, the
  # layers straight; base.set_accelerator), and both train with the paper's attention dropout
  # (the fused attention kernel has it).
  for config in (bert_base, bert_large):
    one, two = config.get_config(), config.get_config("phase=2")
    differ = {k for k in one.model if one.model[k] != two.model[k]}
    assert not differ, differ
    assert not one.model.scan_layers and one.model.remat_policy == "none"
    assert one.model.attention_impl == "auto" and one.model.attention_dropout == 0.1
  assert one.data.packing and two.data.packing  # docs/data.md#packing: 1.09x and 1.23x the tokens
  from bertjax.configs import tiny  # pylint: disable=import-outside-toplevel
  assert not tiny.get_config().data.packing  # `make pretrain` as measured
  with pytest.raises(ValueError, match="phase=3"):
    bert_base.get_config("phase=3")
  with pytest.raises(ValueError, match="Unknown config arguments"):
    bert_base.get_config("stage=2")


def test_a_fields_roles_are_stated_on_the_field_and_the_tuples_read_from_them():
  from bertjax.model import config as model_config  # pylint: disable=import-outside-toplevel
  fields = dataclasses.fields(model_config.BertConfig)
  assert model_config.SHAPE_FIELDS == (
      "vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size",
      "max_position_embeddings", "type_vocab_size", "scan_layers")
  assert model_config.HEAD_FIELDS == ("task_head", "classifier_pooling")
  # A fine-tuning config inherits the encoder's shape but not its layer layout, and its head.
  assert model_config.INHERITED_FIELDS[:7] == model_config.SHAPE_FIELDS[:7]
  assert set(model_config.HEAD_FIELDS) < set(model_config.INHERITED_FIELDS)
  assert "scan_layers" not in model_config.INHERITED_FIELDS
  # What BERT's formats cannot write: every architecture option, and local attention.
  modern = set(model_config.fields_with("modern"))
  assert modern == set(model_config.ARCHITECTURE_FIELDS) | {"global_every"}
  for f in fields:  # each role named on a field is one of ROLES
    assert set(f.metadata.get("roles", ())) <= set(model_config.ROLES), f.name
  with pytest.raises(ValueError, match="no field role 'shapes'"):
    model_config.fields_with("shapes")
  changed = model_config.BertConfig(mlp_bias=False, global_every=3, local_window=8)
  assert changed.modern_options() == ["mlp_bias=False", "global_every=3"]
