"""Which MLP a chip gets for `mlp_impl="auto"`: mlp_kernel's kernels where they made the released
configs' steps faster by the compile's roofline, XLA's products elsewhere.
"""

from __future__ import annotations

import dataclasses

from bertjax.model.config import chosen_remat

# The chips where the kernels made the released configs' steps faster by the compile's roofline
# (device_kind as jax names them): v6e, whose steps XLA's MLP left bound by HBM. On v5p and v5e
# the steps are bound by their FLOPs: the kernels that make the intermediate again cost more
# than the bytes they save (docs/performance.md, "The MLP's pre-activation kept for its
# backward").
FASTER_ON = ("TPU v6 lite",)
# The chips where "pallas_kept" (XLA's six products, no more) is taken where the remat policy
# keeps its pre-activation: FASTER_ON's, v5e, whose every released step it made faster by the
# roofline (0.954 -> 0.956, 0.976 -> 0.979, 0.948 -> 0.950) and BERT-Base's at length 512
# lighter (22.67 -> 19.86 GB a chip), and v5p, since its backward runs a sequence of blocks on
# each of a chip's two TensorCores (docs/performance.md, "The gated MLP and its pre-norm in one
# kernel, and the kernels on v5e"). Not v4: its 16 MiB of VMEM hold no released MLP's weights.
KEPT_FASTER_ON = FASTER_ON + ("TPU v5 lite", "TPU v5")
# The remat policies under which "pallas_kept"'s pre-activation is kept for the backward (named
# "mlp_hidden"): under the others it would be written, dropped and written again.
KEEPS_HIDDEN = ("none", "dots_mlp", "dots_kernels")

def chosen(config, device, tensor_parallel: int = 1) -> str:
  """What `mlp_impl="auto"` means on `device`: for an MLP (dense or gated) whose F is not split
  over a tensor axis (the kernels would compute every split's whole MLP), "pallas_kept" on
  KEPT_FASTER_ON's chips where the remat policy keeps its pre-activation (KEEPS_HIDDEN),
  "pallas" on FASTER_ON's where it does not; XLA's elsewhere ("xla_remade" on a TPU under remat
  "none"); another setting as it is."""
  if config.mlp_impl != "auto":
    return config.mlp_impl
  tpu = getattr(device, "platform", "") == "tpu"
  kept = chosen_remat(config.remat_policy, device) in KEEPS_HIDDEN
  kind = getattr(device, "device_kind", "")
  faster = kind in FASTER_ON or (kept and kind in KEPT_FASTER_ON)
  if not (tensor_parallel == 1 and tpu and faster):
    # Nothing rematerialised on a TPU: the pre-activation alone kept (docs/performance.md, "The
    # MLP's activation made again"). On a CPU it was no faster (a BERT-Base step 2% slower by
    # the median of three); a GPU has not measured it.
    remade = tpu and chosen_remat(config.remat_policy, device) == "none"
    return "xla_remade" if remade else "xla"
  return "pallas_kept" if kept else "pallas"


def resolved(config, mesh):
  """`config` with mlp_impl "auto" made the setting `mesh`'s chips get (`chosen`)."""
  impl = chosen(config, mesh.devices.flat[0], dict(mesh.shape).get("tensor", 1))
  return config if impl == config.mlp_impl else dataclasses.replace(config, mlp_impl=impl)
