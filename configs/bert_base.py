"""BERT-Base as released: 12 layers, hidden 768, 12 heads, FFN 3072.

Phase 1 (900k steps at length 128), then phase 2 (100k steps at 512) from phase 1's weights:
  python -m bertjax.pretrain --config=configs/bert_base.py --workdir=gs://BUCKET/base_p1
  python -m bertjax.pretrain --config=configs/bert_base.py:phase=2 --workdir=gs://BUCKET/base_p2 \
      --config.checkpoint.init_from=gs://BUCKET/base_p1
Parameters at vocabulary 30522: 109,482,240 in the encoder with pooler, 110,106,428 with the
pre-training heads (decoder tied to the word embeddings). The paper trained it for 1M steps at
batch 256 x 512 tokens with Adam lr 1e-4 (90% of steps at length 128, 10% at 512).
Set for accelerators: matmuls in bfloat16 (parameters, softmax, LayerNorm statistics, logits and
losses stay float32) and scanned layers (one compiled layer: compile time does not grow with
depth). On a CPU, `--config.model.dtype=float32 --config.model.scan_layers=False`: there the
scanned loop's copies of each layer's weights and gradients in and out of the stacked arrays cost
about 9% of a step (docs/performance.md#throughput).
Both phases pack sequences into rows (`data.packing`; base.py `set_phase`): batch_size counts rows.
"""

from bertjax.configs import base


def get_config(arg=None):
  config = base.get_config()
  base.set_phase(config, base.parse_arg(arg).get("phase", 1), total_steps=1_000_000)
  m = config.model  # base.py's model section is BERT-Base; only the accelerator settings change
  m.dtype = "bfloat16"
  m.scan_layers = True
  return config
