"""BERT-Large as released: 24 layers, hidden 1024, 16 heads, FFN 4096.

Phase 1 (900k steps at length 128), then phase 2 (100k steps at 512) from phase 1's weights:
  python -m bertjax.pretrain --config=configs/bert_large.py --workdir=gs://BUCKET/large_p1
  python -m bertjax.pretrain --config=configs/bert_large.py:phase=2 --workdir=gs://BUCKET/large_p2 \
      --config.checkpoint.init_from=gs://BUCKET/large_p1
Parameters at vocabulary 30522: 335,141,888 in the encoder with pooler, 336,226,108 with the
pre-training heads. Set for TPUs as configs/bert_base.py (base.set_accelerator): roofline MFU
of the compiled step v5p-8 0.98 and 0.97 (phases 1 and 2), v6e-8 0.98 and 0.97, v5e-8 0.98
(phase 1). Both phases keep every activation for the backward (remat "none"). On a GPU or a
CPU, configs/bert_base.py says what to change.
Both phases pack several sequences into a row (`data.packing`; configs/base.py `set_phase`):
train.batch_size counts rows.
MLPerf's BERT-Large target is masked-LM accuracy 0.720 on its fixed evaluation set.
"""

from bertjax.configs import base


def get_config(arg=None):
  config = base.get_config()
  phase = base.parse_arg(arg).get("phase", 1)
  base.set_phase(config, phase, total_steps=1_000_000)
  base.set_accelerator(config)
  m = config.model
  m.hidden_size = 1024
  m.num_layers = 24
  m.num_heads = 16
  m.intermediate_size = 4096
  return config
