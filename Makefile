# `make demo` and `make test` work on a fresh machine: they create .venv and install
# torch==2.13.0 (CPU) before the project, so pip never pulls CUDA wheels.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.dcpbridge-installed

.PHONY: demo test bench lint install

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m dcpbridge.demo

test: $(STAMP)
	$(PY) -m pytest -m "not gpu" -q

bench: $(STAMP)
	$(PY) benchmarks/run.py

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .
