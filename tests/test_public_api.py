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
    [("mpfunc", ["torch"]),
     ("mpfunc_torch", ["jax", "pytorch_lightning", "lightning", "transformers", "accelerate"]),
     ("mpfunc_torch.lightning", ["jax"]), ("mpfunc_torch.transformers", ["jax"])],
)
def test_packages_do_not_import_the_other_framework(package, forbidden):
    # One child per package checks every package it must not pull in (a child per pair
    # imported mpfunc_torch five times: about 8 s of the default suite).
    code = (
        f"import sys; import {package}; "
        f"bad = sorted(m for m in sys.modules for f in {forbidden!r} "
        "if m == f or m.startswith(f + '.')); "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, f"import {package} pulled in {result.stdout}{result.stderr}"


def _public_callables():
    """(qualified name, object) of every exported class and function, and of every public
    method and property our own classes define on them (inherited from torch, Lightning
    or transformers excluded)."""
    import inspect

    own = ("mpfunc", "mpfunc_torch", "_mpfunc_common")
    for package in ["mpfunc", "mpfunc_torch", *SUBMODULES]:
        module = importlib.import_module(package)
        for name in module.__all__:
            obj = getattr(module, name)
            if not callable(obj):
                continue
            yield f"{package}.{name}", obj
            if not inspect.isclass(obj):
                continue
            for klass in obj.__mro__:
                if (klass.__module__ or "").partition(".")[0] not in own:
                    continue
                for attr, value in vars(klass).items():
                    if attr.startswith("_"):
                        continue
                    if isinstance(value, property):
                        yield f"{package}.{name}.{attr}", value.fget
                    elif inspect.isfunction(getattr(value, "__func__", value)):
                        yield f"{package}.{name}.{attr}", getattr(value, "__func__", value)


@pytest.mark.skipif(sys.flags.optimize >= 2, reason="docstrings are stripped under -OO")
def test_every_public_name_method_and_property_has_a_docstring():
    found = dict(_public_callables())
    assert len(found) > 150  # the enumeration itself works (184 today)
    assert "mpfunc_torch.LossScaler.skipped_steps" in found
    assert "mpfunc_torch.lightning.AmpPrecision.clip_grad_by_norm" in found
    assert sorted(name for name, obj in found.items() if not (obj.__doc__ or "").strip()) == []


def test_no_error_message_names_a_private_module():
    # What a user is told to call must be importable from the public packages.
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    bad = []
    for package in ("mpfunc", "mpfunc_torch", "_mpfunc_common"):
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.Raise) or node.exc is None:
                    continue
                text = " ".join(c.value for c in ast.walk(node.exc)
                                if isinstance(c, ast.Constant) and isinstance(c.value, str))
                if "_mpfunc_common" in text or "._src" in text or "_src." in text:
                    bad.append(f"{path.relative_to(root)}:{node.lineno}")
    assert bad == []
