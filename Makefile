# Two commands on a fresh machine: `make run` (the default job) and `make test` (the suite).
# torch comes first and pinned: 2.13.0 is a CPU build on our machines' disk; a bare `torch` would pull CUDA.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
export WANDB_ERROR_REPORTING := false
# bash for pipefail: pip's exit status survives the filter below
SHELL := /bin/bash
# pip -q still warns once per package for an index location that lacks it (a machine's extra local index: hundreds
# of "WARNING: Location '...' is ignored" lines); the filter drops those, pip's other warnings and errors stay.
QUIET_PIP = 2>&1 | { grep -v "^WARNING: Location '.*' is ignored" || true; }

.PHONY: install run test test-fast bench clean

install: $(VENV)/.installed

# tinker-cookbook 0.6.1 (tests/test_serve_cookbook.py) requires tml-renderers>=0.4.1, which our registry lacks (0.2.1);
# it imports it only for Inkling and Kimi models, so its other requirements come with the test extra, it without its own.
$(VENV)/.installed: pyproject.toml
	@echo "creating $(VENV) with $$($(PYTHON) --version) ..."
	@$(PYTHON) -m venv $(VENV)
	@echo "installing torch 2.13.0 (CPU build) into $(VENV) (~1 min) ..."
	@set -o pipefail; $(PY) -m pip install --quiet torch==2.13.0 $(QUIET_PIP)
	@echo "installing tinker_exp and its dependencies (verl, Ray, transformers, W&B, Optuna, pytest, ...) (3-5 min) ..."
	@set -o pipefail; $(PY) -m pip install --quiet -e '.[test]' $(QUIET_PIP)
	@set -o pipefail; $(PY) -m pip install --quiet --no-deps tinker-cookbook==0.6.1 $(QUIET_PIP)
	@touch $@
	@echo "installed into $(VENV) (make clean removes it)"

run: install
	$(PY) -m tinker_exp $(ARGS)

# Two pytest-xdist workers: most of the suite's time is waiting (Slurm, Ray start-up, subprocesses), which overlaps.
# Each xdist_group runs whole on one worker (tests/conftest.py: all Slurm tests in one, else a file each), longest first.
# Bytecode is written whatever PYTHONDONTWRITEBYTECODE says (this machine kind sets it): pytest's rewritten test and
# plugin modules are then read back by the next run's collection (11 s instead of 19 a process), our modules by
# every fresh process.
test: install
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -n 2 --dist loadgroup --no-loadscope-reorder

# For iteration, not CI: only the tests that start no real work (no Ray workers, Slurm or PostgreSQL), in minutes.
test-fast: install
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -m "not real" -n 2  # no Ray, Slurm or database: two at a time

bench: install
	$(PY) benchmarks/overhead.py

clean:
	rm -rf $(VENV) .cache outputs/runs outputs/sweeps
