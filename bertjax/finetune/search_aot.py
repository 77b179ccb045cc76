"""How many fine-tuning trials of a search fit on a TPU chip, from ahead-of-time compiles on a
machine without a TPU (libtpu's compile-only client, as `python -m bertjax.aot`):

    python -m bertjax.finetune.search_aot --config=configs/bert_base.py --topology=v5p-8 \
        --batch_size=32 --seq_len=128

Compiles the trials' program (bertjax/finetune/job/trials.py: a classification head, bfloat16
matmuls as the config says) for T = chips x 1, 2, 4, ... trials, the trial axis over the chips,
and prints each one's memory per chip from XLA's buffer assignment against the chip's HBM, until
one does not fit: the last that fits is the answer, per chip.

With --run, the step of one fine-tuning run instead (bertjax.finetune's program: train.build
with a classification head, the batch of --batch_size rows over the slice's chips, the config's
mesh, microbatches and remat), and its memory per chip; e.g. ModernBERT-base at 8,192 tokens
(docs/modern.md):

    python -m bertjax.finetune.search_aot --config=configs/modern_base.py:phase=2 \
        --topology=v5p-8 --run --batch_size=32 --seq_len=8192
"""

from __future__ import annotations

import sys

import jax
from absl import app, flags

from bertjax import aot, cli
from bertjax.finetune.families import classification
from bertjax.finetune.job import trials as trials_lib
from bertjax.model.config import BertConfig
from bertjax.parallel import sharding, topologies
from bertjax.training import train

GIB = 2**30


def compile_trials(model_config: BertConfig, devices, num_trials: int, batch_size: int,
                   seq_len: int, vectorize: bool | None = None):
  """The compiled program of `num_trials` trials on a mesh of `devices` (one data axis); the
  trials side by side on an accelerator's devices (trials.build's `vectorize`)."""
  mesh = jax.sharding.Mesh(devices, ("data",))
  base = train.TrainConfig(batch_size=batch_size, num_train_steps=100, warmup_steps=10,
                           learning_rate=2e-5)
  trials = [trials_lib.Trial(k, 2e-5, 3.0, 0.1, 0.01, k, batch_size) for k in range(num_trials)]
  training = trials_lib.build(model_config, base, trials, 33, mesh, classification.objective_of(2),
                              vectorize)
  one = classification.objective_of(2).dummy_batch(1)  # [1, L] tokens, [1] per-row features
  batch = {k: jax.ShapeDtypeStruct((num_trials, batch_size) + ((seq_len,) if v.ndim == 2 else ()),
                                   v.dtype, sharding=training.batch_sharding)
           for k, v in one.items()}
  key = jax.ShapeDtypeStruct((2,), jax.numpy.uint32,
                             sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
  return training.train_step.lower(training.abstract_state, batch, key).compile()


def compile_run(config, model_config: BertConfig, devices, batch_size: int, seq_len: int):
  """The compiled step of one fine-tuning run (a two-label classification head) of `batch_size`
  rows of `seq_len` tokens over `devices`, with the config's mesh and train settings."""
  t = config.train
  base = train.TrainConfig(batch_size=batch_size, num_train_steps=100, warmup_steps=10,
                           learning_rate=2e-5, num_microbatches=t.num_microbatches,
                           weight_decay=0.01)
  objective = classification.objective_of(2)
  training = train.build(model_config, base, sharding.MeshConfig.from_dict(config.mesh),
                         devices, objective)
  one = objective.dummy_batch(1)
  batch = {k: jax.ShapeDtypeStruct((batch_size,) + ((seq_len,) if v.ndim == 2 else ()), v.dtype,
                                   sharding=training.batch_sharding) for k, v in one.items()}
  key = jax.eval_shape(jax.random.PRNGKey, 0)
  key = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=sharding.replicated(training.mesh))
  return training.train_step.lower(training.abstract_state, batch, key).compile()


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  args = flags.FLAGS
  topology = topologies.parse_topology(args.topology)
  devices = aot.topology_devices(topology)
  model_config = BertConfig.from_dict(args.config.model,
                                      vocab_size=args.config.model.vocab_size or args.vocab_size)
  hbm = topology.slice_type.generation.hbm_gib * GIB
  if args.run:
    memory = aot.Memory.of(compile_run(args.config, model_config, devices, args.batch_size,
                                       args.seq_len))
    ok = memory.total <= hbm
    print(f"{topology.name}: one fine-tuning run, batch {args.batch_size} x {args.seq_len} over "
          f"{len(devices)} chips ({model_config.task_head} head, {model_config.attention_impl} "
          f"attention, remat {model_config.remat_policy}): {memory.total / GIB:.2f} GiB of "
          f"{hbm / GIB:.0f} GiB HBM per chip (arguments {memory.arguments / GIB:.2f}, "
          f"temporaries {memory.temporaries / GIB:.2f}) {'fits' if ok else 'does not fit'}")
    sys.exit(0 if ok else 1)
  chips, fits = len(devices), 0
  per_chip = 1
  while per_chip <= args.max_per_chip:
    num = chips * per_chip
    try:
      memory = aot.Memory.of(compile_trials(model_config, devices, num, args.batch_size,
                                            args.seq_len))
      need = memory.total
    except Exception as err:  # pylint: disable=broad-except
      found = aot.xla_out_of_memory(err)
      if found is None:
        raise
      need = found[0]
    ok = need <= hbm
    print(f"{per_chip:3d} trial(s) per chip ({num} on {chips} chips): {need / GIB:6.2f} GiB of "
          f"{hbm / GIB:.0f} GiB HBM per chip {'fits' if ok else 'does not fit'}", flush=True)
    if not ok:
      break
    fits = per_chip
    per_chip *= 2
  print(f"{topology.name}: {fits} trial(s) of batch {args.batch_size} x {args.seq_len} per chip "
        f"fit (tried powers of 2 up to {args.max_per_chip})")
  sys.exit(0 if fits else 1)


if __name__ == "__main__":
  cli.define_config_flag()
  flags.DEFINE_string("topology", "v5p-8", "A Cloud TPU slice (bertjax.parallel.topologies).")
  flags.DEFINE_integer("batch_size", 32, "Each trial's batch.")
  flags.DEFINE_integer("seq_len", 128, "Tokens per row.")
  flags.DEFINE_integer("max_per_chip", 64, "The most trials per chip tried.")
  flags.DEFINE_integer("vocab_size", 30522, "Where the config leaves it 0 (the released BERT's).")
  flags.DEFINE_bool("run", False, "One fine-tuning run's step (its batch over the chips), not "
                    "trials.")
  cli.run(main)
