# One Makefile for set-up, demo, tests and benchmarks. `make demo` and `make test` do all
# set-up themselves on a machine that has only Python 3.11 and make.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# Each Python process the tests start (pytest's workers, and the programs tests run: other
# processes of a multi-process load, crashed saves, the examples) reads compiled modules
# from __pycache__; where the environment sets PYTHONDONTWRITEBYTECODE, none is ever
# written, and each process compiles the ~4,400 modules it imports again (about 14 s of
# CPU a process: a minute or more of `make test`)
unexport PYTHONDONTWRITEBYTECODE

.PHONY: demo test test-accelerator property mutate bench bench-quick lint format docs clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet --no-compile -e '.[dev,bench]'  # (Python compiles what it imports, once)
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/quickstart.py

# the format, lint and type checks first (about 15 s): a lint or type error fails CI.
# Compiling is most of the suite's time, so this run (not `make property`, which keeps
# XLA's defaults) compiles with XLA's CPU backend at optimisation level 1 (here 21% less
# time in tests/nn, every test passing alike; level 0 breaks the bitwise equality of
# sharded and unsharded parameter draws), and its workers share a persistent
# compilation cache, made empty for each run (conftest.py). Three workers on two cores: a
# worker waits on its compiles and its subprocesses, and a third fills that time (610 s of
# pytest against 650 s with two, from fresh clones of the same code, one after the other)
test: lint
	cache=$$(mktemp -d) && trap 'rm -rf "$$cache"' EXIT && \
	XLA_FLAGS="--xla_backend_optimization_level=1 $$XLA_FLAGS" TAKTINY_TEST_COMPILATION_CACHE=$$cache \
	$(PY) -m pytest -q -n 3 --dist worksteal --durations=25 -m "not thorough"

# the Hypothesis suite with its thorough profile, then the tests marked thorough; their
# tests may take longer than the per-test limit of pyproject.toml allows
LONGER := -o timeout=1800 -o faulthandler_timeout=1740
property: $(STAMP)
	$(PY) -m pytest -q property_tests --hypothesis-profile=thorough $(LONGER)
	$(PY) -m pytest -q -n 2 -m thorough tests $(LONGER)

# The suite on an accelerator host (a TPU or a GPU; docs/testing.md): one process (one at a
# time may hold a TPU), JAX's default devices the 8 simulated CPU ones (the sharding tests
# build their meshes from them), the accelerator's for the [tpu] and [gpu] property variants.
# Its environment sees the host's packages, jax and jaxlib held at the host's versions: its
# JAX is the host's, with the accelerator's backend (a plain one would install JAX for the
# CPU alone, and every accelerator test would skip); pytest refuses to start where JAX
# sees no TPU or GPU
ACCEL_VENV := .venv-accelerator
ACCEL_PY := $(ACCEL_VENV)/bin/python
HOST_JAX := import importlib.metadata as m; print(*sorted({f"{d.name}=={d.version}" for d in m.distributions() if d.name in ("jax", "jaxlib")}), sep="\n")

$(ACCEL_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv --system-site-packages $(ACCEL_VENV)
	$(ACCEL_PY) -c '$(HOST_JAX)' > $(ACCEL_VENV)/host-jax.txt
	$(ACCEL_PY) -m pip install --quiet --no-compile -c $(ACCEL_VENV)/host-jax.txt -e '.[dev,bench]'
	touch $@

test-accelerator: $(ACCEL_VENV)/.installed
	JAX_PLATFORM_NAME=cpu $(ACCEL_PY) -m pytest -q -m "not thorough" tests property_tests --hypothesis-profile=accelerator --require-accelerator

# Mutation testing (docs/testing.md): the mutants of taktiny/ not judged yet (all of them the
# first time; then those of changed functions), the survivors again against today's tests,
# then the report (mutants/report.md); fails when a kill rate misses its target. The map of
# which tests reach which function is rebuilt each time (mutmut updates it only for tests
# with new names, so a changed test would keep its old reach). `rm -rf mutants` and an
# empty tests/mutation_results.json (`{}`) first for a run from scratch.
# `make mutate MUTANTS='taktiny.io.*'` judges only the not-yet-judged mutants whose names
# match (mutmut's names: module path, function, number). Results are kept in
# tests/mutation_results.json (commit it), which the next run, on any machine, starts from.
MUTMUT := TAKTINY_TEST_COMPILATION_CACHE=$(CURDIR)/.jax-cache $(VENV)/bin/mutmut run --max-children 2
MUTANTS ?=
mutate: $(STAMP)
	rm -f mutants/mutmut-stats.json
	$(PY) tests/mutation_report.py --restore
	set -f; if [ -z "$(MUTANTS)" ]; then $(MUTMUT); else \
	names="$$($(PY) tests/mutation_report.py --pending $(MUTANTS))"; \
	if [ -n "$$names" ]; then $(MUTMUT) $$names; fi; fi; \
	status=$$?; $(PY) tests/mutation_report.py --record; exit $$status
	survivors="$$($(PY) tests/mutation_report.py --survivors)"; \
	if [ -n "$$survivors" ]; then $(MUTMUT) $$survivors; fi; \
	status=$$?; $(PY) tests/mutation_report.py --record; exit $$status
	$(PY) tests/mutation_report.py

bench: $(STAMP)
	$(PY) bench/run.py

bench-quick: $(STAMP)
	$(PY) bench/run.py --quick

lint: $(STAMP)
	$(VENV)/bin/ruff format --check taktiny tests property_tests examples bench docs/_ext
	$(VENV)/bin/ruff check taktiny tests property_tests examples bench docs/_ext
	$(VENV)/bin/pyright

format: $(STAMP)
	$(VENV)/bin/ruff format taktiny tests property_tests examples bench docs/_ext
	$(VENV)/bin/ruff check --fix taktiny tests property_tests examples bench docs/_ext

# The documentation site (mkdocs.yml): the guides in docs/ and the API reference, built
# from the docstrings without importing the package, into site/ (open site/index.html).
# --strict: a broken link or cross-reference, or a docstring griffe cannot parse, fails.
docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) $(ACCEL_VENV) .pytest_cache .hypothesis build *.egg-info mutants .jax-cache site
