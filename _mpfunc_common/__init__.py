"""Pure-Python pieces shared by `mpfunc` (JAX) and `mpfunc_torch` (PyTorch).

Private: neither framework is imported here, so both packages can use these tables and
rules without importing each other's framework.
"""
