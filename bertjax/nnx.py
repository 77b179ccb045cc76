"""`from bertjax.nnx import to_nnx`, as docs/using-the-modules.md writes it: defined in
bertjax/model/nnx.py, where bertjax's own modules import it from."""

from bertjax.model.nnx import ToNNX, to_nnx
