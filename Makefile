# The two README commands: `make demo` runs the main job on the shipped pair, `make test` runs the tests (CI's
# .ci/run). Both set up .venv first: the versions in constraints.txt, the ranges in pyproject.toml.
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/pip install --disable-pip-version-check -c constraints.txt

.PHONY: setup demo serve test test-slow constraints clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	@echo "== setting up $(VENV): about 130 packages, 2 minutes on a new machine (torch comes from the local wheel)"
	$(PYTHON) -m venv $(VENV)
	$(PIP) --progress-bar off -e '.[test]' | { grep --line-buffered -E '^(Collecting|Successfully)' || true; }
	touch $@

# The main job: serve the default pair shipped in models/base, stream a completion through the gRPC API and compare
# its speed with plain decoding (deploy/demo.sh).
demo: setup
	BIN=$(BIN) bash deploy/demo.sh

# Serve the shipped pair on this machine until Ctrl-C (deploy/config.yaml: gRPC :8001, HTTP :8000).
serve: setup
	$(BIN)/blockspec serve --config deploy/config.yaml --no-ray

# The test files spread over the cores (a file's tests stay together: they share its servers and models), a line
# per test as it passes, the slowest tests at the end.
PYTEST := $(BIN)/python -m pytest -n auto --maxprocesses 4 --dist loadfile -v --durations=10

test: setup
	$(PYTEST)

test-slow: setup
	$(PYTEST) -m slow

# Refresh constraints.txt from what .venv holds (after changing pyproject.toml's ranges and installing).
constraints: setup
	{ sed -n '/^#/p' constraints.txt; $(BIN)/pip freeze --exclude-editable --disable-pip-version-check \
	  | grep -v -E '^(blockspec|py-spy|ruff)==' | sed 's/^torch==\(.*\)+cpu$$/torch==\1/' | sort -f; } > constraints.new
	mv constraints.new constraints.txt

clean:
	rm -rf $(VENV) .cache .pytest_cache
