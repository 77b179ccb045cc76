"""Data: tokenizer, corpus (sources, built-in corpus, held-out split), instances (NSP pairs),
prepare (offline shards + manifest), processes (its workers, SIGTERM), storage (folders, shared
across hosts), masking (dynamic, in tf.data), packing (several sequences per row), pipeline
(per-host batches), benchmark. Imports nothing from the model side."""
