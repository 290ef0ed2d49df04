"""Private implementation; import from `mpfunc`."""
