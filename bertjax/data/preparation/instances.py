"""Training instances from tokenized documents: NSP pairs (the original's rules) or MLM-only chunks.

An instance is `(tokens, num_a, label)`: `tokens` = [CLS] A [SEP] B [SEP] (ids, unpadded),
`num_a` = the length of the segment-0 part ([CLS] A [SEP]), `label` 0 = IsNext, 1 = NotNext.
Documents here are lists of sentences, each a list of token ids. Masking happens later, online.
"""

import dataclasses
import random
from typing import Iterator, Sequence

from bertjax.errors import Refusal


TokenDoc = Sequence[Sequence[int]]
Instance = tuple[list[int], int, int]


@dataclasses.dataclass
class InstanceStats:
  instances: int = 0
  not_next: int = 0
  tokens: int = 0  # real tokens (specials included) over all instances
  truncated_tokens: int = 0  # removed by pair truncation (the original's rule; by design)
  long_sentences_split: int = 0  # sentences longer than a sequence, cut into sequence-sized pieces

  def add(self, other: "InstanceStats"):
    for f in dataclasses.fields(self):
      setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


def split_long_sentences(doc: TokenDoc, max_tokens: int, stats: InstanceStats) -> list[list[int]]:
  """Cuts sentences over `max_tokens` (the original would silently truncate them) and drops empties."""
  out = []
  for sent in doc:
    if len(sent) > max_tokens:
      stats.long_sentences_split += 1
      out.extend(list(sent[i:i + max_tokens]) for i in range(0, len(sent), max_tokens))
    elif sent:
      out.append(sent)  # read only from here on: no copy
  return out


def _truncate_pair(a: list[int], b: list[int], max_tokens: int, rng: random.Random) -> int:
  removed = 0
  while len(a) + len(b) > max_tokens:
    longer = a if len(a) > len(b) else b
    # Trimming either end at random, as the original, so the model sees no fixed cut position.
    if rng.random() < 0.5:
      del longer[0]
    else:
      longer.pop()
    removed += 1
  return removed


def nsp_instances(docs: Sequence[TokenDoc], doc_index: int, *, max_seq_length: int,
                  short_seq_prob: float, cls_id: int, sep_id: int, rng: random.Random,
                  stats: InstanceStats) -> Iterator[Instance]:
  """The pairs of one document, as the original `create_instances_from_document`."""
  if len(docs) < 2:
    raise Refusal(f"NSP needs at least 2 documents to draw NotNext segments from, got "
                  f"{len(docs)}; add documents or set config.data.nsp=False.")
  document = docs[doc_index]
  max_num_tokens = max_seq_length - 3
  target_seq_length = max_num_tokens
  if rng.random() < short_seq_prob:
    target_seq_length = rng.randint(2, max_num_tokens)
  chunk, chunk_len, i = [], 0, 0
  while i < len(document):
    chunk.append(document[i])
    chunk_len += len(document[i])
    if i == len(document) - 1 or chunk_len >= target_seq_length:
      a_end = rng.randint(1, len(chunk) - 1) if len(chunk) >= 2 else 1
      tokens_a = [t for s in chunk[:a_end] for t in s]
      tokens_b = []
      if len(chunk) == 1 or rng.random() < 0.5:
        label = 1
        target_b_length = target_seq_length - len(tokens_a)
        # Uniform over the other documents (the original retries 10 times and may keep its own).
        other = rng.randrange(len(docs) - 1)
        other += other >= doc_index
        random_doc = docs[other]
        for j in range(rng.randrange(len(random_doc)), len(random_doc)):
          tokens_b.extend(random_doc[j])
          if len(tokens_b) >= target_b_length:
            break
        # The chunk's unused sentences go back, so their text still appears in some pair.
        i -= len(chunk) - a_end
      else:
        label = 0
        tokens_b = [t for s in chunk[a_end:] for t in s]
      stats.truncated_tokens += _truncate_pair(tokens_a, tokens_b, max_num_tokens, rng)
      tokens = [cls_id, *tokens_a, sep_id, *tokens_b, sep_id]
      stats.instances += 1
      stats.not_next += label
      stats.tokens += len(tokens)
      yield tokens, len(tokens_a) + 2, label
      chunk, chunk_len = [], 0
    i += 1


def mlm_only_instances(docs: Sequence[TokenDoc], *, max_seq_length: int, cls_id: int, sep_id: int,
                       rng: random.Random, stats: InstanceStats) -> Iterator[Instance]:
  """Contiguous full-length chunks across sentence and document boundaries (RoBERTa's FULL-SENTENCES).

  Documents are joined with [SEP] in a shuffled order and the stream is rotated by a random offset,
  so that each duplication pass cuts the text at other places.
  """
  width = max_seq_length - 2
  order = list(range(len(docs)))
  rng.shuffle(order)
  stream = []
  for k in order:
    for sent in docs[k]:
      stream.extend(sent)
    stream.append(sep_id)
  # Rotating (not cutting) the stream keeps every token; it ends with [SEP], so the wrap is a
  # document boundary like any other.
  start = rng.randrange(width) if len(stream) > width else 0
  stream = stream[start:] + stream[:start]
  for lo in range(0, len(stream), width):
    piece = stream[lo:lo + width]
    while piece and piece[-1] == sep_id:  # the closing [SEP] follows anyway
      piece.pop()
    while piece and piece[0] == sep_id:
      piece.pop(0)
    if not piece:
      continue
    tokens = [cls_id, *piece, sep_id]
    stats.instances += 1
    stats.tokens += len(tokens)
    yield tokens, len(tokens), 0


def create_instances(docs: Sequence[TokenDoc], *, max_seq_length: int, nsp: bool,
                     short_seq_prob: float, dupe_factor: int, cls_id: int, sep_id: int,
                     rng: random.Random, stats: InstanceStats, num_own: int | None = None,
                     per_document: list[int] | None = None) -> list[Instance]:
  """All instances of a document set, `dupe_factor` passes, shuffled (pairs differ per pass).

  Only the first `num_own` documents get instances; the others only lend NotNext segments.
  `per_document`, if given, receives each own document's instance count (MLM-only chunks cross
  documents: there, its share of the tokens in chunks).
  """
  num_own = len(docs) if num_own is None else num_own
  if max_seq_length < 5:
    raise Refusal(f"max_seq_length {max_seq_length} leaves no room for [CLS] A [SEP] B [SEP].")
  max_tokens = max_seq_length - 3 if nsp else max_seq_length - 2
  own_split = [split_long_sentences(doc, max_tokens, stats) for doc in docs[:num_own]]
  own_index = [i for i, d in enumerate(own_split) if d]
  own = [own_split[i] for i in own_index]
  lent = [d for d in (split_long_sentences(doc, max_tokens, InstanceStats()) for doc in
                      docs[num_own:]) if d]
  docs = own + lent
  counts = [0] * num_own
  out = []
  for _ in range(dupe_factor):
    if nsp:
      for k in range(len(own)):
        before = len(out)
        out.extend(nsp_instances(docs, k, max_seq_length=max_seq_length,
                                 short_seq_prob=short_seq_prob, cls_id=cls_id, sep_id=sep_id,
                                 rng=rng, stats=stats))
        counts[own_index[k]] += len(out) - before
    else:
      out.extend(mlm_only_instances(own, max_seq_length=max_seq_length, cls_id=cls_id,
                                    sep_id=sep_id, rng=rng, stats=stats))
      for k, d in enumerate(own):
        counts[own_index[k]] += -(-sum(map(len, d)) // max_tokens)
  if per_document is not None:
    per_document[:] = counts
  rng.shuffle(out)
  return out
