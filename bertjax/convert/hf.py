"""The commands of Hugging Face `BertForPreTraining` folders (`model.safetensors`): import, export.

The format itself (names, config keys, arrays; a fine-tuned model's task class) is
bertjax/formats/hf.py's, below the one reader of weights (bertjax/weights/reader.py); these commands read
through that reader and write with the format.

Command line:
  python -m bertjax.convert.hf import --weights=DIR_WITH_config.json_AND_model.safetensors --output=OUT
  python -m bertjax.convert.hf export --weights=OUT --output=HF_DIR
`import` writes a converted folder (bertjax/formats/converted.py: an orbax checkpoint of the
parameters plus `bert_config.json`), and copies the folder's `vocab.txt` with its casing
(tokenizer_config.json's do_lower_case) recorded in `tokenizer.json`; a Hugging Face folder is also
read as it is by every `init_from`. `export` writes `config.json`, `model.safetensors` and the
tokenizer's files from any bertjax weights folder (a workdir included): a pre-training run as
`BertForPreTraining`; a fine-tuning workdir (its best epoch; `--checkpoint=latest` or a step for
another) as `BertForSequenceClassification` (with `problem_type` regression where it is one),
`BertForTokenClassification` or `BertForQuestionAnswering`, its labels as `id2label` / `label2id`;
an embeddings workdir as `BertModel` with sentence-transformers' files (modules.json, its pooling
and normalisation: bertjax/formats/sentence_transformers.py), which `SentenceTransformer(folder)`
loads as it is. A fine-tuning workdir's export says which step it took and what chose it (the
best epoch of a finished run, or of one not finished; a step no evaluation chose: a run stopped
before its first, --checkpoint=latest), in its line and in config.json's `bertjax_export`.
WordPiece vocabularies go as vocab.txt, SentencePiece ones as a fast tokenizer's tokenizer.json
giving the same ids (a literal "[CLS]" in a text is the one difference: transformers reads it as the
special token), a Hugging Face tokenizer.json as it is.
"""

from __future__ import annotations

import os
import shutil

from bertjax import files
from bertjax.data import hf_tokenizer, tokenizer as tokenizer_lib, vocab_record
from bertjax.errors import Refusal
from bertjax.finetune import families
from bertjax.formats import converted, hf, outfolder, sentence_transformers, taskspec
from bertjax.model.config import BertConfig
from bertjax.weights import reader as weights


def import_folder(hf_dir: str, output: str, *, scan_layers: bool = False) -> str:
  """Writes a converted folder (bert_config.json + params/, and the vocabulary with its casing
  recorded) from a Hugging Face BERT folder; returns a line saying what was done."""
  source = weights.inspect(hf_dir, what="--weights")
  if source.kind != "huggingface":
    raise Refusal(f"--weights={hf_dir} is a {source.kind} folder, not a Hugging Face one "
                  "(config.json + model.safetensors); bertjax reads it as it is")
  config, params = hf.load_hf_dir(hf_dir, scan_layers=scan_layers)
  converted.save_params(output, params, config)
  said = "no vocab.txt"
  if source.vocab_file is not None:  # the vocabulary travels with the weights it indexes
    _write_vocabulary(source.vocab_file, output, source.lower)
    said = f"vocab.txt (do_lower_case={source.lower}: {source.casing_why})"
  return (f"Imported {hf_dir} -> {output} ({config.num_layers} layers, hidden "
          f"{config.hidden_size}, vocab {config.vocab_size}; {said})")


def _write_vocabulary(vocab: str, output: str, lower: bool) -> None:
  fingerprint = tokenizer_lib.load_vocabulary(vocab, "wordpiece", lower).fingerprint
  vocab_record.copy_to_workdir(vocab, "wordpiece", fingerprint, output, lower, replace=True)


EXPORTED = "bertjax_export"  # config.json's key of the step exported and what chose it


def chosen_step(source, spec, checkpoint: str = "best") -> tuple[dict, str]:
  """Which step of a fine-tuning workdir an export takes, and what chose it: (config.json's
  EXPORTED record, a line to say; "" where the best epoch of a finished run was taken). {} and ""
  for any other folder."""
  if source.kind != "workdir" or spec is None:
    return {}, ""
  finished = files.exists(os.path.join(source.path, "results.json"))
  step, best = source.step, os.path.basename(os.path.normpath(source.checkpoints)) == "best"
  if best:
    epoch = source.meta.get("epoch")
    chosen = "the best dev evaluation" + (f" (epoch {epoch:g})" if epoch is not None else "")
    line = "" if finished else (
        f"step {step} is {chosen} of a run that has not finished (no results.json): a later "
        "epoch may score higher; rerun its fine-tuning command to finish it.")
  else:
    chosen = (f"--checkpoint={checkpoint}, not an evaluation" if checkpoint != "best" else
              "no evaluation: the newest checkpoint, the run holding no best epoch")
    line = (f"step {step} is exported as chosen by {chosen}"
            + ("" if finished else " (no results.json: the run has not finished)") + ".")
  return {"step": step, "chosen_by": chosen, "finished": finished}, line


def export_folder(params_path: str, output: str, checkpoint: str = "best",
                  sentence: sentence_transformers.SentenceVectors | None = None) -> str:
  """Writes a Hugging Face folder (config.json, model.safetensors, the tokenizer's files) from any
  folder bertjax/weights/reader.py reads; a fine-tuning workdir (its best epoch by default) as its task's
  transformers class with its labels. `sentence`: also sentence-transformers' files, so that
  SentenceTransformer(output) gives those vectors. Returns a line saying what was done."""
  source = weights.inspect_trained(params_path, what="--weights", checkpoint=checkpoint)
  spec = families.spec_of(source)
  task_heads = sorted(set(source.subtrees) - {weights.ENCODER, *hf.HEAD_PREFIXES})
  if task_heads and spec is None:
    raise Refusal(
        f"--weights={params_path} holds a fine-tuned head ({', '.join(task_heads)}) but no label "
        f"map: neither {taskspec.FILE} nor a task in its checkpoint's record. Without it the "
        "outputs have no names; put the run's task.json back (rerunning its fine-tuning command "
        "in the workdir writes it), or export the encoder alone from a pre-training run.")
  hf_config = hf.config_to_hf(source.config)  # refuses what BERT cannot express, before reading
  exported, line = chosen_step(source, spec, checkpoint)
  if exported:
    hf_config[EXPORTED] = exported
  folder = outfolder.ExportFolder(output)  # refuses a file or a folder of other files, first
  params = weights.read(source)
  with folder:
    if spec is None:
      hf.write_hf_dir(folder, hf.params_to_hf(params, source.config), hf_config)
      what = "BertForPreTraining"
    elif not (family := families.get(spec.family)).head:
      # Vectors of the encoder's own (embeddings): the encoder alone, pooler included, as the
      # base class (BertModel), with what sentence-transformers needs to make the same vectors.
      sd = hf.params_to_hf({weights.ENCODER: params[weights.ENCODER]}, source.config)
      hf.write_hf_dir(folder, sd, {**hf_config, "architectures": [family.hf_class]})
      what = family.hf_class
      sentence = sentence or family.sentence(spec)
    else:
      sd, extra = hf.task_to_hf(params, source.config, head=family.head,
                                hf_class=family.hf_class, hf_head=family.hf_head,
                                outputs=family.num_outputs(spec), labels=spec.labels)
      hf.write_hf_dir(folder, sd, {**hf_config, **extra})
      what = family.hf_class + (f", {len(spec.labels)} labels" if spec.labels else "")
    said = write_tokenizer_files(source, folder, source.config)
    if sentence is not None:
      said += sentence_transformers.write(folder, sentence, source.config.hidden_size)
  return (f"Exported {source.describe()} -> {output} ({what}: config.json, model.safetensors"
          f"{said}{folder.said()})" + (f"\nExported {line}" if line else ""))


def write_tokenizer_files(source, folder: outfolder.ExportFolder, config: BertConfig,
                          input_names: tuple[str, ...] | None = None) -> str:
  """The vocabulary beside exported weights, as transformers reads it: vocab.txt (BertTokenizer)
  for WordPiece, tokenizer.json (a fast tokenizer) for SentencePiece and for a tokenizer.json
  (copied as it is; one without a post-processor gets BERT's layout, as bertjax framed its rows),
  with the casing and the special tokens; returns what was written, for the console.
  `input_names`: the model's inputs where they are not BERT's three (ModernBERT takes no
  token_type_ids)."""
  if source.vocab_file is None:
    return ""
  specials = {"unk_token": "[UNK]", "sep_token": "[SEP]", "pad_token": "[PAD]",
              "cls_token": "[CLS]", "mask_token": "[MASK]"}
  files.write_json(folder.path("special_tokens_map.json"), specials)
  names = {"model_input_names": list(input_names)} if input_names else {}
  if source.tokenizer_kind == hf_tokenizer.KIND:
    # A file without a post-processor gets BERT's layout, as bertjax framed its rows.
    added = hf_tokenizer.copy_framed(source.vocab_file, folder.path("tokenizer.json"))
    files.write_json(folder.path("tokenizer_config.json"), {
        "tokenizer_class": "PreTrainedTokenizerFast", **specials,
        "model_max_length": config.max_position_embeddings, **names})
    return (", tokenizer.json (as trained" + (", with BERT's [CLS] A [SEP] B [SEP] layout added"
                                             if added else "") + "), tokenizer_config.json")
  if source.tokenizer_kind == "sentencepiece":
    sentencepiece_to_tokenizer_json(source.vocab_file, folder.path("tokenizer.json"))
    files.write_json(folder.path("tokenizer_config.json"), {
        "tokenizer_class": "PreTrainedTokenizerFast", **specials,
        "model_max_length": config.max_position_embeddings, **names})
    return ", tokenizer.json (the SentencePiece model as a fast tokenizer), tokenizer_config.json"
  shutil.copyfile(source.vocab_file, folder.path("vocab.txt"))
  # The input names here too: ModernBERT's forward takes no token_type_ids, which a BertTokenizer
  # returns unless told (its folder's `model(**tokenizer(texts))` failed).
  files.write_json(folder.path("tokenizer_config.json"), {
      "tokenizer_class": "BertTokenizer", "do_lower_case": source.lower, **specials,
      "model_max_length": config.max_position_embeddings, **names})
  return f", vocab.txt, tokenizer_config.json (do_lower_case={source.lower})"


def sentencepiece_to_tokenizer_json(model_path: str, output: str) -> None:
  """A `tokenizers` file that encodes as the SentencePiece model does, with BERT's [CLS]/[SEP]
  layout and segment ids: the model's own normalization table (its precompiled character map:
  NFKC, and case folding for a lower-cased vocabulary), its whitespace rules (runs of spaces to
  one, none at either end, "\u2581" before every word) and its unigram pieces with their scores.
  Written with the `tokenizers` library's public API; tests compare its ids with bertjax's."""
  from sentencepiece import sentencepiece_model_pb2  # pylint: disable=import-outside-toplevel
  from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
  from tokenizers import processors  # pylint: disable=import-outside-toplevel
  with files.open_file(model_path, "rb") as f:
    proto = sentencepiece_model_pb2.ModelProto.FromString(f.read())
  model_types = sentencepiece_model_pb2.TrainerSpec.ModelType
  if proto.trainer_spec.model_type != model_types.UNIGRAM:
    raise Refusal(f"{model_path}: a {model_types.Name(proto.trainer_spec.model_type)} "
                  "SentencePiece model; the export writes unigram models (bertjax trains "
                  "those) as tokenizer.json.")
  spec = proto.normalizer_spec
  pieces = [(p.piece, p.score) for p in proto.pieces]
  ids = {p: i for i, (p, _) in enumerate(pieces)}
  tok = Tokenizer(models.Unigram(pieces, unk_id=ids["[UNK]"], byte_fallback=False))
  steps = []
  if spec.precompiled_charsmap:
    steps.append(normalizers.Precompiled(spec.precompiled_charsmap))
  if spec.remove_extra_whitespaces:
    steps += [normalizers.Strip(), normalizers.Replace(Regex(" {2,}"), " ")]
  tok.normalizer = normalizers.Sequence(steps)
  tok.pre_tokenizer = pre_tokenizers.Metaspace(
      replacement="\u2581", prepend_scheme="always" if spec.add_dummy_prefix else "never")
  tok.decoder = decoders.Metaspace(replacement="\u2581",
                                   prepend_scheme="always" if spec.add_dummy_prefix else "never")
  cls, sep = ids["[CLS]"], ids["[SEP]"]
  tok.post_processor = processors.TemplateProcessing(
      single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
      special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
  from tokenizers import AddedToken  # pylint: disable=import-outside-toplevel
  tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                          for t in tokenizer_lib.SPECIAL_TOKENS])
  tok.save(output)


if __name__ == "__main__":
  from bertjax.convert import command  # pylint: disable=ungrouped-imports
  command.start("hf_dir", "Hugging Face", import_folder, export_folder,
                command.define_checkpoint_flag, export_flags={"checkpoint": str})
