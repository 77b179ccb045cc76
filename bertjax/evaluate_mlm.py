"""Held-out MLM accuracy of pre-training runs on one common held-out set:
`python -m bertjax.evaluate_mlm --data_config=configs/tiny.py WORKDIR [WORKDIR ...]`.

Runs of different recipes (configs/tiny.py against configs/modern_tiny.py: another masking rate,
packing, no NSP) each score themselves on their own held-out batches; to compare them, each
workdir's model (its newest checkpoint, the shape recorded beside it) is scored here on the
held-out split of `--data_config`'s data section, masked with its preparation seed, so every
model sees the same sequences with the same masks (configs/tiny.py: 3,272 unpacked sequences,
15% masked). The vocabulary must be the same (the fingerprints are compared).
"""

from __future__ import annotations

import dataclasses
import json

import jax
from absl import app, flags

from bertjax import cli
from bertjax.configs import tiny
from bertjax.data import pipeline
from bertjax.data.config import DataConfig
from bertjax.errors import Refusal
from bertjax.pretrain import job as pretrain_job
from bertjax.training import checkpoint as checkpoint_lib, train
from bertjax.weights import reader as weights


def score(workdir: str, data: DataConfig, sequences: int = 0) -> dict:
  """MLM accuracy and loss of the workdir's newest checkpoint on the first `sequences` (0: all) of
  `data`'s held-out split, in batches of configs/tiny.py's 8."""
  source = weights.inspect(workdir, what="workdir")
  config = tiny.get_config()  # its model, train and mesh sections; `data` is the data
  tok, manifest = pretrain_job.prepare_data(data)
  if source.fingerprint and source.fingerprint != manifest["settings"]["tokenizer_fingerprint"]:
    raise Refusal(f"{workdir} was trained with another vocabulary than --data_config's.")
  for key, value in dataclasses.asdict(source.config).items():
    if key in config.model:
      config.model[key] = value
  training = train.from_config(config, devices=jax.devices()[:1])
  like = checkpoint_lib.abstract_like(training.abstract_state.params)
  params = weights.read(source, like={k: like[k] for k in like if k in source.subtrees})
  state = training.init_state(jax.random.key(0))
  state = state.replace(params={**state.params, **params})
  batches = pretrain_job.model_batches(
      pipeline.make_pipeline(data, tok, split="eval", seed=data.prepare_seed,
                             global_batch_size=training.train_config.batch_size),
      data.nsp)
  out = pretrain_job.evaluate(training, state, batches, sequences)
  return {"workdir": workdir, "step": source.step, "mlm_accuracy": float(out["mlm_accuracy"]),
          "mlm_loss": float(out["mlm_loss"]), "sequences": int(out.get("num_sequences", 0))}


def main(argv) -> None:
  if len(argv) < 2:
    raise app.UsageError("name the workdirs to score: WORKDIR [WORKDIR ...]")
  data = DataConfig.from_config(flags.FLAGS.data_config.data)
  for workdir in argv[1:]:
    print(json.dumps(cli.explained(score, workdir, data, flags.FLAGS.sequences)), flush=True)


if __name__ == "__main__":
  cli.define_config_flag("The config whose data section gives the held-out split (overrides: "
                         "--data_config.data.KEY=...).", name="data_config",
                         default="configs/tiny.py")
  flags.DEFINE_integer("sequences", 0, "Held-out sequences scored (0: all).", lower_bound=0)
  cli.run(main)
