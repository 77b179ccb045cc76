"""What sentence-transformers needs beside a Hugging Face export to load the folder as it is:
`SentenceTransformer(folder).encode(texts)` then gives bertjax's vectors (the pooling and the
normalisation included).

  modules.json                        the pipeline: the transformer (the folder itself, loaded with
                                      AutoModel and AutoTokenizer), pooling, normalisation
  sentence_bert_config.json           the longest input in tokens (longer texts are cut there)
  config_sentence_transformers.json   the similarity the vectors were trained with: "cosine" for
                                      normalised vectors, "dot" for the others
  1_Pooling/config.json               mean over real tokens ([CLS] and [SEP] included, as bertjax's
                                      mean) or the [CLS] state: the last layer's, as
                                      bertjax/model/contrastive.py pools
  2_Normalize/                        present when the vectors are L2-normalised

Written in the layout every sentence-transformers release since 2.0 reads (the module types'
`sentence_transformers.models.*` names, the `pooling_mode_*` keys), which 5.x still loads; a
newer release writes its own layout when it saves a model again. bertjax/convert/ writes these
beside config.json, the weights and the tokenizer's files of an export.
"""

from __future__ import annotations

import dataclasses

from bertjax import files
from bertjax.errors import Refusal
from bertjax.formats import outfolder

POOLINGS = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token"}
_ALL_MODES = ("pooling_mode_cls_token", "pooling_mode_mean_tokens", "pooling_mode_max_tokens",
              "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens",
              "pooling_mode_lasttoken")
POOLING_DIR, NORMALIZE_DIR = "1_Pooling", "2_Normalize"


@dataclasses.dataclass(frozen=True)
class SentenceVectors:
  """How an encoder's vectors are made: pooling "mean" or "cls", normalised or not, and the
  longest input in tokens ([CLS] and [SEP] counted)."""

  pooling: str
  normalize: bool
  max_seq_length: int

  def __post_init__(self):
    if self.pooling not in POOLINGS:
      raise Refusal(f"pooling={self.pooling!r}: sentence-transformers' export takes one of "
                    f"{sorted(POOLINGS)}")
    if self.max_seq_length < 2:
      raise Refusal(f"max_seq_length={self.max_seq_length}: at least 2 ([CLS] and [SEP])")


def write(folder: outfolder.ExportFolder, vectors: SentenceVectors, hidden_size: int) -> str:
  """Writes the files of the module docstring into an export's folder; returns what was written,
  for the console."""
  modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
             {"idx": 1, "name": "1", "path": POOLING_DIR,
              "type": "sentence_transformers.models.Pooling"}]
  if vectors.normalize:
    modules.append({"idx": 2, "name": "2", "path": NORMALIZE_DIR,
                    "type": "sentence_transformers.models.Normalize"})
    folder.folder(NORMALIZE_DIR)
  files.write_json(folder.path("modules.json"), modules)
  # do_lower_case: sentence-transformers' own lower-casing before the tokenizer, which already
  # lower-cases (or not) as bertjax's vocabulary does.
  files.write_json(folder.path("sentence_bert_config.json"),
                   {"max_seq_length": vectors.max_seq_length, "do_lower_case": False})
  files.write_json(folder.path("config_sentence_transformers.json"), {
      "prompts": {}, "default_prompt_name": None,
      "similarity_fn_name": "cosine" if vectors.normalize else "dot"})
  files.write_json(folder.path(f"{POOLING_DIR}/config.json"), {
      "word_embedding_dimension": hidden_size,
      **{mode: mode == POOLINGS[vectors.pooling] for mode in _ALL_MODES},
      "include_prompt": True})
  return (f", sentence-transformers' modules.json ({vectors.pooling} pooling"
          f"{', normalised' if vectors.normalize else ''}, {vectors.max_seq_length} tokens)")
