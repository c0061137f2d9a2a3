# vramguard: `make up` runs the stack, `make test` runs the suite. See README.md.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
# The CPU wheel for local use and CI; the worker image (deploy/Dockerfile.worker) brings CUDA.
TORCH_VERSION ?= 2.13.0
MODEL ?= minilm
WORKERS ?= 1
WORKERS_PER_GPU ?= $(WORKERS)
GATEWAYS ?= 1
GPUS ?=
PLACEMENT ?=
PYTEST_ARGS ?=
BENCH_ARGS ?=
PEER_VENV := bench/.venv-peer
# A real Triton server (PyTriton, CPU) for the external-engine test. PyTriton's server refuses
# pyenv's Python: the venv is built from Debian's python3.11 (package python3.11-venv).
TRITON_VENV := tests/.venv-triton
TRITON_PYTHON ?= /usr/bin/python3.11

.PHONY: up test test-fast lint bench clean help

help:
	@echo "make up [MODEL=minilm|synthetic] [GPUS=all|0,1] [WORKERS_PER_GPU=N] [GATEWAYS=N]"
	@echo "        [PLACEMENT=deploy/placement.example.toml]  start Redis, gateway and workers (foreground)"
	@echo "make test [PYTEST_ARGS=...]                    install test deps and run the whole suite"
	@echo "make test-fast                                 the suite without the slow (chaos) tests"
	@echo "make bench [BENCH_ARGS=--quick]                reproduce bench/RESULTS.md (~24 min on 2 cores)"
	@echo "make lint                                      ruff and mypy --strict"

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet torch==$(TORCH_VERSION)
	$(BIN)/pip install --quiet -e ".[worker,redis,test]"
	touch $@

up: $(VENV)/.installed
	$(BIN)/python deploy/up.py --model $(MODEL) --workers-per-gpu $(WORKERS_PER_GPU) --gateways $(GATEWAYS) \
		$(if $(GPUS),--gpus "$(GPUS)") $(if $(PLACEMENT),--placement "$(PLACEMENT)")

test: $(VENV)/.installed $(TRITON_VENV)/.installed
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest $(PYTEST_ARGS)

# Best effort: without it the Triton test is skipped, saying why.
$(TRITON_VENV)/.installed:
	($(TRITON_PYTHON) -m venv $(TRITON_VENV) && $(TRITON_VENV)/bin/pip install --quiet nvidia-pytriton==0.7.0 \
		&& touch $@) || echo "warning: no PyTriton venv ($(TRITON_VENV)); the Triton engine test will be skipped" >&2

test-fast: $(VENV)/.installed
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

# The bench extra goes into .venv; LitServe gets a venv of its own (bench/peer-requirements.txt).
$(VENV)/.bench-installed: pyproject.toml | $(VENV)/.installed
	$(BIN)/pip install --quiet -e ".[worker,redis,test,bench]"
	touch $@

$(PEER_VENV)/.installed: bench/peer-requirements.txt
	$(PYTHON) -m venv $(PEER_VENV)
	$(PEER_VENV)/bin/pip install --quiet torch==$(TORCH_VERSION)
	$(PEER_VENV)/bin/pip install --quiet -r bench/peer-requirements.txt
	touch $@

bench: $(VENV)/.bench-installed $(PEER_VENV)/.installed
	HF_HUB_OFFLINE=1 $(BIN)/python -m bench all $(BENCH_ARGS)

lint: $(VENV)/.installed
	$(BIN)/pip install --quiet ruff mypy
	$(BIN)/ruff check shared gateway worker tests deploy bench vramguard examples
	$(BIN)/mypy

clean:
	rm -rf $(VENV) $(PEER_VENV) $(TRITON_VENV) .run .pytest_cache test-artifacts
