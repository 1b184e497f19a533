# Two commands for a newcomer: `make demo` and `make test`. Each creates the local
# virtualenv (.venv) and installs what it needs; nothing is installed by hand.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test check lint typecheck system-deps classpath kafka kafka-scram prometheus bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

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

test: $(STAMP) system-deps classpath check
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

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
