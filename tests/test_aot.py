"""bertjax.aot: the train step compiled for TPU slices by libtpu's compile-only client, on CPU.

The command runs in a subprocess: it loads libtpu, which this CPU-only test process should not,
and its exit status is part of what is tested. Each compile of the tiny config takes ~20 s.
"""

import json
import os
import re
import subprocess
import sys
import types

import jax
import pytest

from bertjax import aot, versions
from bertjax.parallel import platforms, topologies
from bertjax.perf import roofline

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--config=configs/tiny.py", "--config.model.vocab_size=8000"]


def run(*args, timeout=600):
  env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="2")
  env.pop("LIBTPU_INIT_ARGS", None)  # an in-process compile here sets it (aot.topology_devices)
  return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=timeout)


def run_aot(*flags):
  return run("-m", "bertjax.aot", *flags)


def test_topology_names_count_cores_on_v4_v5p_and_chips_on_v5e():
  v5p = topologies.parse_topology("v5p-128")
  assert (v5p.num_chips, v5p.libtpu_name, v5p.hbm_gib) == (64, "v5:4x4x4", 95.0)
  v4 = topologies.parse_topology("v4-32")
  assert (v4.num_chips, v4.libtpu_name) == (16, "v4:2x2x4")
  v5e = topologies.parse_topology("v5e-256")
  assert (v5e.num_chips, v5e.libtpu_name, v5e.hbm_gib) == (256, "v5e:16x16", 16.0)
  assert topologies.parse_topology("v5litepod-256").libtpu_name == "v5e:16x16"  # Cloud TPU's name
  two = topologies.parse_topology("v5p-128", num_slices=2)
  assert (two.num_chips, two.libtpu_name, str(two)) == (128, "v5:4x4x4", "2 x v5p-128")
  with pytest.raises(ValueError, match=r"Unknown TPU topology 'v5p-100': .*nearest: v5p-64 "
                     r"\(2x4x4\), v5p-128 \(4x4x4\)"):
    topologies.parse_topology("v5p-100")


def test_every_documented_shape_including_non_powers_of_two():
  # Whole cubes that are not powers of two (Cloud TPU's AxBxC of multiples of 4), v5e's names.
  for name, shape, libtpu in [("v5p-384", (4, 4, 12), "v5:4x4x12"), ("v5p-640", (4, 4, 20), None),
                              ("v4-384", (4, 4, 12), "v4:4x4x12"), ("v5p-768", (4, 8, 12), None),
                              ("v5p-12288", (16, 16, 24), None), ("v5p-2048", (8, 8, 16), None),
                              ("v6e-256", (16, 16), "v6e:16x16"), ("v5e-1", (1, 1), None)]:
    topology = topologies.parse_topology(name)
    assert topology.shape == shape, name
    assert libtpu is None or topology.libtpu_name == libtpu
  # Shapes that do not exist: named with the nearest that do.
  for name, nearest in [("v5p-24", "v5p-16 (2x2x2), v5p-32 (2x2x4)"),
                        ("v5p-12416", "v5p-12160 (4x20x76), v5p-12288 (16x16x24)"),
                        ("v4-8320", "v4-8064 (12x12x28), v4-8192 (16x16x16)"), ("v6e-12", "v6e-8 (2x4), v6e-16 (4x4)")]:
    with pytest.raises(ValueError, match=re.escape(f"nearest: {nearest}")):
      topologies.parse_topology(name)


@pytest.fixture(scope="module")
def v5p_384(tmp_path_factory):
  """One compile (each is ~15 s of CPU) that two tests read: the tiny config at batch 192 on
  v5p-384, checked against 0.001 GiB of HBM a chip. The command writes its figures (--json)
  once the step has compiled, then refuses the step against that HBM."""
  figures_path = tmp_path_factory.mktemp("v5p_384") / "figures.json"
  result = run_aot(*TINY, "--topology=v5p-384", "--config.train.batch_size=192",
                   "--hbm_gib=0.001", f"--json={figures_path}")
  figures = json.loads(figures_path.read_text()) if figures_path.exists() else None
  return result, figures


def test_a_slice_that_is_not_a_power_of_two_compiles(v5p_384):
  # v5p-384: 192 chips, 4x4x12, one data-parallel row each (the tiny config at batch 192).
  result, figures = v5p_384
  assert figures is not None, result.stdout[-3000:] + result.stderr[-3000:]  # it compiled
  assert (figures["libtpu_topology"], figures["device"]) == ("v5:4x4x12", "192 x TPU v5")
  assert figures["mesh"] == {"data": 192, "fsdp": 1, "tensor": 1}
  assert figures["memory_total_gib"] > 0 and figures["model_tflop_per_step"] > 0
  # What it compiled with, for launch/tpu.py run --aot-report to compare with the workers.
  recorded = versions.parse_versions(figures["versions"])
  assert recorded["jax"] == jax.__version__ and recorded["libtpu"] == figures["libtpu"]
  assert set(recorded) == set(versions.read_lock())


def test_xla_out_of_memory_reads_both_wordings():
  new = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
         "temporaries (47.99G) exceeds available HBM (15.75G).")
  old = ("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space "
         "hbm. Used 20.25G of 15.48G hbm. Exceeded hbm capacity by 4.77G.")
  assert aot.xla_out_of_memory(RuntimeError(new)) == (47.99 * 2**30, 15.75 * 2**30)
  assert aot.xla_out_of_memory(RuntimeError(old)) == (20.25 * 2**30, 15.48 * 2**30)
  assert aot.xla_out_of_memory(RuntimeError("INTERNAL: something else")) is None


def test_a_kernel_over_vmem_is_a_one_line_refusal_naming_it():
  # As libtpu words it (BERT-Large L 512 at 128 rows a chip on v5p-128, before the MLM kernel
  # split its predictions): not HBM, so no shortfall of HBM is claimed.
  error = RuntimeError(
      "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space "
      "vmem. Used 76.17M of 63.94M vmem. Exceeded vmem capacity by 12.23M.\n\nProgram vmem "
      "requirement 76.17M:\n  1. Size: 16.00M\n     Operator: op_name=\"jit(<lambda>)/jvp("
      "BertForPreTraining)/mlm/cond/branch_0_fun/shard_map/mlm_scores_fwd/pallas_call\"\n")
  training = types.SimpleNamespace(
      train_config=types.SimpleNamespace(batch_size=8192, num_microbatches=1))
  message = aot.vmem_message(error, topologies.parse_topology("v5p-128"), training)
  assert "76.2 MiB of a core's VMEM, v5p has 63.9 (mlm_scores_fwd)" in message
  assert "lower train.batch_size (now 8192, 128 per chip)" in message
  assert aot.xla_out_of_memory(error) is None
  assert aot.vmem_message(RuntimeError("INTERNAL: something else"), None, training) is None


@pytest.fixture(scope="module")
def probes():
  """One interpreter loading libtpu (~3 s a start) for the probes: the cost model's known
  answers on v5e-8, the DCN axes of two v5p-8 slices, and the splash and the fused kernels
  compiled into the train step for v5p (the libtpu environment is the v5p-8 slice's, as
  bertjax.aot sets it)."""
  probe = r"""
import json, os, re
for name, value in (("TPU_ACCELERATOR_TYPE", "v5p-8"), ("TPU_WORKER_HOSTNAMES", "localhost"),
                    ("TPU_SKIP_MDS_QUERY", "1")):
  os.environ.setdefault(name, value)
from bertjax import aot
from bertjax.configs import tiny
from bertjax.model import attention
from bertjax.model.kernels import attention_blocks
from bertjax.parallel import platforms, sharding, topologies
from bertjax.perf import hlocost, layercost, roofline
from bertjax.training import train
v5e = aot.topology_devices(topologies.parse_topology("v5e-8"))
print("cost_model " + json.dumps(roofline.check_cost_model(v5e, size=2048)), flush=True)
devices = aot.topology_devices(topologies.parse_topology("v5p-8", num_slices=2))
out = {}
for name, cfg in {"data": sharding.MeshConfig(),
                  "fsdp": sharding.MeshConfig(ici_data=1, ici_fsdp=-1, dcn_data=1, dcn_fsdp=-1)
                  }.items():
  mesh = sharding.create_mesh(cfg, devices)
  out[name] = [dict(mesh.shape), list(aot.dcn_axes(mesh))]
print("dcn " + json.dumps(out), flush=True)
# The device kind each generation's table row names (what "auto" settings read before a compile).
# And a core's VMEM as the kernels read it under a mesh of the generation's chips.
kinds = {}
for name in ("v4-8", "v5p-8", "v5e-8", "v6e-8"):
  topology = topologies.parse_topology(name)
  chips = aot.topology_devices(topology)
  with sharding.logical_context(sharding.create_mesh(sharding.MeshConfig(), chips)):
    vmem, chip = platforms.vmem_bytes(), platforms.tpu_chip()
    slabs = [attention_blocks.by_slabs(n, 128, 0.0, 1024) for n in (1024, 8192)]
  kinds[name] = [chips[0].device_kind, topology.slice_type.generation.device_kind, vmem, chip,
                 slabs]
print("kinds " + json.dumps(kinds), flush=True)
# A table split along its columns on v5p-8's 4 chips, updated from a gradient scattered in rows:
# the order each shard is stored in, and the copies of a shard the update makes with the
# gradient as it comes and in that order (layouts.as_stored).
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from bertjax.parallel import layouts
chips = aot.topology_devices(topologies.parse_topology("v5p-8"))
mesh = jax.sharding.Mesh(np.array(chips), ("fsdp",))
split = NamedSharding(mesh, P(None, "fsdp"))

def update(p, mu, ids, dy, stored):
  g = jax.lax.with_sharding_constraint(jnp.zeros((4000, 768)).at[ids].add(dy), split)
  mu = 0.9 * mu + (layouts.as_stored(g, split) if stored else g)
  return p - 0.1 * mu, mu

args = [jax.ShapeDtypeStruct((4000, 768), jnp.float32, sharding=split)] * 2 + [
    jax.ShapeDtypeStruct((512,), jnp.int32, sharding=NamedSharding(mesh, P("fsdp"))),
    jax.ShapeDtypeStruct((512, 768), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))]
copies = {}
for stored in (False, True):
  text = jax.jit(update, static_argnums=4, donate_argnums=(0, 1)).lower(*args, stored).compile()
  copies[stored] = len(re.findall(r"= f32\[4000,192\]\S* copy\(", text.as_text()))
print("layouts " + json.dumps({
    "stored": [layouts.stored(np.float32, shape, chips[0])
               for shape in ((4000, 192), (4000, 256), (192, 3072))],
    "cpu": layouts.stored(np.float32, (4000, 192), jax.devices("cpu")[0]),
    "copies": [copies[False], copies[True]]}), flush=True)
config = tiny.get_config()
# 3 layers: a depth no other dimension shares (the layer loops' arrays are found by it).
config.model.update(vocab_size=8000, attention_impl="splash", scan_layers=True, num_layers=3,
                    mlp_impl="pallas")
config.data.max_seq_length = 128
devices = aot.topology_devices(topologies.parse_topology("v5p-8"))
text = aot.compile_train_step(train.from_config(config, devices=devices), 128, 10).as_text()
print("splash " + json.dumps({"custom_calls": text.count('custom_call_target="tpu_custom_call"'),
                  "kernels": sorted(set(re.findall(r"splash_mha_[a-z_]+", text))),
                  "mlp_kernels": sorted(set(re.findall(r"fused_mlp_[a-z]+", text))),
                  # The forward kernel may come fused with the update of the loop's stack its
                  # results go to (with BERT's post-norm end inside, the sum it keeps).
                  "mlp_flops": [r["flops"] for r in hlocost.program_rows(text)
                                if r["opcode"] in ("custom-call", "fusion")
                                and "fused_mlp" in r["op_name"]],
                  "layer_loops": len(layercost.layer_loops(text, 3)),
                  "ops_per_layer": layercost.layer_ops(text, 3, scanned=True),
                  "stack_writes": layercost.stack_writes(text, 3),
                  "counted": hlocost.program_cost(text, attention.splash_flops),
                  "uncounted": hlocost.program_cost(text)}), flush=True)
# BERT's post-norm layers with the fused attention and the MLP kernels: the attention's end too.
config.model.update(attention_impl="fused", attention_dropout=0.1, hidden_dropout=0.1)
text = aot.compile_train_step(train.from_config(config, devices=devices), 128, 10).as_text()
print("end " + json.dumps({"kernels": sorted(set(re.findall(r"fused_end_[a-z]+", text))),
                           "flops": sorted(r["flops"] for r in hlocost.program_rows(text)
                                           if r["opcode"] in ("custom-call", "fusion")
                                           and "fused_end" in r["op_name"])}), flush=True)
config.model.update(attention_impl="fused", attention_dropout=0.1, mlp_impl="pallas_kept",
                    mlp_type="gated", norm_position="pre", recompute_mlm_logits=True,
                    qkv_product="auto", hidden_dropout=0.0)
# 80 predictions a row: enough a chip for the MLM scores kernel (mlm_kernel.worth_it: > D / 2).
training = train.from_config(config, devices=devices)
text = aot.compile_train_step(training, 128, 80).as_text()

def kernel(name):
  line = next(l for l in text.splitlines() if re.match(rf"\s*%{name}[.0-9]* = ", l))
  inside = re.search(r"calls=%([\w.-]+)", line)
  body = text.split("%" + inside.group(1) + " ", 1)[1].split("\n}", 1)[0] if inside else ""
  # The kernel's q, k and v (operands 5-7 after the 3 scalars, segments and biases): made
  # inside the fusion from its parameters (a slice of a stack or of one product), or
  # parameters themselves.
  fused = sum(not re.search(rf"%{re.escape(operand)} = [^\n]* parameter\(", body)
              for operand in re.findall(r"%([\w.-]+)", re.search(
                  r"= [^\n]*custom-call\(([^)]*)\)", body).group(1))[5:8]) if body else 0
  return line, body, fused

bwd, body, bwd_fused = kernel("fused_attention_bwd")
rows = hlocost.program_rows(text)
print("fused " + json.dumps({
    "qkv_product": training.model_config.qkv_product,
    "fwd_fused_qkv": kernel("fused_attention_fwd")[2],
    "kernels": sorted(set(re.findall(r"fused_attention_[a-z]+", text))),
    # Kernels XLA fused with their operands' slicing count as fusions, by their own estimate.
    "flops": sorted(r["flops"] for r in rows
                    if r["opcode"] in ("custom-call", "fusion")
                    and r["op_name"].endswith(("fused_attention_fwd/pallas_call",
                                               "fused_attention_bwd/pallas_call"))),
    "bwd_opcode": re.search(r"[})] (fusion|custom-call)\(", bwd).group(1),
    "bwd_fused_qkv": bwd_fused,
    "bwd_bytes": [r["hbm_bytes"] for r in rows
                  if r["op_name"].endswith("fused_attention_bwd/pallas_call")
                  and r["opcode"] in ("custom-call", "fusion")],
    "bwd_estimate": int(re.search(r"bytes_accessed\W*(\d+)", body or bwd).group(1)),
    # The forward kernel may come fused with the update of the loop's stack its result goes to.
    "mlp_flops": [r["flops"] for r in rows
                  if r["opcode"] in ("custom-call", "fusion") and "fused_mlp" in r["op_name"]],
    "mlm_flops": [r["flops"] for r in rows
                  if r["opcode"] in ("custom-call", "fusion")
                  and r["op_name"].endswith("mlm_scores_fwd/pallas_call")],
    "mlm_bwd_flops": [r["flops"] for r in rows
                      if r["opcode"] in ("custom-call", "fusion")
                      and r["op_name"].endswith("mlm_scores_bwd/pallas_call")]}), flush=True)
# Straight pre-norm layers under remat "dots_kernels": the norm and q, k and v by qkv_kernel;
# the MLM logits kept (mlm_kernel.kept_scores).
config.model.update(scan_layers=False, remat_policy="dots_kernels", recompute_mlm_logits=False)
text = aot.compile_train_step(train.from_config(config, devices=devices), 128, 80).as_text()
rows = hlocost.program_rows(text)
print("qkv " + json.dumps({
    "kernels": sorted(set(re.findall(r"fused_qkv_[a-z]+", text))),
    "flops": sorted(r["flops"] for r in rows if r["opcode"] in ("custom-call", "fusion")
                    and "fused_qkv" in r["op_name"]),
    # What XLA runs between it and the attention kernels (a rounding or a bitcast of q, k and v).
    "mlm_kept_flops": [r["flops"] for r in rows if r["opcode"] in ("custom-call", "fusion")
                       and r["op_name"].endswith("mlm_kept_fwd/pallas_call")],
    "between": sorted({r["opcode"] + " " + r["shape"] for r in rows
                       if "_projections/" in r["op_name"]
                       and r["opcode"] in ("reduce-precision", "bitcast-convert")})}))
"""
  result = run("-c", probe, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  return {line.split(" ", 1)[0]: json.loads(line.split(" ", 1)[1])
          for line in result.stdout.splitlines()
          if line.startswith(("dcn ", "kinds ", "splash ", "cost_model ", "fused ", "end ",
                              "qkv ", "layouts "))}


def test_a_gradient_in_the_order_its_parameter_is_stored_spares_the_update_its_copies(probes):
  # A float32 shard of 192 columns is stored column-major on a TPU (256 and 3,072 fill lanes and
  # are not), every CPU array row-major; the update then turns the table and its moment to the
  # gradient's order and back (4 copies), where the gradient put in the stored order is turned
  # once.
  out = probes["layouts"]
  assert out["stored"] == [[1, 0], None, None] and out["cpu"] is None, out
  assert out["copies"] == [4, 1], out


def test_dcn_mesh_axes_span_the_slices(probes):
  # Two v5p-8 slices: the DCN sizes of config.mesh choose which axis crosses slices.
  out = probes["dcn"]
  assert out["data"] == [{"data": 8, "fsdp": 1, "tensor": 1}, ["data"]]
  assert out["fsdp"] == [{"data": 1, "fsdp": 8, "tensor": 1}, ["fsdp"]]


def test_each_generation_names_the_device_kind_libtpu_gives_its_chips(probes):
  for name, (libtpu, table, *_) in probes["kinds"].items():
    assert libtpu == table, name


def test_the_kernels_read_a_core_s_vmem_and_chip_from_the_mesh_in_scope(probes):
  # mlm_kernel sizes its blocks by it: on v4 the sizes that fit v5p's 64 MiB needed 18.3 MiB of
  # 16 and BERT-Base's released step did not compile. Outside a TPU mesh (this CPU) no TPU is
  # named, and the kernels run in Pallas' interpreter at v5e's and v6e's sizes.
  vmem = {name: mib for name, (_, _, mib, *_) in probes["kinds"].items()}
  assert vmem == {"v4-8": 16 << 20, "v5p-8": 64 << 20, "v5e-8": 128 << 20, "v6e-8": 128 << 20}
  assert platforms.vmem_bytes() == platforms.VMEM_UNKNOWN
  # And the chip, by which a local window at lengths the whole-row attention kernel holds runs
  # by slabs (bound by FLOPs) or whole (v6e, bound by HBM); past it by slabs on every chip.
  chips = {name: chip for name, (*_, chip, _) in probes["kinds"].items()}
  assert chips == {"v4-8": "TPU_V4", "v5p-8": "TPU_V5P", "v5e-8": "TPU_V5E", "v6e-8": "TPU_V6E"}
  slabs = {name: at for name, (*_, at) in probes["kinds"].items()}
  assert slabs == {"v4-8": [True, True], "v5p-8": [True, True], "v5e-8": [True, True],
                   "v6e-8": [False, True]}
  assert platforms.tpu_chip() == ""


def test_tiny_config_fits_a_v5p_8(tmp_path):
  figures_path = tmp_path / "figures.json"
  hlo_path = tmp_path / "step.hlo"
  result = run_aot(*TINY, "--topology=v5p-8", f"--json={figures_path}", f"--dump_hlo={hlo_path}")
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  assert "bertjax.aot: fits" in result.stdout
  # The optimised module the figures were read from, for reading them instruction by instruction.
  assert hlo_path.read_text().startswith("HloModule ") and "ENTRY" in hlo_path.read_text()
  figures = json.loads(figures_path.read_text())
  assert figures["device"] == "4 x TPU v5"
  # Compiled with the flags a TPU host's commands start libtpu with.
  assert set(platforms.TPU_LIBTPU_FLAGS) <= set(figures["libtpu_flags"].split()), figures
  assert figures["mesh"] == {"data": 4, "fsdp": 1, "tensor": 1}
  assert 0 < figures["memory_total_gib"] < figures["hbm_gib"] == 95.0
  assert figures["memory_arguments_gib"] > 0 and figures["memory_temporaries_gib"] > 0
  # The state is donated: its outputs reuse the argument buffers.
  assert figures["memory_aliased_gib"] > 0
  assert figures["model_tflop_per_step"] > 0
  # XLA counts a little more than the model's matmuls (softmax, LayerNorm, the optimizer).
  assert 1.0 <= figures["xla_over_model"] < 1.5
  assert figures["step_s"] > 0 and figures["chip_hours"] > 0
  # The roofline of the executable: XLA's FLOPs and bytes at v5p's peak and HBM bandwidth.
  assert (figures["peak_tflops_per_chip"], figures["hbm_gbps_per_chip"]) == (459.0, 2765.0)
  assert figures["xla_tflop_per_chip_all_layers"] == figures["xla_tflop_per_chip"]  # unrolled
  assert figures["roofline_step_s"] == max(figures["roofline_compute_s"],
                                           figures["roofline_memory_s"]) > 0
  assert figures["roofline_bound"] in ("compute", "memory") and 0 < figures["roofline_mfu"] <= 1
  assert figures["ops_per_layer"] > 0
  # HBM's bytes are among XLA's (which counts every memory), at least the analytic floor, and the
  # roofline takes them; the parts they go to add up to them (the largest eight of them).
  hbm, xla = figures["hbm_gb_per_chip_all_layers"], figures["xla_gb_per_chip_all_layers"]
  assert figures["roofline_bytes"] == "HBM's alone"
  assert figures["bound_gb_per_chip"] <= hbm <= xla, figures
  assert figures["hbm_over_bound"] >= 1 and figures["xla_over_bound"] >= figures["hbm_over_bound"]
  assert 0.9 * hbm <= sum(figures["hbm_gb_by_part"].values()) <= 1.0001 * hbm, figures


def test_each_part_of_the_step_is_named_by_its_instructions_op_names():
  layer = "jit(train_step)/transpose(jvp(BertForPreTraining))/bert/encoder/layer_3/attention/"
  named = {roofline.part_of({"op_name": layer + tail, "opcode": "fusion"}): tail for tail in (
      "attention._kernel/shard_map/cond/branch_0_fun/fused_attention_bwd/pallas_call",
      "attention._projections/dot_general", "query/dot_general", "output/dot_general",
      "shard_map/cond/branch_0_fun/fused_end_bwd/pallas_call")}
  assert set(named) == {"attention kernel (backward)", "attention projections (backward)",
                        "attention end kernel (backward)"}, named
  forward = roofline.part_of({"op_name": layer.replace("transpose(jvp(", "jvp((") + "key/add",
                              "opcode": "fusion"})
  assert forward == "attention projections", forward
  assert roofline.part_of({"op_name": "", "opcode": "copy-start"}) == (
      "copies between memories (unnamed)")


def test_the_splash_kernel_compiles_into_the_train_step_for_v5p(probes):
  # The tiny config at length 128 (the kernel's block), 3 layers scanned (one compiled layer):
  # the step's program holds the Pallas kernels themselves (Mosaic custom calls), forward and
  # fused backward, not their CPU interpreter.
  out = probes["splash"]
  assert out["kernels"] == ["splash_mha_dkv_segmented_no_residuals",
                            "splash_mha_fwd_segmented_residuals"]
  assert out["custom_calls"] >= 2
  # The TPU program's layer loops (found without XLA's trip-count annotation, which TPU programs
  # lack), their operations, and no whole [layers, ...] buffer computed at every layer. What
  # XLA's TPU compiler does write whole at this size: the stacked bfloat16 MLP kernels moved
  # between memory spaces (asynchronous copies, 0.4 MB each), which a full-size model's do not
  # fit (bertjax.aot reports them as whole_stack_writes_per_layer).
  assert out["layer_loops"] == 2 and out["ops_per_layer"] > 0
  assert set(out["stack_writes"]) <= {"copy-start:bf16", "copy-done:bf16"}, out["stack_writes"]
  # XLA sees no FLOPs inside a kernel: counted by attention.splash_flops, the kernels add the
  # attention matmuls of 3 layers, 2 rows a chip, 2 heads of 64 at length 128: the forward's 4
  # and the fused backward's 10 per query, key and head dimension. Without it they are named.
  per_layer = 2 * 2 * 128 * 128 * 64
  added = out["counted"]["flops"] - out["uncounted"]["flops"]
  assert added == (4 + 10) * per_layer * 3, added
  assert out["counted"]["opaque"] == [] and len(out["uncounted"]["opaque"]) == 2


def test_the_fused_mlp_kernels_compile_into_the_train_step_and_count_their_own_flops(probes):
  # The same step with mlp_impl="pallas": its forward and backward kernels are Mosaic's, and the
  # roofline counts each by the estimate it carries, never as zero: 2 rows a chip of 128 tokens,
  # D 128, F 512; the forward's two products, the backward's five (the intermediate made again).
  out = probes["splash"]
  assert out["mlp_kernels"] == ["fused_mlp_bwd", "fused_mlp_fwd"]
  product = 2 * (2 * 128) * 128 * 512
  assert sorted(out["mlp_flops"]) == [2 * product, 5 * product], out["mlp_flops"]
  # mlp_impl="pallas_kept" with a gated MLP in pre-norm layers (the fused-attention step's,
  # GeGLU, the norm before the MLP made inside the kernels: Mosaic compiles it): the forward's
  # three products (W1 and G side by side, then W2), the backward reads the pre-activation the
  # forward wrote, six products, the XLA path's nine in all. XLA fuses that forward kernel with
  # the update writing its pre-activation into the loop's stack: counted all the same.
  assert sorted(probes["fused"]["mlp_flops"]) == [3 * product, 6 * product], probes["fused"]


def test_the_attention_end_kernels_compile_into_a_post_norm_train_step_and_count_their_flops(
    probes):
  # BERT's layers with the fused attention and the MLP kernels: the attention's end (output
  # projection, hidden dropout, residual sum, LayerNorm) is end_kernel's, Mosaic's on v5p (its two
  # cores summing the weights' gradients apart), each kernel counted by its own estimate: 2 rows
  # a chip of 128 tokens, D 128; the forward's one product, the backward's two.
  out = probes["end"]
  assert out["kernels"] == ["fused_end_bwd", "fused_end_fwd"], out
  product = 2 * (2 * 128) * 128 * 128
  assert out["flops"] == [product, 2 * product], out


def test_the_qkv_kernels_compile_into_a_pre_norm_train_step_and_hand_q_k_and_v_on_as_written(
    probes):
  # Straight pre-norm layers with the fused attention and the MLP kernels: each layer's norm and
  # q, k and v's products are qkv_kernel's (layer 0 without the norm it skips), counted by their
  # own estimates: 2 rows a chip of 128 tokens, D 128; three products forward, six backward.
  # Remat keeps q, k and v as bits and the attention kernels read them so: no rounding pass or
  # bitcast runs between the kernels (each was a pass over q, k and v: docs/performance.md).
  out = probes["qkv"]
  assert out["kernels"] == ["fused_qkv_bwd", "fused_qkv_fwd"], out
  product = 2 * (2 * 128) * 128 * 128
  assert out["flops"] == [3 * product] * 3 + [6 * product] * 3, out
  assert out["between"] == [], out


def test_the_kept_mlm_logits_kernel_compiles_into_the_train_step_and_counts_its_flops(probes):
  # recompute_mlm_logits false on a TPU: the logits written with their figures by
  # mlm_kernel.kept_scores, counted by its own estimate: 2 rows a chip of 80 predictions
  # against a vocabulary of 8,000 padded to whole blocks of 512, D 128 (and the slices of its
  # figures XLA names after it, their few FLOPs beside it).
  *rest, kernel = sorted(probes["qkv"]["mlm_kept_flops"])
  assert kernel == 2 * 160 * 8192 * 128 and sum(rest) < 1e4, probes["qkv"]


def test_the_mlm_scores_kernel_compiles_into_the_train_step_and_counts_its_flops(probes):
  # recompute_mlm_logits on a TPU: the MLM head's forward is mlm_kernel's (its logits never
  # written), counted by its own estimate: 2 rows a chip of 80 predictions against a vocabulary
  # of 8,000 padded to whole blocks of 2,048, D 128.
  # XLA names the slices of the kernel's results after it too: their few FLOPs beside it.
  out = probes["fused"]
  *rest, kernel = sorted(out["mlm_flops"])
  assert kernel == 2 * 160 * 8192 * 128 and sum(rest) < 1e4, out
  # Its backward is mlm_grads' (the logits made again, their gradient never written): three
  # products over the vocabulary of 8,000 as it is (its last block partial).
  *rest, kernel = sorted(out["mlm_bwd_flops"])
  assert kernel == 6 * 160 * 8000 * 128 and sum(rest) < 1e4, out


def test_the_fused_attention_kernels_compile_into_the_train_step_with_dropout(probes):
  # The step with attention_impl="fused" and attention dropout: Mosaic's forward and backward
  # kernels (the dropout drawn inside them), each counted by the estimate it carries: 2 rows a
  # chip, 2 heads of 64 at length 128; the forward's 4 and the backward's 10 matmul FLOPs per
  # query, key and head dimension.
  out = probes["fused"]
  assert out["kernels"] == ["fused_attention_bwd", "fused_attention_fwd"]
  per_layer = 2 * 2 * 128 * 128 * 64
  assert out["flops"] == [4 * per_layer, 10 * per_layer], out["flops"]


def test_on_v5p_q_k_and_v_are_one_product_whose_thirds_the_forward_kernel_reads_in_place(probes):
  # qkv_product "auto" is "one" on v5p (train.build settles it for the mesh's chips), and the
  # forward kernel's q, k and v are slices of that product, computed inside its reads
  # (attention_kernel._call's `fused`): no copy of each third is written for the kernel here.
  # XLA's choice: at BERT-Base L 512 it copied them out (docs/performance.md).
  out = probes["fused"]
  assert out["qkv_product"] == "one" and out["fwd_fused_qkv"] == 3, out


def test_the_attention_backward_reads_q_k_and_v_in_the_loop_s_stacks(probes):
  # The scanned layers' backward: XLA fuses the slicing of the saved q, k and v out of the
  # loop's [layers, rows, L, width] stacks into the kernel's reads (attention_kernel._call's
  # `fused`), where it copied each out whole first. The count gives such a fusion the slices'
  # bytes, not the stacks' (what the kernel's own estimate says it moves), so a stack is not
  # counted three times over.
  out = probes["fused"]
  assert out["bwd_opcode"] == "fusion" and out["bwd_fused_qkv"] == 3, out
  # Counted whole, the stacks alone would be more than the kernel's estimate (7 slices); XLA may
  # also have moved a slice into VMEM ahead, which the HBM count leaves out.
  (counted,) = out["bwd_bytes"]
  assert 0.5 * out["bwd_estimate"] < counted < 1.01 * out["bwd_estimate"], out


def test_the_cost_model_reads_the_known_answers_on_a_tpu_compile(probes):
  # roofline.check_cost_model on a v5e-8 compile: a square bf16 matmul, an elementwise pass and a
  # matmul whose large operand XLA prefetches into the chip's own memory. The HBM count gives
  # each one's operands and result (and each matmul its compute roof); XLA's own bytes count
  # the prefetched operand three times (copy read, copy write, the matmul's read there).
  cases = {case["case"]: case for case in probes["cost_model"]}
  assert all(case["ok"] for case in cases.values()), cases
  for case in cases.values():
    assert abs(case["hbm_bytes_over_known"] - 1) < 0.05 and case["flops_over_known"] == 1.0
  assert cases["matmul"]["roofline_mfu"] == cases["prefetched matmul"]["roofline_mfu"] == 1.0
  assert cases["elementwise"]["roofline_mfu"] < 0.1
  assert cases["prefetched matmul"]["xla_bytes_over_known"] > 2, cases


def test_the_roofline_is_the_slower_of_compute_and_memory():
  # 9.18 TFLOP at v6e's 918 TFLOP/s: 10 ms; 32.8 GB at 1,640 GB/s: 20 ms, the bound.
  bound = roofline.roofline(9.18e12, 32.8e9, 918.0, 1640.0)
  assert bound == {"roofline_compute_s": 0.01, "roofline_memory_s": 0.02,
                   "roofline_step_s": 0.02, "roofline_bound": "memory"}
  assert roofline.roofline(9.18e13, 32.8e9, 918.0, 1640.0)["roofline_bound"] == "compute"


def test_a_step_larger_than_hbm_is_refused_with_the_shortfall(v5p_384):
  # A per-chip HBM of 1 MiB: the compile above, refused by bertjax's own check (the compile
  # itself succeeded: XLA's TPU compiler knows v5p's own 95 GiB).
  result, figures = v5p_384
  assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
  assert "bertjax.aot: fits" not in result.stdout
  assert "GiB per chip, v5p has 0.001 GiB:" in result.stderr
  assert "GiB short; lower train.batch_size (now 192, 1 per chip)" in result.stderr
  assert figures["hbm_gib"] == 0.001 and figures["memory_total_gib"] > 0.001


def test_an_oversized_per_chip_batch_is_refused_with_the_shortfall():
  # 262,144 sequences per v5e chip need ~200 GiB even after XLA rematerialises what it can; its
  # TPU compiler gives up within seconds and its numbers reach the message.
  result = run_aot(*TINY, "--topology=v5e-4", "--config.train.batch_size=1048576")
  assert result.returncode == 1
  assert "v5e-4: the train step needs" in result.stderr
  assert "GiB per chip, v5e has 16 GiB (15.75 usable):" in result.stderr
  assert "GiB short; lower train.batch_size (now 1048576, 262144 per chip)" in result.stderr
  assert "RESOURCE_EXHAUSTED" in result.stderr


def test_unknown_topology_is_refused_with_the_nearest_ones():
  result = run_aot(*TINY, "--topology=v5p-24")
  assert result.returncode == 1
  assert "Unknown TPU topology 'v5p-24': v5p has no slice of 24 TensorCores" in result.stderr
  assert "nearest: v5p-16 (2x2x2), v5p-32 (2x2x4)" in result.stderr


def test_a_packing_config_compiles_the_rows_the_pipeline_feeds():
  """With data.packing the step reads S x M masked slots, sequence ids and [B, S] next-sentence
  features: the compile check must lower that program, not the unpacked one."""
  from bertjax.configs import tiny  # pylint: disable=import-outside-toplevel
  from bertjax.data.config import DataConfig  # pylint: disable=import-outside-toplevel
  from bertjax.training import flops, train  # pylint: disable=import-outside-toplevel
  config = tiny.get_config()
  config.data.packing, config.data.max_sequences_per_row = True, 3
  config.model.num_layers = 1  # the rows' shapes are the input's, whatever the depth
  seq_len, slots, per_row = flops.rows_shape(DataConfig.from_config(config.data))
  assert (seq_len, slots, per_row) == (64, 30, 3)
  training = train.from_config(config, devices=jax.devices()[:1], vocab_size=1000)
  batch = aot.abstract_batch(training, seq_len, slots, per_row)
  assert batch["masked_lm_positions"].shape == (8, 30) and batch["sequence_ids"].shape == (8, 64)
  assert batch["nsp_positions"].shape == batch["next_sentence_labels"].shape == (8, 3)
  compiled = aot.compile_train_step(training, seq_len, slots, per_row)
  (_, compiled_batch, _), _ = compiled.args_info  # what the program was compiled for
  assert compiled_batch["nsp_positions"].shape == (8, 3)
  assert compiled_batch["masked_lm_positions"].shape == (8, 30)
