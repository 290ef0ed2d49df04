"""Private implementation; import from `mpfunc_torch`."""
