"""The one reader of weights: what a path holds (`inspect`) and its parameters (`read`).

Every caller that takes weights from a path goes through here: pre-training's and fine-tuning's
`checkpoint.init_from`, `pretrained.load_pretrained`, the exporters of `bertjax.convert` and
`bertjax.predict`. A path is one of five kinds (KINDS), tested in this order (the first that fits
decides):

  workdir      a bertjax run (pre-training or fine-tuning), or its checkpoints/ folder: the
               newest checkpoint (or the step asked for) and the model recorded beside it; the
               vocabulary the run copied in (tokenizer.json), or for a run older than that copy,
               the one its config.json names
  converted    written by `convert.hf import` or `convert.google import`: bert_config.json in
               bertjax's keys (num_layers) and params/ (orbax); vocab.txt and tokenizer.json (its
               casing and fingerprint) when the import had a vocabulary
  google       a folder of Google's release: bert_config.json in Google's keys
               (num_hidden_layers) and bert_model.ckpt.index + data (read by formats/tf_bundle.py)
  huggingface  a Hugging Face BERT folder: config.json (model_type "bert") and model.safetensors;
               vocab.txt, its casing from tokenizer_config.json (else its tokenizer.json)
  modernbert   a Hugging Face ModernBERT folder: config.json (model_type "modernbert") and
               model.safetensors (bertjax/formats/modernbert.py); its tokenizer.json (byte-level
               BPE, bertjax/data/hf_tokenizer.py), casing and special tokens in the file
A fine-tuned transformers class (BertFor..., ModernBertFor...) is recorded as its config.json says
it (`task_class`: the class, its labels, problem_type); which task family that is, fine-tuning
says (bertjax/finetune/families/).

Casing of a folder's vocabulary (bertjax/formats/vocabulary.py), in this order: what bertjax's
tokenizer.json record says (told from Hugging Face's file of that name by content), what
tokenizer_config.json says (Hugging Face), what the folder's name says (the original's
`validate_case_matches_checkpoint` reading: uncased_*, cased_*, ...), what a Hugging Face
tokenizer.json's normalizer does where it is the folder's only vocabulary, else unknown (a run
then lower-cases, as the original's flag defaults). Local paths are read without TensorFlow
(bertjax/files.py).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

import jax
import numpy as np
import orbax.checkpoint as ocp

from bertjax import errors, files
from bertjax.errors import Refusal
from bertjax.formats import (converted, google, hf, modernbert, modernbert_tasks, tf_bundle,
                             vocabulary)
from bertjax.model.config import BertConfig
from bertjax.training import checkpoint as checkpoint_lib

KINDS = ("workdir", "converted", "google", "huggingface", "modernbert")
ENCODER = "bert"  # the encoder's subtree in every bertjax model's parameters


@dataclasses.dataclass(frozen=True)
class Weights:
  """What `inspect` found at a path; nothing of its arrays is read yet."""

  path: str  # the folder: a run's workdir (not its checkpoints/), or the folder itself
  kind: str  # one of KINDS
  config: BertConfig  # the stored model, its layer layout (scan_layers) included
  subtrees: tuple[str, ...]  # top-level parameter trees stored: "bert", "mlm", "nsp", a task head
  vocab_file: str | None = None
  tokenizer_kind: str | None = None  # "wordpiece", "sentencepiece" or "huggingface"
  do_lower_case: bool | None = None  # None: the source does not say
  casing_why: str = ""
  fingerprint: str | None = None  # of the vocabulary, when recorded with the weights
  checkpoints: str | None = None  # workdir: the checkpoints folder read
  step: int | None = None  # workdir: the checkpoint step read
  meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # workdir: its record
  task_class: hf.TaskClass | None = None  # a fine-tuned transformers class: what it says
  # Parts of the encoder the folder does not hold, which a model with them starts fresh: the
  # pooler of a task class that builds none (BertForTokenClassification, ...QuestionAnswering).
  lacks: tuple[str, ...] = ()

  @property
  def lower(self) -> bool:
    """The casing to use: the source's, else lower-cased as the original's flag defaults."""
    return True if self.do_lower_case is None else self.do_lower_case

  def describe(self) -> str:
    where = f" step {self.step}" if self.step is not None else ""
    return f"{self.path} ({self.kind}{where})"


class NotWeightsError(FileNotFoundError):
  """The path is none of the kinds of weights folder bertjax reads."""


def _is_google_config(path: str) -> bool:
  try:
    return "num_hidden_layers" in files.read_json(path)
  except (OSError, ValueError):
    return False


def _kind(path: str, checkpoints: str) -> tuple[str, str] | None:
  """(kind, folder) of `path` under the one order of the module docstring, None if none fits."""
  base = os.path.basename(path.rstrip("/"))
  if base == checkpoints and files.isdir(path):
    return "workdir", os.path.dirname(path.rstrip("/")) or "."
  if files.isdir(os.path.join(path, checkpoints)):
    return "workdir", path
  if not files.isdir(path):
    return None
  names = set(files.listdir(path))
  if converted.CONFIG_FILE in names and "params" in names and not _is_google_config(
      os.path.join(path, converted.CONFIG_FILE)):
    return "converted", path
  if google.CONFIG_FILE in names and any(n.endswith(".index") for n in names):
    return "google", path
  if "config.json" in names and "model.safetensors" in names:
    return _hf_model_type(os.path.join(path, "config.json")), path
  return None


def _hf_model_type(config_json: str) -> str:
  """The kind of a Hugging Face folder: ModernBERT by its model_type, else BERT (whose reader
  refuses other types by name)."""
  try:
    model_type = files.read_json(config_json).get("model_type")
  except (OSError, ValueError):
    return "huggingface"  # its reader names the damage
  return "modernbert" if model_type == "modernbert" else "huggingface"


def inspect(path: str, *, what: str = "path", checkpoints: str = "checkpoints",
            step: int | None = None) -> Weights:
  """What `path` holds: its kind, stored model, parameter subtrees, vocabulary and casing.

  `what` names the path in messages (the config key or flag it came from); `checkpoints` is the
  folder of a workdir to read ("best" for a fine-tuning run's best epoch); `step` a checkpoint
  step other than the newest.
  """
  if not files.exists(path):
    raise FileNotFoundError(f"{what}={path} does not exist")
  found = _kind(path, checkpoints)
  if found is None:
    if files.isdir(path) and "config.json" in set(files.listdir(path)):
      # A Hugging Face folder without its weights: name the one file it lacks.
      kind = _hf_model_type(os.path.join(path, "config.json"))
      name = "ModernBERT" if kind == "modernbert" else "Hugging Face BERT"
      raise NotWeightsError(
          f"{what}={path} holds a {name} config.json but no model.safetensors, the weights "
          "bertjax reads beside it: save the model with save_pretrained(..., "
          "safe_serialization=True) into the folder (a pytorch_model.bin is not read)")
    raise NotWeightsError(
        f"{what}={path} holds no weights bertjax reads: expected a bertjax workdir (with "
        f"{checkpoints}/), a folder written by `python -m bertjax.convert.hf import` or "
        "`convert.google import` (bert_config.json and params/), one of Google's released "
        "folders (bert_config.json and bert_model.ckpt.index), a Hugging Face BERT folder or a "
        "ModernBERT folder (config.json and model.safetensors)")
  kind, folder = found
  reader = {"workdir": _inspect_workdir, "converted": _inspect_converted,
            "google": _inspect_google, "huggingface": _inspect_huggingface,
            "modernbert": _inspect_modernbert}[kind]
  if kind == "workdir":
    return reader(folder, os.path.join(folder, checkpoints), step, what)
  return reader(folder, what)


def inspect_trained(path: str, *, what: str = "path", checkpoint: str = "best") -> Weights:
  """`inspect` for a model to use as it is (prediction, export): a fine-tuning workdir's best
  epoch (best/) where it has one, else the newest checkpoint; `checkpoint` is "best", "latest"
  or a step number. Other kinds of folder are read as `inspect` reads them."""
  step = None
  if checkpoint not in ("best", "latest"):
    try:
      step = int(checkpoint)
    except ValueError:
      raise Refusal(f"checkpoint={checkpoint!r}: use best, latest or a step number.") from None
  best = os.path.join(path, "best")
  if checkpoint == "best" and files.isdir(best) and any(
      name.isdigit() for name in files.listdir(best)):
    return inspect(path, what=what, checkpoints="best")
  # No best epoch (a pre-training run, or a fine-tuning run stopped before its first
  # evaluation): the newest checkpoint.
  return inspect(path, what=what, step=step)


# The kinds -------------------------------------------------------------------------------------

def _inspect_workdir(workdir: str, folder: str, step: int | None, what: str) -> Weights:
  ckpt = checkpoint_lib.Checkpointer.reader(folder)
  try:
    steps = ckpt.all_steps()
    if not steps:
      raise FileNotFoundError(f"{what}={folder} holds no checkpoint (the run saved none yet)")
    if step is None:
      step = steps[-1]
    elif step not in steps:
      raise FileNotFoundError(f"{what}={folder} has no step {step} (it has {steps})")
    try:
      meta = ckpt.read_meta(step)
      stored = ckpt.item_metadata(step, "params")
    except Exception as err:  # pylint: disable=broad-except
      if not checkpoint_lib.is_damage(err):
        raise
      raise _damaged(f"{what}={folder}", folder, step, steps, err) from None
  finally:
    ckpt.close()
  if "model" not in meta:
    raise Refusal(f"{what}={folder} step {step} records no model shape (its record has "
                  f"{sorted(meta)}); it was not written by bertjax's training loop")
  vocab = vocabulary.of_workdir(workdir)
  if vocab.get("fingerprint") is None:
    vocab["fingerprint"] = meta.get("tokenizer_fingerprint")
  return Weights(workdir, "workdir", BertConfig.from_dict(meta["model"]), tuple(sorted(stored)),
                 checkpoints=folder, step=step, meta=meta, **vocab)


def _damaged(where: str, folder: str, step: int, steps, err: BaseException
             ) -> errors.CheckpointDamagedError:
  """The one message of a damaged step of another run: which step, what, and the older one."""
  older = [s for s in steps if s < step]
  if older:
    fix = (f"Step {older[-1]} is the newest before it: move {os.path.join(folder, str(step))} "
           "away to use it.")
  elif os.path.basename(folder.rstrip("/")) == "best":
    # A fine-tuning run keeps one best epoch; its latest checkpoints are another copy of weights.
    fix = ("It holds no older step; the run's latest checkpoint is read with --checkpoint=latest "
           "(bertjax.predict, the exports).")
  else:
    fix = "It holds no older step."
  return errors.CheckpointDamagedError(
      f"{where}: its step {step} is damaged ({checkpoint_lib.damage_summary(err)}). " + fix)


def _inspect_converted(folder: str, what: str) -> Weights:
  config = converted.read_config(folder)
  with ocp.StandardCheckpointer() as checkpointer:
    try:
      stored = checkpointer.metadata(converted.params_dir(folder)).item_metadata
    except Exception as err:  # pylint: disable=broad-except
      raise errors.CheckpointDamagedError(
          f"{what}={folder}: its params/ cannot be read ({checkpoint_lib.damage_summary(err)}); "
          "import the weights again") from None
  return Weights(folder, "converted", config, tuple(sorted(stored)), **vocabulary.of_folder(folder))


def _inspect_google(folder: str, what: str) -> Weights:
  del what
  config = google.read_google_config(folder)
  names = tf_bundle.CheckpointReader(folder).keys()
  return Weights(folder, "google", config, (ENCODER,) + google.heads_in(names),
                 **vocabulary.of_folder(folder))


def _safetensors_names(folder: str, what: str) -> list[str]:
  """The tensor names of a Hugging Face folder's model.safetensors (its header alone)."""
  weights_file = os.path.join(folder, "model.safetensors")
  try:
    return hf.safetensors_names(weights_file)
  except Exception as err:  # pylint: disable=broad-except  (safetensors' own error type)
    raise errors.CheckpointDamagedError(
        f"{what}={folder}: {weights_file} cannot be read ({err}); it is cut short or not a "
        "safetensors file: save the model again (save_pretrained(..., safe_serialization=True))"
    ) from None


def _inspect_huggingface(folder: str, what: str) -> Weights:
  hf_config = files.read_json(os.path.join(folder, "config.json"), "the Hugging Face config")
  if hf_config.get("model_type", "bert") != "bert":
    raise NotWeightsError(f"{what}={folder} is a Hugging Face {hf_config['model_type']!r} model; "
                          "this reader takes model_type 'bert'")
  config = hf.config_from_hf(hf_config)
  names = _safetensors_names(folder, what)
  tokenizer_config = os.path.join(folder, vocabulary.HF_TOKENIZER_CONFIG)
  casing = files.read_json(tokenizer_config, "the tokenizer's config") if files.exists(
      tokenizer_config) else {}
  try:
    task = hf.task_in(hf_config, names)
  except ValueError as err:
    raise Refusal(f"{what}={folder}: {err}") from None
  return Weights(folder, "huggingface", config, (ENCODER,) + hf.heads_in(names),
                 **vocabulary.of_folder(folder, casing), task_class=task,
                 lacks=("pooler",) if hf.without_pooler(names) else ())


def _inspect_modernbert(folder: str, what: str) -> Weights:
  hf_config = files.read_json(os.path.join(folder, "config.json"), "the ModernBERT config")
  names = _safetensors_names(folder, what)
  try:
    config = modernbert.config_from_modernbert(hf_config)
    cls = modernbert_tasks.task_class(hf_config)
    # A fine-tuned class (ModernBertFor...) says its task as a workdir's task.json does.
    task = None if cls is None else hf.task_class(hf_config, cls)
    heads = modernbert_tasks.heads_in(names, hf_config)
  except ValueError as err:
    raise Refusal(f"{what}={folder}: {err}") from None
  # Its tokenizer.json (byte-level BPE), as a BERT folder's vocab.txt; a vocab.txt wins.
  return Weights(folder, "modernbert", config, (ENCODER,) + heads, **vocabulary.of_folder(folder),
                 task_class=task)


# Reading ---------------------------------------------------------------------------------------

def is_scanned(encoder: Mapping[str, Any]) -> bool:
  """Whether an encoder tree stacks its layers (`encoder/layers/layer`) for nn.scan."""
  return "layers" in encoder["encoder"]


def restack(encoder: Mapping[str, Any], num_layers: int, scan: bool,
            first_norm_bypassed: bool = False) -> dict:
  """Unrolled `encoder/layer_N` <-> scanned `encoder/layers/layer` (leading layer axis), numpy.

  `first_norm_bypassed` (BertConfig.skips_first_attention_norm): unrolled, layer 0 has no
  attention norm; scanned layers share one structure, so layer 0 carries an identity one that it
  bypasses, added here when stacking and dropped when unstacking.
  """
  layers = dict(encoder["encoder"])
  norm = "attention_layer_norm"
  if scan:
    per_layer = [dict(layers[f"layer_{i}"]) for i in range(num_layers)]
    if first_norm_bypassed and norm not in per_layer[0]:
      per_layer[0][norm] = {k: (np.ones_like(v) if k == "scale" else np.zeros_like(v))
                            for k, v in per_layer[0]["output_layer_norm"].items()}
    stacked = {"layers": {"layer": jax.tree.map(lambda *xs: np.stack(xs), *per_layer)}}
  else:
    stacked = {f"layer_{i}": jax.tree.map(lambda x, i=i: np.asarray(x)[i],
                                          layers["layers"]["layer"])
               for i in range(num_layers)}
    if first_norm_bypassed:
      stacked["layer_0"] = {k: v for k, v in stacked["layer_0"].items() if k != norm}
  return {**encoder, "encoder": stacked}


def read(source: Weights, like: Mapping[str, Any] | None = None, *,
         fresh: Mapping[str, Any] | None = None) -> dict:
  """Parameters of `source`.

  `like` None: every stored subtree as numpy, in the stored layer layout. Else a dict of subtrees
  (`{"bert": ...}`, the heads) of arrays or ShapeDtypeStructs, each with a sharding or None: those
  subtrees of the source, in `like`'s layer layout, each array placed as its counterpart (read
  straight into its shards where the layouts agree). A subtree the source lacks, or an array
  whose shape differs, is refused naming every one; but what it `lacks` (a pooler) is taken from
  `fresh` (the model's new parameters, in `like`'s tree) where given.
  """
  if like is not None:
    lacking = sorted(set(like) - set(source.subtrees))
    if lacking:
      raise errors.CheckpointMismatchError(
          f"{source.describe()} holds the parameters {list(source.subtrees)}, not {lacking}")
  want = tuple(like) if like is not None else source.subtrees
  scan = (is_scanned(like[ENCODER]) if like is not None and ENCODER in like
          else source.config.scan_layers)
  if like is not None and source.kind in ("workdir", "converted") and (
      scan == source.config.scan_layers or ENCODER not in like):
    return _read_orbax(source, checkpoint_lib.abstract_like(like))
  host = _read_host(source, want, scan)
  if like is None:
    return host
  if ENCODER in like and "pooler" in like[ENCODER] and "pooler" not in host[ENCODER]:
    if fresh is None:
      raise errors.CheckpointMismatchError(
          f"{source.describe()} has no pooler (a transformers BertForTokenClassification or "
          "BertForQuestionAnswering builds none), and this model has one: pass its new pooler as "
          "`fresh` (init_from and load_pretrained do)")
    host[ENCODER] = {**host[ENCODER], "pooler": fresh[ENCODER]["pooler"]}
  return checkpoint_lib.put_like(host, checkpoint_lib.abstract_like(dict(like)))


def _read_host(source: Weights, want: tuple[str, ...], scan: bool) -> dict:
  """The subtrees `want` as numpy, in the layer layout `scan`."""
  config = dataclasses.replace(source.config, scan_layers=scan)
  if source.kind == "google":
    heads = tuple(h for h in want if h != ENCODER)
    params = google.params_from_google(tf_bundle.CheckpointReader(source.path), config,
                                       heads=heads)
  elif source.kind == "huggingface":
    params = hf.params_from_hf(hf.read_safetensors(os.path.join(source.path,
                                                                "model.safetensors")),
                               config, heads=tuple(h for h in want if h != ENCODER))
  elif source.kind == "modernbert":
    params = modernbert.params_from_modernbert(
        hf.read_safetensors(os.path.join(source.path, "model.safetensors")), config,
        heads=tuple(h for h in want if h != ENCODER))
  else:
    params = jax.device_get(_read_orbax(source, None, want))
    if ENCODER in params and scan != source.config.scan_layers:
      params[ENCODER] = restack(params[ENCODER], config.num_layers, scan,
                                config.skips_first_attention_norm)
  return {k: params[k] for k in want}


def _read_orbax(source: Weights, target: Mapping[str, Any] | None,
                want: tuple[str, ...] = ()) -> dict:
  """Subtrees of an orbax `params` item: placed as `target` (ShapeDtypeStructs), or, with
  `target` None, the subtrees `want` as stored on one local device. The rest of the item is read
  onto one device and dropped (orbax restores whole items)."""
  one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  if target is None:
    targets, elsewhere = None, one
  else:
    targets = jax.tree.map(lambda x: x if x.sharding is not None else jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=one), dict(target))
    elsewhere = _replicated_like(targets) or one
  where = source.describe()
  if source.kind == "workdir":
    ckpt = checkpoint_lib.Checkpointer.reader(source.checkpoints)
    try:
      stored = ckpt.item_metadata(source.step, "params")
      abstract = checkpoint_lib.subtrees_target(stored, targets or {}, elsewhere, where)
      items, _ = ckpt.restore(source.step, {"params": abstract})
    except errors.CheckpointMismatchError:
      raise
    except Exception as err:  # pylint: disable=broad-except
      if not checkpoint_lib.is_damage(err):
        raise
      raise _damaged(where, source.checkpoints, source.step, ckpt.all_steps(), err) from None
    finally:
      ckpt.close()
    params = items["params"]
  else:
    with ocp.StandardCheckpointer() as checkpointer:
      stored = checkpointer.metadata(converted.params_dir(source.path)).item_metadata
      abstract = checkpoint_lib.subtrees_target(stored, targets or {}, elsewhere, where)
      params = checkpointer.restore(converted.params_dir(source.path), abstract)
  keys = tuple(target) if target is not None else want
  return {k: params[k] for k in keys}


def _replicated_like(tree) -> jax.sharding.Sharding | None:
  """Replication over the mesh of the first NamedSharding in `tree`, if any."""
  for leaf in jax.tree.leaves(tree):
    if isinstance(leaf.sharding, jax.sharding.NamedSharding):
      return jax.sharding.NamedSharding(leaf.sharding.mesh, jax.sharding.PartitionSpec())
  return None
