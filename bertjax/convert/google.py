"""The commands of Google's released BERT checkpoints (the TF1 variable layout of
google-research/bert): import and export.

The format itself (bert_config.json's keys, the variables' names and shapes, the checkpoint bundle
read without TensorFlow) is bertjax/formats/google.py's and formats/tf_bundle.py's, below the one
reader of weights (bertjax/weights/reader.py); these commands read through that reader and write with
the format (export with TensorFlow's own writer, imported then only).

Command line:
  python -m bertjax.convert.google import --weights=uncased_L-12_H-768_A-12 --output=OUT
      [--do_lower_case=true|false] [--scan_layers]
  (--weights may name one checkpoint of the folder instead, DIR/model.ckpt-1000: that one is read)
  python -m bertjax.convert.google export --weights=OUT_OR_WORKDIR --output=DIR
`import` writes what `convert.hf import` writes (a converted folder: an orbax checkpoint of the
parameters and bertjax's `bert_config.json`), plus the folder's `vocab.txt` and `tokenizer.json`
recording its casing: the form a run's `init_from` reads. A Google folder itself is also accepted as
`init_from`. `export` writes a Google folder from a converted folder or a pre-training workdir.

Casing: the original checks `do_lower_case` against the checkpoint's folder name
(`validate_case_matches_checkpoint`); here the name sets it (uncased_*, multilingual_L-*, chinese_*:
lower-cased; cased_*, multi_cased_*: not), `--do_lower_case` overrides it, and a flag that
contradicts the name is warned about.
"""

from __future__ import annotations

import os

from absl import logging

from bertjax import files
from bertjax.data import tokenizer as tokenizer_lib, vocab_record
from bertjax.errors import Refusal
from bertjax.formats import converted, google, tf_bundle, vocabulary
from bertjax.weights import reader as weights


def resolve_do_lower_case(folder: str, requested: bool | None) -> tuple[bool, str]:
  """The casing for a Google folder's vocabulary: `requested` if given (warned when the name
  says otherwise, as the original's check would refuse it), else what the folder says
  (bertjax/formats/vocabulary.py: its record, else its name, else lower-cased as the original's
  default)."""
  if requested is None:
    return vocabulary.folder_casing(folder)
  by_name = vocabulary.lower_case_from_name(folder)
  if by_name is not None and by_name != requested:
    logging.warning(
        "do_lower_case=%s, but %s seems to be a%s model: its pieces were made from %s text, so "
        "use do_lower_case=%s unless you know the name is wrong.", requested,
        os.path.basename(folder.rstrip("/")), "n uncased" if by_name else " cased",
        "lower-cased" if by_name else "cased", by_name)
  return requested, "given"


# Import and export -----------------------------------------------------------------------------

def folder_and_checkpoint(ckpt_dir: str) -> tuple[str, str]:
  """(the folder, the checkpoint to read) of `--weights`: a folder, or the prefix of one
  checkpoint in it (DIR/bert_model.ckpt, DIR/model.ckpt-1000, or its .index or data file), whose
  folder holds bert_config.json and vocab.txt: that checkpoint exactly, whatever else is there."""
  if files.isdir(ckpt_dir):
    return ckpt_dir, ckpt_dir
  try:
    prefix = tf_bundle.resolve_prefix(ckpt_dir)
  except FileNotFoundError:
    return ckpt_dir, ckpt_dir  # nothing there: the folder's reader says what is missing
  return os.path.dirname(prefix) or ".", prefix


def import_folder(ckpt_dir: str, output: str, *, do_lower_case: bool | None = None,
                  scan_layers: bool = False) -> str:
  """Writes a converted folder (see the module docstring) from a Google folder, or from one
  checkpoint of it (`folder_and_checkpoint`); returns a line saying what was done."""
  ckpt_dir, checkpoint = folder_and_checkpoint(ckpt_dir)
  config = google.read_google_config(ckpt_dir, scan_layers=scan_layers)
  reader = tf_bundle.CheckpointReader(checkpoint)
  vocab = os.path.join(ckpt_dir, google.VOCAB_FILE)
  if not files.exists(vocab):
    raise FileNotFoundError(f"{vocab} not found: the vocabulary the checkpoint's embedding rows "
                            "index is part of a Google folder (vocab.txt of the same release)")
  lower, why = resolve_do_lower_case(ckpt_dir, do_lower_case)
  tokenizer = tokenizer_lib.load_vocabulary(vocab, "wordpiece", lower)
  if tokenizer.vocab_size > config.vocab_size:
    raise Refusal(f"{vocab} has {tokenizer.vocab_size} pieces, more than the model's "
                  f"{config.vocab_size} embedding rows: it is not this checkpoint's vocabulary")
  params = google.params_from_google(reader, config)
  ignored = google.ignored_variables(reader.keys())
  converted.save_params(output, params, config)
  _write_vocabulary(vocab, tokenizer.fingerprint, output, lower)
  slots = ", ".join(f"{kind} {n}" for kind, n in sorted(ignored.items())) or "none"
  return (f"Imported {reader.prefix} -> {output} ({config.num_layers} layers, hidden "
          f"{config.hidden_size}, vocab {config.vocab_size}; do_lower_case={lower}: {why}; "
          f"ignored optimizer slots and step: {slots})")


def _write_vocabulary(vocab: str, fingerprint: str, output: str, lower: bool) -> None:
  vocab_record.copy_to_workdir(vocab, "wordpiece", fingerprint, output, lower, replace=True)


def export_folder(params_path: str, output: str) -> str:
  """Writes a Google folder (bert_model.ckpt.*, bert_config.json, vocab.txt) from any folder
  bertjax/weights/reader.py reads that holds the pre-training heads; returns a line saying what was
  done. Uses TensorFlow's own writer."""
  source = weights.inspect(params_path, what="--weights")
  lacking = sorted({"bert", "mlm", "nsp"} - set(source.subtrees))
  if lacking:
    raise Refusal(f"--weights={params_path} holds parameters {list(source.subtrees)}, without "
                  f"{lacking}: a fine-tuning run keeps no MLM and NSP heads; export a "
                  "pre-training workdir or a converted folder (or a fine-tuning run to Hugging "
                  "Face: python -m bertjax.convert.hf export)")
  vocab = source.vocab_file
  if vocab is not None and source.tokenizer_kind != "wordpiece":
    logging.warning("%s's vocabulary is %s, which Google's tokenization.py cannot read: no "
                    "vocab.txt is written.", params_path, source.tokenizer_kind)
    vocab = None
  config = source.config
  google_config = google.config_to_google(config)  # refuses a modern model before any write
  variables = google.params_to_google(weights.read(source), config)
  # lazy: only this export writes with TensorFlow; the import and every reader run without it.
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  tf.io.gfile.makedirs(output)
  names = sorted(variables)
  tf.raw_ops.SaveV2(prefix=os.path.join(output, google.CHECKPOINT_NAME), tensor_names=names,
                    shape_and_slices=[""] * len(names),
                    tensors=[tf.constant(variables[name]) for name in names])
  files.write_json(os.path.join(output, google.CONFIG_FILE), google_config)
  said = "no vocabulary"
  if vocab is not None:
    fingerprint = tokenizer_lib.load_vocabulary(vocab, "wordpiece", source.lower).fingerprint
    _write_vocabulary(vocab, fingerprint, output, source.lower)
    said = f"vocab.txt (do_lower_case={source.lower})"
  return (f"Exported {source.describe()} -> {os.path.join(output, google.CHECKPOINT_NAME)} "
          f"({len(names)} variables), {google.CONFIG_FILE}, {said}")


# Command line ----------------------------------------------------------------------------------

def _define_own_flags(command: str | None) -> None:
  from absl import flags  # pylint: disable=import-outside-toplevel
  if command in ("import", None):
    flags.DEFINE_enum("do_lower_case", None, ["true", "false"], "import: default: what the "
                      "folder's name says.")


if __name__ == "__main__":
  from bertjax.convert import command  # pylint: disable=ungrouped-imports
  command.start("ckpt_dir", "Google (the unzipped release: bert_config.json, bert_model.ckpt.*, "
                "vocab.txt)", import_folder, export_folder, _define_own_flags,
                import_flags={"do_lower_case": lambda t: None if t is None else t == "true"})
