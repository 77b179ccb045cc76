"""A tiny BERT (2 layers, 128 wide) sized for a CPU: tests, smoke runs and `make pretrain`.

Run: python -m bertjax.main --config=configs/tiny.py --workdir=/tmp/tiny
Model: 2 layers, hidden 128, 2 heads, FFN 512, no dropout (at this size and step count dropout
only slows learning). With a 30522-token vocabulary it has 4.4M parameters, 3.9M of them in the
word-embedding table.
"""

from configs import base


def get_config():
  config = base.get_config()
  m = config.model
  m.hidden_size = 128
  m.num_layers = 2
  m.num_heads = 2
  m.intermediate_size = 512
  m.hidden_dropout = 0.0
  m.attention_dropout = 0.0
  return config
