"""A tiny BERT (2 layers, 128 wide) sized for a CPU: `make pretrain`, smoke runs and tests.

Run: python -m bertjax.main --config=configs/tiny.py --workdir=workdirs/tiny   (= `make pretrain`)
Model: 2 layers, hidden 128, 2 heads, FFN 512, no dropout (at this size and step count dropout
only slows learning), on the built-in corpus (Python's own documentation) with an 8,000-piece
SentencePiece vocabulary: 1.5M parameters, 1.0M of them in the word embeddings. Sequence length 64,
batch 8: on this corpus what matters is the number of optimizer steps, not the batch.
Measured on a 2-core machine: about 200 sequences/s (25 steps/s), so 12,000 steps take about
8 minutes after a first-time setup of about 2 minutes (install) + 30 seconds (vocabulary and data).
Accuracy so far: held-out MLM 0.135 after 8,000 steps, still on the early plateau where the model
predicts frequent pieces, and NSP 0.60 against a majority-label baseline of 0.605.
"""

from configs import base


def get_config():
  config = base.get_config()
  m = config.model
  m.hidden_size = 128
  m.num_layers = 2
  m.num_heads = 2
  m.intermediate_size = 512
  m.max_position_embeddings = 128
  m.hidden_dropout = 0.0
  m.attention_dropout = 0.0

  d = config.data
  d.max_seq_length = 64
  d.max_predictions_per_seq = 10  # 15% of 64, rounded up

  t = config.train
  t.batch_size = 8
  t.num_train_steps = 12_000  # about 8 minutes at the ~200 seq/s measured on a 2-core machine
  t.learning_rate = 1e-3
  t.warmup_steps = 600  # 5%
  t.log_every_steps = 500
  t.eval_every_steps = 0  # evaluated once, at the end, on the whole held-out split

  c = config.checkpoint
  c.save_every_steps = 3_000
  c.keep = 2
  return config
