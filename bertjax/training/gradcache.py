"""The gradient of a loss that does not split over the rows of a batch, computed a chunk of rows at
a time: GradCache (Gao, Zhang, Han & Callan 2021, "Scaling Deep Contrastive Learning Batch Size
under Memory Limited Setup").

A contrastive loss scores every query against every passage of the batch, so unlike a per-row loss
it is not a sum over microbatches, and microbatches would each see their own negatives only. It
reads the rows through their vectors alone, though, and those are small. So:

  1. encode each chunk, keeping none of its activations: every row's vectors, [k, n, ...];
  2. the loss of all the vectors, and its gradient with respect to them (and to the parameters
     the loss reads directly: a learned temperature);
  3. encode each chunk again under `jax.vjp` and pull its rows' vector gradients back to the
     parameters, summing over the chunks.

Step 3's sum plus step 2's direct gradient is the chain rule over the whole batch: the gradient of
loss(encode(every row)), up to the order of float additions, with one chunk's activations live at
a time (plus every row's vectors), for one more forward pass than a plain step.

Dropout: step 3 must differentiate the function step 1 evaluated, so chunk c's encoder is given
the same key `keys[c]` in both. bertjax's dropout masks are a function of the key and each
element's index in its array (bertjax/model/dropout.py), so both passes draw the same masks, bit for bit.
(They are not the masks of the unchunked batch, whose arrays are k times longer: with dropout, k
chunks and one batch are two draws of the same distribution; without, the same numbers.)

Nothing here knows the model: bertjax/training/contrastive.py hands it the bi-encoder.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp


def chunked_value_and_grad(encode: Callable, loss: Callable, params: Any, chunks: Any,
                           keys: jax.Array, *, constrain: Callable | None = None):
  """((value, aux), grads) of `loss(params, vectors)` where vectors = encode over every chunk.

  encode(params, chunk, key) -> a tree of arrays (one chunk's vectors);
  loss(params, vectors) -> (scalar, aux), its vectors those trees stacked over the chunks [k, ...];
  chunks: a tree of arrays with a leading axis of k chunks; keys: k keys, one per chunk;
  constrain: applied to the summed parameter gradient after each chunk (to keep it laid out as
  the parameters are, as train_step's accumulator).
  """
  def forward(_, xs):
    chunk, key = xs
    return None, encode(params, chunk, key)

  _, vectors = jax.lax.scan(forward, None, (chunks, keys))
  (value, aux), (direct, d_vectors) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
      params, vectors)

  def backward(total, xs):
    chunk, key, d_chunk = xs
    _, pull = jax.vjp(lambda p: encode(p, chunk, key), params)
    (grads,) = pull(d_chunk)
    total = jax.tree.map(lambda a, g: a + g.astype(a.dtype), total, grads)
    return (total if constrain is None else constrain(total)), None

  start = jax.tree.map(lambda g: g.astype(jnp.float32), direct)
  grads, _ = jax.lax.scan(backward, start if constrain is None else constrain(start),
                          (chunks, keys, d_vectors))
  return (value, aux), grads
