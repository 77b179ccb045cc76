"""Corpus sources: text files, TFDS (built locally), the built-in corpus, the held-out split."""

import gzip
import os

import pytest

from bertjax.data import corpus
from bertjax.data.corpora import builtin_corpus


def _write(path, data: bytes, gz=False):
  with (gzip.open(path, "wb") if gz else open(path, "wb")) as f:
    f.write(data)
  return path


def test_text_files_plain_gzip_glob(tmp_path):
  d = str(tmp_path)
  _write(os.path.join(d, "a.txt"), b"One.\nTwo.\n\n\nThree.\n")
  _write(os.path.join(d, "b.txt.gz"), b"Four.\n\nFive.\nSix.", gz=True)
  stats = corpus.CorpusStats()
  docs = list(corpus.documents_from_source(os.path.join(d, "*"), stats))
  assert docs == [["One.", "Two."], ["Three."], ["Four."], ["Five.", "Six."]]
  assert (stats.files, stats.documents, stats.sentences) == (2, 4, 6)
  both = list(corpus.documents_from_source(
      f"{os.path.join(d, 'b.txt.gz')},{os.path.join(d, 'a.txt')}"))
  assert both[0] == ["Four."] and len(both) == 4


def test_glob_without_match_is_an_error(tmp_path):
  with pytest.raises(FileNotFoundError, match="No file matches"):
    list(corpus.documents_from_source(os.path.join(str(tmp_path), "*.txt")))
  with pytest.raises(ValueError, match="source is empty"):
    corpus.documents_from_source("")


def test_invalid_utf8_is_replaced_and_counted(tmp_path):
  path = _write(os.path.join(str(tmp_path), "bad.txt"), b"caf\xc3\xa9 ok.\nbad \xff\xfe here.\n\xc3\n")
  stats = corpus.CorpusStats()
  docs = list(corpus.documents_from_source(path, stats,
                                           limits=corpus.InputLimits(max_replaced_char_share=1.0)))
  assert docs == [["caf\u00e9 ok.", "bad \ufffd\ufffd here.", "\ufffd"]]
  assert (stats.invalid_utf8_lines, stats.invalid_utf8_chars) == (2, 3)


def test_builtin_corpus_sentence_rule():
  text = "Dr. Smith went home. It rained!  Did it?\nNew line here. 3 cats \"ran.\" Then (more) text."
  assert builtin_corpus.split_sentences(text) == [
      "Dr. Smith went home.", "It rained!", "Did it?", "New line here.", "3 cats \"ran.\"",
      "Then (more) text."]
  # Titles and common abbreviations do not end a sentence; the word "No." may.
  text = "Ask Mrs. Jones (cf. Fig. 2) or e.g. Prof. Li. It works. No. It does not."
  assert builtin_corpus.split_sentences(text) == [
      "Ask Mrs. Jones (cf. Fig. 2) or e.g. Prof. Li.", "It works.", "No.", "It does not."]


def test_tfds_source_built_locally(tmp_path):
  import tensorflow as tf
  import tensorflow_datasets as tfds

  class LocalTexts(tfds.dataset_builders.TfDataBuilder):
    url_infos = {}  # nothing to download; skips a checksum lookup that needs extra packages

  texts = ["First sentence here. Second one follows! A third?", "", "Another document. With two."]
  data_dir = str(tmp_path)
  LocalTexts(name="bertjax_test_texts", config="small", version="1.0.0", data_dir=data_dir,
             split_datasets={"train": tf.data.Dataset.from_tensor_slices({"text": texts})},
             features=tfds.features.FeaturesDict({"text": tfds.features.Text()})
             ).download_and_prepare()
  stats = corpus.CorpusStats()
  docs = list(corpus.documents_from_source("tfds:bertjax_test_texts/small:text", stats,
                                           tfds_data_dir=data_dir))
  assert docs == [["First sentence here.", "Second one follows!", "A third?"],
                  ["Another document.", "With two."]]
  assert stats.documents == 2
  with pytest.raises(KeyError, match="no feature 'body'"):
    list(corpus.documents_from_source("tfds:bertjax_test_texts/small:body", tfds_data_dir=data_dir))
  with pytest.raises(FileNotFoundError, match="mnist is not built under .*never downloads.*tfds_data_dir"):
    list(corpus.documents_from_source("tfds:mnist:image", tfds_data_dir=data_dir))
  with pytest.raises(ValueError, match="must look like"):
    list(corpus.documents_from_source("tfds:nofeature"))


def test_builtin_corpus():
  docs = list(corpus.documents_from_source("builtin"))
  assert corpus.word_count(docs) >= 250_000
  assert len(docs) > 500 and all(doc and all(s.strip() for s in doc) for doc in docs)
  # Code examples are left out.
  assert not any(s.startswith(">>>") for d in docs for s in d)
  builtin_corpus.documents.cache_clear()
  again = list(corpus.documents_from_source("builtin"))
  assert again == docs
  # The modules' docstrings, which the summary pairs task reads: each module's document is its
  # docstrings' sentences in order (so held-out modules are the held-out documents).
  modules = builtin_corpus.builtin_modules()
  assert [[s for d in m for s in d] for m in modules] == docs[:len(modules)]
  assert all(all(m) for m in modules)
  assert sum(len(d) > 1 for m in modules for d in m) > 3000
  heldout = list(corpus.split_documents(docs, "eval", 0.1))
  train = list(corpus.split_documents(docs, "train", 0.1))
  assert len(heldout) + len(train) == len(docs) and 0.05 < len(heldout) / len(docs) < 0.15
  assert not {tuple(d) for d in heldout} & {tuple(d) for d in train}
  # The split follows the text, not the position: reordering keeps it.
  assert list(corpus.split_documents(docs[::-1], "eval", 0.1)) == heldout[::-1]


def test_non_local_paths_through_gfile():
  # ram:// stands in for gs://: both go through tf.io.gfile, not the local file system.
  import tensorflow as tf
  tf.io.gfile.makedirs("ram://bertjax_corpus/")
  with tf.io.gfile.GFile("ram://bertjax_corpus/part-0.txt.gz", "wb") as f:
    f.write(gzip.compress(b"One.\nTwo.\n\nThree.\n"))
  assert list(corpus.documents_from_source("ram://bertjax_corpus/*.gz")) == [["One.", "Two."],
                                                                            ["Three."]]


def test_binary_or_undecodable_file_is_refused_naming_it(tmp_path, caplog):
  import random
  d = str(tmp_path)
  _write(os.path.join(d, "a.txt"), b"One good line.\nAnother.\n")
  noise = bytes(random.Random(0).randrange(256) for _ in range(20_000))
  _write(os.path.join(d, "b.txt"), noise)
  with pytest.raises(ValueError, match=r"b\.txt: .* characters \(\d+\.\d%\) are not valid UTF-8, "
                                       r"above config.data.max_replaced_char_share=0.01"):
    list(corpus.documents_from_source(os.path.join(d, "*.txt")))
  # The limit is a setting: raised, the file is read (and still named with its share).
  with caplog.at_level("WARNING"):
    list(corpus.documents_from_source(os.path.join(d, "*.txt"),
                                      limits=corpus.InputLimits(max_replaced_char_share=1.0)))
  assert "b.txt: " in caplog.text and "replaced by U+FFFD" in caplog.text
  # A few bad bytes in a large text are repaired, counted per file and named in a warning.
  stats = corpus.CorpusStats()
  _write(os.path.join(d, "b.txt"), b"Plain text here.\n" * 200 + b"one \xff bad byte.\n")
  caplog.clear()
  with caplog.at_level("WARNING"):
    list(corpus.documents_from_source(os.path.join(d, "*.txt"), stats))
  assert stats.replaced_by_input == {os.path.join(d, "b.txt"): [1, 3215]}
  assert "b.txt: 1 of 3215 characters (0.031%)" in caplog.text


def test_gzip_data_under_another_name_is_refused(tmp_path):
  _write(os.path.join(str(tmp_path), "part.txt.gzip"), b"One.\nTwo.\n" * 100, gz=True)
  with pytest.raises(ValueError, match=r"part\.txt\.gzip is gzip-compressed but its name does not "
                                       r"end in \.gz"):
    list(corpus.documents_from_source(os.path.join(str(tmp_path), "*")))


def test_truncated_or_corrupt_gzip_names_its_path(tmp_path):
  data = gzip.compress(b"One sentence.\nTwo sentences.\n" * 2000)
  cut = _write(os.path.join(str(tmp_path), "cut.txt.gz"), data[:len(data) // 2])
  with pytest.raises(ValueError, match=f"{cut} is not a valid gzip file \\(EOFError"):
    list(corpus.documents_from_source(cut))
  bad = _write(os.path.join(str(tmp_path), "bad.txt.gz"), data[:20] + b"\x00" * 200 + data[220:])
  with pytest.raises(ValueError, match=f"{bad} is not a valid gzip file .*gzip -t"):
    list(corpus.documents_from_source(bad))
  plain = _write(os.path.join(str(tmp_path), "plain.txt.gz"), b"not compressed at all\n")
  with pytest.raises(ValueError, match=f"{plain} is not a valid gzip file"):
    list(corpus.documents_from_source(plain))


def test_over_long_line_is_refused_naming_file_and_line(tmp_path):
  path = _write(os.path.join(str(tmp_path), "c.txt"),
                b"Short.\nAlso short.\n" + b"word " * 6000 + b"\nEnd.\n")
  with pytest.raises(ValueError, match=r"c\.txt, line 3: 30,000 characters, above "
                                       r"config.data.max_line_chars=20,000"):
    list(corpus.documents_from_source(path))
  docs = list(corpus.documents_from_source(path, limits=corpus.InputLimits(max_line_chars=0)))
  assert len(docs[0]) == 4


def test_directory_as_source_suggests_a_glob(tmp_path):
  _write(os.path.join(str(tmp_path), "a.txt"), b"One.\n")
  with pytest.raises(IsADirectoryError, match=f"{tmp_path} .* is a directory; .*use e.g. "
                                              f"'{tmp_path}/\\*.txt'"):
    list(corpus.documents_from_source(str(tmp_path)))
