"""Whether a file or a module is this project's own code, decided by where it lives.

Never by a substring of its path: a checkout is usually a folder named ``mpfunc`` with
its ``.venv`` inside, so ``"mpfunc" in filename`` also matches torch's
``mpfunc/.venv/lib/python3.11/site-packages/torch/optim/adam.py``. The library's folders
are resolved from the packages as Python imports them (without importing them), and a
file is ours when it lies inside one of them.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("mpfunc", "mpfunc_torch", "_mpfunc_common")


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"package {name!r} is not importable here")
    return Path(next(iter(spec.submodule_search_locations))).resolve()


LIBRARY_DIRS = tuple(_package_dir(name) for name in PACKAGES)
# The library plus the scripts that ship beside it (their jitted steps are ours too).
PROJECT_DIRS = LIBRARY_DIRS + (ROOT / "examples", ROOT / "benchmarks")


def _inside(filename: str | Path, dirs: tuple[Path, ...]) -> bool:
    path = Path(filename)
    if not path.is_absolute():  # "<string>", "<frozen ...>", a doctest: not a file of ours
        return False
    path = path.resolve()
    return any(path.is_relative_to(d) for d in dirs)


def is_library_file(filename: str | Path) -> bool:
    """True for a file of the packages ``mpfunc``, ``mpfunc_torch``, ``_mpfunc_common``."""
    return _inside(filename, LIBRARY_DIRS)


def is_project_file(filename: str | Path) -> bool:
    """True for a file of the library, ``examples/`` or ``benchmarks/``."""
    return _inside(filename, PROJECT_DIRS)


def is_library_module(name: str) -> bool:
    """True for a module of the three packages, by its dotted name (``__name__``)."""
    return name.partition(".")[0] in PACKAGES
