"""The model's Pallas kernels, each beside the XLA arithmetic it runs where there is no Mosaic:
attention with its dropout (attention_kernel.py, attention_blocks.py), the MLP and a norm
before it (mlp_kernel.py, mlp_arithmetic.py, row_norm.py), a post-norm layer's attention end
(end_kernel.py), a layer's q, k and v with a pre-norm (qkv_kernel.py), the MLM scores
(mlm_kernel.py) and their recomputing backward (mlm_grads.py); devices.py runs a kernel on
each device's rows and adds the weights' gradients over the chips.
"""
