"""Training: the pure steps and the train state (train.py), the optimizers (optimizer.py), the loop
and what it decides each step (loop.py, control.py), checkpoints (checkpoint.py), what a run
reports (metrics.py) and the FLOPs and chips' peaks its MFU is made of (flops.py), the bi-encoder's
objective (contrastive.py, gradcache.py). Pre-training's job for the loop is bertjax/pretrain/'s."""
