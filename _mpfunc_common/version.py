"""The distribution's version: the one place it is written.

``mpfunc.__version__``, ``mpfunc_torch.__version__``, the wheel's metadata (pyproject's
``dynamic = ["version"]`` reads this attribute) and the docs' ``release`` all read it.
Versions follow Semantic Versioning; what counts as a breaking change is in
docs/releases.md.
"""

__version__ = "0.1.0"
