"""A tiny BERT (2 layers, 128 wide) sized for a CPU: `make pretrain`, smoke runs and tests.

Run: python -m bertjax.pretrain --config=configs/tiny.py --workdir=workdirs/tiny   (= `make pretrain`)
Model: 2 layers, hidden 128, 2 heads, FFN 512, no dropout, on the built-in corpus (Python's own
documentation) with an 8,000-piece SentencePiece vocabulary: 1.5M parameters, 1.0M of them in the
word embeddings. Sequence length 64, batch 8, AdamW at 1e-3 (5% warmup, linear decay), 18,000
steps = 144,000 sequences.
What to expect (its minutes on a 2-core machine, held-out MLM and NSP accuracy over seeds), stated
once: docs/pretraining.md#make-pretrain.
It departs from BERT-Base's recipe only at the start: stddev 0.088 rather than 0.02, a
sinusoidal position table, W_K starting as a copy of W_Q. Why, what else was tried and every
seed's figures: docs/lab-notes.md#configstinypy.
"""

from bertjax.configs import base


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
  m.initializer_range = 0.088  # 1 / sqrt(hidden_size): 0.02 leaves this width on a plateau
  m.position_init = "sinusoidal"  # leaves the plateau thousands of steps sooner (docstring)
  m.query_key_init = "shared"  # W_K starts as W_Q: attention starts local (docstring)

  d = config.data
  d.max_seq_length = 64
  d.max_predictions_per_seq = 10  # 15% of 64, rounded up
  d.dupe_factor = 10  # the original's: 80,718 pairs, each trained ~1.8 times; 5 memorised NSP

  t = config.train
  t.batch_size = 8
  t.num_train_steps = 18_000  # 144,000 sequences (its time: docs/pretraining.md#make-pretrain)
  t.learning_rate = 1e-3  # 7e-4 does as well; 2e-3 never leaves the plateau
  t.warmup_steps = 900  # 5%
  t.log_every_steps = 500
  t.eval_every_steps = 0  # evaluated once, at the end, on the whole held-out split
  t.eval_sequences = 0

  c = config.checkpoint
  c.save_every_steps = 3_000
  c.keep = 2
  return config
