# flowc: `make demo` and `make test` do all set-up (a .venv beside this file, and the system
# libraries generated programs link) on a fresh machine.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# Reinstall when the dependency list changes, or the CMake package (an editable install
# copies it into .venv/share/cmake/flowc).
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml flowc/cmake/* runtime_cpp/flowc/flowc.cmake | cksum | cut -d' ' -f1)
JOBS   ?= 2
DEMO_MODEL ?= examples/models/resnet_tiny.onnx
# Debian packages the host builds link (OpenBLAS, Boost.Context) and multi-rank runs use (OpenMPI);
# Graphviz draws `flowc inspect --report`'s graph and Chromium opens the page in its test.
APT_PKGS := g++ clang-format libopenblas-dev libboost-context-dev libopenmpi-dev openmpi-bin \
            graphviz chromium
CXX_SOURCES = $(shell find runtime_cpp tests/runtime bench -name '*.h' -o -name '*.cu' 2>/dev/null)

.PHONY: setup sysdeps test lint typecheck pytest demo bench clean gpu-prepare gpu-check gpu-anchors gpu-dynamic

setup: $(STAMP) sysdeps

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test,dev]'
	@rm -f $(VENV)/.installed-*
	@touch $@

# System packages through apt when missing; CUDA libraries from NVIDIA's wheels when the
# machine has no CUDA toolkit libraries of its own.
sysdeps: $(STAMP)
	@if command -v dpkg >/dev/null 2>&1; then \
	  missing=""; for p in $(APT_PKGS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	  if [ -n "$$missing" ]; then \
	    echo "installing$$missing (apt)"; \
	    if [ "$$(id -u)" = 0 ]; then sudo=""; else sudo=sudo; fi; \
	    $$sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -qq $$missing >/dev/null; \
	  fi; \
	else echo "note: not a Debian system; install OpenBLAS, Boost.Context and OpenMPI by hand"; fi
	@wheels="$$($(BIN)/python -m flowc.toolchain wheels)"; \
	if [ -n "$$wheels" ]; then echo "installing $$wheels (CUDA libraries as wheels)"; \
	  $(BIN)/python -m pip install -q $$wheels; fi

lint: setup
	$(BIN)/ruff check flowc tests examples bench docs/import_graph.py
	$(BIN)/ruff format --check flowc tests examples bench docs/import_graph.py
	$(BIN)/lint-imports
	clang-format --dry-run --Werror $(CXX_SOURCES)

typecheck: setup
	$(BIN)/mypy

pytest: setup
	$(BIN)/python -m pytest -q -n $(JOBS) --durations=15

test: lint typecheck pytest

demo: setup
	$(BIN)/python examples/demo.py $(DEMO_MODEL)

# Emulator throughput and barrier rate, and the host target beside onnxruntime at equal
# threads (figures, not pass/fail); see bench/README.md.
bench: setup
	$(BIN)/python bench/run_runtime_bench.py
	$(BIN)/python bench/host_vs_ort.py

# GPU checks (docs/performance.md, "GPU checks"). gpu-prepare, where PyPI is reachable,
# fills .gpu/ (carried to the GPU machine, which fetches nothing); gpu-check and gpu-anchors
# run there under its python3 (torch, CuPy), flowc from this tree. DRY=1: the CPU dry run
# here (flowc from .venv, torch from TORCH_PYTHON, a venv of its own kept out of .venv).
GPU_PYTHON   ?= python3
TORCH_PYTHON ?= /tmp/torchvenv/bin/python
GPU_ARGS     ?=
GPU_RUN = $(if $(DRY),$(BIN)/python,$(GPU_PYTHON)) bench/gpu/gpu_check.py
GPU_DRY = $(if $(DRY),--dry-run --torch-python $(TORCH_PYTHON))

gpu-prepare:
	bash bench/gpu/prepare.sh

# The training part (bench/gpu/train_check.py: GPT-2 small's step beside PyTorch eager;
# DRY=1: gpt2_tiny on the host against JAX) runs whether or not the inference part passed.
TRAIN_RUN = $(if $(DRY),$(BIN)/python,$(GPU_PYTHON)) bench/gpu/train_check.py $(if $(DRY),--dry-run)
TRAIN_ARGS ?=

gpu-check:
	$(GPU_RUN) check $(GPU_DRY) $(GPU_ARGS); rc=$$?; $(TRAIN_RUN) $(TRAIN_ARGS) || rc=1; exit $$rc

# One BERT-base program over batch=1..32, seq=1..512 beside static builds (docs/dynamic.md).
gpu-dynamic:
	$(GPU_RUN) dynamic $(GPU_DRY)

gpu-anchors:
	$(GPU_RUN) anchors $(GPU_DRY) $(GPU_ARGS)

clean:
	rm -rf $(VENV) build dist demo_out .pytest_cache .mypy_cache .ruff_cache
