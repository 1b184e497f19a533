# Two commands for a newcomer: `make demo` and `make test`. Each creates the local
# virtualenv (.venv) and installs what it needs; nothing is installed by hand.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
MODELS_STAMP := $(VENV)/.installed-transformers
# uv installs the same packages pip would, from PyPI, in a fraction of the time (torch
# and its CUDA libraries: about 15 s instead of over 3 minutes here)
UV := $(BIN)/uv pip install -q --python $(BIN)/python

.PHONY: demo test check lint typecheck system-deps classpath kafka kafka-scram prometheus bench bench-tap clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip uv
	$(UV) -e '.[dev]'
	touch $(STAMP)

# torch, transformers and its HTTP server for the attention tap's tests (the service itself never needs them)
$(MODELS_STAMP): $(STAMP)
	$(UV) -e '.[dev,transformers,serving,test-models]'
	touch $(MODELS_STAMP)

demo: $(STAMP)
	$(BIN)/attention-monitor demo

system-deps:
	devstack/install-system-deps.sh

classpath: $(STAMP) system-deps
	$(BIN)/python -m devstack classpath

lint: $(STAMP)
	$(BIN)/ruff check monitor devstack tests benchmarks dashboards

typecheck: $(STAMP)
	$(BIN)/mypy

check: lint typecheck

test: $(STAMP) $(MODELS_STAMP) system-deps classpath check
	$(BIN)/python -m pytest

# Services by hand, for exploring (Ctrl-C stops and cleans up).
kafka: $(STAMP) system-deps
	$(BIN)/python -m devstack kafka

kafka-scram: $(STAMP) system-deps
	$(BIN)/python -m devstack kafka --profile scram

prometheus: $(STAMP) system-deps
	$(BIN)/python -m devstack prometheus --alertmanager --target attention-monitor=127.0.0.1:9464

bench: $(STAMP)
	$(BIN)/python benchmarks/metrics_bench.py

bench-tap: $(MODELS_STAMP)
	$(BIN)/python benchmarks/tap_bench.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
