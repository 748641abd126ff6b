# The two commands of the README: `make demo` and `make test`. Both create the virtual
# environment from nothing on a fresh machine (Python 3.11+ is all they need).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvflow-installed

.PHONY: install demo test lint format clean vllm-env

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[dev,postgres,otlp]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/kvflow demo

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# Real vLLM (CPU build) and a tiny local model for the tests, built once per machine outside
# the repository (KVFLOW_VLLM_HOME, default ~/.cache/kvflow/vllm).
vllm-env:
	PYTHON=$(PYTHON) bash scripts/vllm_env.sh

test: lint vllm-env
	$(BIN)/pytest

clean:
	rm -rf $(VENV) .kvflow .pytest_cache .mypy_cache .ruff_cache
