"""A run's vocabulary kept in its workdir (or a converted folder): the copy, and the record that
names it, its kind, casing and fingerprint. bertjax/data/tokenizer.py loads vocabularies."""

import os

from bertjax import files
from bertjax.data import hf_tokenizer
from bertjax.errors import Refusal


# A run's vocabulary is copied into its workdir, with a record named here, so the workdir alone can
# be fine-tuned or served: a cached SentencePiece model lives under a cache_dir another machine
# lacks. The record keeps the name older workdirs have; a Hugging Face tokenizer.json is copied as
# HF_COPY beside it, and readers tell the two apart by content (`read_record`).
WORKDIR_RECORD = "tokenizer.json"
COPY_NAMES = {"sentencepiece": "vocab.model", "wordpiece": "vocab.txt",
              hf_tokenizer.KIND: "hf_tokenizer.json"}


def read_record(folder: str) -> dict | None:
  """The vocabulary record of a workdir or converted folder, None where there is none (no
  tokenizer.json, or Hugging Face's own under that name)."""
  path = os.path.join(folder, WORKDIR_RECORD)
  if not files.exists(path) or hf_tokenizer.is_hf_tokenizer_json(path):
    return None
  return files.read_json(path, "the vocabulary's record")


def copy_to_workdir(vocab_file: str, kind: str, fingerprint: str, workdir: str,
                    do_lower_case: bool = True, replace: bool = False) -> str:
  """Copies the vocabulary into `workdir` (vocab.model, vocab.txt or hf_tokenizer.json) with
  tokenizer.json naming it, its kind, casing and fingerprint; returns the copy's path. Written
  once (unless `replace`, for a converter's output): a later run in the same workdir finds its
  fingerprint already checked against the checkpoints."""
  name = COPY_NAMES[kind]
  target = os.path.join(workdir, name)
  record = os.path.join(workdir, WORKDIR_RECORD)
  if files.exists(record) and hf_tokenizer.is_hf_tokenizer_json(record):
    raise Refusal(f"{workdir} holds a Hugging Face tokenizer.json where bertjax records the "
                  "run's vocabulary: give the run a folder of its own (not a model's folder).")
  if files.exists(record) and not replace:
    return target
  files.makedirs(workdir)
  if os.path.abspath(vocab_file) != os.path.abspath(target):
    files.copy(vocab_file, target)  # local files without TensorFlow (bertjax/files.py)
  files.write_json(record, {"file": name, "kind": kind, "do_lower_case": bool(do_lower_case),
                            "fingerprint": fingerprint, "copied_from": vocab_file})
  return target
