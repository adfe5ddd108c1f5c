# Two commands on a fresh machine: `make run` (the default job) and `make test` (the suite).
# torch comes first and pinned: 2.13.0 is a CPU build on our machines' disk; a bare `torch` would pull CUDA.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
export WANDB_ERROR_REPORTING := false
SHELL := /bin/bash

.PHONY: install run test test-fast bench clean

install: $(VENV)/.installed

# scripts/install.sh: torch first, then this project with its test extra (with uv where the index has it, else pip)
$(VENV)/.installed: pyproject.toml scripts/install.sh
	@bash scripts/install.sh $(PYTHON) $(VENV)

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
