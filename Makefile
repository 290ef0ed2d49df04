# Two entry points, each of which sets up the local virtual environment first:
#   make demo   trains a small model in mixed precision and prints what it did
#   make test   runs the default test suite (everything but the tests marked slow)
#   make test-slow  runs the slow ones (multi-process, whole examples); CI runs both
#   make test-durations  the default suite with its 30 slowest tests and the total time
#   make docs   builds the documentation site into docs/_build/html (warnings are errors)
#   make gpu    every GPU check in one command (<= 9 min on one H100/H200; see
#               BENCHMARKS.md): the GPU parts one at a time, alone, then the CPU suite on
#               every core, each part's time box cut to what is left of the budget. It
#               uses $(PYTHON) with the checkout on PYTHONPATH, not the .venv, so that it
#               runs on a GPU image as it is; GPU_ARGS=--cpu-dry-run tries it on CPU,
#               GPU_ARGS=--plan prints the parts and their boxes.
# The environment in .venv is reused on later runs; it is rebuilt when pyproject.toml or
# constraints.txt change.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.mpfunc-installed
# Two workers, each given whole files (--dist loadfile): a file's tests then share their
# module fixtures, their jitted steps and the README blocks above them, where splitting
# a file between workers made both build them (test_readme.py: 69 -> 52 CPU seconds).
PYTEST_ARGS ?= -n 2 --dist loadfile

.PHONY: demo test test-slow test-durations lint docs gpu venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/compare_modes.py --quick

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS) -m "not slow"

test-slow: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS) -m slow

test-durations: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS) -m "not slow" -q --durations=30

lint: $(STAMP)
	$(BIN)/ruff check .

docs: $(STAMP)
	rm -rf docs/_build
	$(BIN)/python -m sphinx -W --keep-going -q -b html docs docs/_build/html
	$(BIN)/python docs/check_site.py docs/_build/html

gpu:
	PYTHON=$(PYTHON) bash benchmarks/gpu.sh $(GPU_ARGS)

clean:
	rm -rf $(VENV)
