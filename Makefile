# Self-listing: `make help`. ARGS passes config overrides, e.g. make up-cluster ARGS="--trainer.steps 40".
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
ARGS ?=

.PHONY: help setup up-cluster down pretrain test clean gap-experiment hacking-experiment

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

gap-experiment: pretrain ## train with single:<best>, weaver, ground_truth; writes bench/results/gap.{json,md,png} (~15 min)
	nice -n 10 $(BIN)/python bench/gap.py $(ARGS)

hacking-experiment: pretrain ## weaver, majority, average at lr 3e-4: reward vs hidden accuracy; bench/results/hacking.* (~15 min)
	nice -n 10 $(BIN)/python bench/hacking.py $(ARGS)

clean: ## remove runs/ and the base model (keeps .venv)
	rm -rf runs artifacts
