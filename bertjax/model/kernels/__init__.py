"""The model's Pallas kernels, each beside the XLA arithmetic it runs where there is no Mosaic:
attention with its dropout (attention_kernel.py, attention_blocks.py), the MLP and a norm
before it (mlp_kernel.py, mlp_arithmetic.py, row_norm.py), a post-norm layer's attention end
(end_kernel.py), a pre-norm layer's norm and q, k and v (qkv_kernel.py) and the MLM scores
(mlm_kernel.py); devices.py runs a kernel on each device's rows.
"""
