# flowc: `make demo` and `make test` do all set-up (a .venv beside this file) on a fresh machine.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# Reinstall when the dependency list changes.
STAMP  := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)
JOBS   ?= 2
DEMO_MODEL ?= examples/models/resnet_tiny.onnx

.PHONY: setup test lint typecheck pytest demo wheel-check clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test,dev]'
	@rm -f $(VENV)/.installed-*
	@touch $@

lint: setup
	$(BIN)/ruff check flowc tests examples
	$(BIN)/ruff format --check flowc tests examples

typecheck: setup
	$(BIN)/mypy

pytest: setup
	$(BIN)/python -m pytest -q -n $(JOBS) --durations=15

test: lint typecheck pytest

demo: setup
	$(BIN)/python examples/demo.py $(DEMO_MODEL)

clean:
	rm -rf $(VENV) build dist demo_out .pytest_cache .mypy_cache .ruff_cache
