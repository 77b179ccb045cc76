"""The model's Pallas kernels, each beside the XLA arithmetic it runs where there is no Mosaic:
attention with its dropout (attention_kernel.py), the MLP (mlp_kernel.py) and the MLM scores
(mlm_kernel.py)."""
