"""Which pip extra brings which framework, and the import error that says so.

The base install is framework-free (numpy only); each framework comes with an extra:
``mpfunc[jax]`` (jax, optax), ``mpfunc[flax]`` (adds flax), ``mpfunc[torch]``. A package
or helper that needs a missing framework raises `ModuleNotFoundError` naming the extra
to install, not a bare "No module named ...".
"""

from __future__ import annotations

import importlib

__all__ = ["missing_extra_error", "require_extra"]

# extra -> the hint after "pip install 'mpfunc[extra]'".
_HINTS = {
    "jax": ("(CPU), or 'mpfunc[cuda12]' / 'mpfunc[cuda13]' for jax on NVIDIA GPUs. The "
            "PyTorch side needs no JAX: `import mpfunc_torch` (pip install 'mpfunc[torch]')."),
    "flax": "(it also brings the `jax` extra).",
    "lightning": "(pytorch-lightning; the `lightning` package works too).",
    "hf": "(transformers and accelerate).",
    "torch": ("(for a CUDA build, install torch first as pytorch.org says, then the extra). "
              "The JAX side needs no torch: `import mpfunc` (pip install 'mpfunc[jax]')."),
}


def missing_extra_error(feature: str, extra: str, error: ImportError) -> ModuleNotFoundError:
    """The error for ``feature`` when importing its framework failed with ``error``."""
    missing = getattr(error, "name", None) or "a dependency"
    message = (f"{feature} needs the `{extra}` extra, but {missing!r} could not be imported "
               f"({error}). Install it with: pip install 'mpfunc[{extra}]' "
               + _HINTS.get(extra, ""))
    return ModuleNotFoundError(message.strip(), name=getattr(error, "name", None))


def require_extra(feature: str, extra: str, modules: tuple[str, ...]) -> None:
    """Imports ``modules``; if one is missing, raises `missing_extra_error`.

    Examples:
      >>> require_extra("mpfunc.example", "flax", ("no_such_module_xyz",))
      Traceback (most recent call last):
      ...
      ModuleNotFoundError: mpfunc.example needs the `flax` extra, but 'no_such_module_xyz' could not be imported (No module named 'no_such_module_xyz'). Install it with: pip install 'mpfunc[flax]' (it also brings the `jax` extra).
    """
    for module in modules:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as e:
            raise missing_extra_error(feature, extra, e) from e
