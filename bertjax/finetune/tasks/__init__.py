"""The benchmark tasks, as readers that hand a task family their examples: each task as the run
sees it (tasks.py), GLUE and NEXT (glue.py), SQuAD (squad.py), CoNLL-2003 (ner.py), and BM25,
the retrieval benchmark's baseline (bm25.py)."""
