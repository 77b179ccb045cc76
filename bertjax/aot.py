"""Compile the real train step for a Cloud TPU slice ahead of time, on a machine without a TPU.

    python -m bertjax.aot --config=configs/bert_large.py --topology=v5p-128
    python -m bertjax.aot --config=configs/bert_base.py:phase=2 --topology=v5p-128 --num_slices=2
    python -m bertjax.aot --config=configs/bert_large.py --topology=v5e-256 \
        --config.train.batch_size=4096 --config.model.remat_policy=full --mfu=0.5

libtpu (`pip install -e '.[tpu]'`) has a compile-only client: from a topology name it makes devices
that run nothing but that XLA's TPU compiler targets exactly as it would a real slice. What is
compiled is `train.from_config(config, devices=...).train_step` with its shardings and donation,
lowered on `jax.ShapeDtypeStruct`s: the program `bertjax.pretrain` compiles on the pod, so a config
that fits here fits there.

Prints per-chip memory from XLA's buffer assignment (arguments, outputs, temporaries, code, less
the outputs written into donated arguments) against the chip's HBM; the FLOPs of one step (XLA's
count per chip and the model count of bertjax.training.flops); and at an assumed MFU (--mfu) the step
time, sequences/s and chip-hours of train.num_train_steps. Beside that assumed MFU, the roofline
of the executable itself: XLA's FLOPs and bytes accessed per chip (every layer counted: a scanned
step's layer loop bodies are costed alone and counted once per iteration, bertjax/perf/layercost.py)
at the chip's peak and HBM bandwidth (bertjax/training/flops.py's CHIPS), the step time they allow, and the
operations per layer; with scanned layers also any write of a whole [layers, ...] buffer inside
the layer loops (a cost growing with depth at every layer: none expected). Exits 1, naming the
shortfall, when the step does not fit. (XLA's TPU compiler itself works to fit HBM before it gives up, e.g. by
recomputing activations: a step near the limit can compile slowly and run slower than its FLOPs
suggest.)

Slice names are Cloud TPU accelerator types. The number counts TensorCores on v4 and v5p (two per
chip, one JAX device per chip: v5p-128 is 64 chips, 4x4x4; v5p-384 is 4x4x12) and chips on v5e
and v6e (v5e-256 is 256 chips, 16x16); bertjax.parallel.topologies lists every shape Cloud TPU documents.
With --num_slices=N the job spans N such slices joined by DCN; the config's mesh.dcn_* sizes
split the mesh axes over them.

The report names the versions of jax, jaxlib, libtpu and the rest of launch/requirements-tpu.lock
installed here (`versions`), and warns when they are not the lock's: the TPU VMs install the lock,
and `python -m launch.tpu run --aot-report=FILE.json` refuses to start a job whose workers differ
from what was compiled here.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import re
import sys
import time

import jax
import numpy as np
from absl import app, flags

from bertjax import cli, files, versions
from bertjax.data.config import DataConfig
from bertjax.model import attention
from bertjax.parallel import platforms, sharding, topologies
from bertjax.perf import layercost, roofline as roofline_lib
from bertjax.training import flops, train

GIB = 2**30

def topology_devices(topology: topologies.Topology) -> list:
  """Compile-only devices of the slice(s), from libtpu; with several slices each carries
  `slice_index`, which sharding.create_mesh uses to put the DCN mesh axes across slices."""
  from jax.experimental import topologies as jax_topologies  # pylint: disable=import-outside-toplevel
  # The compile-only client opens no TPU, so it need not take /tmp/libtpu_lockfile, which another
  # process on this machine (a CPU job with libtpu installed, a TPU VM's training) may hold.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  # libtpu asks its environment (or the GCE metadata server) which TPU it runs on, and warns when
  # nothing answers; answer for the requested slice.
  os.environ.setdefault("TPU_ACCELERATOR_TYPE", topology.name)
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
  # The flags a TPU host's commands start libtpu with (cli.run): the step compiled here is theirs.
  platforms.add_libtpu_flags(compiling=True)
  shape = topology.shape + (1,) * (3 - len(topology.shape))
  # Hosts of 2x2 chips (how these slices are cabled); it only sets the devices' process_index.
  host_bounds = tuple(min(2, s) for s in shape)
  # Wraparound links: full 3D cubes (4x4x4 and up) are tori; in 2D only the 16-chip sides wrap.
  if len(topology.shape) == 3:
    wrap = (min(topology.shape) >= 4,) * 3
  else:
    wrap = tuple(s == 16 for s in shape[:2]) + (False,)
  try:
    desc = jax_topologies.get_topology_desc(
        topology.libtpu_name, "tpu", chip_config_name=topology.slice_type.generation.chip_config,
        chips_per_host_bounds=host_bounds, num_slices=topology.num_slices, wrap=wrap)
  except RuntimeError as e:
    if "not installed" in str(e):
      raise RuntimeError("libtpu is not installed: pip install -e '.[tpu]'") from e
    raise
  devices = list(desc.devices)
  if len(devices) != topology.num_chips:  # e.g. a chip config giving one device per TensorCore
    raise RuntimeError(f"libtpu made {len(devices)} devices for {topology} "
                       f"({topology.libtpu_name}); expected {topology.num_chips} chips")
  return devices


def dcn_axes(mesh: jax.sharding.Mesh) -> tuple[str, ...]:
  """The mesh axes along which devices change slice (their collectives cross DCN)."""
  slices = np.vectorize(lambda d: getattr(d, "slice_index", 0))(mesh.devices)
  return tuple(name for i, name in enumerate(mesh.axis_names)
               if (np.diff(slices, axis=i) != 0).any())


def abstract_batch(training: train.Training, seq_len: int, max_predictions: int,
                   sequences_per_row: int = 0) -> dict[str, jax.ShapeDtypeStruct]:
  """The global batch as shapes with the step's sharding (nothing is allocated); packed rows
  (`sequences_per_row` > 0) as the pipeline makes them with `data.packing`."""
  rows = training.train_config.batch_size
  one = train.dummy_batch(1, seq_len, max_predictions, sequences_per_row)
  return {name: jax.ShapeDtypeStruct((rows,) + x.shape[1:], x.dtype,
                                     sharding=training.batch_sharding)
          for name, x in one.items()}


def compile_train_step(training: train.Training, seq_len: int, max_predictions: int,
                       sequences_per_row: int = 0):
  """`training.train_step` lowered on abstract state, batch and key, then compiled."""
  key = jax.eval_shape(jax.random.PRNGKey, 0)
  key = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=sharding.replicated(training.mesh))
  batch = abstract_batch(training, seq_len, max_predictions, sequences_per_row)
  lowered = training.train_step.lower(training.abstract_state, batch, key)
  return lowered.compile()


@dataclasses.dataclass(frozen=True)
class Memory:
  """Bytes per chip of a compiled step, from XLA's buffer assignment."""

  arguments: int  # state, batch and key as they arrive
  outputs: int  # new state and metrics
  aliased: int  # outputs written into donated argument buffers (the state): counted once
  temporaries: int  # activations, gradients, optimizer scratch, collectives' buffers
  code: int  # the program itself

  @property
  def total(self) -> int:
    return self.arguments + self.outputs - self.aliased + self.temporaries + self.code

  @classmethod
  def of(cls, compiled) -> "Memory":
    m = compiled.memory_analysis()
    return cls(m.argument_size_in_bytes, m.output_size_in_bytes, m.alias_size_in_bytes,
               m.temp_size_in_bytes, m.generated_code_size_in_bytes)


_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
# How XLA's TPU compiler words a program that overflows a memory (sizes in binary units): HBM
# two ways, a core's VMEM one; and the operation it names first among the largest allocations.
_USED = r"Used ([\d.]+)([KMGT]?) of ([\d.]+)([KMGT]?) {}"
_XLA_OOM = {"hbm": (re.compile(_USED.format("hbm")),
                    re.compile(r"required for [\w ]+ \(([\d.]+)([KMGT]?)\) exceeds available HBM "
                               r"\(([\d.]+)([KMGT]?)\)")),
            "vmem": (re.compile(_USED.format("vmem")),)}
_XLA_OPERATION = re.compile(r'op_name="[^"]*/([^"/]+)/[^"/]+"')


def xla_out_of_memory(error: Exception, space: str = "hbm") -> tuple[float, float] | None:
  """(bytes needed, bytes usable) when XLA's TPU compiler refused a program too big for `space`:
  "hbm", or "vmem" (a core's)."""
  for pattern in _XLA_OOM[space]:
    found = pattern.search(str(error))
    if found:
      used, used_unit, usable, usable_unit = found.groups()
      return float(used) * _UNITS[used_unit], float(usable) * _UNITS[usable_unit]
  return None


def vmem_message(error: Exception, topology, training) -> str | None:
  """What to say when XLA's TPU compiler refused a step over a core's VMEM (not HBM)."""
  vmem = xla_out_of_memory(error, "vmem")
  if vmem is None:
    return None
  operation = _XLA_OPERATION.search(str(error))
  tc = training.train_config
  return (f"{topology}: an operation of the train step needs {vmem[0] / 2**20:.1f} MiB of a "
          f"core's VMEM, {topology.generation} has {vmem[1] / 2**20:.1f}"
          + (f" ({operation.group(1)})" if operation else "") + "; fewer rows a chip hold less: "
          f"lower train.batch_size (now {tc.batch_size}, {tc.batch_size / topology.num_chips:g} "
          f"per chip) or raise train.num_microbatches (now {tc.num_microbatches}). bertjax sizes "
          f"its kernels to fit VMEM: a bug to report with the command. (XLA's TPU compiler: "
          f"{str(error).splitlines()[0]})")


def shortfall_message(topology: topologies.Topology, need_bytes: float, hbm_gib: float,
                      training: train.Training, usable_bytes: float | None = None) -> str:
  """What does not fit, by how much, and the settings that change it."""
  tc, mc = training.train_config, training.model_config
  need = need_bytes / GIB
  has = f"{hbm_gib:g} GiB"
  if usable_bytes is not None and usable_bytes < hbm_gib * GIB:  # the runtime keeps some
    has += f" ({usable_bytes / GIB:.2f} usable)"
    hbm_gib = usable_bytes / GIB
  fixes = [f"lower train.batch_size (now {tc.batch_size}, "
           f"{tc.batch_size / topology.num_chips:g} per chip)",
           f"raise train.num_microbatches (now {tc.num_microbatches})"]
  if mc.remat_policy != "full":
    fixes.append(f"use model.remat_policy=full (now {mc.remat_policy})")
  if mc.dtype != "bfloat16":
    fixes.append(f"use model.dtype=bfloat16 (now {mc.dtype})")
  if training.mesh.shape["fsdp"] == 1:  # the state is replicated: fsdp splits it
    fixes.append("split the state with mesh.ici_fsdp")
  fixes.append("or use more chips")
  return (f"{topology}: the train step needs {need:.1f} GiB per chip, {topology.generation} has "
          f"{has}: {need - hbm_gib:.1f} GiB short; " + ", ".join(fixes) + ".")


def report(topology: topologies.Topology, training: train.Training, compiled,
           memory: Memory | None,
           compile_s: float, seq_len: int, max_predictions: int, mfu: float,
           hbm_gib: float, layers: dict, bound: dict | None = None) -> dict:
  """The figures of one compiled step as a flat dict (also what the command prints); `layers`:
  its figures with every layer counted (`layer_figures`, or `extrapolated_layer_figures`: then
  `compiled` is the deeper of its two compiles, and `memory` None, not the full depth's);
  `bound`: roofline.bytes_bound's floor on the bytes."""
  mc, tc = training.model_config, training.train_config
  n = topology.num_chips
  device_kind = training.mesh.devices.flat[0].device_kind
  peak = flops.peak_tflops(device_kind)
  model_flops = flops.train_flops(mc, tc.batch_size, seq_len, max_predictions)
  xla_flops = layercost.cost(compiled)["flops"]
  step_s = model_flops / (n * peak * 1e12 * mfu)
  gib = lambda b: roofline_lib.round4(b / GIB)
  if memory is None:  # figures of a shallower step, extrapolated: XLA's count of the whole step
    xla_flops = layers["xla_tflop_per_chip_all_layers"] * 1e12
    memory_figures = {"memory": "not compiled at full depth (--roofline_layers)"}
  else:
    memory_figures = {
        "memory_arguments_gib": gib(memory.arguments), "memory_outputs_gib": gib(memory.outputs),
        "memory_aliased_gib": gib(memory.aliased),
        "memory_temporaries_gib": gib(memory.temporaries), "memory_code_gib": gib(memory.code),
        "memory_total_gib": gib(memory.total), "hbm_gib": hbm_gib,
        "memory_fraction": round(memory.total / (hbm_gib * GIB), 4)}
  roof = roofline_lib.step_roofline(layers, model_flops / n, peak, flops.hbm_gbps(device_kind),
                                    bound)
  return {
      "topology": str(topology), "libtpu_topology": topology.libtpu_name,
      "device": f"{n} x {device_kind}", "libtpu": importlib.metadata.version("libtpu"),
      "versions": versions.format_versions(compiled_with()),
      # What libtpu compiled with: a TPU host's commands start it with the same flags (cli.run).
      "libtpu_flags": os.environ.get("LIBTPU_INIT_ARGS", ""),
      "mesh": dict(training.mesh.shape), "dcn_axes": list(dcn_axes(training.mesh)),
      "batch_size": tc.batch_size, "per_chip_batch": tc.batch_size / n,
      "seq_len": seq_len, "max_predictions": max_predictions,
      "num_microbatches": tc.num_microbatches, "vocab_size": mc.vocab_size, "dtype": mc.dtype,
      "remat_policy": mc.remat_policy, "scan_layers": mc.scan_layers,
      "attention_impl": mc.attention_impl, "attention_dropout": mc.attention_dropout,
      "mlp_impl": mc.mlp_impl, "qkv_product": mc.qkv_product,
      "compile_s": round(compile_s, 1), **memory_figures,
      "model_tflop_per_step": roofline_lib.round4(model_flops / 1e12),
      "model_tflop_per_chip": roofline_lib.round4(model_flops / n / 1e12),
      "xla_tflop_per_chip": roofline_lib.round4(xla_flops / 1e12),
      "xla_over_model": round(xla_flops * n / model_flops, 3),
      # XLA's cost analysis counts the body of a loop once, not once per iteration.
      **({"xla_note": f"counts the scanned layer once, not {mc.num_layers} times (the "
                      "all_layers figures count each: all_layers_counted_as)"}
         if mc.scan_layers and memory is not None else {}),
      **layers,
      "peak_tflops_per_chip": peak, "hbm_gbps_per_chip": flops.hbm_gbps(device_kind),
      "assumed_mfu": mfu,
      "step_s": roofline_lib.round4(step_s), "sequences_per_s": roofline_lib.round4(tc.batch_size / step_s),
      # The executable's FLOPs and HBM bytes at the chip's peak and bandwidth: a floor on the step.
      **roof,
      "num_train_steps": tc.num_train_steps,
      "train_hours": roofline_lib.round4(step_s * tc.num_train_steps / 3600),
      "chip_hours": roofline_lib.round4(n * step_s * tc.num_train_steps / 3600),
  }


def compiled_with() -> dict[str, str]:
  """The installed versions of the lock's packages (what this compile used)."""
  try:
    names = versions.read_lock()
  except OSError:  # installed without the project's launch/ folder: the packages that compile
    names = ("jax", "jaxlib", "libtpu", "flax", "optax")
  return versions.installed(names)


def lock_mismatch() -> list[str]:
  """How the versions here differ from launch/requirements-tpu.lock (empty without a lock)."""
  try:
    return versions.differences(versions.installed(versions.read_lock()), versions.read_lock())
  except OSError:
    return []


def compile_at_depth(config, devices, vocab: int, seq_len: int, max_predictions: int,
                     per_row: int, layers: int):
  """The train step compiled with `layers` layers as straight code (a scanned config's scan
  unrolled: XLA counts every operation), the config left as it was."""
  model = config.model
  full = (model.num_layers, model.scan_unroll)
  model.num_layers = layers
  if model.scan_layers:
    model.scan_unroll = layers
  try:
    return compile_train_step(train.from_config(config, devices=devices, vocab_size=vocab),
                              seq_len, max_predictions, per_row)
  finally:
    model.num_layers, model.scan_unroll = full


def shallow_roofline(config, training: train.Training, topology: topologies.Topology, devices,
                     vocab: int, seq_len: int, max_predictions: int, per_row: int,
                     hbm_gib: float) -> dict:
  """`report`'s figures but memory's, from the step compiled at --roofline_layers N and 2N
  layers (`extrapolated_layer_figures`)."""
  depth = FLAGS.roofline_layers
  if 2 * depth >= training.model_config.num_layers:
    raise app.UsageError(f"--roofline_layers={depth}: 2 x {depth} layers are not fewer than the "
                         f"config's {training.model_config.num_layers}; compile it whole instead")
  compiled, start = [], time.perf_counter()
  for layers in (depth, 2 * depth):
    print(f"bertjax.aot: compiling the train step with {layers} layers for {topology}, for the "
          "roofline (no memory check)", flush=True)
    compiled.append(compile_at_depth(config, devices, vocab, seq_len, max_predictions, per_row,
                                     layers))
  layers = roofline_lib.extrapolated_layer_figures(training, *compiled, depth,
                                                   attention.splash_flops)
  figures = report(topology, training, compiled[1], None, time.perf_counter() - start, seq_len,
                   max_predictions, FLAGS.mfu, hbm_gib, layers,
                   roofline_lib.bytes_bound(training, seq_len, max_predictions, per_row))
  figures["sequences_per_row"] = per_row or 1
  return figures


def print_figures(figures: dict) -> None:
  width = max(len(k) for k in figures)
  for key, value in figures.items():
    print(f"{key:<{width}}  {value}")
  if FLAGS.json:
    with open(FLAGS.json, "w") as f:
      json.dump(figures, f, indent=1)


FLAGS = flags.FLAGS


def define_flags() -> None:
  """The command's flags; defined only when run as a command, so that importing this module next
  to another with a --config flag (bertjax.benchmark, in one test process) does not collide."""
  cli.define_config_flag()
  flags.DEFINE_string("topology", None,
                      "Cloud TPU accelerator type, e.g. v5p-128, v4-32, v5e-256 (v5litepod-256).")
  flags.DEFINE_integer("num_slices", 1, "Slices of that type joined by DCN (multi-slice).")
  flags.DEFINE_float("mfu", 0.45, "Model FLOPs utilisation assumed for the time estimates.")
  flags.DEFINE_float("hbm_gib", 0.0, "HBM per chip to check against (0 = the chip's own).")
  flags.DEFINE_string("json", "", "Also write the figures to this file.")
  flags.DEFINE_bool("roofline", True, "With scanned layers whose loop body cannot be costed "
                    "alone, compile the step a second time (more layers per loop iteration) so "
                    "that the roofline counts every layer.")
  flags.DEFINE_integer("roofline_layers", 0, "N > 0: only the roofline, from the step compiled "
                       "at N and 2N layers (as straight code) and extrapolated linearly to the "
                       "config's depth; no compile at full depth, so no memory check. For deep "
                       "models on a small machine, where a full compile takes many minutes.")
  flags.DEFINE_string("dump_hlo", "", "Also write the compiled train step's optimised module "
                      "(its text) to this file: where hbm_gb_by_part's bytes go, instruction by "
                      "instruction.")
  flags.DEFINE_bool("check_cost_model", False, "First compile the known-answer cases "
                    "(roofline.check_cost_model: a matmul, an elementwise pass, a prefetched "
                    "matmul) for the slice and print how XLA's and the HBM count read them.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  if not 0 < FLAGS.mfu <= 1:
    raise app.UsageError(f"--mfu={FLAGS.mfu} must be in (0, 1]")
  # Nothing runs here: keep jax off any local accelerator (and so this process never starts a
  # TPU runtime the settings below could mislead).
  jax.config.update("jax_platforms", "cpu")
  config = FLAGS.config
  try:
    topology = topologies.parse_topology(FLAGS.topology, FLAGS.num_slices)
  except ValueError as e:
    sys.exit(f"bertjax.aot: {e}")
  mismatch = lock_mismatch()
  if mismatch:
    print(f"bertjax.aot: warning: the versions here are not {versions.LOCK}'s, which the TPU VMs "
          f"install: {'; '.join(mismatch)}. `python -m launch.tpu run --aot-report` will refuse "
          "this compile's report; pip install -r launch/requirements-tpu.lock", file=sys.stderr)
  hbm_gib = FLAGS.hbm_gib or topology.hbm_gib
  # Packed rows (data.packing) compile with S x M masked slots and S next-sentence pairs per row.
  seq_len, max_predictions, per_row = flops.rows_shape(DataConfig.from_config(config.data))
  vocab = int(config.model.vocab_size) or flops.DEFAULT_VOCAB_SIZE
  if not config.model.vocab_size:
    print(f"bertjax.aot: model.vocab_size is 0 (the tokenizer's); assuming {vocab} "
          "(--config.model.vocab_size=N to change)")
  try:
    devices = topology_devices(topology)
    training = train.from_config(config, devices=devices, vocab_size=vocab)
  except ValueError as e:  # the config's checks: batch, mesh or heads do not divide
    sys.exit(f"bertjax.aot: {e}")
  if FLAGS.check_cost_model:
    for case in roofline_lib.check_cost_model(devices):
      print(f"bertjax.aot: cost model, {json.dumps(case)}", flush=True)
  if FLAGS.roofline_layers:
    figures = shallow_roofline(config, training, topology, devices, vocab, seq_len,
                               max_predictions, per_row, hbm_gib)
    print_figures(figures)
    return
  print(f"bertjax.aot: compiling the train step for {topology} ({topology.libtpu_name}, "
        f"{topology.num_chips} chips), mesh {dict(training.mesh.shape)}", flush=True)
  start = time.perf_counter()
  try:
    compiled = compile_train_step(training, seq_len, max_predictions, per_row)
  except jax.errors.JaxRuntimeError as e:
    oom, vmem = xla_out_of_memory(e), vmem_message(e, topology, training)
    if oom is None and vmem is None:
      raise
    # XLA's TPU compiler refuses a program that overflows HBM even after rematerialising what it
    # can; its usable HBM is the chip's less the runtime's reserve.
    sys.exit("bertjax.aot: " + (vmem or (shortfall_message(
        topology, oom[0], hbm_gib, training, usable_bytes=oom[1]) + f" (XLA's TPU compiler: {e})")))
  compile_s = time.perf_counter() - start
  if FLAGS.dump_hlo:
    files.write_text(FLAGS.dump_hlo, compiled.as_text())
  memory = Memory.of(compiled)
  mc = training.model_config
  layers = roofline_lib.layer_figures(training, compiled, opaque_flops=attention.splash_flops)
  if layers["all_layers_counted_as"] == roofline_lib.BODY_ONCE and FLAGS.roofline:
    # A loop body that could not be costed alone: the same step with more layers per loop
    # iteration gives one layer's cost (layer_figures). Its memory is not what is checked.
    config.model.scan_unroll = layercost.second_unroll(mc.num_layers, mc.scan_unroll)
    print(f"bertjax.aot: compiling it again with scan_unroll={config.model.scan_unroll}, for "
          "the roofline (--noroofline skips)", flush=True)
    second = compile_train_step(
        train.from_config(config, devices=devices, vocab_size=vocab),
        seq_len, max_predictions, per_row)
    config.model.scan_unroll = training.model_config.scan_unroll
    layers = roofline_lib.layer_figures(training, compiled, second, attention.splash_flops)
  figures = report(topology, training, compiled, memory, compile_s, seq_len, max_predictions,
                   FLAGS.mfu, hbm_gib, layers,
                   roofline_lib.bytes_bound(training, seq_len, max_predictions, per_row))
  figures["sequences_per_row"] = per_row or 1  # max_predictions above is per row (S x M)
  print_figures(figures)
  need = memory.total
  if need > hbm_gib * GIB:
    sys.exit(f"bertjax.aot: {shortfall_message(topology, need, hbm_gib, training)}")
  print(f"bertjax.aot: fits, {need / GIB:.3g} of {hbm_gib:g} GiB per chip "
        f"({100 * figures['memory_fraction']:.0f}%)")


if __name__ == "__main__":
  define_flags()
  flags.mark_flags_as_required(["config", "topology"])
  cli.run(main)
