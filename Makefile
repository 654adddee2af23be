# Two commands on a fresh machine: `make demo` runs the main job on a built-in preset,
# `make test` runs the test suite. Both create .venv and install what they need.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
# The dev environment is pinned; pyproject.toml accepts a range for users with CUDA builds.
PINS := torch==2.13.0 transformers==5.24.0 accelerate==1.15.0 peft==0.21.2 deepspeed==0.19.8 pytest==9.2.0 hypothesis==6.170.17 matplotlib==3.11.2 nvidia-ml-py==13.615.71 playwright==1.63.0

.PHONY: setup demo test bench golden clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check $(PINS)
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps -e .
	touch $@

demo: setup
	$(BIN)/llamem plan llama-3.1-8b --gpu rtx-4090 --task lora --batch 4 --seq 2048

test: setup
	command -v chromium >/dev/null || (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium)
	$(BIN)/python -m pytest

golden: setup
	$(BIN)/python tests/golden_cases.py --regen

bench: setup
	$(BIN)/python benchmarks/analytic_speed.py
	$(BIN)/python benchmarks/accuracy.py
	$(BIN)/python benchmarks/replay_speed.py
	$(BIN)/python benchmarks/plan_speed.py
	$(BIN)/python benchmarks/trace_speed.py
	$(BIN)/python benchmarks/plan_accuracy.py
	$(BIN)/python benchmarks/web_speed.py
	$(BIN)/python benchmarks/ladder_3b.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
