"""Every test runs on CPU with 8 emulated devices, set before anything imports jax."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
  os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()
# TensorFlow must never grab an accelerator or spam the log in tests.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
# transformers imports its TensorFlow classes wherever TensorFlow is installed (it is, for
# tf.data), and with Keras 3 that import raises: sentence-transformers reaches it through
# transformers.integrations. The tests use transformers' PyTorch and Flax classes only.
os.environ.setdefault("USE_TF", "0")
