# The three commands of the README: `make pretrain`, `make finetune` and `make test`. Each sets
# everything up.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: test pretrain finetune install clean

# Re-install only when the package metadata changes. `pretrain` needs the package alone, `test`
# also the test extra (pytest, and the reference implementation for parity tests), the tpu
# extra (libtpu, whose compile-only client tests/test_aot.py uses on the CPU) and the beam extra
# (Apache Beam, the other driver of preparation, tests/test_data_prepare_scale.py).
$(VENV)/.installed: setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PY) -m pip install -e '.[test,tpu,beam]'
	touch $@

install: $(VENV)/.installed

# XLA's CPU scratch memory on huge pages (bertjax/parallel/hostmem.py: ~20% faster steps where the kernel's
# transparent huge pages are in madvise mode; a glibc older than 2.35 ignores it).
HUGE_PAGES := GLIBC_TUNABLES=glibc.malloc.hugetlb=1

# The whole suite on an emulated 8-device CPU mesh (tests/conftest.py also sets it,
# before jax is imported, for runs of pytest by hand), with XLA's scratch memory on huge pages;
# the 15 slowest tests listed at the end (the budget: 20 minutes on 2 cores). tests/conftest.py
# compiles with LLVM's optimisation and XLA's MLIR fusion emitters off and shares one compilation
# cache per run.
test: $(VENV)/.installed-test
	XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu $(HUGE_PAGES) \
	  $(PY) -m pytest -n 2 --dist loadfile -q --durations=15 tests

# The main job on the built-in corpus: trains a vocabulary and prepares the data the first time
# (cached in .cache/bertjax), pre-trains configs/tiny.py on the CPU, prints held-out accuracy.
# Running it again resumes, or reports that the run is complete.
WORKDIR ?= workdirs/tiny
pretrain: $(VENV)/.installed
	JAX_PLATFORMS=cpu TF_CPP_MIN_LOG_LEVEL=2 $(HUGE_PAGES) $(PY) -m bertjax.pretrain --config=configs/tiny.py \
	  --workdir=$(WORKDIR) $(ARGS)

# Fine-tunes the encoder of $(WORKDIR) (pre-training it first if it has no checkpoint) on the
# built-in task NEXT, and the same model from random initialisation, then prints both dev scores.
# SEED varies the head's init, dropout and example order.
FT_DATA := .cache/bertjax/finetune
SEED ?= 0
FT := JAX_PLATFORMS=cpu TF_CPP_MIN_LOG_LEVEL=2 $(HUGE_PAGES) $(PY) -m bertjax.finetune \
  --config=configs/finetune.py:next --config.checkpoint.init_from=$(WORKDIR) \
  --config.data.data_dir=$(FT_DATA) \
  --config.train.seed=$(SEED)
# The random-init twin gets its own best settings, not the pre-trained encoder's: over learning
# rates 3e-5..1e-3 and 3 or 10 epochs on NEXT's dev split it does best with 10 epochs (at 3e-4 or
# 1e-4; 3 epochs leave it at chance), while the pre-trained encoder does best with 3
# (docs/finetuning.md#make-finetune-and-the-built-in-task-next).
RANDOM_INIT_ARGS := --config.train.num_epochs=10
finetune: $(VENV)/.installed
	test -d $(WORKDIR)/checkpoints || $(MAKE) pretrain
	$(PY) -m bertjax.finetune.builtin write --data_dir=$(FT_DATA)
	$(FT) --workdir=workdirs/next-pretrained-s$(SEED) $(ARGS)
	$(FT) --workdir=workdirs/next-random-s$(SEED) --config.checkpoint.random_init=True \
	  $(RANDOM_INIT_ARGS) $(ARGS)
	$(PY) -m bertjax.finetune.builtin compare workdirs/next-pretrained-s$(SEED) \
	  workdirs/next-random-s$(SEED)

clean:
	rm -rf $(VENV) build *.egg-info
