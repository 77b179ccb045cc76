"""Parquet and JSON Lines corpora (bertjax/data/corpora/records.py, inputfiles.py): a row a document, cut
into sentences; units of row groups and byte ranges; what is refused, skipped and counted."""

import dataclasses
import gzip
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from bertjax.data import corpus, prepare, tokenizer as tokenizer_lib
from bertjax.errors import Refusal
from test_data_fixtures import data_config

TEXTS = ["Hello World. My name is Jonas.\nA new line! Yes.", None, "   ",
         "Москва — столица России. Вы там были?", "", "One more document. Its end."]
DOCS = [["Hello World.", "My name is Jonas.", "A new line!", "Yes."],
        ["Москва — столица России.", "Вы там были?"], ["One more document.", "Its end."]]


def write_parquet(path, texts, row_group_size=2, **columns):
  pq.write_table(pa.table({"text": texts, **columns}), str(path), row_group_size=row_group_size)
  return str(path)


def jsonl_bytes(texts, column="text") -> bytes:
  return "".join(json.dumps({"id": k, column: t}) + "\n" for k, t in enumerate(texts)).encode()


def _docs(source, **kw):
  stats = corpus.CorpusStats()
  return list(corpus.documents_from_source(source, stats, **kw)), stats


def test_parquet_and_json_lines_give_a_document_per_row(tmp_path):
  write_parquet(tmp_path / "a.parquet", TEXTS)
  (tmp_path / "b.jsonl").write_bytes(jsonl_bytes(TEXTS))
  (tmp_path / "c.jsonl.gz").write_bytes(gzip.compress(jsonl_bytes(TEXTS)))
  (tmp_path / "d.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(jsonl_bytes(TEXTS)))
  for name in ("a.parquet", "b.jsonl", "c.jsonl.gz", "d.jsonl.zst"):
    docs, stats = _docs(str(tmp_path / name))
    assert docs == DOCS, name
    # The null, the empty and the blank row: skipped and counted.
    assert (stats.files, stats.documents, stats.sentences, stats.empty_rows) == (1, 3, 8, 3), name
  # The column (field) is a setting.
  write_parquet(tmp_path / "body.parquet", ["x"] * len(TEXTS), body=TEXTS)
  assert _docs(str(tmp_path / "body.parquet"), text_column="body")[0] == DOCS


def test_units_are_runs_of_row_groups_and_byte_ranges_at_line_ends(tmp_path):
  texts = [f"Document {k} has a sentence. And another one." for k in range(40)]
  path = write_parquet(tmp_path / "big.parquet", texts, row_group_size=5)
  units = corpus.plan_inputs(path, 300)
  assert len(units) > 2 and units[0]["row_groups"][0] == 0 and units[-1]["row_groups"][1] == 8
  assert all(a["row_groups"][1] == b["row_groups"][0] for a, b in zip(units, units[1:]))
  assert corpus.plan_inputs(path, 0) == [{"input": path, "row_groups": [0, 8]}]
  (tmp_path / "big.jsonl").write_bytes(jsonl_bytes(texts))
  ranges = corpus.plan_inputs(str(tmp_path / "big.jsonl"), 300)
  data = (tmp_path / "big.jsonl").read_bytes()
  assert len(ranges) > 2 and all(data[u["start"] - 1:u["start"]] == b"\n" for u in ranges[1:])
  # Each unit alone reads its rows; together, every row once, in order.
  c = data_config(tmp_path, n_docs=0, source="unused")
  for source_units in (units, ranges):
    docs = [d for u in source_units
            for d in corpus.unit_documents(u, c, corpus.CorpusStats())]
    assert docs == [["Document %d has a sentence." % k, "And another one."] for k in range(40)]
  # Compressed JSON Lines cannot be entered in the middle: one unit a file.
  (tmp_path / "big.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(data))
  assert len(corpus.plan_inputs(str(tmp_path / "big.jsonl.zst"), 300)) == 1


def _refused(source, match, **kw):
  with pytest.raises(Refusal, match=match) as refused:
    list(corpus.documents_from_source(source, **kw))
  assert "\n" not in str(refused.value)


def test_bad_records_are_refused_naming_the_file_the_place_and_the_fix(tmp_path):
  path = write_parquet(tmp_path / "a.parquet", TEXTS)
  _refused(path, r"a.parquet: no column 'body' \(it has \['text'\]\): set config.data.text_column",
           text_column="body")
  write_parquet(tmp_path / "n.parquet", ["x", "y"], number=[1, 2])
  _refused(str(tmp_path / "n.parquet"), r"n.parquet: column 'number' holds int64, not text",
           text_column="number")
  data = (tmp_path / "a.parquet").read_bytes()
  (tmp_path / "cut.parquet").write_bytes(data[:len(data) // 2])
  _refused(str(tmp_path / "cut.parquet"), r"cut.parquet is not a readable Parquet file .*"
                                          r"truncated or corrupt")
  # A damaged page: the footer reads, the second row group does not.
  (tmp_path / "bad.parquet").write_bytes(data[:4] + b"\xff" * 200 + data[204:])
  _refused(str(tmp_path / "bad.parquet"), r"bad.parquet, row group 0: cannot be read")
  lines = jsonl_bytes(TEXTS[:2]) + b'{"text": "cut short\n' + b'["a list"]\n'
  (tmp_path / "b.jsonl").write_bytes(lines)
  _refused(str(tmp_path / "b.jsonl"), r"b.jsonl, line 3: not JSON \(.*, column \d+\); "
                                      r"JSON Lines holds one object a line")
  (tmp_path / "b.jsonl").write_bytes(jsonl_bytes(TEXTS[:2]) + b'["a list"]\n')
  _refused(str(tmp_path / "b.jsonl"), r"b.jsonl, line 3: a list, not an object")
  _refused(str(tmp_path / "b.jsonl"), r"b.jsonl, line 1: no field 'body' \(it has \['id', "
                                      r"'text'\]\)", text_column="body")
  _refused(str(tmp_path / "b.jsonl"), r"b.jsonl, line 1: field 'id' holds a int, not text",
           text_column="id")
  packed = zstandard.ZstdCompressor().compress(jsonl_bytes(TEXTS * 50))
  (tmp_path / "z.jsonl.zst").write_bytes(packed[:-5])
  _refused(str(tmp_path / "z.jsonl.zst"), r"z.jsonl.zst is cut short: its last zstd frame does "
                                          r"not end. Check it with `zstd -t")
  (tmp_path / "y.jsonl.zst").write_bytes(packed[:12] + b"\xff" * 40 + packed[52:])
  _refused(str(tmp_path / "y.jsonl.zst"), r"y.jsonl.zst is not valid zstd data \(.*corruption")


def test_a_pattern_reads_the_format_its_name_says(tmp_path):
  """A folder of Parquet shards with its README: `dir/*` is refused naming the file and the fix,
  and a Parquet or zstd file under a text name is named, not read as noise."""
  write_parquet(tmp_path / "part-0.parquet", TEXTS)
  (tmp_path / "README.md").write_text("A dataset card.\n")
  _refused(f"{tmp_path}/*", r"part-0.parquet \(a parquet file by its name\) matches '.*/\*' of "
                            r"config.data.source, whose files are read as text. Give each format "
                            r"its own pattern")
  assert _docs(f"{tmp_path}/*.parquet,{tmp_path}/*.md")[0] == DOCS + [["A dataset card."]]
  os.rename(tmp_path / "part-0.parquet", tmp_path / "part-0.txt")
  _refused(f"{tmp_path}/*.txt", r"part-0.txt is a Parquet file but its name does not end in "
                                r"\.parquet")


def test_a_segmented_source_records_its_segmenter_and_text_sources_keep_their_names(tmp_path):
  """Shards and vocabularies made from a source cut into sentences are named by the segmenter's
  release, language and column (another splits otherwise); a text source's names and settings
  stay what they were, so its prepared data and cached vocabulary are found again."""
  text = data_config(tmp_path, tokenizer="sentencepiece", vocab_path="")
  tok = tokenizer_lib.load_tokenizer(data_config(tmp_path))
  assert "segmenter" not in prepare.settings_of(text, tok)
  assert tokenizer_lib.vocab_path_of(text) == tokenizer_lib.cached_sentencepiece_path(
      text.source, text.tfds_split, text.eval_fraction, text.cache_dir, text.spm_vocab_size,
      text.do_lower_case)
  parquet = dataclasses.replace(text, source=str(tmp_path / "*.parquet"))
  s = prepare.settings_of(parquet, tok)
  assert s["segmenter"].startswith("sentencex ") and (s["language"], s["text_column"]) == (
      "en", "text")
  names = {(tokenizer_lib.vocab_path_of(c), prepare.prepared_dir(c, tok))
           for c in (parquet, dataclasses.replace(parquet, language="de"),
                     dataclasses.replace(parquet, text_column="body"))}
  assert len(names) == 3 and len({n for pair in names for n in pair}) == 6
  assert "text_column" not in prepare.settings_of(
      dataclasses.replace(text, source="tfds:x/y:text"), tok)
