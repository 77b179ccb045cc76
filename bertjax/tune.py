"""The best settings of a config for a Cloud TPU slice, found by compiling on a machine without one.

    python -m bertjax.tune --config=configs/bert_large.py:phase=2 --topology=v6e-8
    python -m bertjax.tune --config=bert_base --topology=v5p-8 --write_config=base_v5p.py

From the config as it is, one setting at a time, each candidate's train step is compiled for the
slice by libtpu's compile-only client (as `python -m bertjax.aot`) and its roofline read with every
layer counted and HBM's bytes alone (bertjax/perf/roofline.py); the best of each setting is kept before
the next is tried (a greedy search: the settings interact little, and a full grid of them would
take hours to compile on a laptop):

  mesh       the state replicated on every chip (data) or split over them (fsdp);
  remat      what the backward keeps: none, dots, dots_all, full, dots_kernels, dots_outputs
             (bertjax/model/config.py);
  attention  XLA's, the splash kernel or the fused one (TPU, lengths a multiple of 128; fused up
             to 1,024); splash has no dropout on attention probabilities, so it changes the
             model, and the table says so;
  rows       rows a chip doubled and quadrupled (what does not fit HBM is said): the global
             batch grows, which changes the recipe (its learning rate is yours to set), and the
             table says so;
  layers     scanned (one compiled layer) or straight code;
  mlp        (asked for by name: --dimensions=...,mlp) XLA's MLP or the fused Pallas kernels
             (bertjax/model/kernels/mlp_kernel.py), the intermediate made again in the backward
             ("pallas") or kept for it ("pallas_kept"); under remat "none" also XLA's keeping
             the pre-activation alone ("xla_remade"); all of them where the config says "auto"
             (one of them is what "auto" gives the slice, the table shows which);
  qkv        (asked for by name) q, k and v as three products or one (x @ [Wq Wk Wv], the same
             parameters): the one "auto" does not give the slice, or both.

A scanned candidate is compiled whole, once: its roofline counts every iteration of its layer
loop and its memory is the step's own. A straight one is compiled at 1 and 2 layers and
extrapolated (`bertjax.aot --roofline_layers`' count), and compiled whole if it wins, for its
memory, beside the config as given and the next extrapolated candidates (`whole_batch`);
where a setting has fewer candidates than --jobs (the layers, tried last), a straight one is
compiled whole at once on the core that would wait. A setting that "auto"
already gives the slice's chips (the remat policy, the MLP) is not compiled a second time. A
candidate that does not fit HBM, or that the config cannot take, is listed with the reason.
Prints the ranked table (roofline MFU, HBM GB a step, memory GiB, compile s), then the winner's
flags; --write_config=PATH writes them as a config file.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import multiprocessing.connection
import os
import sys
import time
import types

import jax
from absl import flags

import bertjax.configs as released_configs
from bertjax import aot, cli
from bertjax.data.config import DataConfig
from bertjax.errors import Refusal
from bertjax.model import attention
from bertjax.model.kernels import mlp_choice
from bertjax.model.config import chosen_qkv, chosen_remat
from bertjax.parallel import topologies
from bertjax.perf import roofline
from bertjax.training import flops, train

DIMENSIONS = ("mesh", "remat", "attention", "rows", "layers")
# Searched when named: mlp_impl and qkv_product "auto" already take, per chip, what compiling
# found faster.
OPTIONAL_DIMENSIONS = ("mlp", "qkv")
REMAT = ("none", "dots", "dots_all", "full", "dots_kernels", "dots_outputs")
# The mesh's two layouts of the state over a slice's chips (DCN axes as the config sets them).
MESHES = {"data": {"mesh.ici_data": -1, "mesh.ici_fsdp": 1},
          "fsdp": {"mesh.ici_data": 1, "mesh.ici_fsdp": -1}}


@dataclasses.dataclass
class Result:
  """One compiled candidate: the settings it changes from the config, and what they give."""

  changes: dict  # config key -> value, against the config as given
  roofline_mfu: float | None = None
  hbm_gb: float | None = None  # HBM bytes a chip a step
  memory_gib: float | None = None  # None: not compiled whole (extrapolated)
  fits: bool | None = None
  compile_s: float = 0.0
  note: str = ""  # why not possible; what it changes besides speed

  @property
  def ok(self) -> bool:
    return self.roofline_mfu is not None and self.fits is not False


def apply(config, changes: dict):
  """A copy of the config with `changes` ({"model.remat_policy": "dots", ...}) set."""
  out = config.copy_and_resolve_references()
  for key, value in changes.items():
    section, name = key.split(".", 1)
    with out[section].unlocked():
      out[section][name] = value
  return out


def candidates(dimension: str, config, best: dict, device_kind: str = "") -> list[dict]:
  """The changes to try for one setting, each on top of `best` (the winner so far). On a slice
  of `device_kind`'s chips, a setting that "auto" already gives there is not tried again: it
  would compile the same program as the candidate it is (the remat policy, the MLP)."""
  current = apply(config, best)
  chip = types.SimpleNamespace(platform="tpu", device_kind=device_kind)
  if dimension == "mesh":
    fsdp = current.mesh.ici_fsdp != 1
    return [{**best, **MESHES["data" if fsdp else "fsdp"]}]
  if dimension == "remat":
    now = current.model.remat_policy
    same = {now, chosen_remat(now, chip) if device_kind else now}
    return [{**best, "model.remat_policy": p} for p in REMAT if p not in same]
  if dimension == "attention":
    # The splash kernel without attention dropout; the fused kernel with the config's.
    tries = [{"model.attention_impl": "splash", "model.attention_dropout": 0.0},
             {"model.attention_impl": "fused"}]
    now = {"auto": "fused"}.get(current.model.attention_impl, current.model.attention_impl)
    return [{**best, **t} for t in tries if t["model.attention_impl"] != now]
  if dimension == "rows":
    return [{**best, "train.batch_size": current.train.batch_size * k} for k in (2, 4)]
  if dimension == "layers":
    return [{**best, "model.scan_layers": not current.model.scan_layers}]
  if dimension == "mlp":
    now = current.model.mlp_impl
    if device_kind:
      now = mlp_choice.chosen(current.model, chip, current.mesh.ici_tensor)
    # "xla_remade" differs from "xla" only where nothing is rematerialised.
    remade = ("xla_remade",) if chosen_remat(current.model.remat_policy, chip) == "none" else ()
    return [{**best, "model.mlp_impl": impl}
            for impl in ("xla",) + remade + ("pallas", "pallas_kept")
            if impl not in (now, current.model.mlp_impl)]
  if dimension == "qkv":
    now = current.model.qkv_product
    if device_kind:
      now = chosen_qkv(now, chip)
    return [{**best, "model.qkv_product": p} for p in ("three", "one")
            if p not in (now, current.model.qkv_product)]
  raise Refusal(f"--dimensions: unknown setting {dimension!r}; choose from "
                f"{', '.join(DIMENSIONS + OPTIONAL_DIMENSIONS)}")


def note(changes: dict, config) -> str:
  """What a candidate changes besides the speed of the step."""
  said = []
  if changes.get("model.attention_impl") == "splash" and config.model.attention_dropout:
    said.append(f"no attention dropout (was {config.model.attention_dropout})")
  if changes.get("train.batch_size", config.train.batch_size) != config.train.batch_size:
    said.append(f"global batch {changes['train.batch_size']} (was {config.train.batch_size}): "
                "set its learning rate")
  return "; ".join(said)


def evaluate(config, changes: dict, devices, num_chips: int, hbm_gib: float,
             whole: bool = False) -> Result:
  """Compile one candidate and read its roofline and memory. `whole`: compile a straight
  candidate at full depth too (for its memory)."""
  result = Result(changes, note=note(changes, config))
  cfg = apply(config, changes)
  vocab = int(cfg.model.vocab_size) or flops.DEFAULT_VOCAB_SIZE
  seq_len, max_predictions, per_row = flops.rows_shape(DataConfig.from_config(cfg.data))
  start = time.perf_counter()
  try:
    training = train.from_config(cfg, devices=devices, vocab_size=vocab)
    mc = training.model_config
    model_flops = flops.train_flops(mc, cfg.train.batch_size, seq_len, max_predictions)
    shapes = (seq_len, max_predictions, per_row)
    if mc.scan_layers or whole:
      compiled = aot.compile_train_step(training, *shapes)
      layers = roofline.layer_figures(training, compiled, opaque_flops=attention.splash_flops)
      result.memory_gib = aot.Memory.of(compiled).total / aot.GIB
      result.fits = result.memory_gib <= hbm_gib
    else:
      shallow, deeper = (aot.compile_at_depth(cfg, devices, vocab, *shapes, n) for n in (1, 2))
      layers = roofline.extrapolated_layer_figures(training, shallow, deeper, 1,
                                                   attention.splash_flops)
  except jax.errors.JaxRuntimeError as e:
    oom = aot.xla_out_of_memory(e)
    if oom is None:
      raise
    result.fits, result.memory_gib = False, oom[0] / aot.GIB
    result.note = "; ".join(filter(None, [result.note, "does not fit HBM"]))
    return result
  except (Refusal, ValueError) as e:  # the config cannot take it (a batch, a length, a kernel)
    result.note = f"not possible: {str(e).splitlines()[0]}"
    return result
  finally:
    result.compile_s = time.perf_counter() - start
  device_kind = devices[0].device_kind
  roof = roofline.step_roofline(layers, model_flops / num_chips, flops.peak_tflops(device_kind),
                                flops.hbm_gbps(device_kind))
  result.roofline_mfu = roof["roofline_mfu"]
  result.hbm_gb = layers.get("hbm_gb_per_chip_all_layers", layers["xla_gb_per_chip_all_layers"])
  return result


def _compile_one(conn, config, changes: dict, topology_name: str, whole: bool) -> None:
  """A candidate compiled in a process of its own (`compile_all`), its Result sent back."""
  jax.config.update("jax_platforms", "cpu")
  try:
    topology = topologies.parse_topology(topology_name)
    devices = aot.topology_devices(topology)
    conn.send(evaluate(config, changes, devices, topology.num_chips, topology.hbm_gib, whole))
  except Exception as e:  # pylint: disable=broad-except  # one candidate's failure ends no search
    first = str(e).splitlines()[0] if str(e) else ""
    conn.send(Result(changes, note=f"failed: {type(e).__name__}: {first}"[:300]))
  conn.close()


def compile_all(config, all_changes: list[dict], topology_name: str, jobs: int,
                whole: bool | list[bool] = False, say=print, target=None) -> list[Result]:
  """`evaluate` each candidate in a process of its own, `jobs` at a time: XLA's compile of one
  program runs mostly on one core, and a compiler that crashes on one (libtpu 0.0.42 overflows
  its stack on some steps at length 512) takes only its own process with it. `whole`: for every
  candidate, or one flag each. `target`: what each process runs (`_compile_one`)."""
  wholes = whole if isinstance(whole, list) else [whole] * len(all_changes)
  context = multiprocessing.get_context("spawn")
  waiting, running, results = list(enumerate(all_changes)), {}, [None] * len(all_changes)
  while waiting or running:
    while waiting and len(running) < jobs:
      index, changes = waiting.pop(0)
      receive, send = context.Pipe(duplex=False)
      process = context.Process(target=target or _compile_one,
                                args=(send, config, changes, topology_name, wholes[index]))
      process.start()
      send.close()
      running[index] = (process, receive, time.perf_counter())
    multiprocessing.connection.wait([r[1] for r in running.values()])
    for index, (process, receive, start) in list(running.items()):
      if not receive.poll():
        continue
      try:
        results[index] = receive.recv()
      except EOFError:  # the process ended without a result
        process.join()
        code = process.exitcode
        # Killed by a signal: the compiler crashed (libtpu's stack overflow). An exit status: the
        # process failed otherwise (an import, memory), and printed why above.
        note = (f"the compiler crashed (signal {-code})" if code is not None and code < 0 else
                f"the candidate's process ended without a result (exit {code}): its output above "
                "says why")
        results[index] = Result(all_changes[index], compile_s=time.perf_counter() - start,
                                note=note)
      process.join()
      del running[index]
      say(line(results[index]))
  return results


def at_once_whole(config, batch: list[dict], jobs: int) -> list[bool]:
  """Which of `batch`'s candidates compile whole at once: straight ones, while fewer candidates
  than `jobs` leave a core free. Compiled at 1 and 2 layers, a straight candidate that wins is
  compiled whole after the search, alone (settle_winner); compiled whole here, on a core that
  would wait, it needs no second compile, and its row counts every layer and says the memory."""
  spare = jobs - len(batch)
  out = []
  for changes in batch:
    out.append(spare > 0 and not apply(config, changes).model.scan_layers)
    spare -= out[-1]
  return out


def search(config, topology_name: str, dimensions, budget_s: float, jobs: int = 1,
           say=print) -> list[Result]:
  """The greedy search: the config as it is, then each setting's candidates (compiled `jobs` at
  a time) on top of the best so far; stops starting new settings once `budget_s` is spent.
  Every result, in the order tried."""
  start = time.perf_counter()
  results, best = [], None
  kind = topologies.parse_topology(topology_name).slice_type.generation.device_kind
  for position, dimension in enumerate(dimensions):
    batch = ([] if best else [{}]) + candidates(dimension, config,
                                                best.changes if best else {}, kind)
    found = compile_all(config, batch, topology_name, jobs, at_once_whole(config, batch, jobs),
                        say=say)
    results += found
    for result in found:
      if result.ok and (best is None or not best.ok or result.roofline_mfu > best.roofline_mfu):
        best = result
    best = best or found[0]
    if time.perf_counter() - start > budget_s and position + 1 < len(dimensions):
      say(f"bertjax.tune: --budget_s={budget_s:g} spent; not tried: "
          f"{', '.join(dimensions[position + 1:])}")
      break
  return results


def label(changes: dict) -> str:
  return ", ".join(f"{k.split('.', 1)[1]}={v}" for k, v in changes.items()) or "(as given)"


def line(result: Result) -> str:
  mfu = "-" if result.roofline_mfu is None else f"{result.roofline_mfu:.3f}"
  hbm = "-" if result.hbm_gb is None else f"{result.hbm_gb:.3g}"
  memory = "extrapolated" if result.memory_gib is None else f"{result.memory_gib:.3g}"
  return (f"{mfu:>6}  {hbm:>7}  {memory:>12}  {result.compile_s:7.0f}  {label(result.changes)}"
          + (f"  [{result.note}]" if result.note else ""))


def ranked(results: list[Result]) -> list[Result]:
  """Candidates that compiled and fit first, by roofline MFU; then the rest as tried."""
  good = sorted((r for r in results if r.ok), key=lambda r: -r.roofline_mfu)
  return good + [r for r in results if not r.ok]


def flags_of(changes: dict) -> str:
  return " ".join(f"--config.{key}={value}" for key, value in changes.items())


def config_file(source: str, arg: str, changes: dict, topology: str, result: Result,
                baseline: Result) -> str:
  """A config file that is `source` (a released config's name, or a file's path) with the
  winner's changes, its docstring saying where they came from."""
  name = os.path.splitext(os.path.basename(source))[0]
  released_folder = os.path.realpath(os.path.dirname(released_configs.__file__))
  if os.path.realpath(os.path.dirname(os.path.abspath(source))) == released_folder:
    load = f"from bertjax.configs import {name}\n\n\ndef _source():\n  return {name}"
  else:
    load = ("import importlib.util\n\n\ndef _source():\n"
            f"  spec = importlib.util.spec_from_file_location('tuned_source', "
            f"{os.path.abspath(source)!r})\n"
            "  module = importlib.util.module_from_spec(spec)\n"
            "  spec.loader.exec_module(module)\n  return module")
  call = f"get_config({arg!r})" if arg else "get_config()"
  sets = "\n".join(f"  config.{k} = {v!r}" for k, v in changes.items()) or "  pass"
  return (f'"""{source}{":" + arg if arg else ""} as `python -m bertjax.tune` found it best for '
          f"{topology}:\nroofline MFU {result.roofline_mfu:.3f} (as given "
          f"{baseline.roofline_mfu or 0:.3f}), every layer counted, HBM bytes alone."
          + (f"\nIt changes: {result.note}." if result.note else "") + '\n"""\n\n'
          f"{load}\n\n\ndef get_config():\n  config = _source().{call}\n{sets}\n"
          "  return config\n")


FLAGS = flags.FLAGS


def define_flags() -> None:
  cli.define_config_flag()
  flags.DEFINE_string("topology", None, "Cloud TPU accelerator type, e.g. v6e-8, v5p-8.")
  flags.DEFINE_list("dimensions", list(DIMENSIONS), "The settings to search, in this order.")
  flags.DEFINE_float("budget_s", 1800, "Start no new setting after this many seconds.")
  flags.DEFINE_integer("jobs", min(4, os.cpu_count() or 1), "Candidates compiled at a time, "
                       "each in a process of its own (a compile runs mostly on one core).")
  flags.DEFINE_string("write_config", "", "Write the winner as a config file here.")
  flags.DEFINE_string("json", "", "Also write every result to this file.")


def whole_batch(results: list[Result], jobs: int) -> list[Result]:
  """What settle_winner compiles whole at once: the winner (extrapolated), the config as given
  where it is extrapolated too (the final line compares the two), then the next extrapolated
  candidates by rank while cores are spare. A figure from 1 and 2 layers can miss what XLA does
  at full depth (BERT-Large L 128 on v6e-8, straight, remat "none": 0.937 extrapolated, 0.979
  whole), so the top of the table compares whole compiles."""
  extrapolated = [r for r in ranked(results) if r.ok and r.memory_gib is None]
  given = [r for r in extrapolated[1:] if not r.changes]
  rest = [r for r in extrapolated[1:] if r.changes]
  return (extrapolated[:1] + given + rest)[:max(jobs, 1 + len(given))]


def settle_winner(config, topology: str, results: list[Result], say=print, jobs: int = 1):
  """The best result and the results, a straight winner compiled whole (its memory needs the
  whole step) with whole_batch's others: each whole compile takes the place of its extrapolated
  row, and if the winner no longer wins, the next is settled the same way."""
  while True:
    winner = ranked(results)[0]
    if not winner.ok:
      raise Refusal(f"no candidate compiled and fit {topology}: see the reasons above")
    if winner.memory_gib is not None:
      return winner, results
    batch = whole_batch(results, jobs)
    say("bertjax.tune: compiling the winner whole, for its memory"
        + (f", and beside it {', '.join(label(r.changes) for r in batch[1:])}"
           if len(batch) > 1 else ""))
    whole = compile_all(config, [r.changes for r in batch], topology, jobs, whole=True, say=say)
    replaced = dict(zip(map(id, batch), whole))
    results = [replaced.get(id(r), r) for r in results]  # in place: results[0] is as given


def main(argv):
  del argv
  jax.config.update("jax_platforms", "cpu")  # nothing runs here; libtpu compiles only
  topology = topologies.parse_topology(FLAGS.topology)
  config = FLAGS.config
  say = lambda text: print(text, flush=True)
  say(f"bertjax.tune: {topology} ({topology.num_chips} chips, {topology.hbm_gib:g} GiB HBM "
      f"each), {FLAGS.jobs} compiles at a time; columns: roofline MFU, HBM GB a chip a step, "
      "memory GiB, compile s, changes")
  results = search(config, str(topology), FLAGS.dimensions, FLAGS.budget_s, FLAGS.jobs, say)
  winner, results = settle_winner(config, str(topology), results, say, FLAGS.jobs)
  say("\nbertjax.tune: ranked")
  for rank, result in enumerate(ranked(results), 1):
    say(f"{rank:>3}. {line(result)}")
  say(f"\nbertjax.tune: best for {topology}: {label(winner.changes)}"
      f" (roofline MFU {winner.roofline_mfu:.3f}, as given {results[0].roofline_mfu})")
  say(f"bertjax.tune: flags: {flags_of(winner.changes) or '(none: the config as given)'}")
  source, _, arg = FLAGS["config"].config_filename.partition(":")
  if FLAGS.write_config:
    # The command line's own --config.KEY=VALUE first: the search started from them.
    given = {key: config[key.split(".", 1)[0]][key.split(".", 1)[1]]
             for key in (a[len("--config."):].split("=", 1)[0] for a in sys.argv[1:]
                         if a.startswith("--config.")) if "." in key}
    with open(FLAGS.write_config, "w") as f:
      f.write(config_file(source, arg, {**given, **winner.changes}, str(topology), winner,
                          results[0]))
    say(f"bertjax.tune: wrote {FLAGS.write_config}")
  if FLAGS.json:
    with open(FLAGS.json, "w") as f:
      json.dump([dataclasses.asdict(r) for r in results], f, indent=1)


if __name__ == "__main__":
  define_flags()
  flags.mark_flags_as_required(["config", "topology"])
  cli.run(main)
