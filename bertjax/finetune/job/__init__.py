"""Fine-tuning's job: the run (run.py) and the search over settings (search.py, trials.py: several
trials as one program; svg.py: its picture), where the encoder and the heads start (init_from.py,
init_heads.py), the scores after each epoch and the best checkpoint (evaluations.py)."""
