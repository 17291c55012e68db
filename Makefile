# Two entry points (see README): `make demo` runs the main job, `make test` runs the tests.
# Both set up .venv from pyproject.toml on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo test test-slow clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $@

# The main job: serve the default pair shipped in models/base, stream a completion through the
# gRPC API and print tau, acceptance and speed (deploy/demo.sh).
demo: setup
	BIN=$(BIN) bash deploy/demo.sh

test: setup
	$(BIN)/python -m pytest -q

test-slow: setup
	$(BIN)/python -m pytest -q -m slow

clean:
	rm -rf $(VENV) .cache .pytest_cache
