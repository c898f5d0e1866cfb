# Two entry points for a fresh machine: `make demo` and `make test` (lint, then the tests).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup demo lint test test-bare test-torch test-avx2 test-long test-full bench

$(BIN)/python:
	$(PY) -m venv $(VENV)

# The CPU build of torch is pinned here (not in pyproject): an unpinned torch pulls a CUDA build.
# pip byte-compiles what it installs (two thirds of installing torch, but not to skip:
# where PYTHONDONTWRITEBYTECODE is set, as on this project's machines, Python would then compile
# torch's modules from source in every process, 5 CPU-seconds each for Inductor's imports).
# (A stamp: a second `make test` does not run pip again; editing pyproject.toml does.)
PIP := pip install -q --disable-pip-version-check
setup: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/$(PIP) torch==2.13.0 -e '.[test]'
	touch $@

demo: setup  # one thread, interleaved steps: examples/demo.py --help
	$(BIN)/python examples/demo.py

lint: setup
	$(BIN)/ruff check .

# What a CPU without AVX-512 computes: ATen's AVX2 kernels, and Inductor's C++
# built for an AVX2-only target (with -march=native an AVX-512 machine would mix the two),
# in a cache of its own (Inductor's FX graph cache would serve the AVX-512 graphs).
AVX2_ENV := ATEN_CPU_CAPABILITY=avx2 TORCHINDUCTOR_CPP_MARCH=haswell \
	TORCHINDUCTOR_CACHE_DIR=$(CURDIR)/.cache/inductor-avx2
# The tests whose numbers depend on the CPU's kernels: numerics, generated code, examples.
ISA_TESTS := tests/test_numerics.py tests/test_lm_head.py tests/test_autocast_upgrade.py \
	tests/test_declines.py tests/test_codegen.py tests/test_batch_invariance.py tests/test_examples.py \
	tests/test_loss_in_graph.py tests/test_saved_for_backward.py tests/test_row_local_sweeps.py \
	tests/test_row_local_loss.py

# Two pytest workers (pytest-xdist): most of a test's time is Dynamo and Inductor
# compiling, on one core, so two workers share two cores well (a third made the suite
# slower: the fresh-process tests' children then contend with three workers).  Each keeps
# torch's default thread count: the batch-invariance tests need Inductor's parallel reductions.
# Work stealing: an idle worker takes queued tests from the busy one (the slowest tests,
# fresh processes of a minute or more, otherwise end the run on one worker).
WORKERS := -n 2 --dist worksteal

# The AVX2 part of `make test`: what an AVX2-only CPU runs by default, where its code or
# kernels differ from this CPU's: numerics against stock, the lm_head plan it picks
# (fp32_tiles; the forced two_sweeps / blocks / gpu plans are this CPU's business),
# generated code, batch invariance.  `make test-avx2` runs every ISA-sensitive test
# (about 15 more minutes): the loss-in-graph paths, the row-local losses and sweeps,
# examples, declines, the upgrade, the saved-for-backward tests, every plan.
AVX2_CI_TESTS := tests/test_numerics.py tests/test_lm_head.py tests/test_codegen.py \
	tests/test_batch_invariance.py
# (not the plumbing tests, whose ISA changes no number: compile counts, dynamic lengths, a frozen weight)
AVX2_CI_SELECT := not trl and not two_sweeps and not blocks and not gpu_plan and not compile_once \
	and not dynamic_lengths and not frozen_weight

# Lint, the whole suite on this CPU, then the ISA-sensitive tests as an AVX2-only CPU runs
# them: on an x86-64 CPU with AVX-512 (elsewhere there is no AVX2 to emulate, and on an
# AVX2-only CPU the first run was that already).
HAS_AVX512 := $(shell grep -qw avx512f /proc/cpuinfo 2>/dev/null && echo yes)
# (the bare pass's files ran just before, in the venv they are about: not again here)
test: lint test-bare
	$(BIN)/python -m pytest -q $(WORKERS) $(addprefix --ignore=,$(BARE_TESTS))
ifeq ($(shell uname -m),x86_64)
ifeq ($(HAS_AVX512),yes)
	$(AVX2_ENV) $(BIN)/python -m pytest -q $(WORKERS) $(AVX2_CI_TESTS) -k "$(AVX2_CI_SELECT)"
else
	@echo "AVX2-only CPU: the suite above ran as such a CPU runs it; no AVX2 emulation run"
endif
endif

# The package with torch alone (issue 55): torch requires no numpy, nor does pyproject, and
# the main venv has numpy (through transformers), so a numpy use in fx_passes would pass
# there.  A second venv with the CPU torch pin, pytest, pytest-xdist and expecttest only
# (no numpy, transformers or hypothesis; tests/conftest.py skips the hypothesis modules
# there), the package installed without its dependencies, and a focused set (about a
# minute on 2 cores): the regions whose lm_head runs in the row-local call and whose
# backward reads a host flag, the check that the venv has no numpy and that no module of
# fx_passes uses it (test_torch_alone), and every op's CUDA-graph row (test_cudagraph_ops).
BARE ?= .venv-bare
BARE_TESTS := tests/test_torch_alone.py tests/test_cudagraph_ops.py

$(BARE)/.installed:
	$(PY) -m venv $(BARE)
	$(BARE)/bin/$(PIP) torch==2.13.0 pytest pytest-xdist expecttest
	$(BARE)/bin/$(PIP) --no-deps -e .
	touch $@

test-bare: $(BARE)/.installed
	CHUNKED_LOGITS_BARE=1 $(BARE)/bin/python -m pytest -q $(WORKERS) $(BARE_TESTS)

# The suite on another torch in the range pyproject allows (`make test-torch TORCH=2.14.1`):
# a venv of its own with that torch and the test extras.  Where pip finds only a CUDA build
# (2.14.1 on this project's machines: several GB, from their local disk) the suite runs on the
# CPU as here, less tests/test_fake_cuda.py (it models a CPU-only torch: skipped).
TORCH ?= 2.14.1
TORCH_VENV := .venv-torch-$(TORCH)
$(TORCH_VENV)/.installed:
	$(PY) -m venv $(TORCH_VENV)
	$(TORCH_VENV)/bin/$(PIP) torch==$(TORCH) -e '.[test]'
	touch $@

test-torch: $(TORCH_VENV)/.installed
	TORCHINDUCTOR_CACHE_DIR=$(CURDIR)/.cache/inductor-torch-$(TORCH) \
		$(TORCH_VENV)/bin/python -m pytest -q $(WORKERS)

test-avx2: setup
	$(AVX2_ENV) $(BIN)/python -m pytest -q $(WORKERS) $(ISA_TESTS) -k "not trl"

# the property suite's deep profile (minutes, not run by CI)
test-long: setup
	HYPOTHESIS_PROFILE=long $(BIN)/python -m pytest -q tests/test_properties.py

# `make test` with every matrix of cases x dtypes x plans in full (tests/numerics.py's
# dtype_matrix: CI runs half of each, every case and plan in both dtypes), every case of
# the families marked `sampled` (CI runs one in n: tests/conftest.py), the tests
# marked `full` (costly variants of behaviour other tests cover), and every
# ISA-sensitive test as an AVX2-only CPU runs it (over an hour on 2 cores)
test-full: lint
	CHUNKED_LOGITS_FULL_MATRIX=1 $(BIN)/python -m pytest -q $(WORKERS)
	CHUNKED_LOGITS_FULL_MATRIX=1 $(AVX2_ENV) $(BIN)/python -m pytest -q $(WORKERS) $(ISA_TESTS) -k "not trl"

bench: setup
	$(BIN)/python benchmarks/run.py
