"""What a corpus source is read from (bertjax/data/corpus.py plans and reads the sources): the
files its patterns name and their formats (inputfiles.py), records of Parquet and JSON Lines
(records.py), text cut into sentences (sentences.py) and what the segmenter is measured on
(sentence_cases.py), the built-in corpus's prose (builtin_corpus.py)."""
