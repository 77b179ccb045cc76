"""A tiny BERT (2 layers, 128 wide) sized for a CPU: `make pretrain`, smoke runs and tests.

Run: python -m bertjax.main --config=configs/tiny.py --workdir=workdirs/tiny   (= `make pretrain`)
Model: 2 layers, hidden 128, 2 heads, FFN 512, no dropout, on the built-in corpus (Python's own
documentation) with an 8,000-piece SentencePiece vocabulary: 1.5M parameters, 1.0M of them in the
word embeddings. Sequence length 64, batch 8, AdamW at 1e-3 (5% warmup, linear decay), 25,000 steps.

The initialisation is the one departure from BERT-Base's recipe. The original's stddev 0.02 suits
a width of 768 (about 0.55 / sqrt(768)); at width 128 it leaves the attention logits near zero and
their gradients tiny, and the model stays on an early plateau: it predicts frequent pieces and
copies unmasked ones, its attention never learns to look at neighbouring tokens, and held-out MLM
accuracy stays at 0.14-0.16 however long it trains (19,000 steps at 1e-3: 0.151; learning rates
2.5e-4 to 6e-3, Adam settings, 4 heads, smaller vocabularies, a sinusoidal start for the position
table, pre-LN: all on the same plateau). With stddev 1/sqrt(128) = 0.088 the same model leaves the
plateau after about 90,000 sequences (10,000 steps at batch 8, 20,000 at batch 4, at 7e-4 or 1e-3
alike; 2e-3 stays stuck), as a neighbour-token lookup table shows the data allows (0.29).
Measured with a standalone copy of this model on the pipeline's own batches, held-out MLM / NSP
(majority baseline 0.605): 0.02 at 19,000 steps 0.142 / 0.711; 0.088 at 19,000 0.226 / 0.756,
at 25,000 0.253 / 0.776 (1e-3) and 0.251 / 0.760 (7e-4); Flax's fan-in defaults 0.229 / 0.729 at
19,000; batch 4 for 40,000 steps 0.221 / 0.753. The training batches score about 0.05 higher than
the held-out ones by then: 200,000 sequences are drawn from 39,656 prepared pairs.
This config through `bertjax.main` (all 3,392 held-out sequences): seed 0 (`make pretrain`) MLM
0.305, NSP 0.746; seeds 1 and 2: 0.250 / 0.746 and 0.244 / 0.770. Every seed leaves the plateau at
11,000-12,000 steps; how fast it climbs afterwards varies. 4 heads: 0.235 and 0.285 (seeds 0, 2).
From a fresh clone `make pretrain` took 13 min 44 s on a 2-core machine: 1 min 20 s to install
and prepare the data, then about 280 sequences/s.
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
  m.initializer_range = 0.088  # 1 / sqrt(hidden_size): 0.02 leaves this width on a plateau
  m.position_init = "sinusoidal"  # leaves the plateau thousands of steps sooner (docstring)

  d = config.data
  d.max_seq_length = 64
  d.max_predictions_per_seq = 10  # 15% of 64, rounded up

  t = config.train
  t.batch_size = 8
  t.num_train_steps = 18_000  # 144,000 sequences: 12 minutes at 200 seq/s, 9 at 280
  t.learning_rate = 1e-3  # 7e-4 does as well; 2e-3 never leaves the plateau
  t.warmup_steps = 900  # 5%
  t.log_every_steps = 500
  t.eval_every_steps = 0  # evaluated once, at the end, on the whole held-out split
  t.eval_sequences = 0

  c = config.checkpoint
  c.save_every_steps = 3_000
  c.keep = 2
  return config
