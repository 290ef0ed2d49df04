"""How much of an update rounding cancels when it is added to its stored param: the
``update_cancelled`` column of `mpfunc.precision_report`
(`_mpfunc_common.precision_report.CANCEL_RULE`). The torch twin is
``mpfunc_torch/_src/cancelled_updates.py``.

Also the check that a tree given beside ``params`` (gradients, updates) matches them.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["check_like", "update_counts"]

_F32, _I32 = jnp.float32, jnp.int32


def check_like(tree: Any, params: Any, name: str, what: str) -> None:
    """Raises a ValueError naming ``name`` unless ``tree`` has the structure (paths)
    and leaf shapes of ``params``; ``what`` says what to pass instead."""
    got = jax.tree_util.tree_flatten_with_path(tree)[0]
    want = jax.tree_util.tree_flatten_with_path(params)[0]
    for (gp, g), (pp, p) in zip(got, want):
        if gp != pp or jnp.shape(g) != jnp.shape(p):
            raise ValueError(
                f"`{name}` do not match `params`: leaf "
                f"{jax.tree_util.keystr(gp)} has shape {jnp.shape(g)} where params have "
                f"{jax.tree_util.keystr(pp)} with shape {jnp.shape(p)}. Pass {what}.")
    if len(got) != len(want):
        raise ValueError(f"`{name}` do not match `params`: {len(got)} leaves, params have "
                         f"{len(want)}. Pass {what}.")


def _is_float(x: Any) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def _counts(p: Any, u: Any) -> jax.Array:
    """``(updated, cancelled)`` of one leaf, int32 (`CANCEL_RULE`); ``(-1, 0)`` where
    the param or the update is not floating (no update to speak of)."""
    if not (_is_float(p) and _is_float(u)):
        return jnp.array([-1, 0], _I32)
    p, v = jnp.asarray(p), jnp.asarray(u).astype(_F32)
    new = (p.astype(_F32) + v).astype(p.dtype)
    # Non-zero by its bits, as the report counts zeros: XLA on CPU reads a float32
    # subnormal as 0 in arithmetic.
    nonzero = lax.bitcast_convert_type(jnp.abs(v), _I32) != 0
    cancelled = nonzero & (new == p)
    return jnp.stack([jnp.sum(nonzero, dtype=_I32), jnp.sum(cancelled, dtype=_I32)])


def update_pairs(params: Any, updates: Any, paths: tuple[str, ...]) -> tuple:
    """Per path of ``paths`` (the report's floating gradient leaves, in order), the
    ``(param, update)`` pair, or None where either is not floating (no update to speak
    of). ``params`` and ``updates`` have one structure (`check_like`). Chosen outside
    any ``jit``, where a Python number is not yet a traced float."""
    flat_p = {jax.tree_util.keystr(k): x
              for k, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    flat_u = {jax.tree_util.keystr(k): x
              for k, x in jax.tree_util.tree_flatten_with_path(updates)[0]}
    return tuple((flat_p[k], flat_u[k]) if _is_float(flat_p[k]) and _is_float(flat_u[k])
                 else None for k in paths)


def update_counts(pairs: tuple) -> list:
    """The ``(updated, cancelled)`` int32 pair of each of ``pairs`` (`update_pairs`), as
    a 1-tuple for the report's shard reduction."""
    return [(_counts(*(pair or (None, None))),) for pair in pairs]
