"""The vocabulary a weights folder holds and its casing: the record bertjax writes beside a copy
of a vocabulary (tokenizer.json: file, kind, casing, fingerprint), else vocab.txt with the casing
Hugging Face's tokenizer_config.json or the folder's name says, else a Hugging Face tokenizer.json
(told from the record of that name by content) with the casing its normalizer gives.
bertjax/weights/reader.py gives them to every kind of folder it inspects, a run's workdir included (the
copy it made, or what an older run's config.json names).
"""

from __future__ import annotations

import os

from bertjax import files
from bertjax.data import hf_tokenizer, tokenizer as tokenizer_lib, vocab_record

# Written beside a vocabulary copy (data.tokenizer); Hugging Face names its own file so too.
TOKENIZER_RECORD = vocab_record.WORKDIR_RECORD
HF_TOKENIZER_CONFIG = "tokenizer_config.json"

# The folder's record, None where it has none (or holds Hugging Face's tokenizer.json instead).
record = vocab_record.read_record


def lower_case_from_name(name: str) -> bool | None:
  """The casing a release's folder name says, as the original's check reads it; None if it says
  nothing. Also covers the names it predates (wwm_*, the small BERTs, TF Hub's bert_en_*)."""
  if "://" not in name:
    name = os.path.abspath(name)  # "." names the folder it is
  name = os.path.basename(name.rstrip("/")).lower()
  if "uncased" in name or "multilingual_l" in name or "chinese" in name or "bert_zh" in name:
    return True
  if "cased" in name:
    return False
  return None


def of_folder(folder: str, hf_config: dict | None = None) -> dict:
  """The vocabulary fields of weights.Weights for a folder: its record, else vocab.txt with the
  casing of a Hugging Face tokenizer_config.json or of the folder's name, else a Hugging Face
  tokenizer.json."""
  recorded = record(folder)
  if recorded is not None:
    vocab = os.path.join(folder, recorded.get("file", "vocab.txt"))
    return dict(vocab_file=vocab if files.exists(vocab) else None,
                tokenizer_kind=recorded.get("kind", "wordpiece"),
                do_lower_case=bool(recorded.get("do_lower_case", True)),
                casing_why=f"recorded in {os.path.join(folder, TOKENIZER_RECORD)}",
                fingerprint=recorded.get("fingerprint"))
  vocab, hf_file = os.path.join(folder, "vocab.txt"), os.path.join(folder, TOKENIZER_RECORD)
  if not files.exists(vocab) and files.exists(hf_file):  # Hugging Face's (`record` said)
    lower = hf_tokenizer.lower_cases(hf_file)
    return dict(vocab_file=hf_file, tokenizer_kind=hf_tokenizer.KIND, do_lower_case=lower,
                casing_why=f"{hf_file}'s normalizer {'lower-cases' if lower else 'keeps case'}")
  out = dict(vocab_file=vocab if files.exists(vocab) else None,
             tokenizer_kind="wordpiece" if files.exists(vocab) else None)
  if hf_config is not None and "do_lower_case" in hf_config:
    return {**out, "do_lower_case": bool(hf_config["do_lower_case"]),
            "casing_why": f"{os.path.join(folder, HF_TOKENIZER_CONFIG)} says so"}
  by_name = lower_case_from_name(folder)
  name = os.path.basename(os.path.abspath(folder).rstrip("/"))
  if by_name is not None:
    return {**out, "do_lower_case": by_name,
            "casing_why": f"the name {name} says {'uncased' if by_name else 'cased'}"}
  return {**out, "casing_why": f"the name {name} does not say; lower-cased as the original's "
                               "default (rename the folder or set data.do_lower_case)"}


def folder_casing(folder: str) -> tuple[bool, str]:
  """(do_lower_case, why) of a folder's vocabulary as `inspect` gives it, without reading its
  weights (a Google folder of several checkpoints, one of which is named)."""
  found = of_folder(folder)
  lower = found.get("do_lower_case")
  return (True if lower is None else lower), found["casing_why"]


def of_workdir(workdir: str) -> dict:
  """The vocabulary a run copied into its workdir (tokenizer.json), else what its config.json
  names (pre-training runs from before the copy; relative cache paths resolve from here)."""
  found = of_folder(workdir)
  if found["vocab_file"] is not None or record(workdir) is not None:
    return found
  config_path = os.path.join(workdir, "config.json")
  data = files.read_json(config_path, "the run's config").get("data") if files.exists(
      config_path) else None
  if not data or "spm_vocab_size" not in data:  # not a pre-training config
    return {}
  # Read key by key, not as a DataConfig: a run of an older bertjax records other keys.
  if data["vocab_path"]:
    vocab = data["vocab_path"]
  elif data["tokenizer"] == "sentencepiece":
    vocab = tokenizer_lib.cached_sentencepiece_path(
        data["source"], data["tfds_split"], data["eval_fraction"], data["cache_dir"],
        data["spm_vocab_size"], data["do_lower_case"])
  else:
    return {}  # a WordPiece run without vocab_path never ran
  return dict(vocab_file=vocab if files.exists(vocab) else None,
              tokenizer_kind=data.get("tokenizer"), do_lower_case=bool(data["do_lower_case"]),
              casing_why=f"data.do_lower_case in {config_path}")
