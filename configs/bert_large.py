"""BERT-Large as released: 24 layers, hidden 1024, 16 heads, FFN 4096.

Phase 1 (900k steps at length 128), then phase 2 (100k steps at 512) from phase 1's weights:
  python -m bertjax.pretrain --config=configs/bert_large.py --workdir=gs://BUCKET/large_p1
  python -m bertjax.pretrain --config=configs/bert_large.py:phase=2 --workdir=gs://BUCKET/large_p2 \
      --config.checkpoint.init_from=gs://BUCKET/large_p1
Parameters at vocabulary 30522: 335,141,888 in the encoder with pooler, 336,226,108 with the
pre-training heads. Set for TPUs as configs/bert_base.py (base.set_accelerator): roofline MFU
of the compiled step v5p-8 0.98 and 0.96 (phases 1 and 2), v6e-8 0.77 and 0.66 (phase 2 with
the fused MLP kernel, phase 1 without: it adds more FLOPs there than it saves bytes). On a GPU
or a CPU, configs/bert_base.py says what to change.
Both phases pack several sequences into a row (`data.packing`; configs/base.py `set_phase`):
train.batch_size counts rows.
MLPerf's BERT-Large target is masked-LM accuracy 0.720 on its fixed evaluation set.
"""

from bertjax.configs import base


def get_config(arg=None):
  config = base.get_config()
  phase = base.parse_arg(arg).get("phase", 1)
  base.set_phase(config, phase, total_steps=1_000_000)
  base.set_accelerator(config, phase)
  m = config.model
  m.hidden_size = 1024
  m.num_layers = 24
  m.num_heads = 16
  m.intermediate_size = 4096
  if int(phase) == 1:
    # At length 128 the fused MLP's extra products leave BERT-Large's step on v6e bound by its
    # FLOPs: 0.746 against XLA's MLP's 0.772 by the compile's roofline (docs/performance.md, "The
    # MLP in one kernel"); at 512 the kernel is ahead (0.655 against 0.533).
    m.mlp_impl = "xla"
  return config
