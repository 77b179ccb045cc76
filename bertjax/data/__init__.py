"""Data: tokenizer, corpus (sources, built-in corpus, held-out split), instances (NSP pairs),
prepare (offline shards + manifest), masking (dynamic, in tf.data), pipeline (per-host batches),
benchmark. Imports nothing from the model side."""
