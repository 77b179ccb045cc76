"""BERT-Base as released: 12 layers, hidden 768, 12 heads, FFN 3072.

Run: python -m bertjax.main --config=configs/bert_base.py --workdir=gs://BUCKET/bert_base
Parameters at vocabulary 30522: 109,482,240 in the encoder with pooler, 110,106,428 with the
pre-training heads (decoder tied to the word embeddings). The paper trained it for 1M steps at
batch 256 x 512 tokens with Adam lr 1e-4 (90% of steps at length 128, 10% at 512).
"""

from configs import base


def get_config():
  config = base.get_config()
  return config  # base.py's model section is BERT-Base.
