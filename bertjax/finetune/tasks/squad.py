"""SQuAD v1.1 / v2.0, the benchmark of the span family: its TFDS datasets. Its JSON files are in
the layout of every span task (bertjax/inputs/questions.py reads them, and makes the windowed
features); its official EM / F1 are squad_metrics.py's, its prediction files squad_postprocess.py's.
"""

from bertjax.data import corpus
from bertjax.errors import Refusal
from bertjax.inputs import questions

TFDS_NAMES = ("squad/v1.1", "squad/v2.0")


def read_squad_tfds(name: str, split: str, *, data_dir: str | None = None,
                    is_training: bool) -> questions.SquadSet:
  """The questions of a TFDS `squad/v1.1` or `squad/v2.0` split already built under `data_dir`;
  nothing is ever downloaded."""
  if name not in TFDS_NAMES:
    raise Refusal(f"Unknown SQuAD TFDS name {name!r}; use one of {list(TFDS_NAMES)}.")
  import tensorflow_datasets as tfds
  builder = corpus.built_tfds(name, data_dir, "read the SQuAD JSON files with read_squad_json")
  if split not in builder.info.splits:
    raise Refusal(f"TFDS dataset {name} has no split {split!r}; it has "
                  f"{sorted(builder.info.splits)}.")

  def records():
    for r in tfds.as_numpy(builder.as_dataset(split=split, shuffle_files=False)):
      answers = r["answers"]
      yield {"id": r["id"].decode(), "question": r["question"].decode(),
             "context": r["context"].decode(),
             "texts": [t.decode() for t in answers["text"]],
             "starts": [int(s) for s in answers["answer_start"]],
             "is_impossible": bool(r.get("is_impossible", False)), "marked": "is_impossible" in r}

  return questions.squad_set(records(), f"tfds:{name}/{split}", is_training)
