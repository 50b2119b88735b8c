# make demo / make test work on a fresh clone: they create .venv and install what they need.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
	# The CPU build of torch that lies on this machine's disk; other versions pull a CUDA build.
	$(BIN)/pip install -q --disable-pip-version-check torch==2.13.0 2>&1 | grep -v "^WARNING: Location" || true
	$(BIN)/pip install -q --disable-pip-version-check -e ".[dev]" 2>&1 | grep -v "^WARNING: Location" || true
	$(BIN)/python -c "import torch, ray, diffusers, ray_hsdp" 
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/ray-hsdp demo

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q --durations=15 tests

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) out .pytest_cache
