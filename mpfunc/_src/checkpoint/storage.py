"""`convert_checkpoint`'s side of the storages without float32 masters (the torch twin is
``mpfunc_torch/_src/checkpoint/storage.py``): the float32 values a storage's params and
state stand for, the storage that holds given float32 values, and the count of applied
steps a stochastic target's random bits go on from. The bit rules are
`_mpfunc_common.rounding`'s (`split_remainder`, `kahan_from_master`, ...).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mpfunc._src.param_storage import KahanState, RemainderState, StochasticRoundingState
from mpfunc._src.rounding import (
    bf16_from_pattern,
    join_remainder,
    rne_bf16_pattern,
    split_remainder,
)

__all__ = ["STORED", "applied_steps", "stored_masters", "store"]

# The state `mpfunc.master_weights` keeps for each storage without float32 masters.
STORED = {"remainder": RemainderState, "kahan": KahanState,
          "stochastic": StochasticRoundingState}


def _is_float(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray) and jnp.issubdtype(x.dtype, jnp.floating)


def _copy(tree: Any) -> Any:
    """Float32 copies of the floating leaves (own buffers: a step may donate them)."""
    return jax.tree_util.tree_map(
        lambda x: jnp.array(x, jnp.float32, copy=True) if _is_float(x) else x, tree)


def applied_steps(state: Any, step: Any) -> Any:
    """The source's count of applied steps, which a stochastic target's random bits go
    on from: the storage's or `state_dtype`'s own ``step`` where it has one, else the
    largest ``count`` in the optax state (Adam's, a schedule's: each counts the steps
    the optimizer took, skipped ones not), else 0 (SGD keeps none)."""
    if step is not None:
        return step
    counts = [jnp.asarray(c).astype(jnp.uint32).reshape(())
              for _, c in optax.tree_utils.tree_get_all_with_path(state, "count")
              if np.size(c) == 1]
    return jnp.max(jnp.stack(counts)) if counts else jnp.zeros((), jnp.uint32)


def _is_half(x: Any) -> bool:
    return _is_float(x) and jnp.dtype(x.dtype).itemsize == 2


def _flat_beside(params: Any, beside: Any, what: str) -> tuple[list, Any, list]:
    leaves, treedef = jax.tree_util.tree_flatten(params)
    try:
        return leaves, treedef, treedef.flatten_up_to(beside)
    except (ValueError, TypeError) as e:
        raise ValueError(f"`params` do not fit the {what} in `opt_state` (another tree): "
                         f"were they saved together? ({e})") from None


def stored_masters(storage: str, params: Any, state: Any) -> Any:
    """The float32 values a storage's params and state stand for: a remainder's master
    exactly, Kahan's ``param + compensation`` (in float32), a stochastic param as it is."""
    if storage == "stochastic":
        return _copy(params)
    leaves, treedef, beside = _flat_beside(params, state[0], f"{storage} state")
    out = []
    for p, e in zip(leaves, beside):
        if not _is_half(p) or e is None:
            out.append(jnp.array(p, jnp.float32, copy=True) if _is_float(p) else p)
        elif np.shape(e) != np.shape(p):
            raise ValueError(f"`opt_state`'s {storage} of shape {np.shape(e)} sits beside a "
                             f"param of shape {np.shape(p)}: were they saved together?")
        elif storage == "remainder":
            out.append(join_remainder(p, e))
        else:
            out.append(p.astype(jnp.float32) + e.astype(jnp.float32))
    return treedef.unflatten(out)


def store(storage: str, truth: Any, params: Any, fresh: Any, inner: Any,
           step: Any) -> tuple[Any, Any]:
    """(params, storage state) of ``storage`` holding the float32 ``truth``: a
    remainder's split (`split_remainder`: ties away from zero), Kahan's param rounded
    to nearest with the residual rounded beside it, a stochastic param rounded to
    nearest (its seed the target's, its step ``step``); ``params`` is the target's cast
    (their dtypes), ``fresh`` its fresh storage state."""
    if storage == "stochastic":
        return params, fresh._replace(step=step, inner_state=inner)
    leaves, treedef, truths = _flat_beside(params, truth, "masters")
    out, beside = [], []
    for p, m in zip(leaves, truths):
        if not _is_half(p):
            out.append(p)
            beside.append(None)
            continue
        m = jnp.asarray(m, jnp.float32)
        if storage == "remainder":
            hi, lo = split_remainder(m)
            out.append(bf16_from_pattern(hi))
            beside.append(lo)
        elif p.dtype == jnp.bfloat16:
            bits = rne_bf16_pattern(m)
            residual = m - jax.lax.bitcast_convert_type(bits, jnp.float32)
            out.append(bf16_from_pattern(bits))
            beside.append(bf16_from_pattern(rne_bf16_pattern(residual)))
        else:  # a float16 Kahan param: the framework's cast rounds to nearest, ties to even
            half = m.astype(p.dtype)
            out.append(half)
            beside.append((m - half.astype(jnp.float32)).astype(p.dtype))
    return treedef.unflatten(out), type(fresh)(treedef.unflatten(beside), inner)
