"""`from bertjax import sharding`, as the README and docs/using-the-modules.md write it: the mesh,
the logical-axis rules and the host-local -> global batch are defined in
bertjax/parallel/sharding.py, where bertjax's own modules import them from."""

from bertjax.parallel.sharding import (BATCH_AXES, DEFAULT_RULES, MESH_AXES, MeshConfig, Rules,
                                       batch_axis_size, batch_sharding, check_auto_axes,
                                       check_batch_size, check_model_fits, check_spec_divides,
                                       create_mesh, fill_sizes, host_batch_to_global,
                                       logical_context, logical_shardings, logical_shards,
                                       mesh_shape, replicated, rules_from_config)
