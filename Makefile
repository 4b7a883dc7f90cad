# make demo | make test | make bench -- each creates .venv and installs what it needs.
# GPU users: make test TORCH_SPEC="torch" (or any torch build you want) instead of the CPU pin.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
BENCH_ARGS ?=

.PHONY: demo test bench clean test-browser

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[mpi,test,telemetry,examples,secure,bench]"
	touch $(STAMP)

# the MPI transport's compiled helper (aioready/transports/native): the C source against the
# venv's MPICH; rebuilt when the source changes
NATIVE := aioready/transports/native/_mpifast.so.stamp
$(NATIVE): $(STAMP) aioready/transports/native/_mpifast.c aioready/transports/native/__init__.py
	$(PY) -m aioready.transports.native build
	touch $(NATIVE)

test: $(STAMP) $(NATIVE)
	$(PY) -m pytest -q -m "not heavy and not gpu" $(PYTEST_ARGS)

# the dashboard's page in a real headless browser: installs Chromium from the system packages
# when none is on PATH (needs apt-get and root), then runs the tests that use it
test-browser: $(STAMP)
	command -v chromium || command -v chromium-browser || command -v google-chrome || \
		(apt-get update -q && apt-get install -y -q chromium)
	$(PY) -m pytest -q tests/test_dashboard.py -k browser -rs $(PYTEST_ARGS)

demo: $(STAMP) $(NATIVE)
	$(PY) -m aioready.cli.demo

bench: $(STAMP) $(NATIVE)
	$(PY) -m bench all $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache out aioready/transports/native/_mpifast*
