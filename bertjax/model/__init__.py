"""The model: the encoder (encoder.py) and its config (config.py), what they are built of
(self_attention.py, attention.py, rope.py, mlp.py, dropout.py, primitives.py, residuals.py; the
Pallas kernels in kernels/), the heads (heads.py) and losses (losses.py), NNX (nnx.py) and the bi-encoder
(contrastive.py).

`from bertjax.model import BertConfig, BertModel`, as the README writes it, imports from here;
bertjax's own modules import each name from the module that defines it.
"""

from bertjax.model.config import BertConfig
from bertjax.model.encoder import (BertModel, Embeddings, Encoder, EncoderLayer, Pooler,
                                   positions_from_sequence_ids)
from bertjax.model.mlp import Mlp
from bertjax.model.self_attention import SelfAttention
