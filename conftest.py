"""Collection rules for the whole checkout; tests/conftest.py configures the tests.

The doctest collector imports every module of the three packages. A module whose
optional dependency is not installed (Triton for `mpfunc_torch/_src/fp8/triton_kernels.py`,
Lightning or transformers for the trainer modules, jax for `mpfunc` in a torch-only
install) would stop the whole run with a collection error; it is skipped instead, with
the import's own message as the reason (the packages' messages name the extra to
install).
"""

from __future__ import annotations

import importlib

import pytest

_PACKAGES = ("mpfunc", "mpfunc_torch", "_mpfunc_common")
_EXTRA_OF = {"triton": "triton"}  # modules that import a dependency by its bare name


class _NotInstalled(pytest.File):
    reason = ""

    def collect(self):
        pytest.skip(self.reason)


@pytest.hookimpl(wrapper=True)
def pytest_collect_file(file_path, parent):
    collectors = yield
    rel = file_path.relative_to(parent.config.rootpath) if file_path.is_relative_to(
        parent.config.rootpath) else None
    if rel is None or rel.suffix != ".py" or rel.parts[0] not in _PACKAGES:
        return collectors
    name = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as e:
        missing = (e.name or "").partition(".")[0]
        if not missing or missing in _PACKAGES:
            raise
        extra = _EXTRA_OF.get(missing)
        item = _NotInstalled.from_parent(parent, path=file_path)
        item.reason = f"{rel}: {e}" + (f" (the `{extra}` extra)" if extra else "")
        return [item]
    return collectors
