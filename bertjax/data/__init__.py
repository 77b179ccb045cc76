"""Data: tokenizers (tokenizer.py; hf_tokenizer.py, normalize.py, template.py, vocab_record.py),
corpus sources (corpus.py; what they are read from: corpora/), offline preparation (prepare.py;
its steps, NSP pairs, workers and Beam driver: preparation/), storage (folders, shared across
hosts), masking (dynamic, in tf.data), packing (several sequences per row), pipeline (per-host
batches), config (the data section, typed). Imports nothing from the model side."""
