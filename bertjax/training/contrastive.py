"""The bi-encoder (bertjax/model/contrastive.py) as a `train.Objective`: its batch, its loss over the
global batch and its chunked gradient.

A batch (numpy, rows split over the batch's devices as any other):
  query_ids, query_mask      [Q, L]      a query per row
  passage_ids, passage_mask  [Q, C, L']  its positive first, then C - 1 hard negatives (an
                                         all-zero mask: none in that slot)
  passage_key                [Q, C]      optional: an id per distinct passage text (0: none), so
                                         a copy of a query's positive is no negative of it
  weight                     [Q]         1 for a real row, 0 for one that pads the batch

A batch of texts alone (input_ids, input_mask [N, L]: what evaluation and prediction encode,
queries and passages alike) gives their vectors, the outputs' "vector" [N, D].

One step sees every passage of the global batch as a negative of every query (bertjax/
contrastive.py says how, on any mesh). With `config.train.num_microbatches` k > 1 the batch is
encoded k chunks at a time and still scored as one (GradCache, bertjax/training/gradcache.py): k bounds
the encoder's activations, as it does for a per-row loss, and the negatives stay the whole batch.
Chunk c's dropout key is the one microbatch c would have, fold_in(step key, c); with k = 1 the
step is train_step's own.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from bertjax.model import contrastive, losses
from bertjax.model.contrastive import BiEncoder, ContrastiveConfig
from bertjax.parallel import sharding
from bertjax.training import gradcache, train

INPUTS = ("query_ids", "query_mask", "passage_ids", "passage_mask")
KEY = "passage_key"
BATCH_KEYS = INPUTS + (KEY, "weight")
TERM = "contrastive_loss"
# The encoder's tanh pooler, which neither pooling reads: kept as it starts (train.Objective's
# `frozen`), as sentence-transformers' PyTorch training leaves it (an optimizer step skips a
# weight without a gradient), rather than decayed towards 0 by AdamW; an export then holds the
# pre-trained pooler, a whole BertModel that any reader loads without a warning.
FROZEN = (("bert", "pooler"),)


def inputs(batch) -> dict:
  """The bi-encoder's arguments: queries and passages, or texts alone (BiEncoder's docstring)."""
  if INPUTS[0] not in batch:
    return {"query_ids": batch["input_ids"], "query_mask": batch["input_mask"]}
  return {name: batch[name] for name in INPUTS}


def outputs(out) -> dict:
  return {"vector": out["query"]}


def _metrics(out, batch, settings: ContrastiveConfig):
  return contrastive.metrics(out, batch["passage_mask"], batch["weight"], settings,
                             batch.get(KEY))


def dummy_batch(batch_size: int, query_length: int = 8, passage_length: int = 8,
                passages: int = 1) -> dict:
  """Zeros of a batch (for init and shapes): the parameters do not depend on the lengths or C."""
  ints = lambda *shape: np.zeros(shape, np.int32)
  return {"query_ids": ints(batch_size, query_length),
          "query_mask": ints(batch_size, query_length),
          "passage_ids": ints(batch_size, passages, passage_length),
          "passage_mask": ints(batch_size, passages, passage_length),
          KEY: ints(batch_size, passages), "weight": np.zeros((batch_size,), np.float32)}


def denominators(batch) -> dict:
  return {TERM: jnp.sum(batch["weight"].astype(jnp.float32))}


def _unsplit(x_KxNx, mesh):
  """[k, n, ...] chunks of train.split_microbatches (chunk c: rows c, c + k, ...) -> [k n, ...] in
  the batch's order, split over the batch's devices as the batch was (no data moves)."""
  x = jnp.swapaxes(x_KxNx, 0, 1).reshape((-1,) + x_KxNx.shape[2:])
  if mesh is not None:
    x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(sharding.BATCH_AXES)))
  return x


def _chunked_gradient(params, model, batch, step_rng, dens, k, mesh, param_shardings, *,
                      settings: ContrastiveConfig):
  """train.Objective.chunked_gradient: the whole batch's loss and gradient, k chunks at a time."""
  chunks = train.split_microbatches(inputs(batch), k, mesh)
  keys = jax.vmap(lambda i: jax.random.fold_in(step_rng, i))(jnp.arange(k))

  def encode(p, chunk, key):
    return model.apply({"params": p}, **chunk, deterministic=False, rngs={"dropout": key},
                       method=BiEncoder.encode)

  def loss(p, vectors):
    q_KxNxD, p_KxNxCxD = vectors
    scale, bias = model.apply({"params": p}, method=BiEncoder.logit_terms)
    out = {"query": _unsplit(q_KxNxD, mesh), "passage": _unsplit(p_KxNxCxD, mesh),
           "scale": scale, "bias": bias}
    metrics = _metrics(out, batch, settings)
    return losses.total_loss({name: (metrics[name][0], den) for name, den in dens.items()}), metrics

  constrain = (None if param_shardings is None
               else lambda g: jax.lax.with_sharding_constraint(g, param_shardings))
  return gradcache.chunked_value_and_grad(encode, loss, params, chunks, keys, constrain=constrain)


def objective(settings: ContrastiveConfig, name: str = "") -> train.Objective:
  """The bi-encoder's objective: TERM, the loss `settings` name, and in_batch_accuracy."""
  return train.Objective(
      name or f"contrastive_{settings.loss}",
      functools.partial(BiEncoder, settings=settings), inputs,
      functools.partial(_metrics, settings=settings), denominators, dummy_batch, outputs,
      chunked_gradient=functools.partial(_chunked_gradient, settings=settings), frozen=FROZEN)

