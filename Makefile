# Two targets do all the set-up: each creates (once) and reuses .venv.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.dpmp-installed
DOCS_STAMP := $(VENV)/.dpmp-docs-installed

.PHONY: setup run test test-all docs lint clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

# The main job: the default config (a private MLP on the digits data, bf16, epsilon 2).
run: $(STAMP)
	$(BIN)/dpmp train --out runs/default

# The default test suite (about 4 minutes on 2 CPU cores, one pytest worker per core);
# slow end-to-end tests are separate.
test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" -n auto

# Everything, slow end-to-end runs included (what CI runs).
test-all: $(STAMP)
	$(BIN)/python -m pytest -q -n auto

$(DOCS_STAMP): $(STAMP) pyproject.toml
	$(BIN)/python -m pip install -q -e '.[test,docs]'
	touch $(DOCS_STAMP)

# The documentation site, from docs/ and the docstrings, into build/site (warnings are errors).
docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

lint: $(STAMP)
	$(BIN)/ruff check dpmp tests examples benchmarks
	$(BIN)/ruff format --check dpmp tests examples benchmarks

clean:
	rm -rf $(VENV) build *.egg-info
