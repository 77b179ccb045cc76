"""Corpora of records, one document each, as the field ships them: Parquet files (a row a
document, its text in the column `config.data.text_column`) and JSON Lines (a line a document, its
text in the field of that name; plain, `.jsonl.gz` or `.jsonl.zst`), at any path bertjax reads
(local, or gs:// through tf.io.gfile).

Units of work (corpus.plan_inputs, for the Beam workers and the hosts alike): a Parquet file's
row groups, in runs of about `input_split_bytes` of text by its footer's sizes, and a plain JSON
Lines file's byte ranges, cut just after a line end (inputfiles.cut_points). A compressed file is
one unit: neither gzip nor zstd can be entered in the middle (a zstd file of independent frames
could be, but nothing here indexes its frames): spread a compressed corpus as many files.

The rows come as (where, text, replaced characters), `where` naming the row group and row, or the
line, for the refusals of what reads them. A row whose text is null, empty or white space is
skipped and counted (`empty_rows` of the corpus counts). The rest that cannot be read is refused
in one line naming the file, the row group or line, and the fix.
"""

import contextlib
import json
from typing import Iterable, Iterator

from bertjax import files
from bertjax.data.corpora import inputfiles
from bertjax.errors import Refusal

def one_line(err: Exception) -> str:
  """An error of pyarrow's in one line (its messages hold line breaks), with its kind."""
  return f"{type(err).__name__}: {' '.join(str(err).split())}"


def _refuse_column(where: str, column: str, names: list[str], what: str = "column"):
  raise Refusal(f"{where}: no {what} {column!r} (it has {names[:20]}): set "
                f"config.data.text_column to the {what} that holds the documents' text.")


@contextlib.contextmanager
def _parquet(path: str, column: str):
  """The opened ParquetFile, its column `column` checked to be text."""
  # lazy: pyarrow takes a second to import, and only Parquet sources need it
  import pyarrow as pa  # pylint: disable=import-outside-toplevel
  import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel
  with files.open_file(path, "rb") as raw:
    try:
      pf = pq.ParquetFile(raw)
    except (pa.ArrowException, OSError) as err:
      raise Refusal(f"{path} is not a readable Parquet file ({one_line(err)}): truncated or "
                    f"corrupt. Copy or write it again, or leave it out of config.data.source."
                    ) from None
    schema = pf.schema_arrow
    if column not in schema.names:
      _refuse_column(path, column, schema.names)
    kind = schema.field(column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)
            or pa.types.is_string_view(kind)):
      raise Refusal(f"{path}: column {column!r} holds {kind}, not text (a string column): set "
                    f"config.data.text_column to the column of the documents' text, or write "
                    f"them as strings.")
    yield pf


def parquet_units(path: str, column: str, split_bytes: int) -> list[dict]:
  """The file's row groups in runs of about `split_bytes` of the column's text (uncompressed, by
  the footer); one run for the file when `split_bytes` <= 0. Reads the footer only."""
  with _parquet(path, column) as pf:
    meta = pf.metadata
    leaf = next((j for j in range(meta.num_columns) if meta.schema.column(j).path == column),
                None)
    cuts, size = [0], 0
    for g in range(meta.num_row_groups):
      group = meta.row_group(g)
      size += group.column(leaf).total_uncompressed_size if leaf is not None else \
          group.total_byte_size
      if split_bytes > 0 and size >= split_bytes and g + 1 < meta.num_row_groups:
        cuts.append(g + 1)
        size = 0
    cuts.append(meta.num_row_groups)
  return [{"input": path, "row_groups": [a, b]} for a, b in zip(cuts, cuts[1:])] or \
      [{"input": path, "row_groups": [0, 0]}]


def parquet_rows(unit: dict, column: str, stats) -> Iterator[tuple[str, str, int]]:
  """The rows of the unit's row groups (an end of None: to the last), streamed a batch at a
  time."""
  import pyarrow as pa  # pylint: disable=import-outside-toplevel  (lazy: as above)
  path, (first, end) = unit["input"], unit["row_groups"]
  with _parquet(path, column) as pf:
    for g in range(first, pf.metadata.num_row_groups if end is None else end):
      row = 0
      try:
        for batch in pf.iter_batches(batch_size=1024, row_groups=[g], columns=[column]):
          for text in batch.column(0).to_pylist():
            where = f"row group {g}, row {row}"
            row += 1
            if text is None or not text.strip():
              stats.empty_rows += 1
              continue
            stats.bytes += len(text.encode())
            yield where, text, 0
      except (pa.ArrowException, OSError, UnicodeDecodeError) as err:
        raise Refusal(f"{path}, row group {g}: cannot be read ({one_line(err)}): "
                      f"the file is truncated or corrupt. Copy or write it again, or leave it "
                      f"out of config.data.source.") from None


def jsonl_rows(path: str, lines: Iterable[bytes], where: str, column: str,
               stats) -> Iterator[tuple[str, str, int]]:
  """The records of JSON Lines `lines` (raw, as read); `where` formats a line's number. Bytes that
  are not UTF-8 become U+FFFD, counted as the text format counts them."""
  for number, raw in enumerate(lines, 1):
    stats.bytes += len(raw)
    if not raw.strip():
      continue
    line = where.format(number)
    text, replaced = inputfiles.decode_line(raw, stats)
    try:
      record = json.loads(text)
    except json.JSONDecodeError as err:
      raise Refusal(f"{path}, {line}: not JSON ({err.msg}, column {err.colno}); JSON Lines "
                    f"holds one object a line. Repair or delete that line, or leave the file "
                    f"out of config.data.source.") from None
    if not isinstance(record, dict):
      raise Refusal(f"{path}, {line}: a {type(record).__name__}, not an object; JSON Lines holds "
                    f'one object a line ({{"{column}": "the document\'s text", ...}}).')
    if column not in record:
      _refuse_column(f"{path}, {line}", column, sorted(record), "field")
    value = record[column]
    if value is None or (isinstance(value, str) and not value.strip()):
      stats.empty_rows += 1
      continue
    if not isinstance(value, str):
      raise Refusal(f"{path}, {line}: field {column!r} holds a {type(value).__name__}, not text: "
                    f"set config.data.text_column to the field of the documents' text.")
    yield line, value, replaced
