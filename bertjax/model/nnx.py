"""bertjax's linen modules (the encoder, the heads) as `flax.nnx` modules, sharding names kept.

    from flax import nnx
    from bertjax.model.nnx import to_nnx

    encoder = to_nnx(BertModel(config), input_ids, rngs=nnx.Rngs(0))
    sequence, pooled = encoder(input_ids, input_mask, segment_ids)

`to_nnx` is `nnx.bridge.ToNNX(module).lazy_init(...)` that also works where the bare bridge does
not. Each parameter becomes an `nnx.Param` whose `out_sharding` metadata holds the module's logical
axis names (("vocab", "embed"), ...). The bridge alone fails to create them outside a mesh ("An
auto mesh context or metadata is required ..."), because NNX places every annotated variable on
its mesh at creation; and its calls trace the model without logical rules, which drops every
sharding constraint inside it. Here every call, the initialising one included, runs with the
logical rules in scope (`sharding.logical_context(rules=...)`), and takes the mesh from the
caller, as NNX code does:

  - under a mesh (`jax.set_mesh(mesh)` or `sharding.logical_context(mesh)`, around the creation
    or around the `nnx.jit` that creates): the parameters are created sharded on it as the rules
    map their names, and the activations keep their constraints;
  - without one: the parameters are plain arrays (NNX's eager sharding is off for them), names
    still attached, to be sharded later.

Each parameter also carries the rules (`sharding_rules` metadata), so what NNX derives from it
elsewhere maps its names too: `nnx.Optimizer`'s state is created sharded like the parameters, and
`nnx.get_partition_spec(nnx.state(model))` gives mesh axes.

Dropout: `rngs=nnx.Rngs(params=0, dropout=1)` and `deterministic=False` in the call.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
from flax import nnx

from bertjax.parallel import sharding


class ToNNX(nnx.bridge.ToNNX):
  """`nnx.bridge.ToNNX` whose calls run inside `sharding.logical_context(rules=rules)`."""

  def __init__(self, module: nn.Module, rngs: nnx.Rngs | jax.Array | None = None, *,
               rules: sharding.Rules | None = None):
    super().__init__(module, rngs)
    # Named like the bridge's own attributes: it takes every other attribute for a collection of
    # linen variables.
    self.to_nnx__rules = (sharding.DEFAULT_RULES if rules is None
                          else sharding.rules_from_config(rules))

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    with sharding.logical_context(rules=self.to_nnx__rules):
      # Create parameters sharded where a mesh is in scope, plain (names kept) where none is.
      with nnx.use_eager_sharding(not jax.sharding.get_abstract_mesh().empty):
        out = super().__call__(*args, **kwargs)
    # New variables carry the rules, so that what NNX derives from them outside this call
    # (nnx.Optimizer's sharded state, nnx.get_partition_spec) maps their names to mesh axes.
    for _, variable in nnx.iter_graph(self):
      if (isinstance(variable, nnx.Variable) and variable.get_metadata("out_sharding", None)
          and variable.get_metadata("sharding_rules", None) is None):
        variable.set_metadata(sharding_rules=self.to_nnx__rules)
    return out


def to_nnx(module: nn.Module, *example_args: Any, rngs: nnx.Rngs | jax.Array,
           rules: sharding.Rules | None = None, **example_kwargs: Any) -> ToNNX:
  """`module` as an initialised NNX module: its parameters created by calling it on the example
  inputs (as linen's `init`), on the mesh in scope if any (see the module docstring)."""
  return ToNNX(module, rngs, rules=rules).lazy_init(*example_args, **example_kwargs)
