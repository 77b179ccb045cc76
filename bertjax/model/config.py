"""BertConfig: every key of a BERT (or ModernBERT-style) encoder and its checks, the activations,
remat policies and the other named choices it offers; the model keys a fine-tuning run inherits.
The modules that build the encoder from it are bertjax/model/encoder.py's; what only reads a config (the
formats, checkpoints, FLOPs) imports it from here.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from bertjax.errors import Refusal
from bertjax.model import attention


def gelu(x):
  """Exact GELU, x·Φ(x), in the original release's words: 0.5·x·(1 + erf(x/√2)).

  `jax.nn.gelu(approximate=False)` writes Φ through erfc, which XLA's CPU backend lowers to a
  longer polynomial with an exp: on [4096, 1024] float32 its forward takes 2.6 ms against 1.1 ms
  for this form, its jitted VJP 2.7 against 2.1 ms, and the 4-layer, 256-wide train step is
  10-12% faster (median) with this form. The two agree within 1e-6; erf's form loses relative
  precision only below x = -5, where GELU is smaller than 2e-6.
  """
  return 0.5 * x * (1.0 + jax.lax.erf(x * np.asarray(1 / np.sqrt(2), x.dtype)))


ACTIVATIONS = {
    "gelu": gelu,
    "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),
    "silu": jax.nn.silu,  # with mlp_type="gated": SwiGLU
}

# What nn.remat may keep from the forward pass instead of recomputing it.
REMAT_POLICIES = {
    "none": None,  # no rematerialisation at all
    "full": jax.checkpoint_policies.nothing_saveable,  # keep only layer inputs
    # Keep the outputs of weight matmuls (no batch dimension in the dot); recompute attention,
    # softmax, GELU and LayerNorm: most of the memory saving for a fraction of the compute.
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "dots_all": jax.checkpoint_policies.checkpoint_dots,  # keep every matmul output
    # "dots", and the fused MLP kernels' output (mlp_impl "pallas"), which is no matmul's: the
    # forward kernel then does not run again in the backward. Fewer FLOPs, more bytes; with
    # XLA's MLP the same as "dots" (docs/performance.md, "The MLP in one kernel"). With
    # "pallas_kept" also the pre-activation its forward writes for the backward; with the kernel
    # that makes a pre-norm layer's q, k and v (qkv_kernel), its outputs, as "dots" kept theirs.
    "dots_mlp": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names("mlp_output", "qkv", "mlp_hidden")),
    # "dots_mlp", and the fused attention kernel's output (attention_impl "fused"): neither
    # kernel's forward runs again in the backward.
    "dots_kernels": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names("mlp_output", "qkv", "mlp_hidden",
                                                      "attention_output")),
    # "dots_kernels" but the MLP's pre-activation: the kernels' outputs alone. Under it
    # mlp_impl "auto" gives "pallas" (the backward kernel makes the pre-activation again), where
    # a [tokens, F] residual kept in the scanned loop's stack costs more bytes than its product.
    "dots_outputs": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names("mlp_output", "qkv", "attention_output")),
}

# remat_policy "auto": "dots_kernels" (the steps bound by their FLOPs keep what the kernels' second
# forward run would cost), but "dots_outputs" on these chips (device_kind as jax names them),
# whose steps at length 512 are bound by HBM, where the MLP's kept pre-activation costs more
# bytes than the product that makes it again (docs/performance.md, "The kernels' outputs kept,
# the MLP's pre-activation made again"). At 128 every chip's steps are bound by FLOPs, and they
# take "dots_kernels". The released configs keep everything instead ("none": configs/base.py).
REMAT_AUTO_OUTPUTS_ON = ("TPU v6 lite",)


def chosen_remat(policy: str, device) -> str:
  """What remat_policy `policy` means on `device`: "auto" settled (REMAT_AUTO_OUTPUTS_ON),
  another policy as it is."""
  if policy != "auto":
    return policy
  return ("dots_outputs" if getattr(device, "device_kind", "") in REMAT_AUTO_OUTPUTS_ON
          else "dots_kernels")


def rematted(layer_cls, config: BertConfig, scanned: bool):
  """`layer_cls` under the config's remat policy (itself where that is "none")."""
  if config.remat_policy == "none":
    return layer_cls
  # prevent_cse=False is safe only inside nn.scan: the loop already keeps XLA from merging the
  # recomputation with the forward pass. Unrolled, XLA would CSE the recomputed activations back
  # into the saved ones and the remat would silently save nothing.
  # "auto": train.build settles it for its mesh's chips; outside it, here.
  policy = chosen_remat(config.remat_policy, jax.devices()[0])
  return nn.remat(layer_cls, policy=REMAT_POLICIES[policy], prevent_cse=not scanned)


# q, k and v as one product, x @ [Wq Wk Wv] (the same three parameters, joined in the step), on
# the chips where compiling found it moves fewer HBM bytes: v6e and v5p. On v5e XLA copied the
# product's thirds out for the attention kernel and wrote the joined gradient whole before its
# products, more bytes than three products (docs/performance.md, "q, k and v in one product").
QKV_ONE_PRODUCT_ON = ("TPU v6 lite", "TPU v5")


def chosen_qkv(setting: str, device) -> str:
  """What qkv_product `setting` means on `device`: "auto" settled (QKV_ONE_PRODUCT_ON), another
  setting as it is."""
  if setting != "auto":
    return setting
  return "one" if getattr(device, "device_kind", "") in QKV_ONE_PRODUCT_ON else "three"


ATTENTION_IMPLS = attention.IMPLS
CUDNN_PACKINGS = ("mask", "segments")
POSITION_INITS = ("normal", "sinusoidal")
QUERY_KEY_INITS = ("independent", "shared")
NORM_POSITIONS = ("post", "pre")
NORM_TYPES = ("layernorm", "rmsnorm")
MLP_TYPES = ("dense", "gated")
MLP_IMPLS = ("xla", "xla_remade", "pallas", "pallas_kept", "auto")
QKV_PRODUCTS = ("three", "one", "auto")
POSITION_EMBEDDINGS = ("learned", "rope")

# Each field's roles, stated once on the field (`_field(default, *roles)`); the tuples below are
# read from them:
#   shape         sets the shape or the layout of the parameters: a checkpoint that differs in one
#                 is another model (bertjax/training/checkpoint.py refuses to resume it)
#   architecture  a modern option that adds, drops or reorders parameters, or changes what the
#                 stored ones mean (pre- vs post-LN, RoPE vs a table): compared like a shape field,
#                 but a fine-tuning config need not spell it out (init_from's value is taken)
#   inherited     a fine-tuning config leaves it at 0 / "" to take init_from's value
#                 (configs/finetune.py, bertjax/finetune/job/run.py): the encoder's shape (its layer
#                 layout is the task's own) and how it computes; a new head is initialized with
#                 init_from's initializer_range
#   head          a key of the fine-tuning head: a run's checkpoints hold its head, so resuming
#                 them under another would fail inside the restore (or change the pooling
#                 silently); init_from reads the encoder alone and may change it
#   modern        a departure from the paper's architecture that BERT's formats (Hugging Face
#                 BertForPreTraining, Google's) cannot write (BertConfig.modern_options)
ROLES = ("shape", "architecture", "inherited", "head", "modern")


def _field(default, *roles: str):
  assert set(roles) <= set(ROLES), roles
  return dataclasses.field(default=default, metadata={"roles": roles})


TASK_HEADS = ("bert", "modernbert")
CLASSIFIER_POOLINGS = ("cls", "mean")


@dataclasses.dataclass(frozen=True)
class BertConfig:
  """Hyper-parameters of the encoder. Defaults are BERT-Base as released."""

  vocab_size: int = _field(30522, "shape", "inherited")
  hidden_size: int = _field(768, "shape", "inherited")
  num_layers: int = _field(12, "shape", "inherited")
  num_heads: int = _field(12, "shape", "inherited")
  intermediate_size: int = _field(3072, "shape", "inherited")
  max_position_embeddings: int = _field(512, "shape", "inherited")
  type_vocab_size: int = _field(2, "shape", "inherited")
  hidden_dropout: float = 0.1
  attention_dropout: float = 0.1
  initializer_range: float = _field(0.02, "inherited")
  layer_norm_eps: float = _field(1e-12, "inherited")
  hidden_act: str = _field("gelu", "inherited")
  dtype: str = _field("float32", "inherited")
  param_dtype: str = _field("float32", "inherited")
  scan_layers: bool = _field(False, "shape")
  scan_unroll: int = 1  # scanned layers per iteration of the compiled loop (nn.scan's unroll)
  remat_policy: str = _field("none", "inherited")
  attention_impl: str = _field("xla", "inherited")
  # "three" (a product each for q, k and v), "one" (x @ [Wq Wk Wv] where the fused attention
  # kernel reads them, its biases apart, and no mesh axis splits the heads: x read once, one
  # weight gradient and one input gradient; elsewhere three) or "auto" (chosen_qkv: "one" on
  # the TPUs where it moved fewer bytes). The parameters are the same three either way.
  qkv_product: str = "three"
  cudnn_packing: str = "mask"  # packed rows on cuDNN: "mask" (a bias) or "segments" (attention.py)
  # Pre-training scores the MLM logits where they are made and recomputes them in the backward
  # instead of keeping them (heads.decoded_scores): fewer HBM bytes, one more head matmul. On a
  # TPU the forward's logits never leave VMEM (mlm_kernel).
  recompute_mlm_logits: bool = False
  # "xla", "xla_remade" (XLA's products, and under remat "none" the backward keeps the
  # pre-activation alone and makes the activation again from it, where "xla" keeps the
  # activation's own intermediates too; under another policy the same as "xla"), "pallas" (the
  # MLP's products in one kernel whose F-wide intermediate stays in VMEM: mlp_kernel.py; dense
  # or gated), "pallas_kept" (the same, its backward reading the pre-activation the
  # forward wrote rather than making it again) or "auto" (the kernels on the TPUs where they
  # measured faster, mlp_choice.FASTER_ON, kept where remat keeps it; XLA's products elsewhere,
  # "xla_remade" on other TPUs)
  mlp_impl: str = "xla"
  # "normal" (the original) or "sinusoidal" (see sinusoidal_init)
  position_init: str = _field("normal", "inherited")
  query_key_init: str = _field("independent", "inherited")  # or "shared": see SelfAttention
  # Options of the encoders that came after the paper (ModernBERT, NeoBERT, Cramming); each is
  # independent, and the defaults are the paper's model.
  # "post" (the paper) or "pre": norms before sub-layers + final norm
  norm_position: str = _field("post", "architecture", "modern")
  # or "rmsnorm" (a scale, no bias, no centring)
  norm_type: str = _field("layernorm", "architecture", "modern")
  norm_bias: bool = _field(True, "architecture", "modern")  # the LayerNorms' bias (ModernBERT: off)
  # biases of the q, k, v and output projections
  attention_bias: bool = _field(True, "architecture", "modern")
  mlp_bias: bool = _field(True, "architecture", "modern")  # biases of the feed-forward projections
  # or "gated": act(x W) * (x G) -> W_o; GeGLU with gelu, SwiGLU with silu
  mlp_type: str = _field("dense", "architecture", "modern")
  # or "rope": rotary q and k, no position table
  position_embedding: str = _field("learned", "architecture", "modern")
  rope_theta: float = 10000.0  # RoPE base of the global layers
  local_rope_theta: float = 0.0  # RoPE base of the local layers; 0 = rope_theta
  # layer i attends globally when i % global_every == 0, locally otherwise
  global_every: int = _field(1, "modern")
  local_window: int = 0  # local layers see keys with |i - j| <= local_window // 2 (ModernBERT's)
  embedding_norm: bool = _field(True, "architecture", "modern")  # a norm after the embeddings
  # the tanh pooler; False: the pooled output is the [CLS] state itself
  pooler: bool = _field(True, "architecture", "modern")
  head_act: str = ""  # activation of the MLM transform; "" = hidden_act
  # bias of the MLM transform's dense layer
  head_bias: bool = _field(True, "architecture", "modern")
  # the MLM output bias over the vocabulary
  decoder_bias: bool = _field(True, "architecture", "modern")
  # decoder = word-embedding table; False: its own [V, D] matrix
  tie_word_embeddings: bool = _field(True, "architecture", "modern")
  # Fine-tuning heads (bertjax/model/heads.py): "bert", the original's (pooled -> dropout -> dense), or
  # "modernbert", transformers' ModernBertFor* (dense, activation, norm -> dropout -> dense) over
  # the [CLS] state or, classifier_pooling="mean", the mean over real tokens.
  task_head: str = _field("bert", "inherited", "head")
  classifier_pooling: str = _field("cls", "inherited", "head")

  def __post_init__(self):
    problems = []
    for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size",
                 "max_position_embeddings", "global_every", "scan_unroll"):
      if int(getattr(self, name)) < 1:
        problems.append(f"{name}={getattr(self, name)} must be a positive integer")
    if int(self.type_vocab_size) < 0:
      problems.append(f"type_vocab_size={self.type_vocab_size} must be >= 0 (0: no segment table)")
    for name, allowed in (("norm_position", NORM_POSITIONS), ("norm_type", NORM_TYPES),
                          ("mlp_type", MLP_TYPES), ("mlp_impl", MLP_IMPLS),
                          ("qkv_product", QKV_PRODUCTS),
                          ("position_embedding", POSITION_EMBEDDINGS)):
      if getattr(self, name) not in allowed:
        problems.append(f"{name}={getattr(self, name)!r}; choose one of {allowed}")
    for name, allowed in (("task_head", TASK_HEADS), ("classifier_pooling", CLASSIFIER_POOLINGS)):
      if getattr(self, name) not in allowed:
        problems.append(f"{name}={getattr(self, name)!r}; choose one of {allowed}")
    if self.classifier_pooling == "mean" and self.task_head != "modernbert":
      problems.append("classifier_pooling='mean' is the ModernBERT head's; BERT's pools [CLS] "
                      "(set task_head='modernbert' or classifier_pooling='cls')")
    if self.head_act and self.head_act not in ACTIVATIONS:
      problems.append(f"head_act={self.head_act!r}; choose one of {sorted(ACTIVATIONS)} or ''")
    if self.global_every > 1 and self.local_window < 2:
      problems.append(f"global_every={self.global_every} makes local layers but local_window="
                      f"{self.local_window}; set local_window (e.g. 128) or global_every=1")
    if self.global_every == 1 and self.local_window:
      problems.append(f"local_window={self.local_window} has no local layer to act in "
                      "(global_every=1); set global_every > 1 or local_window=0")
    if self.position_embedding == "rope" and self.num_heads >= 1 and self.head_size % 2:
      problems.append(f"position_embedding='rope' rotates pairs of head dimensions; head size "
                      f"{self.head_size} is odd")
    for name in ("rope_theta", "local_rope_theta"):
      if getattr(self, name) < 0 or (name == "rope_theta" and not self.rope_theta):
        problems.append(f"{name}={getattr(self, name)} must be positive")
    if self.num_heads >= 1 and self.hidden_size % self.num_heads:
      problems.append(
          f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}; "
          f"pick num_heads among the divisors of {self.hidden_size}")
    if self.hidden_act not in ACTIVATIONS:
      problems.append(f"hidden_act={self.hidden_act!r}; choose one of {sorted(ACTIVATIONS)}")
    if self.remat_policy not in REMAT_POLICIES and self.remat_policy != "auto":
      problems.append(f"remat_policy={self.remat_policy!r}; choose one of "
                      f"{list(REMAT_POLICIES) + ['auto']}")
    if self.position_init not in POSITION_INITS:
      problems.append(f"position_init={self.position_init!r}; choose one of {POSITION_INITS}")
    if self.query_key_init not in QUERY_KEY_INITS:
      problems.append(
          f"query_key_init={self.query_key_init!r}; choose one of {QUERY_KEY_INITS}")
    if self.cudnn_packing not in CUDNN_PACKINGS:
      problems.append(f"cudnn_packing={self.cudnn_packing!r}; choose one of {CUDNN_PACKINGS}")
    if self.attention_impl not in ATTENTION_IMPLS:
      problems.append(f"attention_impl={self.attention_impl!r}; choose one of {ATTENTION_IMPLS}")
    for name in ("hidden_dropout", "attention_dropout"):
      if not 0.0 <= getattr(self, name) < 1.0:
        problems.append(f"{name}={getattr(self, name)} must be in [0, 1)")
    if self.attention_impl in ("cudnn", "splash") and self.attention_dropout > 0:
      problems.append(f"attention_impl={self.attention_impl!r} has no dropout on attention "
                      f"probabilities (attention_dropout={self.attention_dropout}); set "
                      "attention_dropout=0.0 or use attention_impl='fused' (TPU) or 'xla'")
    for name in ("dtype", "param_dtype"):
      try:
        jnp.dtype(getattr(self, name))
      except TypeError:
        problems.append(f"{name}={getattr(self, name)!r} is not a dtype name (e.g. 'bfloat16')")
    if problems:
      raise Refusal("Invalid BertConfig: " + "; ".join(problems))

  @property
  def head_size(self) -> int:
    return self.hidden_size // self.num_heads

  @property
  def compute_dtype(self):
    return jnp.dtype(self.dtype)

  @property
  def storage_dtype(self):
    return jnp.dtype(self.param_dtype)

  @property
  def has_local_layers(self) -> bool:
    return self.global_every > 1 and self.num_layers > 1

  def is_local(self, layer_id):
    """Whether layer `layer_id` (an int, or a traced index under nn.scan) attends locally."""
    return (layer_id % self.global_every) != 0 if self.global_every > 1 else False

  def modern_options(self) -> list[str]:
    """The settings that depart from the paper's architecture ("norm_position='pre'", ...): what
    the exporters to BERT's formats (Hugging Face BertForPreTraining, Google's) cannot write."""
    paper = BertConfig()
    out = [f"{k}={getattr(self, k)!r}" for k in fields_with("modern")
           if getattr(self, k) != getattr(paper, k)]
    if self.type_vocab_size < 1:
      out.append(f"type_vocab_size={self.type_vocab_size}")
    if self.head_act not in ("", self.hidden_act):
      out.append(f"head_act={self.head_act!r}")
    return out

  @property
  def skips_first_attention_norm(self) -> bool:
    # Pre-LN right after the embedding norm would normalise twice in a row: layer 0 reads the
    # embedding norm's output as it is (ModernBERT's layer 0 has no attention norm).
    return self.norm_position == "pre" and self.embedding_norm

  @classmethod
  def from_dict(cls, values: dict[str, Any], **overrides) -> "BertConfig":
    """Builds a config from a mapping (e.g. `config.model`), naming any unknown key."""
    values = {**dict(values), **overrides}
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
      raise Refusal(f"Unknown BertConfig keys {unknown}; known keys are {sorted(known)}")
    return cls(**values)


def fields_with(role: str) -> tuple[str, ...]:
  """BertConfig's fields that have `role` (ROLES), in their order of declaration."""
  if role not in ROLES:
    raise ValueError(f"no field role {role!r}; the roles are {ROLES}")
  return tuple(f.name for f in dataclasses.fields(BertConfig) if role in f.metadata.get("roles", ()))


SHAPE_FIELDS = fields_with("shape")
ARCHITECTURE_FIELDS = fields_with("architecture")
INHERITED_FIELDS = fields_with("inherited")
HEAD_FIELDS = fields_with("head")
