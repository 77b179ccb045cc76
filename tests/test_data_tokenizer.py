"""Tokenizers: WordPiece against the original's documented cases; SentencePiece training."""

import os
import subprocess
import sys
import unicodedata

import pytest

from bertjax.data import tokenizer as tokenizer_lib
from test_data_fixtures import SPECIALS

# The vocabulary of the original tokenization_test.py, with [PAD] and [MASK] added.
ORIGINAL_VOCAB = ["[UNK]", "[CLS]", "[SEP]", "want", "##want", "##ed", "wa", "un", "runn", "##ing",
                  ",", "low", "lowest"]


def _wordpiece(tmp_path, pieces, lower=True, name="vocab.txt"):
  path = os.path.join(str(tmp_path), name)
  with open(path, "w") as f:
    f.write("\n".join(pieces) + "\n")
  cfg = tokenizer_lib.load_tokenizer(path)  # default: uncased
  if lower:
    return cfg
  from test_data_fixtures import data_config
  c = data_config(tmp_path, n_docs=0, vocab_path=path, do_lower_case=False)
  return tokenizer_lib.load_tokenizer(c)


@pytest.fixture
def wp(tmp_path):
  return _wordpiece(tmp_path, ["[PAD]"] + ORIGINAL_VOCAB + ["[MASK]"])


def test_wordpiece_original_cases(wp):
  # FullTokenizer: lower-casing, accent stripping (é), punctuation split, ## continuation.
  assert wp.tokenize("UNwant\u00E9d,running") == ["un", "##want", "##ed", ",", "runn", "##ing"]
  assert wp.encode("UNwant\u00E9d,running") == [8, 5, 6, 11, 9, 10]  # original ids + 1 ([PAD] first)
  # WordpieceTokenizer: a word that cannot be fully matched becomes one [UNK].
  assert wp.tokenize("unwanted running") == ["un", "##want", "##ed", "runn", "##ing"]
  assert wp.tokenize("unwantedX running") == ["[UNK]", "runn", "##ing"]
  assert wp.tokenize("") == []
  assert wp.tokenize("  \t\n ") == []


def test_basic_tokenizer_cases(tmp_path):
  words = ["hello", "!", "how", "are", "you", "?", "ah", "\u535A", "\u63A8", "zz", "HeLLo", "Are",
           "yoU"]
  uncased = _wordpiece(tmp_path, SPECIALS + words)
  # Lower-casing, whitespace cleanup and punctuation splitting.
  assert uncased.tokenize(" \tHeLLo!how  \n Are yoU?  ") == ["hello", "!", "how", "are", "you", "?"]
  # Accent stripping for uncased vocabularies.
  assert uncased.tokenize("H\u00E9llo") == ["hello"]
  # CJK ideographs become words of their own.
  assert uncased.tokenize("ah\u535A\u63A8zz") == ["ah", "\u535A", "\u63A8", "zz"]
  # Control characters and U+FFFD are dropped.
  assert uncased.tokenize("hel\u0000lo\ufffd how") == ["hello", "how"]
  cased = _wordpiece(tmp_path, SPECIALS + words, lower=False, name="cased.txt")
  assert cased.tokenize(" \tHeLLo!how  \n Are yoU?  ") == ["HeLLo", "!", "how", "Are", "yoU", "?"]


def test_wordpiece_long_word_is_one_unk(tmp_path):
  tok = _wordpiece(tmp_path, SPECIALS + ["a", "##a"])
  assert tok.tokenize("a" * 200) == ["a"] + ["##a"] * 199
  assert tok.tokenize("a" * 201) == ["[UNK]"]


def test_wordpiece_special_ids_and_fingerprint(wp, tmp_path):
  assert (wp.pad_id, wp.unk_id, wp.cls_id, wp.sep_id, wp.mask_id) == (0, 1, 2, 3, 14)
  assert wp.vocab_size == 15
  assert wp.word_start_V[wp.encode("want")[0]] and not wp.word_start_V[5]  # "##want"
  other = _wordpiece(tmp_path, ["[PAD]"] + ORIGINAL_VOCAB + ["[MASK]", "extra"], name="v2.txt")
  assert other.fingerprint != wp.fingerprint
  again = _wordpiece(tmp_path, ["[PAD]"] + ORIGINAL_VOCAB + ["[MASK]"], name="v3.txt")
  assert again.fingerprint == wp.fingerprint


def test_vocab_missing_special_token_is_an_error(tmp_path):
  with pytest.raises(ValueError, match=r"lacks the special token\(s\) \['\[PAD\]', '\[MASK\]'\]"):
    _wordpiece(tmp_path, ORIGINAL_VOCAB)
  with pytest.raises(ValueError, match="must have id 0"):
    _wordpiece(tmp_path, ["[UNK]", "[PAD]", "[CLS]", "[SEP]", "[MASK]"], name="b.txt")
  with pytest.raises(FileNotFoundError, match="does not exist"):
    tokenizer_lib.load_tokenizer(os.path.join(str(tmp_path), "nope.txt"))


def test_sentencepiece_training_fixed_special_ids(tmp_path):
  from test_data_fixtures import random_documents
  sentences = [s for d in random_documents(60, 20) for s in d]
  out = os.path.join(str(tmp_path), "sp", "spm")
  path = tokenizer_lib.train_sentencepiece(sentences, vocab_size=300, output=out)
  tok = tokenizer_lib.load_tokenizer(path)
  assert (tok.pad_id, tok.unk_id, tok.cls_id, tok.sep_id, tok.mask_id) == (0, 1, 2, 3, 4)
  assert tok.kind == "sentencepiece" and tok.vocab_size <= 300
  ids = tok.encode(sentences[0])
  assert ids and not set(ids) & {0, 2, 3, 4}
  # Word-start markers: the first piece of a sentence starts a word.
  assert tok.word_start_V[ids[0]]
  # "[MASK]" typed in text is not the control token.
  assert tok.mask_id not in tok.encode("a [MASK] b")
  # Training is deterministic: same corpus, same fingerprint.
  path2 = tokenizer_lib.train_sentencepiece(sentences, vocab_size=300,
                                            output=os.path.join(str(tmp_path), "spm2"))
  assert tokenizer_lib.load_tokenizer(path2).fingerprint == tok.fingerprint


def test_sentencepiece_cli(tmp_path):
  from test_data_fixtures import random_documents, write_corpus
  corpus = write_corpus(os.path.join(str(tmp_path), "c.txt"), random_documents(30, 20))
  out = os.path.join(str(tmp_path), "cli")
  # The documented command lines (absl flags, the command named as an argument).
  run = lambda *args: subprocess.run([sys.executable, "-m", "bertjax.data.tokenizer", *args],
                                     capture_output=True, text=True, check=True, timeout=300).stdout
  assert "wrote " in run("train", f"--corpus={corpus}", "--vocab_size=200", f"--output={out}")
  assert tokenizer_lib.load_tokenizer(out + ".model").vocab_size <= 200
  assert run("encode", f"--vocab={out}.model", "hello world").split()


def test_sentencepiece_vocab_per_source_in_cache(tmp_path):
  from test_data_fixtures import data_config
  c = data_config(tmp_path, n_docs=30, tokenizer="sentencepiece", vocab_path="", spm_vocab_size=200)
  path = tokenizer_lib.ensure_sentencepiece(c)
  assert path.startswith(c.cache_dir) and os.path.exists(path)
  assert tokenizer_lib.load_tokenizer(c).fingerprint == tokenizer_lib.load_tokenizer(path).fingerprint
  other = data_config(tmp_path / "b", n_docs=30, tokenizer="sentencepiece", vocab_path="")
  assert tokenizer_lib.vocab_path_of(other) != path  # another corpus, another vocabulary
  wp = data_config(tmp_path / "c", n_docs=0, vocab_path="")
  with pytest.raises(ValueError, match="vocab_path is empty"):
    tokenizer_lib.load_tokenizer(wp)


def test_sentencepiece_says_when_the_corpus_is_too_small_or_odd(tmp_path, caplog):
  from test_data_fixtures import random_documents
  sentences = [s for d in random_documents(20, 10) for s in d]
  # Far more pieces asked for than the text holds: both numbers are said.
  with caplog.at_level("WARNING"):
    path = tokenizer_lib.train_sentencepiece(sentences, vocab_size=8000,
                                             output=str(tmp_path / "big"))
  made = tokenizer_lib.load_tokenizer(path).vocab_size
  assert made < 8000 and f"SentencePiece made {made} pieces, not the 8000 asked for" in caplog.text
  # Fewer pieces than the corpus has characters: our message, not SentencePiece's check.
  with pytest.raises(ValueError, match=r"vocabulary of 20 pieces .* cannot hold the \d+ distinct "
                                       r"characters"):
    tokenizer_lib.train_sentencepiece(sentences, vocab_size=20, output=str(tmp_path / "small"))
  # Only a giant line: SentencePiece would skip it and fail on an empty corpus.
  with pytest.raises(ValueError, match=r"no sentence of at most 65536 bytes \(1 longer one"):
    tokenizer_lib.train_sentencepiece(["word " * 20_000], vocab_size=100,
                                      output=str(tmp_path / "long"))


# --- The original's rules, written out plainly as a reference (tokenization.py's documented
# behaviour, not its code): BasicTokenizer then greedy longest-match WordPiece.
_CJK = ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F),
        (0x2B740, 0x2B81F), (0x2B820, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F))


def _is_punct(ch):
  cp = ord(ch)
  return (33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126
          or unicodedata.category(ch).startswith("P"))


def _reference_tokenize(text, vocab, lower):
  kept = []
  for ch in text:
    if ch in "\t\n\r" or unicodedata.category(ch) == "Zs":
      kept.append(" ")
    elif not (ord(ch) in (0, 0xFFFD) or unicodedata.category(ch) in ("Cc", "Cf")):
      kept.append(f" {ch} " if any(lo <= ord(ch) <= hi for lo, hi in _CJK) else ch)
  words = []
  for token in "".join(kept).split():  # str.split: every Unicode whitespace, U+2028 included
    if lower:
      token = "".join(c for c in unicodedata.normalize("NFD", token.lower())
                      if unicodedata.category(c) != "Mn")
    word = ""
    for ch in token:
      if _is_punct(ch):
        words += [word, ch] if word else [ch]
        word = ""
      else:
        word += ch
    words += [word] if word else []
  pieces = []
  for word in words:
    if len(word) > 200:
      pieces.append("[UNK]")
      continue
    out, start = [], 0
    while start < len(word):
      end = len(word)
      while end > start and ("##" if start else "") + word[start:end] not in vocab:
        end -= 1
      if end == start:
        out = ["[UNK]"]
        break
      out.append(("##" if start else "") + word[start:end])
      start = end
    pieces += out
  return pieces


# Characters where Hugging Face's BertNormalizer and the original part ways, and some that agree.
_TRICKY = ["\ue000", "\U000F0001", "\u0378", "\U0002B820", "\U0002B8FF", "\u4e00", "\x0b", "\x0c",
           "\x1c", "\x85", "\u2028", "\u2029", "\u00a0", "\u200b", "\u093e", "\u0301", "\u20dd",
           "\u00e9", "\u0130", "\u03a3", "\ufffd", "\x00", "!", "-", "\u00bf", " ", "\t"]


def test_wordpiece_matches_the_original_where_hugging_face_differs(tmp_path):
  import random
  words = ["a", "b", "ab", "##b", "##a", "\ue000", "a\ue000", "\U0002B820", "\u4e00", "\u0378",
           "\u093e", "a\u093e", "\u20dd", "\u0130", "\u03c3", "\u03c2", "\U000F0001", "\u00e9",
           "e", "i", "\u00bf", "!", "-", "ab\u20dd", "\u2028"]
  for lower in (True, False):
    tok = _wordpiece(tmp_path, SPECIALS + words, lower=lower, name=f"v{lower}.txt")
    vocab = set(tok.pieces)
    assert tok.tokenize("a\ue000 \U0002B820b a\x0bb a\x0cb") == _reference_tokenize(
        "a\ue000 \U0002B820b a\x0bb a\x0cb", vocab, lower)
    rng = random.Random(0)
    for _ in range(400):
      text = "".join(rng.choice(_TRICKY + ["a", "b", "e", "ab", "i", " "]) for _ in range(12))
      assert tok.tokenize(text) == _reference_tokenize(text, vocab, lower), (lower, repr(text))


def test_wordpiece_vocab_lines_as_the_original_reads_them(tmp_path):
  # Split on "\n" only: a piece holding U+0085 or U+2028 is one line, not two; a duplicate maps to
  # its last line; a blank line is an entry; the final newline is not.
  path = tmp_path / "v.txt"
  path.write_bytes("\n".join(SPECIALS + ["x\u0085y", "dup", "", "z\u2028q", "dup", "w"]).encode()
                   + b"\n")
  tok = tokenizer_lib.load_tokenizer(str(path))
  assert tok.pieces == SPECIALS + ["x\u0085y", "dup", "", "z\u2028q", "dup", "w"]
  assert tok.encode("dup w") == [9, 10]


def test_a_vocabulary_is_built_once_per_process_and_never_stale(tmp_path):
  pieces = ["[PAD]"] + ORIGINAL_VOCAB + ["[MASK]"]
  first = _wordpiece(tmp_path, pieces)
  assert _wordpiece(tmp_path, pieces) is first  # the same file again: the same tokenizer
  cased = _wordpiece(tmp_path, pieces, lower=False)
  assert cased is not first and cased.tokenize("Want") != first.tokenize("Want")
  # Rewritten at the same path (same size, so neither name nor size tells them apart).
  changed = _wordpiece(tmp_path, pieces[:-2] + ["[MASK]", "lowesT"])
  assert changed is not first and changed.fingerprint != first.fingerprint
