# Self-listing: `make help`. ARGS passes config overrides, e.g. make up-cluster ARGS="--trainer.steps 40".
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
ARGS ?=

.PHONY: help setup up-cluster down pretrain test clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-12s %s\n", $$1, $$2}'

setup: $(VENV)/.installed ## create .venv and install the pinned dependencies

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --progress-bar on -e '.[test]'
	touch $@

up-cluster: setup ## Redis + feeder + 2 generators + 2 verifiers + trainer on the embedded default; writes runs/<id>/
	$(BIN)/pipeline up $(ARGS)

down: ## stop a cluster left running
	$(BIN)/pipeline down

pretrain: setup ## build and warm up the base model (artifacts/base-model) if missing
	$(BIN)/pipeline pretrain $(ARGS)

test: setup ## the test suite (real Redis-compatible server, real processes)
	$(BIN)/python -m pytest -q $(ARGS)

clean: ## remove runs/ and the base model (keeps .venv)
	rm -rf runs artifacts
