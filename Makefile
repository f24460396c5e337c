# Two commands for a fresh machine: `make demo` and `make test`. Each creates .venv when missing and
# installs what it needs into it (torch pinned to 2.13.0, the CPU build on this machine).
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip install --disable-pip-version-check -q

.PHONY: demo test lint typecheck docs pytest bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip

$(VENV)/.demo-installed: pyproject.toml setup.py src/gaussdp/_gauss.c | $(BIN)/python
	$(PIP) "torch==2.13.0"
	$(PIP) -e ".[all]"
	touch $@

$(VENV)/.test-installed: pyproject.toml setup.py src/gaussdp/_gauss.c src/gaussdp/_search.c $(VENV)/.demo-installed
	$(PIP) -e ".[all,dev]"
	touch $@

demo: $(VENV)/.demo-installed
	$(BIN)/gaussdp demo

lint: $(VENV)/.test-installed
	$(BIN)/ruff check setup.py src tests benchmarks examples scripts
	$(BIN)/ruff format --check setup.py src tests benchmarks examples scripts

typecheck: $(VENV)/.test-installed
	$(BIN)/mypy

# The docs site, warnings as errors (a few seconds); tests/test_docs.py runs its python blocks.
docs: $(VENV)/.test-installed
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -q

pytest: $(VENV)/.test-installed
	@# Debian's Chromium for the in-browser text test (skipped with a reason where it cannot be installed).
	command -v chromium >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null) || true
	$(BIN)/python -m pytest -q

test: lint typecheck docs pytest

bench: $(VENV)/.test-installed
	for f in benchmarks/bench_*.py; do $(BIN)/python $$f || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache demo_out build dist site src/gaussdp/*.so
