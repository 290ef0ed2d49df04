"""The equations of a traced function, sub-programs included (for dtype checks)."""

import jax


def all_eqns(fn, *args):
    """Every equation of ``jax.make_jaxpr(fn)(*args)``, in order, with those of its
    sub-programs (``custom_vjp`` bodies, ``scan``/``cond`` branches, nested ``jit``)."""
    out = []

    def walk(jaxpr):
        for e in jaxpr.eqns:
            out.append(e)
            for p in e.params.values():
                for sub in p if isinstance(p, tuple) else (p,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return out
