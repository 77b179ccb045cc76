"""A document's text cut into sentences, for every source whose documents are not already one
sentence a line: Parquet and JSON Lines rows (bertjax/data/corpora/records.py) and TFDS text.

The segmenter is sentencex (Wikimedia's, written in Rust): chosen on measurement against pySBD,
blingfire, syntok, segtok and spaCy's sentencizer (docs/data.md#sentences; `python -m
bertjax.benchmark sentences` measures them): the fastest by far (27 MB/s on one core; 15 with
the rule and clean-up here, twice the preparation's own tokenizer), rules for about 300
languages through one call (a language without rules of its own falls back to a related one's,
then to English's), 4 MB installed, released this year. On the 48 English golden rules it splits
43 right alone; the one rule bertjax adds (`_list_items`: a line that starts with a list marker
keeps it with its first sentence, and an inline list, "1. The first item 2. The second item", is
cut before each marker that continues the count) brings it to 47. pySBD, the one other that
passes 46, splits 0.10 MB/s and has had no release since 2021.

A line break ends a sentence (web text and Wikipedia put paragraphs on lines of their own); runs
of white space become one space, as the reader of the one-sentence-a-line format makes them, so a
document cut here and written out in that format reads back as the same sentences.
"""

import functools
import importlib.metadata
import re

import sentencex

from bertjax.errors import Refusal

# A language code as sentencex takes it: ISO 639-1 or -3, optionally with a region or script.
_LANGUAGE = re.compile(r"^[a-z]{2,3}(?:[-_][A-Za-z0-9]{2,8})*$")
# A list item's marker: a number or a lower-case letter and a stop, optionally after a bullet, at
# the start of a line or after white space, and followed by white space.
_MARKER = re.compile(r"(?:^|(?<=\s))([\u2022\u2043*-]?\s?(\d{1,3}|[a-z])\.)(?=\s)")


@functools.lru_cache(maxsize=1)
def segmenter() -> str:
  """The segmenter and its release, recorded with the settings of what it splits: another
  release may cut otherwise, and the shards and vocabularies cached from its sentences with it."""
  return f"sentencex {importlib.metadata.version('sentencex')}"


def check_language(language: str) -> str:
  if not _LANGUAGE.match(language):
    raise Refusal(f"config.data.language={language!r} is not a language code: give the ISO 639 "
                  f"code of the corpus's language (en, de, hi, zh, ...), which chooses the "
                  f"sentence rules of Parquet, JSON Lines and TFDS documents.")
  return language


def _successor(a: str, b: str) -> bool:
  if a.isdigit():
    return b.isdigit() and int(b) == int(a) + 1
  return not b.isdigit() and ord(b) == ord(a) + 1


def _list_items(line: str) -> list[tuple[str, str]]:
  """(marker, text) of each item where the line is a list item: it starts with a marker, and each
  later marker that continues the count (1., 2., ... or a., b., ...) starts another item; else
  [("", line)]. A marker is no sentence of its own: it starts its item's first sentence."""
  first = _MARKER.match(line)
  if not first:
    return [("", line)]
  cuts = [first]
  for m in _MARKER.finditer(line, first.end()):
    if _successor(cuts[-1].group(2), m.group(2)):
      cuts.append(m)
  ends = [m.start() for m in cuts[1:]] + [len(line)]
  return [(m.group(1).strip(), line[m.end():end].strip()) for m, end in zip(cuts, ends)]


def split_document(text: str, language: str = "en") -> list[str]:
  """The sentences of a document's text, each without line breaks and with its runs of white
  space made one space; none empty."""
  sentences = []
  for line in text.splitlines():
    if not line.strip():
      continue
    for marker, body in _list_items(line):
      pieces = [" ".join(s.split()) for s in sentencex.segment(language, body)]
      pieces = [p for p in pieces if p]
      if marker:
        pieces = [f"{marker} {pieces[0]}" if pieces else marker] + pieces[1:]
      sentences += pieces
  return sentences
