"""Sphinx configuration for the mpfunc documentation (Sphinx + MyST, the furo theme).

The API reference pages (api/mpfunc.md, api/mpfunc_torch.md) are written here, at every
build, from each package's ``__all__``: a name added to ``__all__`` gets its entry
without anyone editing a page, and one removed loses it.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

project = "mpfunc"
author = "mpfunc developers"
copyright = "2026, mpfunc developers"  # noqa: A001 - Sphinx's name
from _mpfunc_common.version import __version__  # noqa: E402 - ROOT is on sys.path now

release = version = __version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build", "README.md"]
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3
html_theme = "furo"
html_title = "mpfunc"
html_static_path = []
templates_path = []
napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"members": False}
pygments_style = "default"
# The docstrings' single backticks name code (`dynamic_scale`); show them as code.
default_role = "code"

API_PAGES = {
    "mpfunc": "The JAX package: policies, autocast, loss scaling as optax transforms, "
              "master weights, flax policies, fp8 and the AMP modes.",
    "mpfunc_torch": "The PyTorch package: `convert_to_amp` and its modes, the wrapped "
                    "optimizer, fp8, checkpoints and scale-out helpers.",
    "mpfunc_torch.lightning": "The Lightning precision plugin (the `lightning` extra); see "
                              "[Lightning and HF Trainer](../trainers.md).",
    "mpfunc_torch.transformers": "HuggingFace's Trainer in any mode (the `hf` extra); see "
                                 "[Lightning and HF Trainer](../trainers.md).",
}


def api_entries(module_name: str) -> list[tuple[str, str]]:
    """``(name, autodoc directive)`` for every name in the module's ``__all__``."""
    module = importlib.import_module(module_name)
    out = []
    for name in module.__all__:
        obj = getattr(module, name)
        if inspect.isclass(obj):
            directive = "autoclass"
        elif callable(obj):
            directive = "autofunction"
        else:
            directive = "autodata"
        out.append((name, directive))
    return out


def shared_with_jax(module_name: str, name: str) -> str | None:
    """"class"/"function" when ``module_name.name`` is the very object ``mpfunc.name``
    is (the shared configs and recipes), else None."""
    if module_name == "mpfunc":
        return None
    import mpfunc

    obj = getattr(importlib.import_module(module_name), name)
    if getattr(mpfunc, name, None) is obj:
        return "class" if inspect.isclass(obj) else "function"
    return None


def write_api_pages(app=None) -> None:
    api = HERE / "api"
    api.mkdir(exist_ok=True)
    for module_name, blurb in API_PAGES.items():
        lines = [f"# `{module_name}`", "", blurb, "",
                 f"Every name in `{module_name}.__all__`, from its docstring.", ""]
        for name, directive in api_entries(module_name):
            lines += [f"## {name}", ""]
            shared = shared_with_jax(module_name, name)
            if shared:  # one object, documented (and indexed) once, under mpfunc
                lines += [f"The same {shared} as {{py:obj}}`mpfunc.{name}` (one shared "
                          "definition for both frameworks).", ""]
            lines += ["```{eval-rst}"]
            if shared:
                # Its own target and inventory entry, so that `mpfunc_torch.<name>`
                # links here too; the autodoc entry below only shows it (indexing it
                # would register its `_mpfunc_common` name a second time).
                lines += [f".. py:{shared}:: {module_name}.{name}", "   :no-typesetting:", ""]
            lines += [f".. {directive}:: {module_name}.{name}"]
            lines += ["   :no-index:"] * bool(shared) + ["```", ""]
        text = "\n".join(lines)
        page = api / f"{module_name}.md"
        if not page.exists() or page.read_text() != text:  # unchanged: no rebuild
            page.write_text(text)


def setup(app):
    write_api_pages()
    return {"parallel_read_safe": True}
