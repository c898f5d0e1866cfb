# Two entry points for a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup demo test test-long bench lint

$(BIN)/python:
	$(PY) -m venv $(VENV)

# The CPU build of torch is pinned here (not in pyproject): an unpinned torch pulls a CUDA build.
setup: $(BIN)/python
	$(BIN)/pip install -q --disable-pip-version-check torch==2.13.0 -e '.[test]'

demo: setup
	$(BIN)/python examples/demo.py

test: setup
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/python benchmarks/run.py
