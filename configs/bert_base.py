"""BERT-Base as released: 12 layers, hidden 768, 12 heads, FFN 3072.

Phase 1 (900k steps at length 128), then phase 2 (100k steps at 512) from phase 1's weights:
  python -m bertjax.pretrain --config=configs/bert_base.py --workdir=gs://BUCKET/base_p1
  python -m bertjax.pretrain --config=configs/bert_base.py:phase=2 --workdir=gs://BUCKET/base_p2 \
      --config.checkpoint.init_from=gs://BUCKET/base_p1
Parameters at vocabulary 30522: 109,482,240 in the encoder with pooler, 110,106,428 with the
pre-training heads. The paper: 1M steps at batch 256 x 512 tokens, Adam lr 1e-4.
Set for TPUs (base.set_accelerator, chosen by compiling): bfloat16, straight layers, fsdp,
remat "none" (every activation kept), the fused attention kernel with the paper's attention
dropout, the fused MLP and attention end with the dropout, sum and norm. Roofline MFU, phases 1
and 2: v5p-8 0.96, 0.95; v6e-8 0.96, 0.95; v5e-8 0.96, 0.95 (docs/performance.md). On a GPU
add `--config.model.attention_impl=cudnn --config.model.attention_dropout=0`; on a CPU
`--config.model.dtype=float32 --config.model.remat_policy=none`.
Both phases pack sequences into rows (`data.packing`; base.py `set_phase`): batch_size counts rows.
"""

from bertjax.configs import base


def get_config(arg=None):
  config = base.get_config()
  phase = base.parse_arg(arg).get("phase", 1)
  base.set_phase(config, phase, total_steps=1_000_000)
  base.set_accelerator(config)
  return config  # base.py's model section is BERT-Base
