"""The model's Pallas kernels, each beside the XLA arithmetic it runs where there is no Mosaic:
attention with its dropout (attention_kernel.py), the MLP and a norm before it (mlp_kernel.py,
mlp_arithmetic.py, row_norm.py) and the MLM scores (mlm_kernel.py); devices.py runs a kernel on
each device's rows.
"""
