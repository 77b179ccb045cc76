"""Tokenizers: SentencePiece (trained here), WordPiece `vocab.txt` (Google's released checkpoints)
and a Hugging Face `tokenizer.json` (ModernBERT's byte-level BPE; bertjax/data/hf_tokenizer.py).

All expose the same small interface (`Tokenizer`): the BERT special ids, a vocabulary fingerprint
that prepared shards record, `encode`, `encode_with_offsets` (character spans in the original text,
for span extraction), the layout of a row's special tokens (`template`) and per-id tables of where
words start, for whole-word masking.

Train a SentencePiece vocabulary:
  python -m bertjax.data.tokenizer train --corpus=builtin --vocab_size=8000 --output=/tmp/spm
"""

import hashlib
import json
import logging
import os
import re
import tempfile
from typing import Iterable, Sequence

import numpy as np

from bertjax import files
from bertjax.data import corpus, hf_tokenizer, storage
from bertjax.data.config import DataConfig
from bertjax.data.normalize import (normalize_with_source, original_normalize,
                                    read_wordpiece_vocab)
from bertjax.data.template import Template
from bertjax.errors import Refusal

PAD, UNK, CLS, SEP, MASK = "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"
SPECIAL_TOKENS = (PAD, UNK, CLS, SEP, MASK)
KINDS = ("sentencepiece", "wordpiece", hf_tokenizer.KIND)
# The original WordPiece gives up on longer words (one [UNK]).
MAX_WORD_CHARS = 200
# SentencePiece's trainer skips longer sentences (in bytes); with none left it fails obscurely.
SPM_MAX_SENTENCE_BYTES = 1 << 16


class Tokenizer:
  """Text -> ids with the BERT special tokens; built by `load_tokenizer`.

  Rows are padded with zeros and `input_mask` says which positions are real, whatever `pad_id` is:
  a tokenizer.json may put [PAD] elsewhere (ModernBERT's is 50283), its id 0 then a real piece
  (prepared shards find a sequence's end at its last non-zero id, its closing [SEP]).
  """

  def __init__(self, kind: str, pieces: Sequence[str], encode_batch_fn, word_start_V: np.ndarray,
               options: str, offsets_batch_fn=None, *, template: Template | None = None,
               word_tables=None, encode_words_fn=None, where: str = ""):
    self.kind = kind
    self.pieces = list(pieces)
    self.vocab_size = len(self.pieces)
    self._encode_batch_fn = encode_batch_fn
    self._offsets_batch_fn = offsets_batch_fn
    self._encode_words_fn = encode_words_fn
    index = {p: i for i, p in enumerate(self.pieces)}
    missing = [t for t in SPECIAL_TOKENS if t not in index]
    if missing:
      raise Refusal(f"{kind} vocabulary {where}of {self.vocab_size} pieces lacks the special "
                    f"token(s) {missing}; BERT needs all of {list(SPECIAL_TOKENS)}.")
    self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id = (
        index[t] for t in SPECIAL_TOKENS)
    if self.pad_id != 0 and kind != hf_tokenizer.KIND:
      raise Refusal(f"[PAD] must have id 0 (padding is zeros everywhere); this vocabulary has "
                    f"it at {self.pad_id}.")
    if self.sep_id == 0:
      raise Refusal(f"{kind} vocabulary {where}has [SEP] at id 0; a prepared sequence ends at "
                    "its last non-zero id, its closing [SEP]: give [SEP] another id.")
    self.special_ids = (self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id)
    self.template = template or Template.bert(self.cls_id, self.sep_id)
    # Whole-word masking groups a piece with the word-start piece before it.
    self.word_start_V = np.asarray(word_start_V, bool)
    self.word_tables = word_tables  # hf_tokenizer.WordTables: also where symbol classes change
    digest = hashlib.sha256(f"{kind}|{options}|".encode() + "\n".join(self.pieces).encode())
    self.fingerprint = f"{kind}-{self.vocab_size}-{digest.hexdigest()[:16]}"

  def encode(self, text: str) -> list[int]:
    return self._encode_batch_fn([text])[0]

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    return self._encode_batch_fn(list(texts))

  def encode_words(self, sentences: Sequence[Sequence[str]]) -> list[list[int]]:
    """The pieces of each word of each sentence (a flat list over all words), for tagging: each
    word alone, or, for a tokenizer.json, each word after the first as it reads after a space."""
    if self._encode_words_fn is not None:
      return self._encode_words_fn([list(s) for s in sentences])
    return self.encode_batch([w for s in sentences for w in s])

  def encode_with_offsets(self, texts: Sequence[str]) -> list[tuple[np.ndarray, np.ndarray,
                                                                     np.ndarray]]:
    """Per text (ids_N, start_N, end_N) int32: the ids of `encode_batch` and each token's characters
    `text[start:end]` in the ORIGINAL text (normalization may change its length)."""
    if self._offsets_batch_fn is None:
      raise NotImplementedError(f"{self!r} was built without character offsets.")
    return self._offsets_batch_fn(list(texts))

  def tokenize(self, text: str) -> list[str]:
    return [self.pieces[i] for i in self.encode(text)]

  def __repr__(self):
    return f"Tokenizer({self.fingerprint})"


def _load_sentencepiece(path: str) -> Tokenizer:
  import sentencepiece as spm
  with files.open_file(path, "rb") as f:
    proto = f.read()
  sp = spm.SentencePieceProcessor(model_proto=proto)
  pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
  word_start_V = np.array([p.startswith("\u2581") for p in pieces])

  def encode_batch(texts):
    return sp.encode(texts, out_type=int)

  def offsets_batch(texts):
    return [_sentencepiece_offsets(t, proto) for t, proto in
            zip(texts, sp.encode(texts, return_type="proto"))]

  # Pieces, scores and normalization rules decide the encoding; the trainer spec (which records
  # temporary paths) does not, so it is left out.
  from sentencepiece import sentencepiece_model_pb2
  model = sentencepiece_model_pb2.ModelProto.FromString(proto)
  model.ClearField("trainer_spec")
  options = hashlib.sha256(model.SerializeToString(deterministic=True)).hexdigest()[:16]
  return Tokenizer("sentencepiece", pieces, encode_batch, word_start_V, options, offsets_batch)


def _sentencepiece_offsets(text: str, proto) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """SentencePiece reports UTF-8 byte spans of the original text; a word-initial piece's span
  holds the spaces before it, which no answer wants, so they are left out (a bare "\u2581" piece
  becomes empty)."""
  ids = np.array([p.id for p in proto.pieces], np.int32)
  begin_N = np.array([p.begin for p in proto.pieces], np.int64)
  end_N = np.array([p.end for p in proto.pieces], np.int64)
  if not text.isascii():
    data = np.frombuffer(text.encode("utf-8"), np.uint8)
    # chars_before[b] = number of characters that start before byte b.
    chars_before = np.concatenate([[0], np.cumsum((data & 0xC0) != 0x80)])
    begin_N, end_N = chars_before[begin_N], chars_before[end_N]
  for i in range(len(ids)):
    while begin_N[i] < end_N[i] and text[begin_N[i]].isspace():
      begin_N[i] += 1
  return ids, begin_N.astype(np.int32), end_N.astype(np.int32)


def _load_wordpiece(path: str, do_lower_case: bool) -> Tokenizer:
  from tokenizers import Tokenizer as HfTokenizer
  from tokenizers import models, pre_tokenizers
  pieces = read_wordpiece_vocab(path)
  vocab = {}
  for i, p in enumerate(pieces):
    vocab[p] = i  # a duplicate maps to its last line, as the original's dict; ids = line numbers
  if UNK not in vocab:
    raise Refusal(f"WordPiece vocabulary {path} ({len(pieces)} lines) lacks {UNK}; BERT needs "
                  f"all of {list(SPECIAL_TOKENS)}.")
  hf = HfTokenizer(models.WordPiece(vocab=vocab, unk_token=UNK,
                                    max_input_chars_per_word=MAX_WORD_CHARS))
  # Normalized here, not by Hugging Face's BertNormalizer, which differs from the original:
  # it also deletes private-use and unassigned characters, splits at vertical tab and form feed
  # (the original deletes them), strips every combining mark (not only Mn) and misses part of a
  # CJK range.
  hf.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
  word_start_V = np.array([not p.startswith("##") for p in pieces])

  def encode_batch(texts):
    texts = [original_normalize(t, do_lower_case) for t in texts]
    return [e.ids for e in hf.encode_batch(texts, add_special_tokens=False)]

  def offsets_batch(texts):
    pairs = [normalize_with_source(t, do_lower_case) for t in texts]
    encodings = hf.encode_batch([n for n, _ in pairs], add_special_tokens=False)
    out = []
    for text, (_, source_M), enc in zip(texts, pairs, encodings):
      # Hugging Face's offsets are characters of the normalized text it was given.
      span_Nx2 = np.array(enc.offsets, np.int64).reshape(-1, 2)
      start_N, end_N = span_Nx2[:, 0], span_Nx2[:, 1]
      if source_M is not None:
        # A token ends where the next normalized character begins in the original, so characters
        # normalization deleted (an accent's combining mark, a soft hyphen) stay with the word they
        # follow; the max covers a CJK character whose added spaces share its index.
        next_source = np.append(source_M, len(text))
        start_N, end_N = source_M[start_N], np.maximum(source_M[end_N - 1] + 1, next_source[end_N])
      out.append((np.array(enc.ids, np.int32), start_N.astype(np.int32), end_N.astype(np.int32)))
    return out

  return Tokenizer("wordpiece", pieces, encode_batch, word_start_V,
                   f"lower={do_lower_case}|original-normalization", offsets_batch)


def vocab_path_of(data: DataConfig) -> str:
  """`vocab_path`, or for SentencePiece without one a cache file named by source and size.

  Naming it by the source means a new corpus gets its own vocabulary instead of silently reusing
  one trained on another text.
  """
  if data.vocab_path:
    return data.vocab_path
  if data.tokenizer != "sentencepiece":
    raise Refusal(f"config.data.vocab_path is empty; a {data.tokenizer} tokenizer needs "
                  f"one (the vocab.txt of a released BERT checkpoint, a tokenizer.json).")
  # A source cut into sentences also names its segmenter, language and column (text files and
  # the built-in corpus keep the names they had).
  text = {k: v for k, v in corpus.text_settings(data).items() if k != "text_version"}
  return cached_sentencepiece_path(data.source, data.tfds_split, data.eval_fraction,
                                   data.cache_dir, data.spm_vocab_size, data.do_lower_case,
                                   json.dumps(text, sort_keys=True) if text else "")


def cached_sentencepiece_path(source: str, tfds_split: str, eval_fraction: float, cache_dir: str,
                              spm_vocab_size: int, do_lower_case: bool, text: str = "") -> str:
  """The cache file of the SentencePiece vocabulary trained on `source` (`vocab_path_of`); by its
  keys, for a workdir's recorded config.json, which may come from an older bertjax."""
  slug = re.sub(r"[^A-Za-z0-9]+", "_", source)[:40].strip("_") or "corpus"
  key = hashlib.sha256(f"{source}|{tfds_split}|{eval_fraction}|{corpus.TEXT_VERSION}".encode()
                       + (f"|{text}".encode() if text else b""))
  case = "uncased" if do_lower_case else "cased"
  return os.path.join(cache_dir, f"spm-{slug}-{key.hexdigest()[:8]}-{spm_vocab_size}-{case}.model")


def load_tokenizer(path_or_data: str | os.PathLike | DataConfig) -> Tokenizer:
  """A `.model` path (SentencePiece), a `vocab.txt` path (WordPiece, uncased), a Hugging Face
  `tokenizer.json`, or the run's data config. A run loads its tokenizer once, where it starts,
  and passes it down."""
  if isinstance(path_or_data, (str, os.PathLike)):
    return load_vocabulary(os.fspath(path_or_data))
  data = path_or_data
  return load_vocabulary(vocab_path_of(data), data.tokenizer, data.do_lower_case)


def kind_of(path: str) -> str:
  """The tokenizer a vocabulary file is for, by its name: .model is SentencePiece's, .json a
  Hugging Face tokenizer.json, anything else a WordPiece vocab.txt."""
  if path.endswith(".model"):
    return "sentencepiece"
  return hf_tokenizer.KIND if path.endswith(".json") else "wordpiece"


def load_vocabulary(path: str, kind: str | None = None, do_lower_case: bool = True) -> Tokenizer:
  """The tokenizer of a vocabulary file; `kind` None goes by the file's name (`kind_of`);
  `do_lower_case` is WordPiece's (a SentencePiece model and a tokenizer.json carry their own
  normalization)."""
  if not path:
    raise Refusal("No vocabulary: set config.data.vocab_path (a SentencePiece .model, a "
                  "WordPiece vocab.txt or a Hugging Face tokenizer.json).")
  if not files.exists(path):
    raise FileNotFoundError(f"Vocabulary file {path} does not exist (train one with "
                            f"`python -m bertjax.data.tokenizer train ...`).")
  kind = kind or kind_of(path)
  if kind not in KINDS:
    raise Refusal(f"Unknown tokenizer {kind!r}: use one of {list(KINDS)}.")
  if path.endswith(".json"):
    _refuse_json_of_another_kind(path, kind)
  # Once per process: preparation, the pipeline, init_from and the converters each ask for the
  # run's vocabulary, and building one (a 30k-piece WordPiece, a SentencePiece model) costs far
  # more than reading its file. Keyed by the file's bytes, not its name or time, so a vocabulary
  # rewritten at the same path is never served stale.
  with files.open_file(path, "rb") as f:
    digest = hashlib.sha256(f.read()).hexdigest()
  key = (path, kind, kind == "wordpiece" and bool(do_lower_case), digest)
  if key not in _LOADED:
    if kind == "sentencepiece":
      _LOADED[key] = _load_sentencepiece(path)
    elif kind == "wordpiece":
      _LOADED[key] = _load_wordpiece(path, do_lower_case)
    else:
      _LOADED[key] = _load_hf(path)
    while len(_LOADED) > 8:  # a long test session loads many; a run, one or two
      _LOADED.pop(next(iter(_LOADED)))
  return _LOADED[key]


def _refuse_json_of_another_kind(path: str, kind: str) -> None:
  """Names what a .json given as a vocabulary is, where it is not one of `kind`: a Hugging Face
  tokenizer.json read as WordPiece lines lacked [UNK] (the wrong cause), and bertjax's record of
  a run's vocabulary (`vocab_record.WORKDIR_RECORD`) names the file to give instead."""
  if hf_tokenizer.is_hf_tokenizer_json(path):
    if kind != hf_tokenizer.KIND:
      raise Refusal(f"{path} is a Hugging Face tokenizer.json, given as a {kind} vocabulary "
                    f"(config.data.tokenizer={kind!r}): set config.data.tokenizer=huggingface.")
    return
  try:
    record = files.read_json(path)
  except ValueError:
    return  # not JSON: the kind's reader names it
  if isinstance(record, dict) and {"file", "kind", "fingerprint"} <= set(record):
    raise Refusal(f"{path} is bertjax's record of a run's vocabulary, not a vocabulary: give "
                  f"the file it names, config.data.vocab_path="
                  f"{os.path.join(os.path.dirname(path), str(record['file']))} with "
                  f"config.data.tokenizer={record['kind']}.")


def _load_hf(path: str) -> Tokenizer:
  parts = hf_tokenizer.load_parts(path)
  tables = parts["word_tables"]
  return Tokenizer(hf_tokenizer.KIND, parts["pieces"], parts["encode_batch_fn"], tables.start_V,
                   parts["options"], parts["offsets_batch_fn"], template=parts["template"],
                   word_tables=tables, encode_words_fn=parts["encode_words_fn"],
                   where=f"{path} ")


_LOADED: dict[tuple, Tokenizer] = {}


def train_sentencepiece(sentences: Iterable[str], *, vocab_size: int, output: str,
                        do_lower_case: bool = True, model_type: str = "unigram",
                        max_sentences: int = 2_000_000, seed: int = 0) -> str:
  """Trains a vocabulary with [PAD]=0, [UNK]=1, [CLS]=2, [SEP]=3, [MASK]=4; returns the .model path."""
  import sentencepiece as spm
  import tensorflow as tf
  output = output[:-len(".model")] if output.endswith(".model") else output
  parent = os.path.dirname(output)
  if parent:
    tf.io.gfile.makedirs(parent)
  # SentencePiece samples with its own RNG when input exceeds input_sentence_size; taking the first
  # sentences ourselves keeps training deterministic.
  count = too_long = 0
  with tempfile.TemporaryDirectory() as tmp:
    text_path = os.path.join(tmp, "corpus.txt")
    with open(text_path, "w", encoding="utf-8") as f:
      for s in sentences:
        s = s.strip()
        if len(s.encode()) > SPM_MAX_SENTENCE_BYTES:
          too_long += 1
        elif s:
          f.write(s + "\n")
          count += 1
          if count >= max_sentences:
            break
    if too_long:
      logging.warning("SentencePiece training leaves out %d sentence(s) longer than %d bytes.",
                      too_long, SPM_MAX_SENTENCE_BYTES)
    if count == 0:
      raise Refusal(f"Cannot train SentencePiece: the corpus yielded no sentence of at most "
                    f"{SPM_MAX_SENTENCE_BYTES} bytes ({too_long} longer one(s)). The format "
                    f"wants one sentence per line, a blank line between documents.")
    spm.set_random_generator_seed(seed)
    try:
      spm.SentencePieceTrainer.train(
          input=text_path, model_prefix=os.path.join(tmp, "spm"), vocab_size=vocab_size,
          model_type=model_type, pad_id=0, unk_id=1, bos_id=-1, eos_id=-1, pad_piece=PAD,
          unk_piece=UNK, control_symbols=[CLS, SEP, MASK], character_coverage=0.9995,
          normalization_rule_name="nmt_nfkc_cf" if do_lower_case else "nmt_nfkc",
          max_sentence_length=SPM_MAX_SENTENCE_BYTES, num_threads=1, minloglevel=2,
          hard_vocab_limit=False)
    except RuntimeError as err:
      raise _spm_error(err, vocab_size, count) from None
    made = spm.SentencePieceProcessor(model_file=os.path.join(tmp, "spm.model")).get_piece_size()
    if made < vocab_size:
      logging.warning("SentencePiece made %d pieces, not the %d asked for (spm_vocab_size): %d "
                      "sentences hold too little text for more. Train on more text, or ask for "
                      "%d to make the size explicit.", made, vocab_size, count, made)
    # Write through gfile so gs:// outputs work; write-then-rename so readers never see half a file.
    tf.io.gfile.copy(os.path.join(tmp, "spm.model"), output + ".model.tmp", overwrite=True)
    tf.io.gfile.rename(output + ".model.tmp", output + ".model", overwrite=True)
    tf.io.gfile.copy(os.path.join(tmp, "spm.vocab"), output + ".vocab", overwrite=True)
  return output + ".model"


def _spm_error(err: RuntimeError, vocab_size: int, count: int) -> Exception:
  """SentencePiece's internal check messages, said in terms of our settings."""
  text = str(err)
  sizes = re.search(r"(\d+) vs (\d+)", text)
  if "required_chars" in text and sizes:
    needed = max(int(x) for x in sizes.groups())
    return Refusal(f"A SentencePiece vocabulary of {vocab_size} pieces (spm_vocab_size, or "
                   f"--vocab_size) cannot hold the {needed} distinct characters and special "
                   f"pieces this corpus needs; ask for at least {needed} pieces (thousands, for "
                   f"a useful vocabulary).")
  return Refusal(f"SentencePiece could not train a vocabulary of {vocab_size} pieces on {count} "
                 f"sentence(s): {text}")


def ensure_sentencepiece(data: DataConfig) -> str:
  """Trains the vocabulary (`vocab_path_of`) from the source's train split unless it exists."""
  import tensorflow as tf
  path = vocab_path_of(data)
  if data.tokenizer != "sentencepiece":
    raise Refusal(f"Only SentencePiece vocabularies are trained here, not {data.tokenizer!r}.")
  if not path.endswith(".model"):
    raise Refusal(f"SentencePiece vocab_path must end in .model, got {path!r}.")
  if not tf.io.gfile.exists(path):
    storage.make_dirs(os.path.dirname(path) or ".",
                      "vocab_path" if data.vocab_path else "cache_dir")
    docs = corpus.split_documents(corpus.read_documents(data), "train", data.eval_fraction)
    train_sentencepiece((s for d in docs for s in d), vocab_size=data.spm_vocab_size,
                        output=path, do_lower_case=data.do_lower_case)
  return path


def define_flags() -> None:
  """The command's flags; defined only when run as a command (bertjax.aot's pattern), so that
  importing this module beside another command's in one process does not collide."""
  from absl import flags  # pylint: disable=import-outside-toplevel
  flags.DEFINE_string("corpus", "builtin", "train: 'builtin', text file glob(s) "
                      "(comma-separated), or tfds:name/config:feature.")
  flags.DEFINE_integer("vocab_size", 8000, "train: pieces of the vocabulary.")
  flags.DEFINE_string("output", None, "train: output prefix; writes PREFIX.model and PREFIX.vocab.")
  flags.DEFINE_bool("cased", False, "train: keep case (default: case-folded).")
  flags.DEFINE_float("eval_fraction", 0.1, "train: held-out documents excluded from training "
                     "(the same split as prepare).")
  flags.DEFINE_string("vocab", None, "encode: the vocabulary file.")


def main(argv):
  """`train` a SentencePiece vocabulary with the BERT special tokens, or `encode TEXT` (print its
  pieces)."""
  from absl import app, flags  # pylint: disable=import-outside-toplevel
  args = flags.FLAGS
  command, rest = (argv[1], argv[2:]) if len(argv) > 1 else (None, [])
  if command == "train" and not rest:
    if not args.output:
      raise app.UsageError("train needs --output=PREFIX.")
    docs = corpus.split_documents(corpus.documents_from_source(args.corpus), "train",
                                  args.eval_fraction)
    path = train_sentencepiece((s for d in docs for s in d), vocab_size=args.vocab_size,
                               output=args.output, do_lower_case=not args.cased)
    tok = load_tokenizer(path)
    print(f"wrote {path}: {tok.vocab_size} pieces, fingerprint {tok.fingerprint}")
  elif command == "encode" and len(rest) == 1 and args.vocab:
    print(" ".join(load_tokenizer(args.vocab).tokenize(rest[0])))
  else:
    raise app.UsageError("Usage: train --output=PREFIX [--corpus=... --vocab_size=N --cased], "
                         f"or encode --vocab=FILE TEXT (got {argv[1:]}).")


if __name__ == "__main__":
  from bertjax import cli  # pylint: disable=ungrouped-imports
  define_flags()
  cli.run(main)
