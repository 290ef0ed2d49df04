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
#   make typecheck  pyright (basic) on the three packages (`make lint` runs it too)
#   make test-latest  the newest torch, jax, flax, optax, transformers and Lightning the
#               registry serves, in .venv-latest: MATRIX_TESTS there; CI runs it
#   make test-oldest  the oldest versions pyproject's lower bounds claim
#               (constraints-oldest.txt), in .venv-oldest: MATRIX_TESTS there; CI runs it
#   make test-wheel  builds the sdist and wheel, checks them (twine, check-wheel-contents,
#               the sdist's files), installs the wheel alone with the `jax` extra, then
#               with the `torch` extra, each in a fresh venv, and runs the README's quick
#               start there; CI runs it
# The environment in .venv is reused on later runs; it is rebuilt when pyproject.toml or
# constraints.txt change.

SHELL := bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.mpfunc-installed
# Two workers, each given whole files (--dist loadfile): a file's tests then share their
# module fixtures, their jitted steps and the README blocks above them, where splitting
# a file between workers made both build them (test_readme.py: 69 -> 52 CPU seconds).
PYTEST_ARGS ?= -n 2 --dist loadfile

.PHONY: demo test test-slow test-durations test-compiles lint typecheck docs gpu venv clean test-latest \
	test-oldest test-wheel

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

# Where the default suite's JAX compile time goes, cache off (tests/compile_profile.py).
test-compiles: $(STAMP)
	MPFUNC_TEST_JAX_CACHE=off MPFUNC_COMPILE_PROFILE=$(CURDIR)/.compile-profile \
		$(BIN)/python -m pytest $(PYTEST_ARGS) -m "not slow" -q

lint: $(STAMP)
	$(BIN)/ruff check .
	$(MAKE) typecheck

typecheck: $(STAMP)
	PYRIGHT_PYTHON_IGNORE_WARNINGS=1 $(BIN)/pyright --project pyproject.toml --pythonpath $(BIN)/python

# The version matrix: a named subset of the default suite that imports every module
# (the doctests of all three packages) and exercises what moves between releases:
# torch's private ops, every torch mode, the scaler, the optimizer, torch.compile, fp8
# (Triton), checkpoints, both trainers, the README's blocks, the install checks, and the
# fused Adam kernel taken over for stored params (storage_kernels).
# The whole default suite would not fit CI's budget twice more (it takes 12-17 min).
MATRIX_TESTS ?= mpfunc mpfunc_torch _mpfunc_common tests/test_public_api.py \
	tests/test_install.py tests/test_optimize_flag.py tests/test_torch_private_ops.py \
	tests/test_torch_fused.py tests/test_torch_modes.py tests/test_torch_loss_scale.py \
	tests/test_torch_optimizer.py tests/test_torch_compile.py tests/test_hf_trainer.py \
	tests/test_lightning_plugin.py tests/test_hf_transformers.py tests/test_readme.py \
	tests/test_fp8_torch.py tests/test_fp8_fused.py tests/test_torch_checkpoint.py \
	tests/test_torch_resume.py tests/test_torch_storage_kernels.py
# On torch 2.11 (the oldest) a compiled step differs from eager (see
# docs/known-limits.md), so test-oldest leaves the torch.compile tests out.
OLDEST_TESTS ?= $(filter-out tests/test_torch_compile.py,$(MATRIX_TESTS))
LATEST_VENV ?= .venv-latest
OLDEST_VENV ?= .venv-oldest
VERSIONS := import importlib.metadata as m; print(', '.join(f'{d} {m.version(d)}' for d in \
	('torch', 'triton', 'jax', 'flax', 'optax', 'numpy', 'transformers', 'accelerate', \
	'lightning', 'pytorch-lightning')))

# No constraints: whatever is newest (--upgrade-strategy eager also upgrades a reused
# environment's dependencies).
test-latest:
	test -x $(LATEST_VENV)/bin/python || $(PYTHON) -m venv $(LATEST_VENV)
	time $(LATEST_VENV)/bin/python -m pip install --quiet --upgrade \
		--upgrade-strategy eager -e '.[dev]'
	$(LATEST_VENV)/bin/python -c "$(VERSIONS)"
	time $(LATEST_VENV)/bin/python -m pytest $(PYTEST_ARGS) -m "not slow" $(MATRIX_TESTS)

test-oldest:
	test -x $(OLDEST_VENV)/bin/python || $(PYTHON) -m venv $(OLDEST_VENV)
	time $(OLDEST_VENV)/bin/python -m pip install --quiet -c constraints-oldest.txt \
		-e '.[dev]'
	$(OLDEST_VENV)/bin/python -c "$(VERSIONS)"
	time $(OLDEST_VENV)/bin/python -m pytest $(PYTEST_ARGS) -m "not slow" $(OLDEST_TESTS)

WHEEL_TMP ?= build/wheel-check
test-wheel: $(STAMP)
	rm -rf dist $(WHEEL_TMP)
	$(BIN)/python -m build --outdir dist .
	$(BIN)/twine check --strict dist/*
	$(BIN)/check-wheel-contents dist/*.whl
	$(BIN)/python .ci/wheel_check.py sdist dist
	for extra in jax torch; do \
		$(PYTHON) -m venv $(WHEEL_TMP)/$$extra && \
		time $(WHEEL_TMP)/$$extra/bin/python -m pip install --quiet -c constraints.txt \
			"$$(ls dist/*.whl)[$$extra]" && \
		$(BIN)/python .ci/wheel_check.py quickstart $$extra $(WHEEL_TMP)/$$extra/bin/python \
		|| exit 1; \
	done
	rm -rf $(WHEEL_TMP)

docs: $(STAMP)
	rm -rf docs/_build
	$(BIN)/python -m sphinx -W --keep-going -q -b html docs docs/_build/html
	$(BIN)/python docs/check_site.py docs/_build/html

gpu:
	PYTHON=$(PYTHON) bash benchmarks/gpu.sh $(GPU_ARGS)

clean:
	rm -rf $(VENV) $(LATEST_VENV) $(OLDEST_VENV) dist build
