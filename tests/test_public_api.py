"""Every exported name resolves, and the packages do not import each other's framework."""

import importlib
import subprocess
import sys
import types

import pytest

# The trainer integrations: submodules of mpfunc_torch, each importing its trainer.
SUBMODULES = ["mpfunc_torch.lightning", "mpfunc_torch.transformers"]


@pytest.mark.parametrize("package", ["mpfunc", "mpfunc_torch", *SUBMODULES])
def test_every_exported_name_resolves(package):
    module = importlib.import_module(package)
    assert isinstance(module.__all__, list)
    assert len(module.__all__) == len(set(module.__all__)), "duplicate names in __all__"
    for name in module.__all__:
        assert hasattr(module, name), f"{package}.__all__ lists {name!r}, which does not exist"
        assert not name.startswith("_")


@pytest.mark.parametrize("package", ["mpfunc", "mpfunc_torch", *SUBMODULES])
def test_no_private_module_leaks_into_all(package):
    module = importlib.import_module(package)
    for name in module.__all__:
        obj = getattr(module, name)
        # A module is judged by its dotted name, not its file's path (a clone's folder
        # could be named anything, `_src` included).
        assert not (isinstance(obj, types.ModuleType) and "_src" in obj.__name__.split(".")), name


@pytest.mark.parametrize(
    "package, forbidden",
    [("mpfunc", "torch"), ("mpfunc_torch", "jax"), ("mpfunc_torch.lightning", "jax"),
     ("mpfunc_torch.transformers", "jax"), ("mpfunc_torch", "pytorch_lightning"),
     ("mpfunc_torch", "lightning"), ("mpfunc_torch", "transformers"),
     ("mpfunc_torch", "accelerate")],
)
def test_packages_do_not_import_the_other_framework(package, forbidden):
    code = (
        f"import sys; import {package}; "
        f"bad = sorted(m for m in sys.modules if m == {forbidden!r} or m.startswith({forbidden!r} + '.')); "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, f"import {package} pulled in {forbidden}: {result.stdout}{result.stderr}"
