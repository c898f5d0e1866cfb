# Two entry points for a fresh machine: `make demo` and `make test` (lint, then the tests).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup demo lint test test-long bench

$(BIN)/python:
	$(PY) -m venv $(VENV)

# The CPU build of torch is pinned here (not in pyproject): an unpinned torch pulls a CUDA build.
setup: $(BIN)/python
	$(BIN)/pip install -q --disable-pip-version-check torch==2.13.0 -e '.[test]'

demo: setup
	$(BIN)/python examples/demo.py

lint: setup
	$(BIN)/ruff check .

test: lint
	$(BIN)/python -m pytest -q

# the property suite's deep profile (minutes, not run by CI)
test-long: setup
	HYPOTHESIS_PROFILE=long $(BIN)/python -m pytest -q tests/test_properties.py

bench: setup
	$(BIN)/python benchmarks/run.py
