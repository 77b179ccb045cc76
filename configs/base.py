"""Every configuration key of bertjax, each with a one-line comment.

Size configs (`bert_base.py`, `bert_large.py`, `tiny.py`) import this file and only override.
Run a config with `python -m bertjax.pretrain --config=configs/<name>.py --workdir=DIR`; override any key
from the command line, e.g. `--config.train.batch_size=256`. Unknown keys are an error. These files
ship in the package as `bertjax.configs`: where bertjax is installed (a wheel, no checkout), name
one as `--config=<name>` (`--config=tiny`, `--config=finetune:next`); a config of one's own imports
them (`from bertjax.configs import base`).
"""

import ml_collections

from bertjax.parallel import sharding


def get_config():
  """Every key with its default (BERT-Base shape; data and steps of the paper's phase 1)."""
  config = ml_collections.ConfigDict()

  # --- model: becomes bertjax.model.BertConfig(**config.model). -----------------------------------
  m = config.model = ml_collections.ConfigDict()
  m.vocab_size = 0  # rows of the word-embedding table; 0 = the tokenizer's size, more pads it
  m.hidden_size = 768  # D: width of every token representation
  m.num_layers = 12  # encoder layers
  m.num_heads = 12  # attention heads; must divide hidden_size
  m.intermediate_size = 3072  # F: width of the feed-forward layer
  m.max_position_embeddings = 512  # longest sequence the position table covers
  m.type_vocab_size = 2  # segment (token type) ids: 0 = sentence A, 1 = sentence B
  m.hidden_dropout = 0.1  # dropout after embeddings and each sub-layer
  m.attention_dropout = 0.1  # dropout on attention probabilities; "xla" and "fused" (0 for cudnn, splash)
  m.initializer_range = 0.02  # stddev of the truncated-normal weight init
  m.layer_norm_eps = 1e-12  # epsilon of every LayerNorm, as the original
  m.hidden_act = "gelu"  # "gelu" (exact erf, the 2018 checkpoints) or "gelu_tanh"
  m.dtype = "float32"  # compute dtype of matmuls: "bfloat16" on accelerators
  m.param_dtype = "float32"  # storage dtype of parameters
  m.scan_layers = False  # stack layers with nn.scan: one compiled layer, faster compiles
  m.scan_unroll = 1  # scanned layers per iteration of the compiled loop (nn.scan's unroll)
  # "none", "full", "dots" (save matmuls without batch dims), "dots_all", "dots_mlp" (dots and the
  # fused MLP kernels' output), "dots_kernels" (dots_mlp and the fused attention kernel's output),
  # "auto" (dots_kernels, but dots_outputs on v6e); the released configs keep everything ("none")
  m.remat_policy = "none"
  m.attention_impl = "xla"  # "xla" (any device), "cudnn" (NVIDIA GPUs), "splash" (TPU; L % 128 == 0),
  # "fused" (TPU; L % 128 == 0, L <= 1024; with attention dropout), "auto" (fused on TPU, its
  # arithmetic by XLA elsewhere and XLA's attention at other lengths)
  m.cudnn_packing = "mask"  # packed rows on cuDNN: "mask" (read as a bias) or "segments" (no bias)
  m.recompute_mlm_logits = False  # True: MLM logits scored where made, recomputed in the backward
  # "pallas": the MLP's two products in one kernel, its F-wide intermediate in VMEM; "auto": that
  # kernel on the TPUs where it measured faster (v6e), XLA elsewhere
  m.mlp_impl = "xla"
  # q, k and v: "three" products, "one" (x @ [Wq Wk Wv] on the fused attention kernel's path, the
  # same parameters) or "auto" (one on the TPUs where it moved fewer bytes: v6e, v5p)
  m.qkv_product = "three"
  m.position_init = "normal"  # position table start: "normal" (original) or "sinusoidal" (small models)
  m.query_key_init = "independent"  # "independent" (original) or "shared": W_K starts as W_Q (small models)
  # Encoders after the paper (ModernBERT, NeoBERT, Cramming; configs/modern_base.py). Each key is
  # independent; these defaults are the paper's model.
  m.norm_position = "post"  # "post" (the paper) or "pre" (norm before each sub-layer + final norm)
  m.norm_type = "layernorm"  # "layernorm" or "rmsnorm"
  m.norm_bias = True  # LayerNorm biases (ModernBERT: False)
  m.attention_bias = True  # q, k, v and output projection biases
  m.mlp_bias = True  # feed-forward biases
  m.mlp_type = "dense"  # "dense" or "gated" (GeGLU with hidden_act gelu, SwiGLU with silu)
  m.position_embedding = "learned"  # "learned" (a table) or "rope" (rotary q and k, no table)
  m.rope_theta = 10000.0  # RoPE base of global layers
  m.local_rope_theta = 0.0  # RoPE base of local layers (0: rope_theta)
  m.global_every = 1  # layer i attends globally when i % global_every == 0, else in a window
  m.local_window = 0  # window of local layers: keys with |i - j| <= local_window // 2
  m.embedding_norm = True  # a norm after the embeddings
  m.pooler = True  # the tanh pooler on [CLS] (False: pooled output = the [CLS] state)
  m.head_act = ""  # activation of the MLM transform ("" = hidden_act)
  m.head_bias = True  # bias of the MLM transform
  m.decoder_bias = True  # the MLM output bias
  m.tie_word_embeddings = True  # MLM decoder = the word-embedding table
  # Fine-tuning heads: "bert" (pooled -> dropout -> dense) or "modernbert" (transformers'
  # ModernBertFor*: dense, activation, norm -> dropout -> dense); fine-tuning takes init_from's.
  m.task_head = "bert"
  m.classifier_pooling = "cls"  # modernbert head: "cls" (the [CLS] state) or "mean" (real tokens)

  # --- data: see bertjax/data. ---------------------------------------------------------------------
  d = config.data = ml_collections.ConfigDict()
  d.source = "builtin"  # "builtin" (Python's docs), globs "a/*.txt,gs://b/*.parquet", "tfds:name/cfg:feature"
  d.tfds_data_dir = ""  # TFDS data_dir for tfds: sources ("" = TFDS default); never downloads
  d.tfds_split = "train"  # TFDS split read for tfds: sources (held-out documents are taken from it)
  d.text_column = "text"  # the column (Parquet) or field (JSON Lines) holding a document's text
  d.language = "en"  # ISO 639 code: the sentence rules of Parquet, JSON Lines and TFDS documents
  d.tokenizer = "sentencepiece"  # "sentencepiece" (trained), "wordpiece" (vocab.txt), "huggingface"
  d.vocab_path = ""  # .model, vocab.txt or tokenizer.json; "" = SentencePiece trained per source
  d.spm_vocab_size = 8000  # pieces of a SentencePiece vocabulary trained when none exists yet
  d.do_lower_case = True  # lower-case (and, for WordPiece, strip accents): the uncased models
  d.max_seq_length = 128  # L: tokens per sequence, [CLS] A [SEP] B [SEP] plus padding
  d.max_predictions_per_seq = 20  # M: masked positions per sequence (20 at 128, 76 at 512 in MLPerf)
  d.masked_lm_prob = 0.15  # fraction of non-special tokens to predict (stochastically rounded)
  d.mask_token_prob = 0.8  # of the predicted tokens: replaced by [MASK]
  d.random_token_prob = 0.1  # of the predicted tokens: a random real token instead (rest unchanged)
  d.whole_word_masking = False  # mask all pieces of a word together (word starts from the vocabulary)
  d.nsp = True  # next-sentence pairs; False = MLM-only full-length chunks (labels all 0)
  d.short_seq_prob = 0.1  # chance a document targets a random shorter length, as the original
  d.dupe_factor = 5  # pairings drawn per training document at preparation (masks are drawn online)
  d.eval_dupe_factor = 5  # pairings per held-out document: more distinct eval pairs from little text
  d.eval_fraction = 0.1  # share of documents held out for evaluation (chosen by a hash of the text)
  d.num_shards = 16  # training TFRecord shards: >= the number of hosts (hundreds for Wikipedia)
  d.num_eval_shards = 2  # held-out TFRecord shards
  d.prepare_seed = 12345  # seed of pair drawing at preparation (the original's default)
  d.prepare_workers = 0  # processes preparing shards in parallel (0 = one per CPU)
  d.prepare_engine = "local"  # "local" (processes of this machine / each pod host) or "beam"
  d.beam_pipeline_options = ""  # "beam": "runner=DataflowRunner,project=p,..." ("": DirectRunner)
  d.input_split_bytes = 64 << 20  # input read in pieces of this size (cut at blank lines) in parallel
  d.max_shard_bytes = 64 << 20  # text one worker holds to build a shard (~22x in memory); more: error
  d.prepared_dir = ""  # where shards + manifest live ("" = cache_dir/<source>-L<len>-<settings hash>)
  d.cache_dir = ".cache/bertjax"  # root of the settings-named prepared-data folders
  d.shuffle_window = 16384  # sequences permuted together; shards are also reordered every epoch
  d.packing = False  # True: several sequences per training row (best-fit in each shuffle window)
  d.max_sequences_per_row = 3  # S: most sequences one packed row holds (MLM slots: S x M per row)
  d.prefetch_batches = 4  # batches tf.data prepares ahead of the training step
  d.max_replaced_char_share = 0.01  # a source file with more invalid UTF-8 (U+FFFD) is refused
  d.max_line_chars = 20_000  # a longer line is refused, naming file and line (0: no limit)
  d.max_document_pair_share = 0.05  # warn when one document yields more of a split's pairs

  # --- train: see bertjax/training/train.py and bertjax/training/optimizer.py. ---------------------
  t = config.train = ml_collections.ConfigDict()
  t.batch_size = 256  # global batch: rows per update, all hosts (a row = a sequence unless packing)
  t.num_microbatches = 1  # gradient accumulation: the batch is processed in this many slices
  t.num_train_steps = 1_000_000  # optimizer updates; the learning rate reaches 0 here
  t.seed = 0  # init, dropout (separate streams: train.rng_streams) and the order of training data
  t.optimizer = "adamw"  # "adamw" (the original, no bias correction) or "lamb" (large batches)
  t.learning_rate = 1e-4  # peak learning rate, reached at the end of warmup
  t.warmup_steps = 10_000  # linear warmup from 0; then linear decay to 0 at num_train_steps
  t.schedule = "linear"  # "linear" (the original) or "wsd": warmup, hold, then 1-sqrt decay to 0
  t.decay_steps = 0  # wsd: the last steps that decay (the rest after warmup hold the peak)
  t.weight_decay = 0.01  # decoupled weight decay; never on LayerNorm parameters or biases
  t.adam_b1 = 0.9  # first-moment decay
  t.adam_b2 = 0.999  # second-moment decay
  t.adam_eps = 1e-6  # added to sqrt(v)
  t.bias_correction = False  # the original has none; NVIDIA's LAMB recipe sets True
  t.max_grad_norm = 1.0  # clip gradients to this global norm (0 disables)
  # The loop (bertjax/training/loop.py):
  t.log_every_steps = 100  # a console line, TensorBoard and metrics.jsonl every this many steps
  t.eval_every_steps = 10_000  # held-out evaluation every this many steps (0: only at the end)
  t.eval_sequences = 10_000  # held-out sequences per evaluation, always the same ones (0: all)
  t.profile_start_step = -1  # first step of a profiler trace in workdir/profile (-1: none)
  t.profile_num_steps = 5  # steps the profiler trace covers
  # Several processes: one that makes no progress (no step or evaluation batch done) for this many
  # seconds is named and the run ended, exit status 75, to be resumed (bertjax/parallel/watchdog.py; 0: off)
  t.watchdog_seconds = 300

  # --- checkpoint: see bertjax/training/checkpoint.py. ----------------------------------------------
  c = config.checkpoint = ml_collections.ConfigDict()
  c.save_every_steps = 5_000  # also saved at the end and on SIGTERM (preemption)
  c.keep = 3  # newest checkpoints kept in workdir/checkpoints
  c.async_save = True  # write in the background while training goes on
  c.init_from = ""  # parameters to start from when the workdir has no checkpoint: any folder of
  #                   weights bertjax reads (another run's workdir, e.g. phase 1; the kinds:
  #                   bertjax/weights/reader.py); its vocabulary becomes the run's when data.vocab_path is ""
  c.init_from_other_vocab = False  # True: take init_from's weights although its tokenizer differs

  # --- mesh: see bertjax/parallel/sharding.py. -------------------------------------------------------
  mesh = config.mesh = ml_collections.ConfigDict()
  # Mesh axis sizes. ICI: devices inside one slice (one -1 takes the devices left over); DCN:
  # slices of a multi-slice job (one -1 takes the slices left over). Axis size = ici x dcn.
  mesh.ici_data = -1  # data parallelism: splits the batch, replicates parameters
  mesh.ici_fsdp = 1  # splits the batch and the parameters / optimizer state (ZeRO-3 style)
  mesh.ici_tensor = 1  # splits heads and the MLP (Megatron); must divide num_heads
  mesh.dcn_data = -1  # data parallelism across slices (the usual choice: least DCN traffic)
  mesh.dcn_fsdp = 1  # fsdp across slices
  mesh.dcn_tensor = 1  # tensor parallelism across slices (rarely wise: DCN is slow)
  # Logical axis name -> mesh axis (or axes, or None = replicated): bertjax.sharding.DEFAULT_RULES
  # (batch over data x fsdp, parameters' "embed" over fsdp, heads and MLP over tensor, the
  # vocabulary whole; the table and its reasons are in bertjax/parallel/sharding.py). Override here.
  mesh.logical_axis_rules = sharding.DEFAULT_RULES

  return config


def parse_arg(arg: str | None) -> dict[str, str]:
  """`configs/bert_base.py:phase=2,foo=bar` -> {"phase": "2", "foo": "bar"}."""
  out = {}
  for item in filter(None, (arg or "").split(",")):
    key, sep, value = item.partition("=")
    if not sep:
      raise ValueError(f"Config argument {item!r} is not key=value (e.g. phase=2)")
    out[key.strip()] = value.strip()
  unknown = set(out) - {"phase"}
  if unknown:
    raise ValueError(f"Unknown config arguments {sorted(unknown)}; known: ['phase']")
  return out


def set_phase(config, phase: str | int, total_steps: int) -> None:
  """The paper's two-phase recipe: 90% of the steps at length 128, then 10% at 512.

  Phase 2 starts from phase 1's weights: pass `--config.checkpoint.init_from=PHASE1_WORKDIR`
  (the position table already has 512 rows in phase 1, so the parameters fit unchanged).
  Both phases pack sequences into rows (`data.packing`): on the data benchmark's long documents
  padding is 9% of unpacked rows at 128 and 22% at 512 (on short documents 20% and 49%), and
  packing turns it into 1.09x and 1.23x the useful tokens per step (docs/data.md#packing).
  `train.batch_size` then counts rows of about 1.1 (phase 1) and 1.25 (phase 2) sequences.
  """
  phase = int(phase)
  if phase not in (1, 2):
    raise ValueError(f"phase={phase}; the recipe has phases 1 (length 128) and 2 (length 512)")
  d, t = config.data, config.train
  d.packing = True
  if phase == 1:
    d.max_seq_length, d.max_predictions_per_seq = 128, 20
    t.num_train_steps = total_steps * 9 // 10
  else:
    d.max_seq_length, d.max_predictions_per_seq = 512, 76  # 15% of 512, as MLPerf
    t.num_train_steps = total_steps - total_steps * 9 // 10
    t.warmup_steps = min(t.warmup_steps, t.num_train_steps // 10)

def set_accelerator(config) -> None:
  """The released sizes' settings for accelerators, chosen by compiling each for v5p-8, v6e-8 and
  v5e-8 and reading the roofline (`python -m bertjax.tune`; docs/performance.md, "The roofline of
  a TPU compile"): bfloat16 matmuls; the layers straight (not scanned); the parameters and
  optimizer state split
  over the slice's chips (fsdp: each chip updates its share, where data parallelism had every
  chip update all of them, a third of a BERT-Base step's HBM bytes on v6e); the backward keeps
  every activation (remat "none": XLA makes the cheap ones again by itself), and recomputes
  the MLM head's logits rather than keeping them (recompute_mlm_logits: 3% of them at L 512); the
  MLP runs as one Pallas kernel that keeps its F-wide intermediate in VMEM (mlp_impl "auto":
  where remat keeps the pre-activation, "none" or "dots_kernels", the kernel's backward reads
  what its forward wrote, "pallas_kept", on v6e, v5e and v5p; on v6e elsewhere it makes it
  again, "pallas"; XLA's MLP elsewhere). On v6e and v5p q, k and v are one
  product, x @ [Wq Wk Wv] (qkv_product "auto"; the parameters the same three), where XLA reads
  x once and the backward makes one weight gradient; on v5e three, where one moved more bytes.
  Attention is bertjax's fused kernel in both phases (attention_impl "auto"): each head's
  [L, L] scores, probabilities and dropout stay in VMEM, where XLA's were half of BERT-Base's
  bytes at length 128 and most of them at 512; it keeps the paper's dropout on attention
  probabilities (0.1), which the splash kernel has not. Off a TPU "auto" runs the kernel's
  arithmetic by XLA (the same dropout bits), and where a length does not fit the kernel (a
  fine-tuning task's, which inherits the setting) XLA's attention; on a GPU
  `--config.model.attention_impl=cudnn --config.model.attention_dropout=0` is faster.
  """
  m = config.model
  m.dtype = "bfloat16"
  # Straight layers in both phases, and nothing recomputed: on every chip the compiled step is
  # faster than the scanned loop's or no slower, by the roofline, and at length 512 faster than
  # under remat "auto", within memory (docs/performance.md, "Straight layers at length 128,
  # nothing recomputed" and "Every released config, compiled"). A run resumes in either layout
  # (training/relayout.py), so a user may scan to compile faster.
  m.scan_layers = False
  m.remat_policy = "none"
  m.recompute_mlm_logits = True
  m.mlp_impl = "auto"
  m.qkv_product = "auto"
  config.mesh.ici_data, config.mesh.ici_fsdp = 1, -1
  m.attention_impl = "auto"

