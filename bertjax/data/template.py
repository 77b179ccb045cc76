"""Where the special tokens go around one text or a pair, and each position's segment (type) id.

BERT's layout is `[CLS] A [SEP]` and `[CLS] A [SEP] B [SEP]` (segments 0, then 1 from B on); a
Hugging Face tokenizer.json says its own in its post-processor (bertjax/data/hf_tokenizer.py), and
every feature builder of fine-tuning and prediction frames its rows with the tokenizer's template,
so a row's ids are those transformers' fast tokenizer gives for the same file. A file without a
post-processor gets BERT's (transformers would add no special token; an export's copy of it
carries BERT's). Pre-training's preparation builds BERT's layout and refuses a tokenizer whose
template is another (`prepare.check_layout`): a text is framed one way.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

# An item: ("A" | "B", type id) for a text's pieces, or (token id, type id) for a special token.
Item = tuple


@dataclasses.dataclass(frozen=True)
class Template:
  single: tuple[Item, ...]
  pair: tuple[Item, ...]

  @classmethod
  def bert(cls, cls_id: int, sep_id: int) -> "Template":
    return cls(single=((cls_id, 0), ("A", 0), (sep_id, 0)),
               pair=((cls_id, 0), ("A", 0), (sep_id, 0), ("B", 1), (sep_id, 1)))

  def items(self, pair: bool) -> tuple[Item, ...]:
    return self.pair if pair else self.single

  def text(self, pair: bool, pieces: Sequence[str]) -> str:
    """The layout as transformers' TemplateProcessing writes it: `[CLS] $A [SEP] $B:1 [SEP]:1`
    (a type id other than 0 after a colon)."""
    return " ".join(("$" + token if token in ("A", "B") else pieces[token])
                    + (f":{type_id}" if type_id else "") for token, type_id in self.items(pair))

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
