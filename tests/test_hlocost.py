"""What a compiled program costs, instruction by instruction, and the bytes that cross HBM
(bertjax/perf/hlocost.py, bertjax/perf/hlotext.py), and the analytic floor beside them (roofline.bytes_bound).

XLA's cost analysis counts every operand and result in whatever memory it lies; on a TPU a buffer
prefetched into the chip's own memory counts three times. The modules here are written by hand
so that every byte's place is known; tests/test_aot.py holds the same on TPU compiles.
"""

import dataclasses
import math
import re

import jax
import pytest

from bertjax.configs import tiny
from bertjax.perf import hlocost, hlotext, roofline
from bertjax.training import train

MIB2 = 1024 * 1024 * 2  # one bf16[1024,1024]

# `a` is copied into memory space 1 (a TPU's VMEM) and read there; `b` is read from HBM.
PREFETCHED = """HloModule prefetched

%fused (p0: bf16[1024,1024], p1: bf16[1024,1024]) -> bf16[1024,1024] {
  %p0 = bf16[1024,1024]{1,0:S(1)} parameter(0)
  %p1 = bf16[1024,1024]{1,0} parameter(1)
  ROOT %add = bf16[1024,1024]{1,0} add(%p0, %p1)
}

ENTRY %main (a: bf16[1024,1024], b: bf16[1024,1024]) -> bf16[1024,1024] {
  %a = bf16[1024,1024]{1,0} parameter(0)
  %b = bf16[1024,1024]{1,0} parameter(1)
  %copy-start = (bf16[1024,1024]{1,0:S(1)}, bf16[1024,1024]{1,0}, u32[]{:S(2)}) copy-start(%a)
  %copy-done = bf16[1024,1024]{1,0:S(1)} copy-done(%copy-start)
  ROOT %f = bf16[1024,1024]{1,0} fusion(%copy-done, %b), kind=kLoop, calls=%fused
}
"""

# A counter from 1 by 2 while below 7: 3 iterations (1, 3, 5), where the limit alone says 7.
STRIDED_LOOP = """HloModule strided

%cond (p: (u32[], f32[8])) -> pred[] {
  %p = (u32[], f32[8]) parameter(0)
  %i = u32[] get-tuple-element(%p), index=0
  %n = u32[] constant(7)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (p: (u32[], f32[8])) -> (u32[], f32[8]) {
  %p = (u32[], f32[8]) parameter(0)
  %i = u32[] get-tuple-element(%p), index=0
  %x = f32[8] get-tuple-element(%p), index=1
  %two = u32[] constant(2)
  %next = u32[] add(%i, %two)
  %y = f32[8] multiply(%x, %x)
  ROOT %t = (u32[], f32[8]) tuple(%next, %y)
}

ENTRY %main (x: f32[8]) -> f32[8] {
  %x = f32[8] parameter(0)
  %one = u32[] constant(1)
  %init = (u32[], f32[8]) tuple(%one, %x)
  %w = (u32[], f32[8]) while(%init), condition=%cond, body=%body
  ROOT %r = f32[8] get-tuple-element(%w), index=1
}
"""

# A kernel (a Pallas call, its own cost estimate in its backend config) fused by XLA with the
# update that writes its result into a loop's stack: XLA counts no FLOPs for it.
KERNEL_IN_FUSION = """HloModule kernel_in_fusion

%fused (p0: f32[8,128], p1: f32[4,8,128], p2: s32[]) -> f32[4,8,128] {
  %p0 = f32[8,128]{1,0} parameter(0)
  %p1 = f32[4,8,128]{2,1,0} parameter(1)
  %p2 = s32[] parameter(2)
  %k = f32[8,128]{1,0} custom-call(%p0), custom_call_target="tpu_custom_call", backend_config={"custom_call_config": {"cost_estimate": {
"bytes_accessed":8192,
"flops":1000000,
"transcendentals":0
}}}
  %b = f32[1,8,128]{2,1,0} bitcast(%k)
  %zero = s32[] constant(0)
  ROOT %u = f32[4,8,128]{2,1,0} dynamic-update-slice(%p1, %b, %p2, %zero, %zero)
}

ENTRY %main (x: f32[8,128], s: f32[4,8,128], i: s32[]) -> f32[4,8,128] {
  %x = f32[8,128]{1,0} parameter(0)
  %s = f32[4,8,128]{2,1,0} parameter(1)
  %i = s32[] parameter(2)
  ROOT %f = f32[4,8,128]{2,1,0} fusion(%x, %s, %i), kind=kOutput, calls=%fused
}
"""


# One branch a product (4.2 MFLOP, 0.2 MB), the other an elementwise pass (0.26 MFLOP, 3 MB):
# the program does not say which runs (ModernBERT's global and local layers in one scanned loop).
CONDITIONAL = """HloModule conditional

%product (p: f32[128,128]) -> f32[128,128] {
  %p = f32[128,128]{1,0} parameter(0)
  ROOT %d = f32[128,128]{1,0} dot(%p, %p), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%pass (p: f32[512,512]) -> f32[128,128] {
  %p = f32[512,512]{1,0} parameter(0)
  %a = f32[512,512]{1,0} add(%p, %p)
  ROOT %s = f32[128,128]{1,0} slice(%a), slice={[0:128], [0:128]}
}

ENTRY %main (i: s32[], x: f32[128,128], y: f32[512,512]) -> f32[128,128] {
  %i = s32[] parameter(0)
  %x = f32[128,128]{1,0} parameter(1)
  %y = f32[512,512]{1,0} parameter(2)
  ROOT %c = f32[128,128]{1,0} conditional(%i, %x, %y), branch_computations={%product, %pass}
}
"""


def test_a_conditional_counts_its_dearest_branch_in_flops_and_in_bytes_and_says_so():
  cost = hlocost.program_cost(CONDITIONAL)
  product, elementwise = 2 * 128 ** 3, 512 * 512
  # The pass's bytes (the branch of most HBM bytes) and the product's FLOPs: an upper bound on
  # each, named. Counting the pass's alone, its FLOPs, was 16 times short of the product's.
  assert cost["flops"] == max(product, elementwise), cost
  assert cost["hbm_bytes"] >= 2 * 512 * 512 * 4, cost
  assert cost["upper_bound"] == ["c"], cost
  # Branches that cost alike are no estimate.
  alike = CONDITIONAL.replace("branch_computations={%product, %pass}",
                              "branch_computations={%pass, %pass}")
  assert hlocost.program_cost(alike)["upper_bound"] == []


def test_a_prefetched_operand_crosses_hbm_once():
  cost = hlocost.program_cost(PREFETCHED)
  # a read by the copy, b read by the fusion, the result written: three arrays through HBM.
  assert cost["hbm_bytes"] == 3 * MIB2, cost
  # XLA's own count adds the copy's write into VMEM and the fusion's read there (and more).
  assert cost["bytes"] >= 5 * MIB2, cost
  rows = {r["opcode"]: r for r in hlocost.instruction_costs(PREFETCHED, "main")}
  assert rows["copy-start"]["hbm_bytes"] == MIB2 and rows["copy-done"]["hbm_bytes"] == 0
  assert rows["fusion"]["hbm_bytes"] == 2 * MIB2


def test_a_loop_counts_its_iterations_from_its_counter():
  comps = hlotext.blocks(STRIDED_LOOP)
  [(_, _, _, line)] = [i for i in hlotext.parse(comps["main"][1:]) if i[2] == "while"]
  assert hlotext.trip_count(comps, line, "main") == 3
  cost = hlocost.program_cost(STRIDED_LOOP)
  assert cost["flops"] == 3 * (8 + 1), cost  # 3 x (the multiply's 8 and the counter's add)
  assert cost["unknown_trips"] == []


def test_an_instruction_over_several_lines_is_one():
  # A Pallas call's kernel metadata is printed over lines of its own.
  text = PREFETCHED.replace("kind=kLoop, calls=%fused",
                            'kind=kLoop, calls=%fused, frontend_attributes={k={\n"v"\n}}')
  lines = hlotext.blocks(text)["main"]
  assert sum("fusion(" in line for line in lines) == 1 and lines[-1] == "}"
  assert "\n" in next(line for line in lines if "fusion(" in line)


def test_a_kernel_inside_a_fusion_counts_by_its_own_estimate():
  [row] = [r for r in hlocost.program_rows(KERNEL_IN_FUSION) if r["opcode"] == "fusion"]
  assert row["flops"] == 1e6 and not row.get("opaque"), row
  # Without an estimate of its own it is named, never counted as zero silently; what the caller
  # knows of the kernel counts in its place.
  bare = re.sub(r", backend_config=\{.*?\}\}\}", "", KERNEL_IN_FUSION, flags=re.S)
  assert "cost_estimate" not in bare
  assert hlocost.program_cost(bare)["opaque"] == ["f"]
  known = hlocost.program_cost(bare, lambda line, operands, shape: 7.0)
  assert known["flops"] == 7.0 and known["opaque"] == [], known


def test_the_known_answers_on_a_cpu_compile():
  # roofline.check_cost_model on this CPU's devices (no memory but main, no peak figures), in
  # float32 (a CPU converts bfloat16 matmul operands to it): each case's FLOPs and bytes are its
  # known ones.
  cases = roofline.check_cost_model(jax.devices()[:8], size=512, dtype=jax.numpy.float32)
  assert [c["case"] for c in cases] == ["matmul", "elementwise", "prefetched matmul"]
  for case in cases:
    assert case["ok"] and case["flops_over_known"] == 1.0, case
    assert abs(case["hbm_bytes_over_known"] - 1) < 0.05, case
    assert case["xla_bytes_over_known"] == case["hbm_bytes_over_known"], case


def _training(**model):
  config = tiny.get_config()
  config.model.update(vocab_size=512, **model)
  config.train.batch_size = 16
  return train.from_config(config, devices=jax.devices()[:8])


def test_the_bytes_bound_counts_every_row_and_layer_of_the_residuals():
  # bytes_bound takes a row's and a layer's share of jax's residuals from one and two rows and
  # layers; its activations must equal twice (written, read) the residuals that the chip's own
  # rows add at the model's depth, measured directly (at a policy that keeps fewer than the
  # floor's).
  training = _training(remat_policy="dots")
  bound = roofline.bytes_bound(training, 64, 10)
  rows = 16 // 8
  layers = training.model_config.num_layers
  direct = (roofline.residual_bytes(training.model_config, layers, 2 * rows, 64, 10, 0)
            - roofline.residual_bytes(training.model_config, layers, rows, 64, 10, 0))
  assert bound["bound_parts_gb"]["activations"] == roofline.round4(2 * direct / 1e9), bound
  # The state: parameters, gradients, Adam's two moments, each read and written once.
  params = sum(x.size * 4 for x in jax.tree.leaves(training.abstract_state.params))
  assert bound["bound_parts_gb"]["state"] == roofline.round4(2 * 4 * params / 1e9)


def test_the_bytes_bound_counts_the_mlm_logits_where_the_backward_keeps_them():
  # Kept: float32 [predictions, V] written once and read once (2 rows a chip of 10 predictions,
  # V 512). Made again in the backward: a TPU's kernels never write them, and the floor counts
  # none (a step that moved less than its floor would show the floor wrong).
  kept, remade = (roofline.bytes_bound(_training(recompute_mlm_logits=r), 64, 10)
                  for r in (False, True))
  assert kept["bound_parts_gb"]["mlm_logits"] == roofline.round4(2 * 2 * 10 * 512 * 4 / 1e9)
  assert remade["bound_parts_gb"]["mlm_logits"] == 0.0
  assert remade["bound_parts_gb"]["state"] == kept["bound_parts_gb"]["state"]


def test_the_bytes_bound_follows_remat_and_the_state_split():
  plain, full, kept = (roofline.bytes_bound(_training(remat_policy=p), 64, 10)
                       for p in ("none", "full", roofline.FLOOR_POLICY))
  assert full["bound_parts_gb"]["activations"] < 0.5 * plain["bound_parts_gb"]["activations"]
  # "none" keeps more residuals than the floor's policy, which XLA makes again unasked: the
  # floor counts the fewer.
  training = _training()
  shares = {p: roofline._residual_shares(  # pylint: disable=protected-access
      dataclasses.replace(training.model_config, remat_policy=p), 64, 10, 0)
            for p in ("none", roofline.FLOOR_POLICY)}
  assert shares["none"][1] > 1.5 * shares[roofline.FLOOR_POLICY][1], shares
  assert plain["bound_parts_gb"] == kept["bound_parts_gb"], (plain, kept)
  split = roofline.bytes_bound(training, 64, 10)
  config = tiny.get_config()
  config.model.vocab_size = 512
  config.train.batch_size = 16
  config.mesh.update(ici_data=1, ici_fsdp=-1)
  fsdp = roofline.bytes_bound(train.from_config(config, devices=jax.devices()[:8]), 64, 10)
  # Each chip holds an eighth of what fsdp splits (the embed axis); biases stay whole.
  assert fsdp["bound_parts_gb"]["state"] < 0.2 * split["bound_parts_gb"]["state"], (fsdp, split)
  # And computes with the whole of it: the seven eighths it gathers (written, read) and their
  # gradients before the reduce-scatter (written, read), in the compute dtype (float32 here).
  assert split["bound_parts_gb"]["gathered_weights"] == 0.0
  leaves = jax.tree.leaves(train.from_config(config, devices=jax.devices()[:8])
                           .abstract_state.params)
  rest = sum(x.size - math.prod(x.sharding.shard_shape(x.shape)) for x in leaves)
  assert rest > 0.8 * sum(x.size for x in leaves)
  assert fsdp["bound_parts_gb"]["gathered_weights"] == roofline.round4(4 * 4 * rest / 1e9), fsdp
  assert fsdp["bound_gb_per_chip"] >= sum(fsdp["bound_parts_gb"].values()) - 2e-4, fsdp


def test_without_jaxlibs_analysis_the_program_is_not_costed(monkeypatch):
  from jax._src.lib import xla_client  # pylint: disable=import-outside-toplevel
  monkeypatch.delattr(xla_client._xla, "hlo_module_cost_analysis")  # pylint: disable=protected-access
  assert hlocost.analyse(PREFETCHED) is None
  with pytest.raises(ValueError, match="could not cost"):
    hlocost.program_cost(PREFETCHED)
