"""Every configuration key of bertjax, each with a one-line comment.

Size configs (`bert_base.py`, `bert_large.py`, `tiny.py`) import this file and only override.
Run a config with `python -m bertjax.main --config=configs/<name>.py --workdir=DIR`; override any key
from the command line, e.g. `--config.train.batch_size=256`. Unknown keys are an error.
"""

import ml_collections


def get_config():
  config = ml_collections.ConfigDict()

  # --- model: becomes bertjax.model.BertConfig(**config.model). -----------------------------------
  m = config.model = ml_collections.ConfigDict()
  m.vocab_size = 30522  # rows of the word-embedding table; must cover the tokenizer's vocabulary
  m.hidden_size = 768  # D: width of every token representation
  m.num_layers = 12  # encoder layers
  m.num_heads = 12  # attention heads; must divide hidden_size
  m.intermediate_size = 3072  # F: width of the feed-forward layer
  m.max_position_embeddings = 512  # longest sequence the position table covers
  m.type_vocab_size = 2  # segment (token type) ids: 0 = sentence A, 1 = sentence B
  m.hidden_dropout = 0.1  # dropout after embeddings and each sub-layer
  m.attention_dropout = 0.1  # dropout on attention probabilities
  m.initializer_range = 0.02  # stddev of the truncated-normal weight init
  m.layer_norm_eps = 1e-12  # epsilon of every LayerNorm, as the original
  m.hidden_act = "gelu"  # "gelu" (exact erf, the 2018 checkpoints) or "gelu_tanh"
  m.dtype = "float32"  # compute dtype of matmuls: "bfloat16" on accelerators
  m.param_dtype = "float32"  # storage dtype of parameters
  m.scan_layers = False  # stack layers with nn.scan: one compiled layer, faster compiles
  m.remat_policy = "none"  # "none", "full", "dots" (save matmuls without batch dims), "dots_all"
  m.attention_impl = "xla"  # "xla" (any device) or "cudnn" (fused kernel, NVIDIA GPUs)

  # --- data: see bertjax/data. ---------------------------------------------------------------------
  config.data = ml_collections.ConfigDict()

  # --- train: see bertjax/train.py and bertjax/optimizer.py. ---------------------------------------
  config.train = ml_collections.ConfigDict()

  # --- mesh: see bertjax/sharding.py. ----------------------------------------------------------------
  mesh = config.mesh = ml_collections.ConfigDict()
  # Logical axis name -> mesh axis (or axes, or None = replicated). Parameters are named in
  # bertjax/model.py ("vocab", "embed", "heads", "kv", "mlp", "layers"); activations carry
  # "activation_*" names. `data` and `fsdp` split the batch; `fsdp` also splits parameters and
  # optimizer state (ZeRO-3 style); `tensor` splits heads, the MLP and the vocabulary (Megatron).
  mesh.logical_axis_rules = (
      ("activation_batch", ("data", "fsdp")),
      ("activation_length", None),
      ("activation_embed", None),
      ("activation_heads", "tensor"),
      ("activation_kv", None),
      ("activation_mlp", "tensor"),
      ("activation_vocab", "tensor"),
      ("vocab", "tensor"),
      ("embed", "fsdp"),
      ("heads", "tensor"),
      ("kv", None),
      ("mlp", "tensor"),
      ("layers", None),
  )

  return config
