# meshpilot — the README's two commands:
#   make demo   install if needed, start a local S3 server, train the 3D-parallel demo, print the run dir
#   make test   install if needed, then lint (ruff, mypy), the docs build and the tests not marked slow (about 10 min on 2 cores)
#   make test-all   the same with the long scenarios marked slow too: what CI runs (.ci/run)
#   make lint   ruff check, ruff format --check, mypy
#   make docs   the docs site into site/ (mkdocs build --strict: a broken link or anchor fails it)
#   make coverage   the whole suite under coverage.py, the ranks' processes included; prints line coverage
#   make test-gpu   tests/gpu and bench/gpu.py --quick on a machine with CUDA GPUs (install a CUDA torch first:
#                   make setup TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128")
#   make gpu-wheels the wheels bench/gpu_check.py carries to a lent GPU machine (into .gpu-wheels/)
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
# The CPU wheel of this version is what the CI machines have; on a GPU machine pick your own build,
# e.g. make setup TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.meshpilot-installed

.PHONY: setup demo lint docs test test-all test-gpu gpu-wheels coverage bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --upgrade pip
	$(PY) -m pip install -q --disable-pip-version-check $(TORCH_SPEC)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test]'
	bash deploy/prometheus/install.sh
	@touch $@

demo: setup
	$(VENV)/bin/meshpilot demo

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

test: setup lint docs
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

# The reference pages are generated during the build (mkdocs.yml's hook, orchestrator/cli/docs_reference.py);
# the benchmarks page is rendered from bench/results/ first (the hook stands in a placeholder until
# bench/report.py exists). PYTHONPATH: the hook documents this checkout's code, whatever the venv's editable
# install points at. NO_MKDOCS_2_WARNING: Material's banner about MkDocs 2, not about this site.
docs: setup
	if [ -f bench/report.py ]; then $(PY) bench/report.py; fi
	PYTHONPATH=$(CURDIR) NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

# Everything, the long scenarios marked slow included: CI runs this.
test-all: setup lint docs
	$(PY) -m pytest $(PYTEST_ARGS)

# Every process the suite starts measures itself (COVERAGE_PROCESS_START; coverage's own .pth
# starts it), writing .coverage.* files here, combined at the end. -i: a Ray job's copy of the code
# (test_submit's working_dir) is measured too but gone by the report.
coverage: setup
	rm -f .coverage .coverage.*
	COVERAGE_PROCESS_START=$(CURDIR)/pyproject.toml COVERAGE_FILE=$(CURDIR)/.coverage $(PY) -m pytest $(PYTEST_ARGS)
	$(PY) -m coverage combine -q
	$(PY) -m coverage report -i | grep -E '^(Name|TOTAL)'

# tests/gpu needs a CUDA GPU (two for its replica-group tests): without one `make test` does not
# collect it, and naming it here stops with one line (exit 4). On a GPU machine `make test` and
# `make test-all` run it too. A lent machine as it is (its own python3, no pip, no Ray) runs
# `PYTHONPATH=$PWD python3 bench/gpu_check.py --out DIR` instead (docs/guides/gpus.md); its --smoke is a
# unit test (tests/unit/test_gpu_check.py).
test-gpu: setup
	$(PY) -m pytest tests/gpu -s $(PYTEST_ARGS)
	$(PY) bench/gpu.py --quick

# What bench/gpu_check.py carries to a lent GPU machine (torchao, torchtitan); RAY=1 adds Ray,
# repacked to fit the 64 MiB that may travel with the tree.
# Needs only pip, not the project's venv; the wheels are picked for the lent machine's Python 3.11.
gpu-wheels:
	$(PYTHON) bench/support/gpu_wheels.py $(if $(RAY),--ray)

clean:
	rm -rf $(VENV) runs site .pytest_cache .mypy_cache .ruff_cache .coverage .coverage.*
