"""An exact skip of an optax update that costs no extra copy of the optimizer state.

``skip_update(inner, finite, grads, state, params)`` returns ``inner``'s update and new
state when ``finite`` is true, and ``(-0.0 updates, state)`` bit for bit when it is false,
for any optax transformation ``inner``.

Why not ``where(finite, new_state, state)`` after ``inner.update``? With buffer donation
that keeps the old and the new state alive together. Adam's ``mu_new`` feeds both the
new state and the update. Selecting on the state only, XLA writes the selected ``mu``
in place. Then the fusion that computes the update must still read the *old* ``mu``,
to recompute ``mu_new`` from it, and XLA copies every state buffer to keep it (seen in
the optimised HLO as one ``copy`` per state leaf; 1.9x plain Adam's peak).

Here the select moves to where ``inner`` produces each new state value. ``inner.update``
is traced to a jaxpr, and every value that becomes a state leaf is replaced, right
after the op that makes it, by ``where(finite, value, old_leaf)``. Every later op
that reads it, the update included, reads the selected value. On a finite step that
is the same value bit for bit (``where(True, a, b)`` is ``a``). On a skipped step the
state leaves are the old ones by construction, and the updates, which may then be
anything, are replaced by ``-0.0`` (``p + -0.0 == p`` bitwise for every ``p``,
``-0.0`` included). XLA can then write each state leaf in place and compute the update
from the written value, as it does for plain Adam.

The rewrite is only an optimisation. Every state leaf is selected whatever happens, so
the skip is exact for any ``inner``: a value that cannot be redirected (a state leaf
that is also an input, a literal, a dtype that ``inner`` changes, one value feeding
two state leaves, or a program with side effects) is selected at the output instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.core
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Literal

# Calls in INLINE have their body evaluated inline, so the select reaches the ops inside.
from mpfunc._src.rewrite import INLINE, bind_with_subprograms, eval_eqns

__all__ = ["cond_skip_update", "neg_zeros_like", "skip_update"]


def _is_array(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray | np.generic)


def _is_number(x: Any) -> bool:
    """A Python number: a constant an optax state may hold (e.g. ``{"count": 0}``)."""
    return isinstance(x, bool | int | float | complex)


def neg_zeros_like(x: Any) -> Any:
    """``-0.0`` of ``x``'s shape and dtype for floating arrays, ``0`` for other arrays.

    Adding ``-0.0`` leaves every float bit pattern alone (``-0.0 + -0.0 == -0.0``), where
    adding ``+0.0`` turns a ``-0.0`` parameter into ``+0.0``.
    """
    if not _is_array(x):
        return x
    # lax.full_like keeps an explicit sharding, and costs one op to trace.
    return jax.lax.full_like(x, -0.0 if jnp.issubdtype(x.dtype, jnp.inexact) else 0)


def _select(finite: jax.Array, new: Any, old: Any) -> Any:
    if _is_number(old):
        # Selected as an array, as ``jit`` would give it back: a Python value cannot be
        # chosen by a device flag without reading that flag on the host.
        old = jnp.asarray(old)
    elif not _is_array(old):
        return new
    new = jnp.asarray(new)
    if new.dtype != old.dtype:
        new = new.astype(old.dtype)
    # A scalar predicate: broadcasting it would give it a sharding of its own, which
    # under explicit mesh axes must then equal the leaf's (a ShardingTypeError).
    return jax.lax.select_n(jnp.asarray(finite, bool), old, new)


def _redirects(jaxpr, targets: dict[int, Any]) -> dict[Any, Any]:
    """The values of ``jaxpr`` to select where they are produced: ``{var: old leaf}``.

    ``targets`` maps output positions to the old state leaf each must equal on a skip.
    A value qualifies if an op of this jaxpr produces it (not an input, constant or
    literal), it has its old leaf's shape and dtype, and no other target claims it.
    """
    produced = {v for eqn in jaxpr.eqns for v in eqn.outvars}
    claims: dict[Any, list] = {}
    for k, old in targets.items():
        v = jaxpr.outvars[k]
        if not isinstance(v, Literal):
            claims.setdefault(v, []).append(old)
    out = {}
    for v, olds in claims.items():
        old = olds[0]
        if (len(olds) == 1 and v in produced and _is_array(old)
                and tuple(v.aval.shape) == tuple(jnp.shape(old))
                and v.aval.dtype == old.dtype):
            out[v] = old
    return out


def _eval(jaxpr, consts, args, finite, targets: dict[int, Any]) -> list:
    """Evaluates ``jaxpr``; every output in ``targets`` comes back as
    ``where(finite, value, old)``, selected where it is produced when possible."""
    redirect = _redirects(jaxpr, targets)

    def apply(eqn, invals):
        inner = {k: redirect[v] for k, v in enumerate(eqn.outvars) if v in redirect}
        prim, params = eqn.primitive, dict(eqn.params)
        if inner and prim.name in INLINE and hasattr(params.get("jaxpr"), "jaxpr"):
            cj = params["jaxpr"]
            return _eval(cj.jaxpr, cj.consts, invals, finite, inner)
        outs = bind_with_subprograms(prim, invals, params)
        if not prim.multiple_results:
            outs = [outs]
        return [_select(finite, o, inner[k]) if k in inner else o for k, o in enumerate(outs)]

    outs = eval_eqns(jaxpr, consts, args, apply)
    # An output may be a Literal (a constant the state holds), which is not hashable.
    return [o if k not in targets or (not isinstance(jaxpr.outvars[k], Literal)
                                      and jaxpr.outvars[k] in redirect)
            else _select(finite, o, targets[k]) for k, o in enumerate(outs)]


def _check_structure(new_state: Any, state: Any) -> None:
    new_tree = jax.tree_util.tree_structure(new_state)
    old_tree = jax.tree_util.tree_structure(state)
    if new_tree != old_tree:
        raise TypeError(
            "the wrapped transformation's `update` returned a state whose structure "
            f"differs from the state it was given:\n  given:    {old_tree}\n  returned: "
            f"{new_tree}\nAn exact skip needs the same structure on both paths."
        )


def skip_update(
    update_fn: Callable,
    finite: jax.Array,
    grads: Any,
    state: Any,
    params: Any,
    extra_args: dict,
    *,
    fused: bool = True,
) -> tuple[Any, Any]:
    """``update_fn(grads, state, params, **extra_args)`` if ``finite``, else an exact skip.

    Args:
      update_fn: an optax ``update`` (with extra-args support).
      finite: a bool scalar.
      grads, state, params, extra_args: its arguments.
      fused: select where each state leaf is produced (see the module docstring); False
        selects on the outputs only (the reference implementation).

    Returns:
      ``(updates, new_state)``. On a skip the updates are ``-0.0`` (in the dtype
      ``update_fn`` gives them) and the state is ``state``, leaf for leaf. The new state
      has ``state``'s dtypes.

    Raises:
      TypeError: ``update_fn`` returns a state whose tree structure differs from
        ``state``'s.
    """
    if not fused:
        updates, new_state = update_fn(grads, state, params, **extra_args)
        _check_structure(new_state, state)
        return (jax.tree_util.tree_map(lambda u: _select(finite, u, neg_zeros_like(u)), updates),
                jax.tree_util.tree_map(lambda n, o: _select(finite, n, o), new_state, state))
    leaves, treedef = jax.tree_util.tree_flatten((grads, state, params, extra_args))
    dyn_idx = [i for i, x in enumerate(leaves) if _is_array(x) or isinstance(x, jax.core.Tracer)]

    def flat_fn(*dyn):
        full = list(leaves)
        for i, x in zip(dyn_idx, dyn):
            full[i] = x
        g, s, p, kw = jax.tree_util.tree_unflatten(treedef, full)
        return update_fn(g, s, p, **kw)

    dyn = [leaves[i] for i in dyn_idx]
    closed, (upd_shape, state_shape) = jax.make_jaxpr(flat_fn, return_shape=True)(*dyn)
    _check_structure(state_shape, state)
    old_leaves, state_tree = jax.tree_util.tree_flatten(state)
    n_upd = len(jax.tree_util.tree_leaves(upd_shape))
    targets = {n_upd + i: old for i, old in enumerate(old_leaves)}
    if closed.effects:  # side effects (callbacks) run once, as written
        outs = jax.tree_util.tree_leaves(flat_fn(*dyn))
        outs = [_select(finite, o, targets[k]) if k in targets else o
                for k, o in enumerate(outs)]
    else:
        outs = _eval(closed.jaxpr, closed.consts, dyn, finite, targets)
    upd_leaves = [
        jax.lax.select_n(jnp.asarray(finite, bool), neg_zeros_like(u), u)
        if _is_array(u) else u
        for u in outs[:n_upd]
    ]
    updates = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(upd_shape), upd_leaves)
    return updates, jax.tree_util.tree_unflatten(state_tree, outs[n_upd:])


def cond_skip_update(
    update_fn: Callable, finite: jax.Array, grads: Any, state: Any, params: Any, extra_args: dict
) -> tuple[Any, Any]:
    """The same contract as `skip_update`, with ``lax.cond`` (kept for the benchmarks)."""

    def apply(_):
        u, s = update_fn(grads, state, params, **extra_args)
        _check_structure(s, state)
        return u, jax.tree_util.tree_map(
            lambda a, b: a.astype(b.dtype) if _is_array(b) and a.dtype != b.dtype else a,
            s, state)

    def skip(_):
        u, _s = jax.eval_shape(apply, None)
        return jax.tree_util.tree_map(
            lambda a: neg_zeros_like(jnp.zeros(a.shape, a.dtype)), u), state

    return jax.lax.cond(finite, apply, skip, None)
