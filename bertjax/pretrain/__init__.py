"""Pre-training: the command (`python -m bertjax.pretrain`, __main__.py) and its job for the loop
(job.py: the data, the model and its objective, the start from scratch or from init_from)."""
