"""The benchmark: analytic FLOPs vs XLA's count, the peak table, the report, no TensorFlow."""

import io
import json
import math
import os
import subprocess
import sys
import time

import jax
import pytest

from bertjax.benchmark import train as benchmark
from bertjax.configs import base

L, M = 64, 10


@pytest.fixture(scope="module")
def runner():
  config = base.get_config()
  config.model.update(hidden_size=128, intermediate_size=512, num_layers=2, num_heads=2,
                      vocab_size=1000, max_position_embeddings=L)
  config.train.batch_size = 2
  return benchmark.StepRunner(config, L, M, devices=jax.devices()[:1])


def test_analytic_flops_match_xla_within_10_percent(runner):
  analytic = benchmark.train_flops(runner.cfg, 2, L, M)
  xla = benchmark.xla_flops(runner.compiled)
  assert xla is not None
  assert abs(xla / analytic - 1) < 0.10, (xla, analytic)


def _traced_matmul_flops(jaxpr) -> int:
  """2 x multiply-adds of every dot_general the step traces (scan bodies times their length)."""
  total = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      (contracting, _), _ = eqn.params["dimension_numbers"]
      k = math.prod(eqn.invars[0].aval.shape[i] for i in contracting)
      total += 2 * k * math.prod(eqn.outvars[0].aval.shape)
    repeat = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
    for value in eqn.params.values():
      for inner in (value if isinstance(value, (tuple, list)) else (value,)):
        inner = getattr(inner, "jaxpr", inner)
        if hasattr(inner, "eqns"):
          total += repeat * _traced_matmul_flops(inner)
  return total


def test_report_figures(runner):
  # The model FLOPs of the report against the matmuls the real train step traces (forward,
  # backward, every layer): the same count, reached without the formula.
  jaxpr = jax.make_jaxpr(runner.training.train_step)(runner.state, runner.batch, runner.rng)
  traced = _traced_matmul_flops(jaxpr.jaxpr)
  # By hand, one sequence forward: 2 layers x 64 tokens x (8 D^2 + 4 D F + 4 L D = 425,984),
  # pooler + NSP 33,280, MLM 10 x (2 D^2 + 2 D V) = 2,887,680: 57,446,912; x 3 x 2 sequences.
  # The step also traces the MLM bias gradient, which heads.tied_decoder computes as a product
  # with ones (a sum, not model arithmetic): 2 x (2 x 10 predictions) x V 1,000 = 40,000.
  bias_sum = 2 * 2 * M * 1000
  assert traced == 344_681_472 + bias_sum
  model = traced - bias_sum
  start = time.perf_counter()
  times = benchmark.time_steps(runner.step, 2)
  wall = time.perf_counter() - start
  figures = benchmark.report(runner, times)
  assert figures["model_tflop_per_step"] == pytest.approx(model / 1e12, rel=1e-3)
  assert figures["model_tflops"] == pytest.approx(model / 1e12 / figures["step_s"], rel=1e-2)
  # Step times within the test's own clock around the two steps.
  assert 0 < figures["step_s_min"] <= figures["step_s"] <= wall
  assert figures["sequences_per_s"] == pytest.approx(2 / figures["step_s"], rel=0.01)
  assert figures["tokens_per_s"] == pytest.approx(figures["sequences_per_s"] * L, rel=0.01)
  assert figures["compile_s"] > 0
  assert figures["mfu"] is None  # CPU: TFLOP/s only
  assert int(runner.state.step) == 2


@pytest.mark.parametrize("kind,peak", [
    ("TPU v4", 275.0), ("TPU v5 lite", 197.0), ("TPU v5e", 197.0), ("TPU v5p", 459.0),
    ("TPU v6 lite", 918.0), ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA H100 80GB HBM3", 989.0),
    ("NVIDIA H200", 989.0), ("cpu", None)])
def test_peak_table(kind, peak):
  assert benchmark.peak_tflops(kind) == peak


def test_synthetic_batch_masks_distinct_real_positions():
  batch = benchmark.synthetic_batch(4, 16, 3, vocab_size=50)
  for row in batch["masked_lm_positions"]:
    assert len(set(row)) == 3 and min(row) >= 1  # never [CLS] at 0


def test_benchmark_imports_no_tensorflow_or_transformers():
  code = ("import sys, bertjax.benchmark.train, bertjax.benchmark.accel; "
          "bad = sorted({m.split('.')[0] for m in sys.modules} & "
          "{'tensorflow', 'transformers', 'torch'}); print(bad); assert not bad")
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                        env={**os.environ, "PYTHONPATH": root}, timeout=120)
  assert done.returncode == 0, done.stdout + done.stderr[-2000:]


def test_the_profile_puts_each_operation_in_its_kind(runner):
  from bertjax.perf import opprofile  # pylint: disable=import-outside-toplevel
  hlo = """HloModule m

%fused_dot (p0: f32[4,4], p1: f32[4,4]) -> f32[4,4] {
  %p0 = f32[4,4]{1,0} parameter(0)
  %p1 = f32[4,4]{1,0} parameter(1)
  ROOT %dot.1 = f32[4,4]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_copy (p0: f32[4,4]) -> f32[4,4] {
  %p0 = f32[4,4]{1,0} parameter(0)
  ROOT %t = f32[4,4]{0,1} transpose(%p0), dimensions={1,0}
}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (x: f32[4,4], k: u32[4]) -> f32[4] {
  %x = f32[4,4]{1,0} parameter(0)
  %k = u32[4]{0} parameter(1)
  %mm = f32[4,4]{1,0} fusion(%x, %x), kind=kCustom, calls=%fused_dot
  %tr = f32[4,4]{0,1} fusion(%mm), kind=kLoop, calls=%fused_copy
  %bits = u32[4]{0} xor(%k, %k)
  %zero = f32[] constant(0)
  %red = f32[4]{0} reduce(%tr, %zero), dimensions={1}, to_apply=%add
  %loop = (f32[4]{0}) while(%red), condition=%add, body=%add
  ROOT %out = f32[4]{0} exponential(%red)
}
"""
  kinds = opprofile.classify(hlo)
  assert [kinds[n] for n in ("mm", "tr", "bits", "red", "out")] == [
      "matmul", "layout", "rng", "reduce", "elementwise"]
  # A loop's own event spans its body's, which are counted one by one (a scanned encoder).
  assert "loop" not in kinds

  # The real step: every traced operation lands in a kind, and the matmuls are among them.
  result = opprofile.profile(runner.step, runner.compiled.as_text(), steps=1)
  assert set(result["ms_per_step"]) == set(opprofile.KINDS)
  assert result["ms_per_step"]["matmul"] > 0
  assert abs(sum(result["share"].values()) - 1) < 0.01
  assert result["wall_ms_per_step"] > 0


def test_a_gpu_trace_is_itemised_by_the_kernels_hlo_stat():
  # A GPU trace as XLA's profiler writes it (xplane's planes, lines, events): kernels named by
  # the library that ran them, each with an "hlo_op" stat naming the instruction; the "XLA Ops"
  # line holding only what was launched outside a command buffer (the H200's 3.4 of 75 ms).
  from types import SimpleNamespace as E  # pylint: disable=import-outside-toplevel
  from bertjax.perf import opprofile  # pylint: disable=import-outside-toplevel
  kinds = {"fusion.1": "matmul", "fusion.2": "elementwise", "copy.3": "layout"}
  ms = 1_000_000
  kernel = lambda name, dur, op=None: E(name=name, duration_ns=dur * ms,
                                       stats=[("hlo_module", "jit_step")] + ([("hlo_op", op)] if op else []))
  gpu = E(name="/device:GPU:0", lines=[
      E(name="XLA Ops", events=[kernel("copy.3", 1)]),  # the only op outside the graphs
      E(name="Stream #13(compute)", events=[
          kernel("sm90_xmma_gemm_bf16bf16_bf16f32", 30, "fusion.1"),
          kernel("loop_add_fusion_kernel", 8, "fusion.2"), kernel("copy.3", 1),  # name only
          kernel("void cutlass::Kernel<unknown>", 2)]),  # names nothing: counted apart
      E(name="Stream #14(memcpy)", events=[kernel("MemcpyD2D", 3)])])
  host = E(name="/host:CPU", lines=[E(name="python3", events=[kernel("fusion.1", 99)])])
  per_op, unattributed = opprofile.attribute([gpu, host], kinds, steps=1)
  assert per_op == {"fusion.1": 30 + 99, "fusion.2": 8, "copy.3": 1}
  assert unattributed == 5
  result = opprofile.summarise({k: v for k, v in per_op.items()}, kinds, wall_ms=160,
                               unattributed_ms=unattributed)
  assert result["ms_per_step"]["matmul"] == 129 and result["unattributed_device_ms_per_step"] == 5
  # Without any kernel naming an instruction, the "XLA Ops" line is read (as before).
  bare = E(name="/device:GPU:0", lines=[E(name="XLA Ops", events=[kernel("fusion.2", 4)]),
                                        E(name="Stream #7", events=[kernel("gemm", 9)])])
  assert opprofile.attribute([bare], kinds, steps=2)[0] == {"fusion.2": 2}


def test_the_layer_probe_times_reads_and_traces_its_variants(tmp_path):
  """bertjax.benchmark.layers' group on a CPU at a tiny size (3 layers of 32): what the GPU run
  writes, so that the command is ready when a GPU is."""
  from bertjax.benchmark import layers as benchmark_layers  # pylint: disable=import-outside-toplevel
  results = benchmark_layers.run_group(
      "A", ("base:num_layers=3", "noscan:num_layers=3,scan=0"), str(tmp_path), "tiny",
      hlo=("base", "noscan"), traced="base")
  assert json.loads((tmp_path / "A.json").read_text()) == json.loads(json.dumps(results))
  base, noscan = results["base"], results["noscan"]
  assert base["layers"] == 3 and base["step_s"] > 0 and base["ms_per_layer"] > 0, base
  assert base["hlo"]["ops_per_layer"] > 0 and base["hlo"]["whole_stack_writes_per_layer"] == {}
  assert len(base["hlo"]["layer_loop_opcodes"]) == 2  # forward and backward loops
  assert noscan["hlo"]["ops_per_layer"] > 0 and noscan["hlo"]["layer_loop_opcodes"] == {}
  assert base["trace"]["traced_wall_ms"] > 0 and base["trace"]["lines"]
  assert (tmp_path / "A_base.hlo.txt.gz").exists()


def test_the_layer_probe_never_hands_xla_a_blank_flag_string(monkeypatch):
  """XLA reads an XLA_FLAGS not starting with "--" as a file of flags and dies: a group with no
  flags of its own, under a user with none, runs without the variable; the user's come last."""
  from bertjax.benchmark import layers as benchmark_layers  # pylint: disable=import-outside-toplevel
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  assert "XLA_FLAGS" not in benchmark_layers._with_xla_flags("", " ")
  monkeypatch.setenv("XLA_FLAGS", "--user_flag=1")
  env = benchmark_layers._with_xla_flags("", "--group_flag=0")
  assert env["XLA_FLAGS"] == "--group_flag=0 --user_flag=1"


def test_a_packed_benchmark_counts_the_sequences_of_its_rows():
  config = base.get_config()
  config.model.update(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                      vocab_size=100, max_position_embeddings=L)
  config.train.batch_size = 2
  packed = benchmark.StepRunner(config, L, 3 * M, devices=jax.devices()[:1], sequences_per_row=3)
  host = benchmark.synthetic_batch(2, L, 3 * M, 100, sequences_per_row=3)
  assert list(host["nsp_positions"][0]) == [0, L // 3, 2 * (L // 3)]
  assert list(host["sequence_ids"][0, [0, L // 3, L - 1]]) == [1, 2, 0]  # the remainder pads
  metrics = packed.step()
  assert float(metrics["nsp_loss"][1]) == 6  # three pairs a row, each with its own label
  figures = benchmark.report(packed, [1.0])
  assert figures["sequences_per_row"] == 3 and figures["sequences_per_s"] == 6.0


def test_the_accelerator_check_runs_every_case_at_a_tiny_size(tmp_path):
  """bertjax.benchmark.accel at --size=tiny on one CPU device: a line per case with its figures,
  so the GPU/TPU command cannot rot where the suite runs (TensorFlow-free:
  tests/test_without_tensorflow.py)."""
  from bertjax.benchmark import accel as benchmark_accel  # pylint: disable=import-outside-toplevel
  full = benchmark_accel.cases("full", "cudnn")
  names = [benchmark_accel.describe(c) for c in full]
  for wanted in ("bert_base L128 xla unpacked", "bert_large L512 cudnn packed x4",
                 "modern_base L1024 cudnn local windows", "modern_base L1024 cudnn all global"):
    assert wanted in names, names
  assert len(full) == 2 * 2 * 4 + 2 + 1
  printed = io.StringIO()
  results = dict(benchmark_accel.check("tiny", tokens_per_device=64, steps=1,
                                       devices=jax.devices()[:1], out=printed,
                                       json_path=str(tmp_path / "accel.json")))
  written = json.loads((tmp_path / "accel.json").read_text())
  assert [row["case"] for row in written] == list(results)
  text = printed.getvalue()
  assert "H100 989" in text and "none known (MFU not computed)" in text, text
  assert list(results) == [benchmark_accel.describe(c) for c in benchmark_accel.cases("tiny", None)]
  for name, figures in results.items():
    assert figures["seq_per_s"] > 0 and name in text, (name, figures)
  packed = results["bert_base L16 xla packed x2"]
  assert packed["batch"] == 4  # 64 positions / 16 per row
  # Two sequences a row: 8 a step.
  assert packed["seq_per_s"] == pytest.approx(8 / packed["step_s"], rel=0.05)
  assert packed["mfu"] is None and packed["memory_gib"] > 0
  assert results["predict bert_base (texts up to 16 tokens)"]["torch_cuda_seq_per_s"] is None
  local = benchmark_accel.Case("local", "modern_base", 32, "xla", 0, True)
  m = benchmark_accel.step_config(local, "tiny", 64, 1).model
  assert "modern_base L32 xla local windows" in results
  assert (m.num_layers, m.global_every, m.local_window) == (2, 2, 8)


def test_the_accelerator_check_reports_a_failed_case_and_goes_on_and_skips_past_its_budget(
    monkeypatch):
  """A case that fails prints its error and the next still runs; once the budget is spent the
  rest are skipped, not lost: a time-limited lease still returns what was measured."""
  from bertjax.benchmark import accel as benchmark_accel  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(benchmark_accel, "cases", lambda size, fused: [
      benchmark_accel.Case("predict", "bert_base", n) for n in (16, 32, 64)])
  calls = []

  def run_predict(case, *args):
    calls.append(case.seq_len)
    time.sleep(0.3)
    if case.seq_len == 16:
      raise ValueError("cuDNN refused the shape")
    return {"seq_per_s": 1.0}

  monkeypatch.setattr(benchmark_accel, "run_predict", run_predict)
  printed = io.StringIO()
  results = dict(benchmark_accel.check("tiny", budget_s=0.5, out=printed))
  assert calls == [16, 32]
  assert results["predict bert_base (texts up to 16 tokens)"] == {
      "error": "ValueError: cuDNN refused the shape"}
  assert results["predict bert_base (texts up to 32 tokens)"] == {"seq_per_s": 1.0}
  assert "skipped" in results["predict bert_base (texts up to 64 tokens)"]
  assert "cuDNN refused the shape" in printed.getvalue()
