# Two entry points (see README): `make demo` runs the main job, `make test` runs the tests.
# Both set up .venv from pyproject.toml on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
DEMO := .cache/demo

.PHONY: setup demo test test-slow clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $@

# Until the default model pair ships (issue 3) the demo builds a tiny RANDOM-weight Qwen3 checkpoint:
# the text is gibberish, the mechanics (streaming, drafting, acceptance, speed) are real.
demo: setup
	$(BIN)/python -c "from blockspec.services.build.tiny import build_tiny_checkpoint as b; \
	  import pathlib; p = pathlib.Path('$(DEMO)/target'); (p / 'config.json').exists() or b(p, 'qwen3', hidden_size=128, num_layers=4)"
	$(BIN)/blockspec generate "def fibonacci(n):" --target $(DEMO)/target --method none --max-tokens 96
	$(BIN)/blockspec generate "def fibonacci(n):" --target $(DEMO)/target --method ngram -k 5 --max-tokens 96
	$(BIN)/blockspec generate "def fibonacci(n):" --target $(DEMO)/target --drafter $(DEMO)/target --method draft_model -k 5 --max-tokens 96

test: setup
	$(BIN)/python -m pytest -q

test-slow: setup
	$(BIN)/python -m pytest -q -m slow

clean:
	rm -rf $(VENV) .cache .pytest_cache
