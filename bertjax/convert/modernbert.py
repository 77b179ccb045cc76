"""The commands of Hugging Face ModernBERT folders (`config.json` + `model.safetensors`): import
and export.

The format itself (config keys, names, arrays) is bertjax/formats/modernbert.py's, below the one
reader of weights (bertjax/weights/reader.py); these commands read through that reader and write with the
format.

Command line:
  python -m bertjax.convert.modernbert import --weights=DIR --output=OUT
  python -m bertjax.convert.modernbert export --weights=OUT --output=HF_DIR [--checkpoint=best]
A ModernBERT folder is also read as it is by every `init_from` (bertjax/weights/reader.py), its
tokenizer.json with it, and a fine-tuned one (ModernBertForSequenceClassification,
...ForTokenClassification, ...ForQuestionAnswering) by `bertjax.predict` as a fine-tuning
workdir. `export` writes a fine-tuning workdir of a modern model as its task's class with
id2label, label2id, problem_type and classifier_pooling; the tokenizer's files go beside it.
"""

from __future__ import annotations

import json
import os

from bertjax.convert import hf as convert_hf
from bertjax.data import tokenizer as tokenizer_lib, vocab_record
from bertjax.errors import Refusal
from bertjax.finetune import families
from bertjax.formats import (converted, hf, modernbert, modernbert_tasks, outfolder,
                             sentence_transformers, taskspec)
from bertjax.weights import reader as weights


def import_folder(hf_dir: str, output: str, *, scan_layers: bool = False) -> str:
  """Writes a converted folder (bert_config.json + params/, and the tokenizer with its record)
  from a ModernBERT folder."""
  source = weights.inspect(hf_dir, what="--weights")
  if source.kind != modernbert.MODEL_TYPE:
    raise Refusal(f"--weights={hf_dir} is a {source.kind} folder, not a ModernBERT one")
  config, params = modernbert.load_dir(hf_dir, scan_layers=scan_layers)
  converted.save_params(output, params, config)
  said = "no tokenizer"
  if source.vocab_file is not None:  # the vocabulary travels with the weights it indexes
    tok = tokenizer_lib.load_vocabulary(source.vocab_file, source.tokenizer_kind, source.lower)
    vocab_record.copy_to_workdir(source.vocab_file, tok.kind, tok.fingerprint, output,
                                  source.lower, replace=True)
    said = f"{os.path.basename(source.vocab_file)} ({tok.kind})"
  spec = families.spec_of(source)
  if spec is not None:  # a fine-tuned class: its labels go along, as a workdir's task.json
    taskspec.write(spec, output)
  return (f"Imported {hf_dir} -> {output} ({config.num_layers} layers, hidden "
          f"{config.hidden_size}, vocab {config.vocab_size}; {said})")


def _token_ids(source: weights.Weights) -> dict | None:
  """The special tokens' ids of config.json: the tokenizer's where the source has one, else a
  ModernBERT folder's own (a round trip keeps them), else None (formats/modernbert.py's)."""
  if source.vocab_file is not None:
    tok = tokenizer_lib.load_vocabulary(source.vocab_file, source.tokenizer_kind, source.lower)
    return dict(pad_token_id=tok.pad_id, bos_token_id=tok.cls_id, eos_token_id=tok.sep_id,
                cls_token_id=tok.cls_id, sep_token_id=tok.sep_id)
  if source.kind == modernbert.MODEL_TYPE:
    with open(os.path.join(source.path, "config.json")) as f:
      return {k: v for k, v in json.load(f).items() if k in modernbert.TOKEN_ID_KEYS}
  return None


def export_folder(params_path: str, output: str, checkpoint: str = "best",
                  sentence: sentence_transformers.SentenceVectors | None = None) -> str:
  """Writes a ModernBERT folder from any folder bertjax/weights/reader.py reads: a fine-tuning workdir
  (its best epoch by default) as its task's class (ModernBertForSequenceClassification,
  ...ForTokenClassification, ...ForQuestionAnswering) with its labels, anything else as
  ModernBertForMaskedLM. `sentence`: also sentence-transformers' files (as the BERT export)."""
  source = weights.inspect_trained(params_path, what="--weights", checkpoint=checkpoint)
  spec = families.spec_of(source)
  token_ids = _token_ids(source)
  # Refused before anything is read or written: a model ModernBERT cannot express, a head its
  # classes do not have, an output folder of somebody's files.
  hf_config = modernbert.config_to_modernbert(source.config, token_ids)
  exported, line = convert_hf.chosen_step(source, spec, checkpoint)
  if exported:
    hf_config[convert_hf.EXPORTED] = exported
  family = None if spec is None else families.get(spec.family)
  if family is not None and not family.head:
    # Vectors of the encoder's own (embeddings): the encoder alone as the base class, with
    # sentence-transformers' files (as the BERT export).
    hf_config["architectures"] = [family.modernbert_class]
    sentence = sentence or family.sentence(spec)
  elif family is not None:
    if family.modernbert_class is None:
      classes = sorted(f.modernbert_class for f in families.FAMILIES.values() if f.modernbert_class)
      raise Refusal(f"A {spec.family} model has no ModernBERT class; those exported are {classes}")
    hf_config.update(modernbert_tasks.task_config(
        source.config, cls=family.modernbert_class, outputs=family.num_outputs(spec),
        labels=spec.labels))
  folder = outfolder.ExportFolder(output)
  params = weights.read(source)
  if family is not None:
    keep = ((weights.ENCODER, modernbert_tasks.PREDICTION_HEAD, family.head) if family.head
            else (weights.ENCODER,))
    params = {k: params[k] for k in keep}
  with folder:
    hf.write_hf_dir(folder, modernbert.params_to_modernbert(params, source.config), hf_config)
    said = convert_hf.write_tokenizer_files(source, folder, source.config,
                                            ("input_ids", "attention_mask"))
    if sentence is not None:
      said += sentence_transformers.write(folder, sentence, source.config.hidden_size)
  what = hf_config["architectures"][0] + (f", {len(spec.labels)} labels" if spec and spec.labels
                                          else "")
  return (f"Exported {source.describe()} -> {output} ({what}: config.json, model.safetensors"
          f"{said}{folder.said()})" + (f"\nExported {line}" if line else ""))


if __name__ == "__main__":
  from bertjax.convert import command  # pylint: disable=ungrouped-imports
  command.start("hf_dir", "ModernBERT", import_folder, export_folder,
                command.define_checkpoint_flag, export_flags={"checkpoint": str})
