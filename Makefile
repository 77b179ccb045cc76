# The two commands of the README: `make pretrain` and `make test`. Both set everything up.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test install clean

# Re-install only when the package metadata changes.
$(STAMP): setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# The whole suite on an emulated 8-device CPU mesh (tests/conftest.py also sets it,
# before jax is imported, for runs of pytest by hand).
test: $(STAMP)
	XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \
	  $(PY) -m pytest -n 2 --dist loadfile -q tests

clean:
	rm -rf $(VENV) build *.egg-info
