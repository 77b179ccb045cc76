"""Model FLOPs of a BERT training step and the peak FLOP/s of accelerators: what MFU is made of.

Read by the loop's throughput line, `bertjax.benchmark` and `bertjax.aot`.
"""

from __future__ import annotations

from bertjax.data.config import DataConfig
from bertjax.model.config import BertConfig


# Model FLOPs count matmuls only, 2 per multiply-add, training = 3 x forward. Per sequence, forward:
#   encoder  num_layers * L * (8 D^2 + 4 D F + 4 L D)   (Q, K, V, output; MLP; QK^T and PV)
#            a gated MLP: 6 D F (its gate is a third F-wide matmul); a local layer's query reads
#            min(L, local_window + 1) keys, not L (the work a windowed kernel does)
#   pooler + NSP        2 D^2 + 4 D  (NSP's 4 D alone without the pooler)
#   MLM head        M * (2 D^2 + 2 D V)                  (only the M masked positions)
# Rematerialisation is not useful work and is not counted, so MFU compares across remat policies.
# Per chip (per GPU): dense bfloat16 peak TFLOP/s and HBM bandwidth in GB/s (10^9 bytes), from
# the vendors' pages: Cloud TPU's system architecture pages (cloud.google.com/tpu/docs/v6e, v5p,
# v5e, v4: 918 / 1,640; 459 / 2,765; 197 / 819; 275 / 1,200) and NVIDIA's data sheets (H200 SXM
# 989 / 4,800; H100 SXM 989 / 3,350; A100 80GB SXM 312 / 2,039). Matched against jax's
# `device_kind` in order (more specific names first).
CHIPS = (
    ("TPU v6 lite", 918.0, 1640.0), ("TPU v6e", 918.0, 1640.0),
    ("TPU v5 lite", 197.0, 819.0), ("TPU v5e", 197.0, 819.0),
    ("TPU v5p", 459.0, 2765.0), ("TPU v5", 459.0, 2765.0),
    ("TPU v4", 275.0, 1200.0),
    ("H200", 989.0, 4800.0), ("H100", 989.0, 3350.0),  # SXM; dense (no sparsity)
    ("A100", 312.0, 2039.0),
)
PEAK_TFLOPS = tuple((name, peak) for name, peak, _ in CHIPS)


# A config may leave the vocabulary to its tokenizer (model.vocab_size 0), which the benchmark and
# the AOT check do not read: they assume Google's English WordPiece.
DEFAULT_VOCAB_SIZE = 30522


def sequence_shape(data: DataConfig) -> tuple[int, int]:
  """(L, M) of the data config: max_seq_length and max_predictions_per_seq."""
  return data.max_seq_length, data.max_predictions_per_seq


def rows_shape(data: DataConfig) -> tuple[int, int, int]:
  """(L, masked-LM slots per row, sequences per row) of the training batches: with
  `data.packing` a row holds up to S = max_sequences_per_row sequences and S x M slots; without,
  M slots and S = 0 (unpacked rows, one NSP label each)."""
  seq_len, max_predictions = sequence_shape(data)
  per_row = data.max_sequences_per_row if data.packing else 0
  return seq_len, max_predictions * max(per_row, 1), per_row


def _chip(device_kind: str):
  for chip in CHIPS:
    if chip[0].lower() in device_kind.lower():
      return chip
  return None


def peak_tflops(device_kind: str) -> float | None:
  """Peak bf16 TFLOP/s of one device, or None when unknown (CPUs)."""
  chip = _chip(device_kind)
  return chip[1] if chip else None


def hbm_gbps(device_kind: str) -> float | None:
  """HBM bandwidth of one device in GB/s, or None when unknown (CPUs)."""
  chip = _chip(device_kind)
  return chip[2] if chip else None


def layer_flops(cfg: BertConfig, layer: int, keys: int, queries: int | None = None) -> float:
  """Matmul FLOPs of encoder layer `layer` on a row of `keys` positions whose outputs are wanted
  at `queries` of them (all by default): keys and values at every position; the queries, the
  attention products, the output projection and the MLP at the queries alone (prediction's last
  layer at the [CLS] slots, BertModel's query_positions). A local layer's query attends to at
  most local_window + 1 keys."""
  d, f = cfg.hidden_size, cfg.intermediate_size
  queries = keys if queries is None else queries
  mlp = (6 if cfg.mlp_type == "gated" else 4) * d * f
  attended = min(keys, cfg.local_window + 1) if cfg.is_local(layer) else keys
  return float(4 * d * d * keys + queries * (4 * d * d + mlp + 4 * attended * d))


def forward_flops_per_sequence(cfg: BertConfig, seq_len: int, max_predictions: int) -> float:
  """Matmul FLOPs of one sequence's forward pass (see the module docstring)."""
  d, v = cfg.hidden_size, cfg.vocab_size
  encoder = sum(layer_flops(cfg, i, seq_len) for i in range(cfg.num_layers))
  pooler_nsp = (2 * d * d if cfg.pooler else 0) + 4 * d
  mlm = max_predictions * (2 * d * d + 2 * d * v)
  return float(encoder + pooler_nsp + mlm)


def train_flops(cfg: BertConfig, batch_size: int, seq_len: int, max_predictions: int) -> float:
  """Model FLOPs of one training step on the whole (global) batch."""
  return 3.0 * batch_size * forward_flops_per_sequence(cfg, seq_len, max_predictions)
