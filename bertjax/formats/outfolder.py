"""The folder an export writes: nothing in it afterwards but what this export wrote.

A folder holding an earlier export keeps that export's files unless they are removed: a
`tokenizer.json` left by a SentencePiece export beside a WordPiece export's `vocab.txt` is what
transformers' AutoTokenizer loads first, with another vocabulary (wrong ids, silently so where the
sizes agree). So an export takes an empty or absent folder, or one holding only the files of a
model folder (an earlier export, or a save_pretrained); it removes those it does not write again,
and says so. A folder holding anything else is refused: it is somebody's, not an export's.

The files are written into `OUTPUT.part/` beside the folder and moved in once all are written: an
export stopped by a full disk, a failed write (EIO) or a kill leaves the earlier export whole.
"""

from __future__ import annotations

import os
import shutil

from bertjax.errors import Refusal


# What a model folder of transformers (and so of an export) may hold: weights, configs and every
# tokenizer's files; and sentence-transformers' files and module folders beside them
# (bertjax/formats/sentence_transformers.py). Nothing here is a user's own file.
MODEL_FILES = frozenset({
    "config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
    "pytorch_model.bin", "pytorch_model.bin.index.json", "tf_model.h5", "flax_model.msgpack",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.txt", "vocab.json", "merges.txt", "spiece.model", "sentencepiece.bpe.model",
    "tokenizer.model", "README.md", ".gitattributes",
    "modules.json", "config_sentence_transformers.json", "sentence_bert_config.json",
    "1_Pooling", "2_Normalize",
})


class ExportFolder:
  """`with ExportFolder(path) as out:` write files with `out.path(name)`; when the block ends
  without an error, the model files of an earlier export that were not written again are removed
  (`out.removed` names them)."""

  def __init__(self, output: str, flag: str = "--output"):
    if os.path.exists(output) and not os.path.isdir(output):
      raise Refusal(f"{flag}={output} is a file; an export writes a folder (config.json, "
                    "model.safetensors, the tokenizer's files). Name a new or empty folder.")
    found = sorted(os.listdir(output)) if os.path.isdir(output) else []
    foreign = [name for name in found if name not in MODEL_FILES]
    if foreign:
      shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
      raise Refusal(f"{flag}={output} holds files an export does not write ({shown}); an "
                    "export would mix its files with them. Name a new or empty folder, or one "
                    "holding an earlier export only.")
    self.output, self.found, self.written, self.removed = output, set(found), set(), []

  @property
  def staging(self) -> str:
    return os.path.normpath(self.output) + ".part"

  def path(self, name: str) -> str:
    """Where to write `name`, a file of the folder or of a subfolder ("1_Pooling/config.json");
    a subfolder is moved in whole."""
    top, _, rest = name.partition("/")
    self.written.add(top)
    if rest:
      os.makedirs(os.path.join(self.staging, top, os.path.dirname(rest)), exist_ok=True)
    return os.path.join(self.staging, name)

  def folder(self, name: str) -> str:
    """An (empty) subfolder of the export, made now: sentence-transformers' Normalize module is a
    folder without files."""
    self.written.add(name)
    os.makedirs(os.path.join(self.staging, name), exist_ok=True)
    return os.path.join(self.staging, name)

  def __enter__(self) -> "ExportFolder":
    shutil.rmtree(self.staging, ignore_errors=True)  # what a stopped export left
    os.makedirs(self.staging)
    return self

  def __exit__(self, kind, value, traceback) -> None:
    if kind is not None:
      shutil.rmtree(self.staging, ignore_errors=True)
      return
    os.makedirs(self.output, exist_ok=True)
    for name in sorted(self.written):  # renames: no space needed, each file whole
      target = os.path.join(self.output, name)
      if os.path.isdir(target):  # an earlier export's subfolder: a rename cannot replace it
        shutil.rmtree(target)
      os.replace(os.path.join(self.staging, name), target)
    shutil.rmtree(self.staging, ignore_errors=True)
    for name in sorted(self.found - self.written):
      target = os.path.join(self.output, name)
      if os.path.isdir(target):
        shutil.rmtree(target)
      else:
        os.remove(target)
      self.removed.append(name)

  def said(self) -> str:
    """For the console: what was taken away."""
    if not self.removed:
      return ""
    return f"; removed an earlier export's {', '.join(self.removed)}"
