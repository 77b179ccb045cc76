"""A Hugging Face `tokenizer.json` (ModernBERT's byte-level BPE, or any other) read with the
`tokenizers` library, as the parts bertjax/data/tokenizer.py builds its Tokenizer from.

- Ids: the file's model, normalizer and pre-tokenizer, as transformers' fast tokenizer gives them
  (`PreTrainedTokenizerFast(tokenizer_file=...)`); the file's own truncation and padding are off
  (bertjax cuts and pads rows itself).
- Layout: the file's post-processor, read by running it on two probe texts (`template.Template`):
  `[CLS] A [SEP] B [SEP]` and its type ids for ModernBERT's TemplateProcessing, whatever another
  file's says. A file without a post-processor says none: its rows are BERT's, `[CLS] A [SEP]`
  and `[CLS] A [SEP] B [SEP]` (segment 1 from B on), as pre-training's preparation builds them
  for every tokenizer, so that fine-tuning and prediction frame a text as pre-training did.
- Offsets: `tokenizers`' character spans in the original text, spaces at either end left out (a
  byte-level piece "Ġword" holds the space before it, which no answer wants); a character that
  byte-level BPE splits into two pieces lies in both.
- Words, for whole-word masking, are what a byte-level pre-tokenizer splits (GPT-2's rule: a run
  of letters or of digits with the one space before it, a run of other symbols, a run of spaces),
  told from ids alone by three tables (`WordTables`); a WordPiece model's pieces by "##", a
  Metaspace's by "\u2581".
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import unicodedata

import numpy as np

from bertjax import files
from bertjax.data.template import Template
from bertjax.errors import Refusal

KIND = "huggingface"

# Character classes at a piece's edges (byte-level): JOIN = the piece begins inside a character
# (a UTF-8 continuation byte), WS = whitespace, LETTER, NUMBER, OTHER (punctuation, symbols),
# SPACE = ends in one plain space (GPT-2's pre-tokenizer gives it to the word after it).
JOIN, WS, LETTER, NUMBER, OTHER, SPACE = range(6)
_JOINS_CxC = np.zeros((6, 6), bool)  # [last class of the piece before, first class of this one]
_JOINS_CxC[:, JOIN] = True
for _c in (WS, LETTER, NUMBER, OTHER):
  _JOINS_CxC[_c, _c] = True
_JOINS_CxC[SPACE, WS] = True  # a run of spaces is one word
_JOINS_CxC[SPACE, (LETTER, NUMBER, OTHER)] = True


@dataclasses.dataclass(frozen=True)
class WordTables:
  """A piece starts a word where `start_V` says so, or where the class its first character has
  does not continue the last character's of the piece before (`joins_CxC[last, first]` False)."""
  start_V: np.ndarray  # [V] bool
  first_V: np.ndarray  # [V] int8
  last_V: np.ndarray  # [V] int8
  joins_CxC: np.ndarray  # [C, C] bool

  def starts(self, ids) -> np.ndarray:
    """Per piece of one text (no special token), whether it starts a word."""
    ids = np.asarray(ids, np.int64)
    out = self.start_V[ids].copy()
    if len(ids):
      out[0] = True
      out[1:] |= ~self.joins_CxC[self.last_V[ids[:-1]], self.first_V[ids[1:]]]
    return out


@functools.lru_cache(maxsize=1)
def byte_of_char() -> dict[str, int]:
  """Byte-level BPE's printable stand-in for each byte (GPT-2's table): printable Latin-1
  characters stand for themselves, the other bytes for 256, 257, ... in byte order."""
  printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
               *range(ord("\xae"), ord("\xff") + 1)]
  table, extra = {}, 0
  for b in range(256):
    if b in printable:
      table[chr(b)] = b
    else:
      table[chr(256 + extra)] = b
      extra += 1
  return table


def _char_class(ch: str) -> int:
  if ch.isspace():
    return WS
  cat = unicodedata.category(ch)
  return LETTER if cat[0] == "L" else NUMBER if cat[0] == "N" else OTHER


def _char_length(lead: int) -> int:
  """Bytes of the UTF-8 character a lead byte begins."""
  return 1 if lead < 0x80 else 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4


def _edge_classes(data: bytes) -> tuple[bool, int, int]:
  """(starts a word by itself, first class, last class) of a piece's bytes. A character the
  piece holds only part of is taken for a letter (most split characters are: accented, CJK)."""
  if not data:
    return True, OTHER, OTHER
  if 0x80 <= data[0] < 0xC0:
    first = JOIN
  else:
    n = _char_length(data[0])
    first = _char_class(data[:n].decode("utf-8", "replace")[0]) if len(data) >= n else LETTER
  j = len(data) - 1
  while j > 0 and 0x80 <= data[j] < 0xC0:
    j -= 1
  if 0x80 <= data[j] < 0xC0 or j + _char_length(data[j]) != len(data):
    last = LETTER  # ends inside a character
  else:
    last = SPACE if data[j:] == b" " else _char_class(data[j:].decode("utf-8", "replace")[0])
  alone = data[:1] == b" " and len(data) > 1 and not data[1:].isspace()
  return alone, first, last


def word_tables(hf, spec: dict, pieces: list[str]) -> WordTables:
  """The tables of `WordTables` for a tokenizer's pieces (see the module docstring); `spec` is
  its tokenizer.json's dict."""
  n = len(pieces)
  start_V, first_V, last_V = np.ones(n, bool), np.full(n, OTHER, np.int8), np.full(n, OTHER,
                                                                                 np.int8)
  joins = np.zeros((6, 6), bool)
  added = set(hf.get_added_tokens_decoder())
  if _is_byte_level(spec.get("pre_tokenizer")):
    chars = byte_of_char()
    joins = _JOINS_CxC
    for i, piece in enumerate(pieces):
      if i in added or not piece or any(c not in chars for c in piece):
        continue  # a special or added token is a word of its own
      start_V[i], first_V[i], last_V[i] = _edge_classes(bytes(chars[c] for c in piece))
  elif (spec.get("model") or {}).get("continuing_subword_prefix"):
    prefix = spec["model"]["continuing_subword_prefix"]
    start_V = np.array([i in added or not p.startswith(prefix) for i, p in enumerate(pieces)])
  elif _metaspace(spec.get("pre_tokenizer")):
    mark = _metaspace(spec.get("pre_tokenizer"))
    start_V = np.array([i in added or p.startswith(mark) for i, p in enumerate(pieces)])
  return WordTables(start_V, first_V, last_V, joins)


def _parts(spec) -> list[dict]:
  if not spec:
    return []
  if spec.get("type") == "Sequence":
    return [p for s in spec.get("pretokenizers", []) for p in _parts(s)]
  return [spec]


def _is_byte_level(spec) -> bool:
  return any(p.get("type") == "ByteLevel" for p in _parts(spec))


def _metaspace(spec) -> str | None:
  return next((p.get("replacement", "\u2581") for p in _parts(spec)
               if p.get("type") == "Metaspace"), None)


def probe_template(hf, where: str) -> Template | None:
  """The post-processor's layout, read off its output for two probe texts of different lengths;
  checked by framing the probes again. None without a post-processor: BERT's layout (the
  Tokenizer's default), not the bare texts transformers would give, whose rows would hold no
  [CLS] for the pooler and none of the [SEP]s the encoder was pre-trained with."""
  if hf.post_processor is None:
    return None
  a = hf.encode("a", add_special_tokens=False)
  b = next((e for e in (hf.encode(t, add_special_tokens=False) for t in ("a b", "a b c", "b b b b"))
            if len(e.ids) not in (0, len(a.ids))), None)
  if not a.ids or b is None:
    raise Refusal(f"{where}: its post-processor's layout cannot be probed (the probe texts "
                  "'a', 'a b' give no pieces)")
  items = {}
  for pair in (False, True):
    out = hf.post_process(a, b if pair else None, add_special_tokens=True)
    got, at, placed = [], 0, set()
    while at < len(out.ids):
      for name, enc in (("A", a), ("B", b) if pair else ("A", a)):
        if name not in placed and out.ids[at:at + len(enc.ids)] == enc.ids and all(
            m == 0 for m in out.special_tokens_mask[at:at + len(enc.ids)]):
          got.append((name, out.type_ids[at]))
          placed.add(name)
          at += len(enc.ids)
          break
      else:
        got.append((out.ids[at], out.type_ids[at]))
        at += 1
    items[pair] = tuple(got)
  template = Template(single=items[False], pair=items[True])
  for pair in (False, True):
    ids, types, _, _ = template.frame(a.ids, b.ids if pair else None)
    out = hf.post_process(a, b if pair else None, add_special_tokens=True)
    if ids != out.ids or types != out.type_ids:
      raise Refusal(f"{where}: its post-processor's layout is not a fixed frame around the "
                    "texts (bertjax frames rows itself); use a TemplateProcessing one")
  return template


def _offsets(text: str, ids, spans) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  start_N = np.array([s for s, _ in spans], np.int32).reshape(-1)
  end_N = np.array([e for _, e in spans], np.int32).reshape(-1)
  for i in range(len(start_N)):
    while start_N[i] < end_N[i] and text[start_N[i]].isspace():
      start_N[i] += 1
    while end_N[i] > start_N[i] and text[end_N[i] - 1].isspace():
      end_N[i] -= 1
  return np.array(ids, np.int32), start_N, end_N


def load_parts(path: str) -> dict:
  """What bertjax/data/tokenizer.py's Tokenizer takes from a tokenizer.json: pieces (by id),
  encode and offsets functions, word tables, template, and the options its fingerprint hashes."""
  from tokenizers import Tokenizer as HfTokenizer  # pylint: disable=import-outside-toplevel
  with files.open_file(path, "rb") as f:
    raw = f.read()
  try:
    spec = json.loads(raw)
    hf = HfTokenizer.from_str(raw.decode("utf-8"))
  except Exception as err:  # pylint: disable=broad-except  (tokenizers raises its own)
    raise Refusal(f"{path} is not a Hugging Face tokenizer.json the tokenizers library reads "
                  f"({str(err).splitlines()[0][:200]})") from None
  hf.no_truncation()
  hf.no_padding()
  vocab = hf.get_vocab(with_added_tokens=True)
  pieces = [""] * (max(vocab.values()) + 1)
  for piece, i in vocab.items():
    pieces[i] = piece

  def encode_batch(texts):
    return [e.ids for e in hf.encode_batch(texts, add_special_tokens=False)]

  def offsets_batch(texts):
    return [_offsets(t, e.ids, e.offsets) for t, e in
            zip(texts, hf.encode_batch(texts, add_special_tokens=False))]

  def encode_words(sentences):
    # Each word after a sentence's first as it reads in the sentence: after a space (byte-level
    # BPE has other pieces for " word" than for "word").
    flat = [w if k == 0 else " " + w for s in sentences for k, w in enumerate(s)]
    return encode_batch(flat)

  for key in ("truncation", "padding"):  # off here, so not part of what the ids depend on
    spec.pop(key, None)
  options = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
  return dict(pieces=pieces, encode_batch_fn=encode_batch, offsets_batch_fn=offsets_batch,
              encode_words_fn=encode_words, word_tables=word_tables(hf, spec, pieces),
              template=probe_template(hf, path), options=options,
              lower_case=_lower_cases(spec.get("normalizer")))


def copy_framed(path: str, output: str) -> bool:
  """Writes the tokenizer.json at `path` to `output` framing rows as bertjax does (an export's, for
  transformers): as it is where it has a post-processor; with BERT's TemplateProcessing where it
  has none, which transformers would frame bare. Returns whether that was added."""
  from tokenizers import Tokenizer as HfTokenizer  # pylint: disable=import-outside-toplevel
  from tokenizers import processors  # pylint: disable=import-outside-toplevel
  with files.open_file(path, "rb") as f:
    raw = f.read()
  hf = HfTokenizer.from_str(raw.decode("utf-8"))
  if hf.post_processor is not None:
    with open(output, "wb") as f:
      f.write(raw)
    return False
  hf.post_processor = processors.TemplateProcessing(
      single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
      special_tokens=[(t, hf.token_to_id(t)) for t in ("[CLS]", "[SEP]")])
  hf.save(output)
  return True


def lower_cases(path: str) -> bool:
  """Whether the normalizer of the tokenizer.json at `path` lower-cases."""
  return _lower_cases(files.read_json(path, "the Hugging Face tokenizer").get("normalizer"))


def _lower_cases(spec) -> bool:
  """Whether the file's normalizer lower-cases (for the casing a folder reports; the file
  itself decides the ids)."""
  if not spec:
    return False
  if spec.get("type") == "Sequence":
    return any(_lower_cases(s) for s in spec.get("normalizers", []))
  return spec.get("type") == "Lowercase" or (spec.get("type") == "BertNormalizer"
                                             and bool(spec.get("lowercase")))


def is_hf_tokenizer_json(path: str) -> bool:
  """Whether a file named tokenizer.json is Hugging Face's (a `model` key), not the record bertjax
  writes beside a vocabulary copy under that name (bertjax/data/tokenizer.py; a few hundred
  bytes). One that cannot be parsed is not taken for Hugging Face's: its reader names it."""
  with files.open_file(path, "rb") as f:
    head = f.read(1 << 16)
  if len(head) == 1 << 16:
    return True  # no record is this long
  try:
    found = json.loads(head)
  except ValueError:
    return False
  return isinstance(found, dict) and "model" in found
