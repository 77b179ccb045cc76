"""Where the special tokens go around one text or a pair, and each position's segment (type) id.

BERT's layout is `[CLS] A [SEP]` and `[CLS] A [SEP] B [SEP]` (segments 0, then 1 from B on); a
Hugging Face tokenizer.json says its own in its post-processor (bertjax/data/hf_tokenizer.py), and
every feature builder of fine-tuning and prediction frames its rows with the tokenizer's template,
so a row's ids are those transformers' fast tokenizer gives for the same file.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from bertjax.errors import Refusal

# An item: ("A" | "B", type id) for a text's pieces, or (token id, type id) for a special token.
Item = tuple


@dataclasses.dataclass(frozen=True)
class Template:
  single: tuple[Item, ...]
  pair: tuple[Item, ...] | None  # None: the tokenizer has no layout for two texts
  where: str = ""  # the file it came from, for the refusal of pairs

  @classmethod
  def bert(cls, cls_id: int, sep_id: int) -> "Template":
    return cls(single=((cls_id, 0), ("A", 0), (sep_id, 0)),
               pair=((cls_id, 0), ("A", 0), (sep_id, 0), ("B", 1), (sep_id, 1)))

  def items(self, pair: bool) -> tuple[Item, ...]:
    if not pair:
      return self.single
    if self.pair is None:
      raise Refusal(f"{self.where} has no post-processor saying how two texts are joined "
                    "(e.g. [CLS] A [SEP] B [SEP]): give one text per example, or use a "
                    "tokenizer.json with a TemplateProcessing post-processor.")
    return self.pair

  def specials(self, pair: bool) -> int:
    """How many special tokens a row holds beside its text(s)."""
    return sum(1 for token, _ in self.items(pair) if token not in ("A", "B"))

  def frame(self, a: Sequence[int], b: Sequence[int] | None = None
            ) -> tuple[list[int], list[int], int, int]:
    """(ids, type ids, where A starts, where B starts (-1 without B)) of one row."""
    ids, types, starts = [], [], {"A": -1, "B": -1}
    for token, type_id in self.items(b is not None):
      if token in ("A", "B"):
        text = a if token == "A" else b
        starts[token] = len(ids)
        ids.extend(text)
        types.extend([type_id] * len(text))
      else:
        ids.append(token)
        types.append(type_id)
    return ids, types, starts["A"], starts["B"]
