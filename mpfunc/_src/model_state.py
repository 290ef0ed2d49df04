"""Mutable model state in `mpfunc.convert_to_amp`: which leaves are state, and its casts.

Batch statistics, caches and fp8 metadata are not params: the modes keep them float32
into and out of ``amp.apply_fn``, so their updates are computed at float32 precision
(a float16 running mean of 1.0001 reads 1.0, and one momentum-0.9 update of a zero
batch then gives 0.8999 instead of 0.90009). State is:

* every collection but ``"params"`` of a flax Linen variables dict
  (``{"params": ..., "batch_stats": ...}``) anywhere in the arguments, and what
  ``apply(..., mutable=[...])`` returns as its second value;
* every ``flax.nnx.Variable`` that is not an ``nnx.Param`` (``nnx.BatchStat``,
  ``nnx.Cache``, ...), e.g. in the state ``nnx.split`` returns.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mpfunc._src.policy import Policy

__all__ = ["amp_io", "map_leaves"]

_F32 = np.dtype(jnp.float32)


def _is_nnx_state(x: Any) -> bool:
    nnx = sys.modules.get("flax.nnx")  # an NNX variable means flax.nnx is imported
    return (nnx is not None and isinstance(x, nnx.Variable)
            and not isinstance(x, nnx.Param))


def _is_variables(x: Any) -> bool:
    return (isinstance(x, Mapping) and "params" in x
            and all(isinstance(v, Mapping) for v in x.values()))


def _key(entry: Any) -> Any:
    return getattr(entry, "key", getattr(entry, "name", getattr(entry, "idx", entry)))


def _state_flags(tree: Any) -> list[bool]:
    """For each leaf of ``tree``, in `jax.tree_util.tree_leaves` order: is it state?"""
    flags: list[bool] = []
    nodes = jax.tree_util.tree_leaves(
        tree, is_leaf=lambda x: _is_nnx_state(x) or _is_variables(x))
    for node in nodes:
        if _is_nnx_state(node):
            flags += [True] * len(jax.tree_util.tree_leaves(node))
        elif _is_variables(node):
            flags += [_key(path[0]) != "params"
                      for path, _ in jax.tree_util.tree_flatten_with_path(node)[0]]
        else:
            flags.append(False)
    return flags


def map_leaves(tree: Any, fn: Callable[[tuple, Any, bool], Any]) -> Any:
    """``tree`` with each leaf replaced by ``fn(path, leaf, is_state)``."""
    pairs, treedef = jax.tree_util.tree_flatten_with_path(tree)
    flags = _state_flags(tree)
    return treedef.unflatten([fn(p, x, s) for (p, x), s in zip(pairs, flags)])


def _is_floating(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray) and jnp.issubdtype(x.dtype, jnp.floating)


def _cast(tree: Any, dtype: Any) -> Any:
    """State leaves in float32, other floating leaves in ``dtype`` (None: as they are)."""
    def f(path, x, state):
        del path
        want = _F32 if state else dtype
        if want is None or not _is_floating(x) or x.dtype == want:
            return x
        return x.astype(want)

    return map_leaves(tree, f)


def amp_io(policy: Policy, cast_inputs: bool) -> tuple[Callable, Callable]:
    """``(cast_in, cast_out)`` for a mode's ``apply_fn``.

    ``cast_in(params, args, kwargs)``: state in float32 everywhere; with
    ``cast_inputs``, the other floating leaves of ``args`` / ``kwargs`` in the compute
    dtype. ``cast_out(out, kwargs)``: the output in the policy's output dtype, state in
    float32 (with flax's ``mutable=``, all of the returned collections).
    """
    compute = policy.compute_dtype if cast_inputs else None

    def cast_in(params, args, kwargs):
        return _cast(params, None), *_cast((args, kwargs), compute)

    def cast_out(out, kwargs):
        if kwargs.get("mutable") and isinstance(out, tuple) and len(out) == 2:
            y, updated = out
            return _cast(y, policy.output_dtype), _cast(updated, _F32)
        return _cast(out, policy.output_dtype)

    return cast_in, cast_out
