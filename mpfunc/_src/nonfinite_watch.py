"""Forward attribution for flax: which module's output first went non-finite.

`watch_nonfinite` records, for every flax module call in a forward, a device flag (one
reduction of its output): Linen modules through flax's method interception
(``flax.linen.intercept_methods``), NNX modules (which have no interceptor) by wrapping
their classes' ``__call__`` for the duration, as ``flax.nnx.capture`` does for its
``method_outputs``. The flags come out as a `NamedFlags` pytree, to return from the
traced function and pass to `mpfunc.precision_report`. The torch twin is
``mpfunc_torch/_src/nonfinite_watch.py``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from _mpfunc_common.extras import require_extra
from mpfunc._src.eager_jit import jit_when_eager
from mpfunc._src.precision_report import NamedFlags

__all__ = ["NonfiniteWatch", "watch_nonfinite"]


@jit_when_eager
def _any_nonfinite(xs: tuple) -> jax.Array:
    """Whether any of the arrays ``xs`` holds an inf or NaN: one program per output
    signature where a forward runs eagerly (not one per op and shape)."""
    flags = [jnp.logical_not(jnp.all(jnp.isfinite(x))) for x in xs]
    return flags[0] if len(flags) == 1 else jnp.any(jnp.stack(flags))


def _flag(out: Any) -> jax.Array | None:
    """Whether any floating array in ``out`` holds an inf or NaN (None if it has none)."""
    xs = tuple(x for x in jax.tree_util.tree_leaves(out)
               if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.floating))
    return _any_nonfinite(xs) if xs else None


def _trace_state():
    from jax.extend.core import get_opaque_trace_state

    return get_opaque_trace_state()


class NonfiniteWatch:
    """The context manager `watch_nonfinite` returns; `flags` holds what it recorded."""

    def __init__(self, nnx_modules: tuple):
        self._nnx = nnx_modules
        self._names: list[str] = []
        self._flags: list[jax.Array] = []
        self._exits: list = []

    def _record(self, name: str, out: Any) -> None:
        if _trace_state() != self._trace:  # inside a lifted transform (scan, remat):
            return                          # its values cannot leave it
        flag = _flag(out)
        if flag is not None:
            self._names.append(name)
            self._flags.append(flag)

    @property
    def flags(self) -> NamedFlags:
        """One flag per recorded module call, in the order the calls returned (a
        `NamedFlags`; names are Linen ``module.path`` / NNX attribute paths joined by
        ``/``, the root ``"(root)"``, and a method other than ``__call__`` appended
        after a ``.``)."""
        flags = jnp.stack(self._flags) if self._flags else jnp.zeros((0,), jnp.bool_)
        return NamedFlags(flags, tuple(self._names))

    def __enter__(self) -> NonfiniteWatch:
        require_extra("mpfunc.watch_nonfinite", "flax", ("flax",))
        import flax.linen as nn

        self._trace = _trace_state()
        self._names, self._flags = [], []
        linen = nn.intercept_methods(self._linen_interceptor)
        linen.__enter__()
        self._exits.append(lambda: linen.__exit__(None, None, None))
        if self._nnx:
            self._exits.append(self._wrap_nnx())
        return self

    def __exit__(self, *exc) -> None:
        while self._exits:
            self._exits.pop()()

    def _linen_interceptor(self, next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        if context.method_name != "setup":
            path = "/".join(context.module.path) or "(root)"
            method = "" if context.method_name == "__call__" else "." + context.method_name
            self._record(path + method, out)
        return out

    def _wrap_nnx(self):
        from flax import nnx

        names: dict[int, str] = {}
        for model in self._nnx:
            if not isinstance(model, nnx.Module):
                raise TypeError("`watch_nonfinite` takes flax NNX modules (Linen modules are "
                                "watched without being named), got "
                                f"{type(model).__name__}.")
            for path, m in nnx.iter_modules(model):
                names.setdefault(id(m), "/".join(map(str, path)) or "(root)")
        classes = {type(m) for model in self._nnx for _, m in nnx.iter_modules(model)}
        # Originals first: a subclass's wrapper must call the original, not a wrapper.
        originals = {c: (c.__dict__.get("__call__"), c.__call__) for c in classes}
        active: set[int] = set()

        def wrap(call) -> Callable[..., Any]:  # becomes a class's __call__
            @functools.wraps(call)
            def wrapper(module, *args, **kwargs):
                key = id(module)
                if key not in names or key in active:  # not watched, or a super() call
                    return call(module, *args, **kwargs)
                active.add(key)
                try:
                    out = call(module, *args, **kwargs)
                finally:
                    active.discard(key)
                self._record(names[key], out)
                return out

            return wrapper

        for c, (_, resolved) in originals.items():
            c.__call__ = wrap(resolved)

        def restore():
            for c, (own, _) in originals.items():
                if own is None:
                    del c.__call__
                else:
                    c.__call__ = own

        return restore


def watch_nonfinite(*nnx_modules: Any) -> NonfiniteWatch:
    """Records, in a flax forward, which modules' outputs went non-finite.

    A context manager. Inside it every flax Linen module method call (through
    ``flax.linen.intercept_methods``) and every ``__call__`` of the NNX modules given
    (and their submodules) records one device flag: whether a floating array in its
    output holds an inf or NaN (one reduction per output, no host sync). Opt-in: nothing
    is watched outside it. Enter it inside the traced function (the loss under
    ``jax.grad`` / ``nnx.grad``, where NNX modules are the transform's copies) and
    return ``watch.flags`` from it (e.g. as ``has_aux``); then
    ``mpfunc.precision_report(grads, forward=flags)`` gives
    ``report.first_nonfinite_module``: the first module, in the order the calls
    returned (a layer before the block holding it), whose output held an inf or NaN.
    Calls inside flax's lifted transforms (``nn.scan``, ``nn.remat``) are not recorded.
    The NNX classes' ``__call__`` are wrapped while the context is open, for every
    thread.

    Args:
      *nnx_modules: NNX modules to watch (none for Linen only).

    Returns:
      A `NonfiniteWatch` (use it in a ``with`` statement).

    Raises:
      TypeError: an argument that is not an NNX module (on entering).
      ModuleNotFoundError: flax is not installed.

    Examples:
      >>> import jax, jax.numpy as jnp, flax.linen as nn, mpfunc
      >>> model = nn.Sequential([nn.Dense(2), nn.Dense(1)])
      >>> x = jnp.ones((1, 2))
      >>> variables = model.init(jax.random.key(0), x)
      >>> variables["params"]["layers_1"]["kernel"] = jnp.full((2, 1), jnp.inf)
      >>> with mpfunc.watch_nonfinite() as watch:
      ...     _ = model.apply(variables, x)
      >>> watch.flags.first_set()
      'layers_1'
    """
    return NonfiniteWatch(nnx_modules)
