# Sluice: `make demo` runs the streaming demo, `make test` the test suite; both set up .venv.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: venv demo test test-all bench bench-staleness bench-weights clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

demo: venv
	$(BIN)/python -m recipes.demo

test: venv
	$(BIN)/python -m pytest -q

test-all: venv
	$(BIN)/python -m pytest -q -m ""

bench: venv
	$(BIN)/python benchmarks/data_plane.py
	$(BIN)/python benchmarks/controller.py

clean:
	rm -rf $(VENV) results .pytest_cache
