"""bertjax's train step side by side with Hugging Face's FlaxBertForPreTraining, in one process.

    python -m bertjax.benchmark hf --config=configs/bert_base.py --config.train.batch_size=8 \
        --config.data.max_seq_length=128 --steps=3

Same model shape, dropout, batch, sequence length and masking density (M = max_predictions_per_seq
masked tokens per row), same optimizer (bertjax's AdamW chain) and one device each. The steps of the
two are interleaved so that background load hits both alike. Hugging Face's step is written as its
`run_mlm_flax` example trains: logits at every position ([B, L, V]), cross-entropy weighted by a
[B, L] mask of the masked positions, plus the NSP loss. bertjax projects only the M masked positions.

This module imports transformers (and whatever it pulls in); `bertjax.benchmark` does not.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import flags

from bertjax import cli
from bertjax.benchmark import train as benchmark
from bertjax.data.config import DataConfig
from bertjax.model.config import BertConfig
from bertjax.parallel import hostmem
from bertjax.training import flops, optimizer as optimizer_lib

FLAGS = flags.FLAGS


def hf_model(cfg: BertConfig, seed: int = 0):
  """FlaxBertForPreTraining with the same shape, activation, dropout and dtype as `cfg`."""
  from transformers import BertConfig as HfBertConfig, FlaxBertForPreTraining
  act = {"gelu": "gelu", "gelu_tanh": "gelu_new"}[cfg.hidden_act]
  hf_cfg = HfBertConfig(
      vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
      num_attention_heads=cfg.num_heads, intermediate_size=cfg.intermediate_size,
      max_position_embeddings=cfg.max_position_embeddings, type_vocab_size=cfg.type_vocab_size,
      hidden_dropout_prob=cfg.hidden_dropout, attention_probs_dropout_prob=cfg.attention_dropout,
      initializer_range=cfg.initializer_range, layer_norm_eps=cfg.layer_norm_eps, hidden_act=act)
  return FlaxBertForPreTraining(hf_cfg, seed=seed, dtype=jnp.dtype(cfg.dtype))


def dense_labels(batch: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
  """[B, L] labels and weights (0 where nothing is predicted), as Hugging Face's collator makes."""
  b, length = batch["input_ids"].shape
  labels = np.zeros((b, length), np.int32)
  weights = np.zeros((b, length), np.float32)
  rows = np.arange(b)[:, None]
  labels[rows, batch["masked_lm_positions"]] = batch["masked_lm_ids"]
  weights[rows, batch["masked_lm_positions"]] = batch["masked_lm_weights"]
  return labels, weights


class HfStepRunner:
  """Hugging Face's pre-training step, jitted on one device, on the same synthetic batch."""

  def __init__(self, cfg: BertConfig, train_config, host_batch: dict[str, np.ndarray], seed=0):
    model = hf_model(cfg, seed)
    tx, _ = optimizer_lib.create_optimizer(train_config)
    labels, weights = dense_labels(host_batch)
    self.batch = {k: jnp.asarray(v) for k, v in host_batch.items()}
    self.batch.update(labels=jnp.asarray(labels), label_weights=jnp.asarray(weights))
    self.rng = jax.random.PRNGKey(seed)
    self.params, self.opt_state = model.params, tx.init(model.params)
    self.step_count = jnp.zeros([], jnp.int32)

    def step(params, opt_state, batch, rng, step_count):
      def loss_fn(p):
        out = model(batch["input_ids"], batch["input_mask"], batch["segment_ids"], params=p,
                    dropout_rng=jax.random.fold_in(rng, step_count), train=True)
        xent_BxL = optax.softmax_cross_entropy_with_integer_labels(
            out.prediction_logits.astype(jnp.float32), batch["labels"])
        mlm = jnp.sum(xent_BxL * batch["label_weights"]) / jnp.sum(batch["label_weights"])
        nsp = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(
            out.seq_relationship_logits.astype(jnp.float32), batch["next_sentence_labels"]))
        return mlm + nsp
      loss, grads = jax.value_and_grad(loss_fn)(params)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss, step_count + 1

    start = time.perf_counter()
    self.compiled = jax.jit(step, donate_argnums=(0, 1)).lower(
        self.params, self.opt_state, self.batch, self.rng, self.step_count).compile()
    self.compile_seconds = time.perf_counter() - start

  def step(self):
    self.params, self.opt_state, loss, self.step_count = self.compiled(
        self.params, self.opt_state, self.batch, self.rng, self.step_count)
    jax.block_until_ready(loss)
    return loss


def main(argv):
  del argv
  config = FLAGS.config
  # One sequence per row for both, packing or not: Hugging Face's model cannot read packed rows.
  seq_len, max_predictions = flops.sequence_shape(DataConfig.from_config(config.data))
  devices = jax.local_devices()[:1]
  ours = benchmark.StepRunner(config, seq_len, max_predictions, devices=devices)
  host = benchmark.synthetic_batch(ours.batch_size, seq_len, max_predictions,
                                   ours.cfg.vocab_size)
  theirs = HfStepRunner(ours.cfg, ours.training.train_config, host, ours.training.train_config.seed)
  for _ in range(FLAGS.warmup_steps):
    ours.step(), theirs.step()
  ours_times, theirs_times = [], []
  for _ in range(FLAGS.steps):  # interleaved: background load hits both alike
    ours_times += benchmark.time_steps(ours.step, 1)
    theirs_times += benchmark.time_steps(theirs.step, 1)
  figures = benchmark.report(ours, ours_times)
  hf_step_s = statistics.median(theirs_times)
  figures.update({
      "hf_compile_s": round(theirs.compile_seconds, 2),
      "hf_step_s": round(hf_step_s, 4),
      "hf_step_s_min": round(min(theirs_times), 4),
      "hf_sequences_per_s": round(ours.batch_size / hf_step_s, 2),
      "hf_xla_tflop_per_step": round((benchmark.xla_flops(theirs.compiled) or 0) / 1e12, 4),
      "speedup_vs_hf": round(hf_step_s / figures["step_s"], 3),  # medians
      "speedup_vs_hf_min": round(min(theirs_times) / min(ours_times), 3),  # least disturbed
  })
  benchmark.print_report(figures)


if __name__ == "__main__":
  hostmem.restart_with_huge_pages()
  benchmark.define_flags()
  cli.run(main)
