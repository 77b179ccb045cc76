"""configs/tiny.py's size and data with ModernBERT's architecture, for a CPU.

Run: python -m bertjax.pretrain --config=configs/modern_tiny.py --workdir=workdirs/modern_tiny
Model: 2 layers (global attention in layer 0, a 16-token window in layer 1), hidden 128,
2 heads, GeGLU 344 (the dense 512 FFN's parameters), pre-LN with a final norm, no biases but the
decoder's, RoPE (10,000 global, 10,000 local: at length 64 a larger global base changes little),
no position or segment table, no pooler. Data as configs/tiny.py's, without NSP and with 30% of
the tokens masked, 14,000 steps (configs/tiny.py's wall-clock). Against configs/tiny.py:
docs/modern.md.
"""

from bertjax.configs import modern_base, tiny


def get_config():
  config = tiny.get_config()
  modern_base.set_modern_recipe(config)
  m = config.model
  m.intermediate_size = 344
  m.global_every = 2
  m.local_window = 16
  m.position_init = "normal"  # no position table to start

  d = config.data
  d.max_predictions_per_seq = 20  # 30% of 64, rounded up
  # configs/tiny.py's wall-clock on a 2-core CPU: its 18,000 steps take as long as 14,000 here.
  config.train.num_train_steps = 14_000
  return config
