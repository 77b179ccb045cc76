"""Tagged words, as one's own files and the benchmarks write them: `Sentence`s of words and their
IOB2 tags, the tag schemes read to IOB2, entities as conlleval finds them, and CoNLL column files
(the tagging family's and CoNLL-2003's; bertjax/finetune/tasks/ner.py reads that benchmark).

Tags inside bertjax are IOB2 (every entity starts with B-): files come in IOB1 (the original
CoNLL-2003 release, where B- only separates two adjacent entities of one type), IOB2, IO or IOBES,
and all read to the same entities, so IOB2 is the one scheme in which an entity's first tag is
always the same and the classifier has one thing to learn for "starts an entity".
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Iterable, Sequence

from bertjax import files
from bertjax.errors import Refusal

DOCSTART = "-DOCSTART-"


@dataclasses.dataclass(frozen=True)
class Sentence:
  where: str  # "file:line" of its first word (or "tfds ... #n")
  words: tuple[str, ...]
  tags: tuple[str, ...]  # IOB2


def split_tag(tag: str) -> tuple[str, str]:
  """("B"|"I"|"O", type); a malformed tag is ("", tag)."""
  if tag == "O":
    return "O", ""
  prefix, dash, kind = tag.partition("-")
  return (prefix, kind) if dash and prefix in ("B", "I") and kind else ("", tag)


def to_iob2(tags: Sequence[str]) -> list[str]:
  """IOB1 or IOB2 -> IOB2: an I- that conlleval would read as starting an entity (after O, at the
  start, or after another type) becomes B-. IOB2 input comes back unchanged."""
  out, prev_kind = [], ""
  for tag in tags:
    prefix, kind = split_tag(tag)
    out.append(f"B-{kind}" if prefix == "I" and kind != prev_kind else tag)
    prev_kind = kind if prefix in ("B", "I") else ""
  return out


def chunks(tags: Sequence[str]) -> list[tuple[str, int, int]]:
  """Entities as (type, start, end exclusive), by conlleval's rules: B- starts an entity; I- starts
  one after O or after another type; an entity ends before B-, O, or a change of type."""
  found, start, kind = [], None, ""
  for i, tag in enumerate(tags):
    prefix, this_kind = split_tag(tag)
    if not prefix:
      raise Refusal(f"Tag {tag!r} (position {i}) is not O, B-TYPE or I-TYPE.")
    if start is not None and (prefix in ("B", "O") or this_kind != kind):
      found.append((kind, start, i))
      start = None
    if prefix == "B" or (prefix == "I" and start is None):
      start, kind = i, this_kind
  if start is not None:
    found.append((kind, start, len(tags)))
  return found


LONG_SENTENCE = 250  # words: past this a "sentence" is taken for a file without blank lines


def read_columns(path: str, word_column: int = 0, tag_column: int = -1
                 ) -> list[tuple[int, list[str], list[str]]]:
  """(first line, words, tags as written) of each sentence of a CoNLL column file: one word per
  line (`word POS chunk NER` in CoNLL-2003), a blank line between sentences, `-DOCSTART-` lines
  between documents.

  Every word line must have as many columns as the first; a line that does not is an error naming
  the file and line (a shifted column would silently read a POS tag as an entity).
  """
  if not files.exists(path):
    raise FileNotFoundError(f"No CoNLL file {path}.")
  with files.open_file(path, "rb") as f:
    try:
      lines = f.read().decode("utf-8-sig").splitlines()
    except UnicodeDecodeError as err:
      raise Refusal(f"{path}: not UTF-8 at byte {err.start} (the original CoNLL-2003 English "
                    f"files are ASCII; convert Latin-1 files with iconv).") from None
  sentences, words, tags, first_line, width = [], [], [], 0, None
  for number, line in enumerate(lines, start=1):
    fields = line.split()
    if not fields or fields[0] == DOCSTART:
      if words:
        sentences.append((first_line, words, tags))
      words, tags = [], []
      continue
    if width is None:
      width = len(fields)
      if width < 2:
        raise Refusal(f"{path}:{number}: one column ({line.strip()[:40]!r}); a CoNLL file has "
                      f"the word first and the tag last on each line.")
    if len(fields) != width:
      raise Refusal(f"{path}:{number}: {len(fields)} column(s), expected {width} as on the "
                    f"first word line; a word or tag holding a space, or a damaged line?")
    if not words:
      first_line = number
    words.append(fields[word_column])
    tags.append(fields[tag_column])
  if words:
    sentences.append((first_line, words, tags))
  if not sentences:
    raise Refusal(f"{path}: no sentences (the file is empty or holds only {DOCSTART} and blank "
                  f"lines).")
  longest = max(sentences, key=lambda s: len(s[1]))
  if len(longest[1]) > LONG_SENTENCE:
    # CoNLL-2003's longest sentence has 124 words: far more means sentences run together.
    logging.warning("%s: a sentence of %d words (at %s:%d): are the blank lines between sentences "
                    "missing? A CoNLL file holds one word per line and a blank line after each "
                    "sentence.", path, len(longest[1]), path, longest[0])
  return sentences


# Tag schemes of one's own data ------------------------------------------------------------------
#   IO     I-TYPE (or a bare TYPE) inside an entity, O outside; adjacent entities of one type merge
#   BIO    (IOB2) B-TYPE starts every entity, I-TYPE continues it
#   IOB1   I-TYPE starts an entity; B-TYPE only where one follows another of the same type
#   IOBES  B- begins, I- continues, E- ends a multi-word entity; S- is a one-word entity
# All read to IOB2 (what the classifier learns, see the module docstring): each names the same
# entities in IOB2 as in its own scheme.
_PREFIXES = {"IO": {"I"}, "BIO": {"B", "I"}, "IOB1": {"B", "I"}, "IOBES": {"B", "I", "E", "S"}}


def scheme_tag(tag: str) -> tuple[str, str]:
  """(prefix, type): "O" -> ("O", ""); "B-PER" -> ("B", "PER"); a bare "PER" -> ("", "PER")."""
  if tag == "O":
    return "O", ""
  prefix, dash, kind = tag.partition("-")
  if dash and kind and prefix in ("B", "I", "E", "S"):
    return prefix, kind
  return "", tag


def detect_scheme(tag_lists: Iterable[Sequence[str]]) -> str:
  """The scheme the tags are written in: IOBES if any E-/S-; IO if no B- (bare types included);
  BIO if every entity starts with B-; else IOB1."""
  prefixes, iob1 = set(), False
  for tags in tag_lists:
    prev = ""
    for tag in tags:
      prefix, kind = scheme_tag(tag)
      prefixes.add(prefix)
      if prefix == "I" and prev != kind:
        iob1 = True
      prev = kind if prefix not in ("O", "E", "S") else ""
  if prefixes & {"E", "S"}:
    return "IOBES"
  if "B" not in prefixes:
    return "IO"
  return "IOB1" if iob1 else "BIO"


def scheme_to_iob2(tags: Sequence[str], scheme: str, where: str) -> list[str]:
  """Tags of `scheme` as IOB2; a tag the scheme does not have is an error naming `where`."""
  allowed = _PREFIXES[scheme]
  out = []
  for i, tag in enumerate(tags):
    prefix, kind = scheme_tag(tag)
    if prefix == "" and scheme != "IO":
      raise Refusal(f"{where} word {i + 1}: tag {tag!r} has no B-/I- prefix; in {scheme} every "
                    "entity tag has one (set config.data.tag_scheme='IO' for bare types).")
    if prefix not in allowed | {"O", ""}:
      raise Refusal(f"{where} word {i + 1}: tag {tag!r} is not {scheme} (its prefixes: "
                    f"{sorted(allowed)}, and O); set config.data.tag_scheme to the file's "
                    "scheme, or leave it '' to detect it.")
    out.append("O" if prefix == "O" else f"{'B' if prefix in ('B', 'S') else 'I'}-{kind}")
  return to_iob2(out)


def tag_labels(kinds: Iterable[str]) -> tuple[str, ...]:
  """The IOB2 label set of entity types: O, then B-/I- of each type in sorted order."""
  return ("O",) + tuple(f"{p}-{k}" for k in sorted(set(kinds)) for p in ("B", "I"))
