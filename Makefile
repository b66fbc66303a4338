# `make demo` and `make test` work on a fresh machine: they create .venv and install
# torch==2.13.0 (CPU) before the project, so pip never pulls CUDA wheels. Where pip's index is
# public PyPI (whose Linux torch wheel is the CUDA build), TORCH_INDEX names torch's CPU index:
# make test TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.dcpbridge-installed
# parallel test processes: 2 on the 2-core machine (with 3, each with its own worker pool,
# forkserver and collection, the run used ~20% more CPU in all: 6 m 49 s against 5 m 59 s)
JOBS ?= 2
# the tests start hundreds of interpreters: where the environment turns bytecode caching off
# (PYTHONDONTWRITEBYTECODE), each of them compiled dcpbridge and the test modules again
CACHED := env -u PYTHONDONTWRITEBYTECODE

.PHONY: demo test test-fast bench lint install

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m dcpbridge.demo

# every test but the gpu-marked ones, test modules spread over parallel processes
test: $(STAMP)
	$(CACHED) $(PY) -m pytest -m "not gpu" -q -n $(JOBS) --dist loadfile

# single-process tests only (no gloo worker pool, S3 server or megatron-core): seconds, not minutes
test-fast: $(STAMP)
	$(CACHED) $(PY) -m pytest -m "not gpu and not dist and not s3 and not interop and not slow" -q -n $(JOBS) --dist loadfile

# the bench extra's contenders (s3torchconnector, torch_checkpointing) where the registry has
# them; their rows say "skipped: not installed" otherwise
bench: $(STAMP)
	$(PY) -m pip install -q -e '.[bench]' || echo "bench extra not installed: its rows are skipped"
	$(PY) benchmarks/run.py

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .
