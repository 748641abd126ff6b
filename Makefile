# The two commands of the README: `make demo` and `make test`. Both create the virtual
# environment from nothing on a fresh machine (Python 3.11+; `make test` also needs a C
# compiler and the Python headers for the compiled scheduler, see `compiled`).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvflow-installed

.PHONY: install demo test lint format clean vllm-env compiled bench chaos paced docs

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

# Lint and the compiled scheduler's build (each about 30-50 s of one core) run side by side,
# with the documentation site (about 5 s);
# the build works on a copy of the source, so the two never see each other's files.
# The suite waits on its servers (Temporal, vLLM, simulators) about as much as it computes, so
# it runs in two processes; each takes whole test files, so a file's servers start once.
test: $(STAMP) vllm-env
	$(MAKE) -j2 lint compiled docs
	$(BIN)/pytest -n 2 --dist loadfile

# The documentation site (mkdocs.yml, docs/), built as CI builds it: --strict turns a broken
# link or anchor, a missing page or an API entry that no longer resolves into a failure (not
# -q, which hides the warnings --strict counts). About 5 s;
# the pages land in .kvflow/site (git-ignored); `mkdocs serve` shows them while editing.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# Tests judged on the pace of a real vLLM engine beside this process (the deadline pause on
# real vLLM): on a loaded 2-core machine the API server's delays of seconds spoil their rounds,
# so they are run on demand, on a quiet machine, and not by `make test`.
paced: $(STAMP) vllm-env
	$(BIN)/pytest -m paced -s

# The fault suite (tests/chaos): kvflow's real processes (Temporal dev server, simulators, GPU
# and workflow workers, PostgreSQL ledger) killed, stopped and broken while tasks run. 6-8
# minutes on a 2-core machine, so not part of `make test`; .ci/run runs both. The table of
# figures goes to .kvflow/chaos-summary.md.
chaos: $(STAMP)
	$(BIN)/pytest -m chaos tests/chaos

# The scheduler's decision path compiled with mypyc, as a deployment installs kvflow
# (HATCH_BUILD_HOOK_ENABLE_MYPYC=true pip install .): the same source, built into a wheel and
# unpacked under .kvflow/compiled/site. The development environment runs it uncompiled, so an
# edited module never hides behind an older compiled one; `bench` puts the build first on the
# path and says which build it measured.
COMPILED := .kvflow/compiled
# Built from a copy of the source: hatch-mypyc moves pyproject.toml aside while it compiles,
# which would leave a linter or a test running beside it without its settings.
$(COMPILED)/site: $(STAMP) pyproject.toml $(wildcard kvflow/*/*.py kvflow/*/*/*.py)
	rm -rf $(COMPILED) && mkdir -p $(COMPILED)/source
	tar -chf - --exclude=__pycache__ pyproject.toml README.md kvflow | tar -xf - -C $(COMPILED)/source
	cd $(COMPILED)/source && HATCH_BUILD_HOOK_ENABLE_MYPYC=true HATCH_BUILD_CLEAN_HOOKS_AFTER=true $(CURDIR)/$(BIN)/python -m pip wheel -q --no-deps -w .. .
	$(BIN)/python -m zipfile -e $(COMPILED)/kvflow-*.whl $(COMPILED)/site

compiled: $(COMPILED)/site

bench: $(COMPILED)/site
	PYTHONPATH=$(COMPILED)/site $(BIN)/kvflow bench scheduler --json scheduler-latency.json
	$(BIN)/kvflow sim bench --json sim-bench.json

clean:
	rm -rf $(VENV) .kvflow .pytest_cache .mypy_cache .ruff_cache
