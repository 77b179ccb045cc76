"""`from bertjax.pretrained import load_pretrained`, as docs/using-the-modules.md writes it: defined
in bertjax/weights/pretrained.py, where bertjax's own modules import it from."""

from bertjax.weights.pretrained import ENCODER, abstract_encoder, load_pretrained
