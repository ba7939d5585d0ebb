# Two commands do all the set-up: `make quickstart` and `make test` each create the virtual
# environment on first use (Python >= 3.10, uv for fast cached installs) and then do their work.
#
# torch is left unpinned on purpose: these machines carry a local torch==2.13.0+cpu wheel that
# breaks torchvision (and so open_clip) when a pin admits it (DESIGN.md, "Environment facts").
# uv does not look at that wheel and resolves the index's regular build, which runs on CPU too.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.tvrpipe-installed
PYTEST_ARGS ?=

.PHONY: help install quickstart test test-all clean

help:
	@echo "make quickstart   set up, then run tvrpipe quickstart (offline, generated data)"
	@echo "make test         set up, then run the test suite (fast tests)"
	@echo "make test-all     set up, then run every test, slow ones too"
	@echo "make install      only set up $(VENV)"

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 10), "tvrpipe needs Python >= 3.10, found " + sys.version' 
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check uv
	# --compile-bytecode: where PYTHONDONTWRITEBYTECODE is set (as on these machines) Python never
	# caches what it compiles, so every process (each test's subprocess, each Ray worker) would
	# compile torch's and ray's sources again, ~5-8 s each; compiled once here, they are only read
	$(BIN)/uv pip install --python $(BIN)/python --compile-bytecode -e '.[dev]'
	$(BIN)/python -c 'import torch, torchvision, open_clip, decord, av, zarr, ray; print("environment ok: torch", torch.__version__)'
	touch $(STAMP)

install: $(STAMP)

quickstart: $(STAMP)
	$(BIN)/tvrpipe quickstart

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-all: $(STAMP)
	$(BIN)/python -m pytest -m "" $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache quickstart
