"""Every test runs on CPU with 8 emulated devices, set before anything imports jax; compiled
programs are made quickly and shared."""

import importlib.util
import os
import shutil
import tempfile
import uuid

os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
  flags += " --xla_force_host_platform_device_count=8"
# Most of the suite's time was XLA compiling the same tiny programs. LLVM's optimisation of the
# machine code is off (the HLO passes, which decide what is computed and in what precision, all
# run): a test program compiles in half the time and its tiny arrays hardly run slower. A
# comparison of bits is always between two programs compiled under the same flags; another
# vectorisation agreeing within the stated tolerances is held by docs/reliability.md's run
# under --xla_cpu_max_isa=AVX. XLA's older emitter of fused loops (LLVM IR written directly, not
# through MLIR) compiles a train step in half the time again, and runs it as fast.
# BERTJAX_TEST_OPTIMISED=1 keeps XLA's defaults.
if os.environ.get("BERTJAX_TEST_OPTIMISED") != "1" and "xla_backend_optimization_level" not in flags:
  flags += (" --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
            " --xla_cpu_use_fusion_emitters=false")
os.environ["XLA_FLAGS"] = flags.strip()
# One persistent compilation cache for the run (both pytest-xdist workers, and the commands the
# tests start, which inherit the environment): a program compiled once, by any test, is loaded
# by the next that builds the same one (a resumed run, another test's tiny model). A fixture
# that sets a cache of its own (tests/finetune_fixtures.py) restores this one after it.
# The process pytest starts names the run; its pytest-xdist workers inherit the name.
_RUN = os.environ.setdefault("BERTJAX_TEST_RUN", uuid.uuid4().hex[:12])
SHARED = os.path.join(tempfile.gettempdir(), f"bertjax-tests-{_RUN}")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(SHARED, "jax_cache")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
# TensorFlow must never grab an accelerator or spam the log in tests.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
# transformers imports its TensorFlow classes wherever TensorFlow is installed (it is, for
# tf.data), and with Keras 3 that import raises: sentence-transformers reaches it through
# transformers.integrations. The tests use transformers' PyTorch and Flax classes only.
os.environ.setdefault("USE_TF", "0")
# TensorFlow's import loads Keras 3 eagerly, and Keras its scikit-learn wrappers (scikit-learn
# is here for sentence-transformers): 3 of the 8 seconds every command a test starts spends
# importing TensorFlow. bertjax uses tf.data alone; with TF_USE_LEGACY_KERAS set and tf_keras
# not installed, TensorFlow skips that load (tf.keras would fail; nothing here uses it).
if importlib.util.find_spec("tf_keras") is None:
  os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")


# The suite's longest files, longest first (their summed test time in a run of the whole suite,
# 60-210 s each). pytest-xdist's --dist loadfile hands files to its workers in collection order,
# the first ones round-robin: a long file collected late ran alone at the end while the other
# worker had nothing left (test_pod_chaos, 100 s). Started first, the long files split between
# the workers and the short ones even out the ends. The first two both build nothing the other
# waits for (tests/finetune_fixtures.py's shared encoder is built by the first alone).
LONGEST_FIRST = ("test_finetune_run.py", "test_loop.py", "test_finetune_custom.py",
                 "test_data_prepare_scale.py", "test_finetune_search.py", "test_pod_chaos.py",
                 "test_finetune_chaos.py", "test_launch_local.py", "test_finetune_embeddings.py",
                 "test_launch_local_finetune.py", "test_aot.py", "test_benchmark.py",
                 "test_model.py", "test_train_step.py")


def pytest_collection_modifyitems(items):
  rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: files stay whole


def xla_flags(devices: int) -> str:
  """This run's XLA flags with another device count: for a command a test starts on its own mesh."""
  kept = [f for f in os.environ.get("XLA_FLAGS", "").split()
          if not f.startswith("--xla_force_host_platform_device_count=")]
  return " ".join(kept + [f"--xla_force_host_platform_device_count={devices}"])


def pytest_sessionfinish(session):
  # The run's shared folder (the compilation cache, tests/finetune_fixtures.py's pre-trained
  # encoder) goes with the run: removed by the process that started it, after its workers.
  if not hasattr(session.config, "workerinput"):
    shutil.rmtree(SHARED, ignore_errors=True)
