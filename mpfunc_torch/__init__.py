"""mpfunc_torch: the PyTorch side of mpfunc (AMP modes, loss scaling, distributed checks)."""

__version__ = "0.1.0"

__all__: list[str] = []
