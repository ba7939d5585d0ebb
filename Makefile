# Two commands do all the set-up: `make quickstart` and `make test` each create the virtual
# environment on first use and then do their work. The environment is exactly uv.lock (every
# package, torch included, at the version and hash CI tested); `make lock` refreshes that lock.
#
# torch is left unpinned in pyproject.toml on purpose: these machines carry a local
# torch==2.13.0+cpu wheel that breaks torchvision (and so open_clip) when a pin admits it
# (docs/design.md, "Environment facts"). uv never looks at that wheel: the lock holds the index's
# regular build, which runs on CPU too (a test checks the lock for it).

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.tvrpipe-installed
PYTEST_ARGS ?=
# uv itself is pinned: the lock's format and its resolution are uv's. It lives in .uv/, beside the
# environment, so that syncing the environment to the lock never removes it.
UV_VERSION := 0.13.9
UV_HOME := .uv
UV := $(UV_HOME)/bin/uv
export UV_PROJECT_ENVIRONMENT := $(VENV)
# The tests whose floats depend on the CPU's code path (heads, equations, evaluation, metrics,
# training steps, CLIP encoders, generated stores: the `numerics` marker) run again under two other code paths
# that every x86-64 CPU has: MKL's bit-reproducible SSE4.2 path, and MKL's COMPATIBLE path with
# ATen's plain (unvectorised) kernels. A test that holds only for one machine's rounding fails here.
NUMERICS_PATHS := "MKL_CBWR=SSE4_2" "MKL_CBWR=COMPATIBLE ATEN_CPU_CAPABILITY=default"

.PHONY: help install quickstart lint test test-all test-numerics lock clean wheelhouse gpu-check

help:
	@echo "make quickstart   set up, then run tvrpipe quickstart (offline, generated data)"
	@echo "make test         set up, then lint (ruff) and run the test suite (fast tests, numerics ones under 3 CPU code paths)"
	@echo "make lint         set up, then ruff check"
	@echo "make test-all     set up, then run every test, slow ones too"
	@echo "make install      only set up $(VENV), exactly as uv.lock says"
	@echo "make lock         refresh uv.lock to the newest releases pyproject.toml admits"
	@echo "make wheelhouse   (connected machine) the wheels an offline GPU machine needs beyond its torch"
	@echo "make gpu-check    (GPU machine, offline) the gpu test suite and the GPU benchmarks, results in one folder"

$(UV):
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "tvrpipe needs Python >= 3.11, found " + sys.version'
	$(PYTHON) -m pip install -qq --disable-pip-version-check --root-user-action=ignore --target $(UV_HOME) uv==$(UV_VERSION)

$(STAMP): pyproject.toml uv.lock | $(UV)
	# --locked: install exactly uv.lock, and stop if pyproject.toml asks for something it lacks (run
	# `make lock`). --compile-bytecode: where PYTHONDONTWRITEBYTECODE is set (as on these machines)
	# Python never caches what it compiles, so every process (each test's subprocess, each Ray
	# worker) would compile torch's and ray's sources again, ~5-8 s each; compiled once here.
	$(UV) sync --locked --extra dev --extra search --extra serve --extra shots --compile-bytecode --python $(PYTHON)
	$(BIN)/python -c 'import torch, torchvision, open_clip, decord, av, zarr, ray; print("environment ok: torch", torch.__version__)'
	touch $(STAMP)

install: $(STAMP)

quickstart: $(STAMP)
	$(BIN)/tvrpipe quickstart
	@echo "tvrpipe lives in $(BIN)/, not on your PATH: run 'source $(BIN)/activate' once in this shell, then 'tvrpipe --help' (or call $(BIN)/tvrpipe)"

# ruff's small rule set (pyproject.toml); the layout rules (imports down the stack, no private names
# across modules) are tests/test_layout.py, in the suite
lint: $(STAMP)
	$(BIN)/ruff check --quiet tvrpipe tests scripts

test: lint
	$(BIN)/python -m pytest $(PYTEST_ARGS)
	$(MAKE) --no-print-directory test-numerics

test-numerics: $(STAMP)
	@for path in $(NUMERICS_PATHS); do \
		echo "numerics tests under $$path"; \
		env $$path $(BIN)/python -m pytest -m "numerics and not slow" $(PYTEST_ARGS) || exit 1; \
	done

test-all: lint
	$(BIN)/python -m pytest -m "" $(PYTEST_ARGS)
	$(MAKE) --no-print-directory test-numerics

lock: | $(UV)
	$(UV) lock --upgrade --python $(PYTHON)

# For a GPU machine without network (docs/install.md, "GPU machines without network"): `make wheelhouse`
# here writes wheelhouse/ (CPython 3.12, manylinux x86-64 by default: WHEELHOUSE_ARGS="--python 3.11");
# copy the repository with it to the GPU machine and run `make gpu-check` there, with the Python that
# has torch (PYTHON=...). It needs no .venv, no Ray and no network.
WHEELHOUSE_ARGS ?=
wheelhouse: $(STAMP)
	$(BIN)/python scripts/wheelhouse.py $(WHEELHOUSE_ARGS)

gpu-check:
	$(PYTHON) scripts/gpu_check.py

clean:
	rm -rf $(VENV) $(UV_HOME) .pytest_cache quickstart .gpu-check gpu-check-results
