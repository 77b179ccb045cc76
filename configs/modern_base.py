"""ModernBERT-base's shape and recipe (Warner et al., 2024) in bertjax: an encoder that
`python -m bertjax.convert.modernbert export` writes as transformers' ModernBertForMaskedLM.

Phase 1 at length 1024, then context extension at 8192 from phase 1's weights:
  python -m bertjax.pretrain --config=configs/modern_base.py --workdir=gs://BUCKET/modern_p1
  python -m bertjax.pretrain --config=configs/modern_base.py:phase=2 --workdir=gs://BUCKET/modern_p2 \
      --config.checkpoint.init_from=gs://BUCKET/modern_p1
Compile check without a TPU (12 microbatches, remat "dots_kernels", as set: 50.5 and 50.8 of 95
GiB a chip on a v5p-8's 4 chips in phases 1 and 2, roofline MFU 0.946 and 0.813; on v6e-8 0.844
and 0.814; without microbatches or remat, 4608 rows of 1024 needed 1,423 GiB a chip; a larger
slice needs fewer microbatches, and a batch that divides over its chips and them):
  python -m bertjax.aot --config=configs/modern_base.py --topology=v5p-8
Model: 22 layers, hidden 768, 12 heads, GeGLU 1,152: 149,014,272 parameters in the encoder;
no NSP, 30% masking, packed rows, warmup-stable-decay. The rest of the shape and what differs
from ModernBERT's run: docs/lab-notes.md#configsmodern_basepy.
"""

from bertjax.configs import base


def set_modern_recipe(config):
  """ModernBERT's architecture and objective, whatever the size: pre-LN, no biases but the
  decoder's, GeGLU, RoPE without a position or segment table, no pooler; MLM alone at 30% on
  packed rows. configs/modern_tiny.py takes these too, so the two differ only in size and steps."""
  m = config.model
  m.type_vocab_size = 0
  m.layer_norm_eps = 1e-5
  m.norm_position = "pre"
  m.norm_bias = False
  m.attention_bias = False
  m.mlp_bias = False
  m.mlp_type = "gated"  # with hidden_act "gelu": GeGLU
  m.position_embedding = "rope"
  m.pooler = False
  m.head_bias = False
  m.task_head = "modernbert"  # fine-tuned as transformers' ModernBertFor* classes are
  d = config.data
  d.nsp = False
  d.masked_lm_prob = 0.3
  d.packing = True


def get_config(arg=None):
  config = base.get_config()
  phase = int(base.parse_arg(arg).get("phase", 1))
  if phase not in (1, 2):
    raise ValueError(f"phase={phase}; the recipe has phases 1 (length 1024) and 2 (length 8192)")
  set_modern_recipe(config)
  m = config.model
  m.vocab_size = 50368  # ModernBERT's table (its tokenizer's 50,280 pieces padded to 64s)
  m.hidden_size = 768
  m.num_layers = 22
  m.num_heads = 12
  m.intermediate_size = 1152  # per half of the GeGLU: Wi is [768, 2 x 1152] in ModernBERT
  m.max_position_embeddings = 8192  # no table with RoPE: only the longest sequence allowed
  m.hidden_dropout = 0.0
  m.attention_dropout = 0.0
  m.rope_theta = 160_000.0
  m.local_rope_theta = 10_000.0
  m.global_every = 3
  m.local_window = 128
  m.dtype = "bfloat16"
  # Straight layers: in one scanned loop the global and local layers are a conditional the
  # compile's count can only bound (every layer its dearest branch), and straight the step moved
  # fewer bytes for the same FLOPs (docs/performance.md, "ModernBERT-base, compiled"); a run
  # resumes in either layout (training/relayout.py).
  m.scan_layers = False
  # bertjax's fused kernel, which turns q and k by RoPE as it reads them (by XLA the turns'
  # float32 copies and relayouts were 55% of the step's HBM bytes on v6e-8), its local windows by
  # slabs of 128 queries at any length (on v6e whole rows up to 1,024). Phase 2's 8,192 is past
  # its whole rows: "splash", whose straight layers the kernel takes block by block (RoPE inside;
  # a scanned layer, or one with dropout, would be splash's).
  m.attention_impl = "auto" if phase == 1 else "splash"
  m.qkv_product = "auto"  # one product for q, k and v on v6e and v5p, where the kernel reads it
  # The GeGLU MLP, the norm before it and the layer's sum as one kernel on v6e, v5e and v5p (both
  # projections side by side, the kept pre-activation read by the backward; mlp_choice.chosen).
  m.mlp_impl = "auto"
  # The MLM logits kept for the backward (written with log Z by mlm_kernel on a TPU), not made
  # again: every step here is bound by its FLOPs or near it, and the second product of the
  # logits costs more time than their float32 bytes (phase 1 on v5p-8, roofline MFU 0.884 made
  # again, 0.946 kept; v6e-8 0.813 and 0.844; docs/performance.md, "ModernBERT's phase 1 keeps
  # its MLM logits").
  m.recompute_mlm_logits = False
  # The matmuls' outputs kept, and the attention kernel's ("dots_kernels"; splash's is not
  # named), in 12 microbatches: 51 and 51 GiB of a v5p-8 chip's 95 in phases 1 and 2, where full
  # remat in 8 made the forward again (docs/performance.md, "ModernBERT-base, compiled"). 12
  # divide both phases' batches over 4 chips and over 8.
  m.remat_policy = "dots_kernels"

  d = config.data
  d.max_seq_length = 1024 if phase == 1 else 8192
  d.max_predictions_per_seq = 320 if phase == 1 else 2560  # 30% of L, rounded up to 64s

  t = config.train
  t.batch_size = 4608 if phase == 1 else 576  # rows of 1024 (ModernBERT's final batch) / 8192
  t.num_microbatches = 12  # v5e-8 (16 GiB a chip): 24, 15.3 and 15.2 GiB, 0.946 and 0.813
  t.num_train_steps = 350_000 if phase == 1 else 50_000
  t.learning_rate = 8e-4 if phase == 1 else 3e-4
  t.warmup_steps = 3_000 if phase == 1 else 500
  t.schedule = "wsd"
  t.decay_steps = 10_000  # ~3% of phase 1's steps, 20% of phase 2's
  t.weight_decay = 1e-5
  t.adam_b2 = 0.98
  t.bias_correction = True
  return config
