# make demo / make test work on a fresh clone: they create .venv and install what they need.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Where this machine keeps the wheels that its package index lacks (the CPU build of torch).
WHEELS ?= /opt/wheels

.PHONY: demo test lint clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	# uv installs in parallel: the venv takes about 45 s instead of pip's 95 s on a 2-core machine.
	$(BIN)/pip install -q --disable-pip-version-check "uv>=0.9" 2>&1 | grep -v "^WARNING: Location" || true
	# The CPU build of torch lies in $(WHEELS) on this machine; other versions pull a CUDA build.
	# Bytecode at install time: processes here may run with PYTHONDONTWRITEBYTECODE, and each Ray
	# worker would otherwise compile torch, ray and diffusers again.
	$(BIN)/uv pip install -q --python $(BIN)/python --compile-bytecode $(if $(wildcard $(WHEELS)),--find-links $(WHEELS)) \
		torch==2.13.0 -e ".[dev]"
	$(BIN)/python -m compileall -q ray_hsdp tests
	$(BIN)/python -c "import torch, ray, diffusers, ray_hsdp"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/ray-hsdp demo

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports  # the layers (pyproject.toml): a module imports only what lies below it
	$(BIN)/python -m pytest -q --durations=25 tests

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports

clean:
	rm -rf $(VENV) out .pytest_cache
