"""The commands of Hugging Face ModernBERT folders (`config.json` + `model.safetensors`): import
and export.

The format itself (config keys, names, arrays) is bertjax/formats/modernbert.py's, below the one
reader of weights (bertjax/weights.py); these commands read through that reader and write with the
format.

Command line:
  python -m bertjax.convert.modernbert import --hf_dir=DIR --output=OUT
  python -m bertjax.convert.modernbert export --params=OUT --output=HF_DIR
A ModernBERT folder is also read as it is by every `init_from` (bertjax/weights.py), its
tokenizer.json with it; an export writes the tokenizer's files beside the weights.
"""

from __future__ import annotations

import json
import os

from bertjax import weights
from bertjax.convert import hf
from bertjax.data import tokenizer as tokenizer_lib
from bertjax.formats import converted, modernbert


def import_folder(hf_dir: str, output: str, *, scan_layers: bool = False) -> str:
  """Writes a converted folder (bert_config.json + params/, and the tokenizer with its record)
  from a ModernBERT folder."""
  source = weights.inspect(hf_dir, what="--hf_dir")
  if source.kind != modernbert.MODEL_TYPE:
    raise ValueError(f"--hf_dir={hf_dir} is a {source.kind} folder, not a ModernBERT one")
  config, params = modernbert.load_dir(hf_dir, scan_layers=scan_layers)
  converted.save_params(output, params, config)
  said = "no tokenizer"
  if source.vocab_file is not None:  # the vocabulary travels with the weights it indexes
    tok = tokenizer_lib.load_vocabulary(source.vocab_file, source.tokenizer_kind, source.lower)
    tokenizer_lib.copy_to_workdir(source.vocab_file, tok.kind, tok.fingerprint, output,
                                  source.lower, replace=True)
    said = f"{os.path.basename(source.vocab_file)} ({tok.kind})"
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


def export_folder(params_path: str, output: str) -> str:
  """Writes a ModernBERT folder, with its tokenizer's files, from any folder bertjax/weights.py
  reads."""
  source = weights.inspect(params_path, what="--params")
  said = modernbert.save_dir(
      output, weights.read(source), source.config, _token_ids(source),
      lambda folder: hf.write_tokenizer_files(source, folder, source.config,
                                              ("input_ids", "attention_mask")))
  return f"Exported {source.describe()} -> {output} (config.json, model.safetensors{said})"


if __name__ == "__main__":
  from bertjax.convert import command  # pylint: disable=ungrouped-imports
  command.start("hf_dir", "ModernBERT", import_folder, export_folder)
