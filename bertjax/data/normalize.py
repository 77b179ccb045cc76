"""The original BERT's text normalization (its BasicTokenizer's character rules), with a map back
to the original characters, and its reading of a WordPiece vocab.txt: what bertjax's WordPiece
tokenizer (bertjax/data/tokenizer.py) runs before Hugging Face's WordPiece model.
"""

import functools
import re
import unicodedata
from typing import Iterable

import numpy as np

from bertjax import files

# The original's CJK ideograph ranges; Hugging Face's normalizer has 0x2B920 for 0x2B820.
_CJK_RANGES = ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F),
               (0x2B740, 0x2B81F), (0x2B820, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F))
# ASCII text (most sentences of most corpora) needs only this: controls dropped, \t \n \r to spaces.
_ASCII_CLEAN = {c: None for c in (*range(32), 127)} | {ord("\t"): " ", ord("\n"): " ",
                                                         ord("\r"): " "}


def _char_class(codes: Iterable[int]) -> str:
  """A regex character class of code points, as ranges."""
  codes, parts, i = sorted(codes), [], 0
  while i < len(codes):
    j = i
    while j + 1 < len(codes) and codes[j + 1] == codes[j] + 1:
      j += 1
    parts.append(re.escape(chr(codes[i])) + ("-" + re.escape(chr(codes[j])) if j > i else ""))
    i = j + 1
  return "[" + "".join(parts) + "]"


@functools.lru_cache(maxsize=1)
def _original_patterns():
  """Regexes of the original BasicTokenizer's character rules, from this Python's Unicode tables.

  Planes 4 to 13 hold no assigned character, so they are not scanned (a quarter of a second).
  """
  by_cat = {"Cc": [], "Cf": [], "Zs": [], "Mn": []}
  for c in (*range(0x40000), *range(0xE0000, 0xE1000)):
    cat = unicodedata.category(chr(c))
    if cat in by_cat:
      by_cat[cat].append(c)
  drop = {0, 0xFFFD, *by_cat["Cc"], *by_cat["Cf"]} - {ord("\t"), ord("\n"), ord("\r")}
  space = {ord(" "), ord("\t"), ord("\n"), ord("\r"), *by_cat["Zs"]}
  cjk = [c for lo, hi in _CJK_RANGES for c in range(lo, hi + 1)]
  return (re.compile(_char_class(drop)), re.compile(_char_class(space)),
          re.compile(_char_class(cjk)), re.compile(_char_class(by_cat["Mn"])))


def original_normalize(text: str, do_lower_case: bool) -> str:
  """The original BasicTokenizer up to its whitespace and punctuation split (which the Hugging Face
  pre-tokenizer does alike): drop NUL, U+FFFD and Cc/Cf controls (vertical tab and form feed
  included; tab and newlines become spaces, as Zs does); spaces around CJK ideographs; if uncased,
  lower-case, NFD, drop Mn marks.
  """
  if text.isascii():
    text = text.translate(_ASCII_CLEAN)
    return text.lower() if do_lower_case else text
  drop, space, cjk, marks = _original_patterns()
  text = space.sub(" ", drop.sub("", text))
  text = cjk.sub(r" \g<0> ", text)
  if do_lower_case:
    text = text.lower()
    if not text.isascii():
      text = marks.sub("", unicodedata.normalize("NFD", text))
  return text


# ASCII characters that `original_normalize` deletes (tab and line breaks become spaces, 1 for 1).
_ASCII_DROPPED = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


@functools.lru_cache(maxsize=1 << 16)
def _normalized_length(char: str, do_lower_case: bool) -> int:
  return len(original_normalize(char, do_lower_case))


def normalize_with_source(text: str, do_lower_case: bool) -> tuple[str, np.ndarray | None]:
  """`original_normalize(text)` and, per normalized character, the index of the original character
  it came from (None when that is the identity: ASCII text without deleted controls).

  Every rule of the normalization acts on one character at a time, so the map is the per-character
  output lengths, repeated. Python's lower-casing of a final sigma depends on its neighbours but
  keeps the length; should any rule ever disagree in length, the per-character text is used.
  """
  if text.isascii() and not _ASCII_DROPPED.search(text):
    return original_normalize(text, do_lower_case), None
  codes_N = np.frombuffer(text.encode("utf-32-le"), np.uint32)
  length_N = np.ones(len(codes_N), np.int64)
  length_N[(codes_N < 32) & (codes_N != 9) & (codes_N != 10) & (codes_N != 13)] = 0
  length_N[codes_N == 127] = 0
  wide = np.flatnonzero(codes_N >= 128)
  if len(wide):
    uniq, inverse = np.unique(codes_N[wide], return_inverse=True)
    length_N[wide] = np.array([_normalized_length(chr(c), do_lower_case) for c in uniq])[inverse]
  normalized = original_normalize(text, do_lower_case)
  if int(length_N.sum()) != len(normalized):
    normalized = "".join(original_normalize(c, do_lower_case) for c in text)
  return normalized, np.repeat(np.arange(len(codes_N)), length_N)


def read_wordpiece_vocab(path: str) -> list[str]:
  """The lines of a vocab.txt as the original reads them: split on "\n" only (not on the other
  line breaks `str.splitlines` knows), each stripped; a blank line is an (unused) entry."""
  with files.open_file(path, "rb") as f:
    text = f.read().decode("utf-8", errors="ignore")
  lines = text.split("\n")
  if lines and lines[-1] == "":
    lines.pop()  # the newline that ends the last line
  return [line.strip() for line in lines]
