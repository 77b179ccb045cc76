"""What the task families share: fine-tuning's typed config (config.py), one's own files
(custom.py), metrics in numpy (metrics.py), what the objectives share (objectives.py), what a task
gives the run (taskdata.py), retrieval on the host (retrieval.py), SQuAD's official scores and
predictions (squad_metrics.py, squad_postprocess.py)."""
