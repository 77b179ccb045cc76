"""The commands of Hugging Face ModernBERT folders (`config.json` + `model.safetensors`): import
and export.

The format itself (config keys, names, arrays) is bertjax/formats/modernbert.py's, below the one
reader of weights (bertjax/weights.py); these commands read through that reader and write with the
format.

Command line:
  python -m bertjax.convert.modernbert import --hf_dir=DIR --output=OUT
  python -m bertjax.convert.modernbert export --params=OUT --output=HF_DIR
A ModernBERT folder is also read as it is by every `init_from` (bertjax/weights.py).
"""

from __future__ import annotations

import json
import os

from bertjax import weights
from bertjax.errors import Refusal
from bertjax.formats import converted, modernbert


def import_folder(hf_dir: str, output: str, *, scan_layers: bool = False) -> str:
  """Writes a converted folder (bert_config.json + params/) from a ModernBERT folder."""
  source = weights.inspect(hf_dir, what="--hf_dir")
  if source.kind != modernbert.MODEL_TYPE:
    raise Refusal(f"--hf_dir={hf_dir} is a {source.kind} folder, not a ModernBERT one")
  config, params = modernbert.load_dir(hf_dir, scan_layers=scan_layers)
  converted.save_params(output, params, config)
  return (f"Imported {hf_dir} -> {output} ({config.num_layers} layers, hidden "
          f"{config.hidden_size}, vocab {config.vocab_size}; the tokenizer is not copied: "
          "keep the folder's tokenizer files beside your data config)")


def export_folder(params_path: str, output: str) -> str:
  """Writes a ModernBERT folder from any folder bertjax/weights.py reads."""
  source = weights.inspect(params_path, what="--params")
  token_ids = None
  if source.kind == modernbert.MODEL_TYPE:  # a round trip keeps the tokenizer's ids
    with open(os.path.join(source.path, "config.json")) as f:
      token_ids = {k: v for k, v in json.load(f).items() if k in modernbert.TOKEN_ID_KEYS}
  said = modernbert.save_dir(output, weights.read(source), source.config, token_ids)
  return f"Exported {source.describe()} -> {output} (config.json, model.safetensors{said})"


if __name__ == "__main__":
  from bertjax.convert import command  # pylint: disable=ungrouped-imports
  command.start("hf_dir", "ModernBERT", import_folder, export_folder)
