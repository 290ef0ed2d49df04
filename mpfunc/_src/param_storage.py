"""Half-precision params without float32 masters: remainder, Kahan and stochastic storage.

`mpfunc.master_weights(inner, storage=...)` builds these (``storage="float32"`` is
`mpfunc._src.master_weights`'s own). Each runs ``inner`` in float32 on the params' exact
values and emits half-precision updates that ``optax.apply_updates`` adds:

* ``"remainder"``: an int16 remainder per bfloat16 param; (param, remainder) *is* the
  float32 master (`_mpfunc_common.rounding.split_remainder`), so the trajectory is
  float32 masters' bit for bit.
* ``"kahan"``: a compensation per param in its own dtype (bfloat16 or float16) keeps
  what each rounding lost (`_mpfunc_common.rounding.kahan_update`).
* ``"stochastic"``: nothing beside the param, which is rounded stochastically with the
  shared counter-based random bits (stream 0, the state's seed and step).

Landing. The update ``d`` is applied by ``optax.apply_updates``, which computes
``(p + d).astype(p.dtype)``; the state is computed against exactly that landed value.
Under JAX's default (standard) dtype promotion ``d`` is float32, ``target - p`` (exact):
``p + d`` is ``target`` and every param lands on its target. Under strict promotion
(``jax_numpy_dtype_promotion="strict"``) apply_updates refuses bf16 + float32, so ``d``
is ``target - p`` rounded to the param's dtype; that lands whenever the step is no larger
than the new value, but a step that carries a param past zero or shrinks it by more than
half may land one rounding (of the step's size) off. Then the remainder saturates (the
master moves to the closest value the landed param can carry, and from there the
trajectory differs from float32 masters'), Kahan's compensation absorbs the difference,
and a stochastic param keeps the landed value (and differs from torch's there).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from _mpfunc_common.storage import check_param_dtype
from mpfunc._src.eager_jit import jit_when_eager
from mpfunc._src.rounding import (
    bf16_from_pattern,
    join_remainder,
    random_bits,
    remainder_against,
    rne_bf16_pattern,
    split_remainder,
    sr_bf16_pattern,
)

__all__ = ["KahanState", "RemainderState", "StochasticRoundingState", "param_storage"]

_F32 = jnp.float32


class RemainderState(NamedTuple):
    """State of `master_weights` with ``storage="remainder"``.

    Attributes:
      remainders: an int16 array per bfloat16 param (None for the other leaves): the
        param and its remainder are the float32 master, bit for bit.
      inner_state: the wrapped transformation's state (float32).
    """

    remainders: Any
    inner_state: Any


class KahanState(NamedTuple):
    """State of `master_weights` with ``storage="kahan"``.

    Attributes:
      compensation: per half-precision param, in its dtype (None for the other leaves):
        what the rounding of the param has not applied yet.
      inner_state: the wrapped transformation's state (float32).
    """

    compensation: Any
    inner_state: Any


class StochasticRoundingState(NamedTuple):
    """State of `master_weights` with ``storage="stochastic"``.

    Attributes:
      seed: uint32, the seed of the random bits (a checkpoint keeps it).
      step: uint32, the applied (not skipped) steps; it wraps modulo 2**32, as the rule
        takes it (a saturating count would reuse one step's bits forever, and bias).
      inner_state: the wrapped transformation's state (float32).
    """

    seed: jax.Array
    step: jax.Array
    inner_state: Any


def _is_float(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray) and jnp.issubdtype(x.dtype, jnp.floating)


def _is_half(x: Any) -> bool:
    return _is_float(x) and jnp.dtype(x.dtype).itemsize == 2


def _check_params(storage: str, params: Any) -> None:
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        if _is_half(x):
            check_param_dtype(storage, x.dtype, f"params{jax.tree_util.keystr(path)}")


def _round(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """float32 -> (its half rounding, nearest; that rounding's float32 value)."""
    if dtype == jnp.bfloat16:
        bits = rne_bf16_pattern(x)
        return bf16_from_pattern(bits), jax.lax.bitcast_convert_type(bits, _F32)
    half = x.astype(dtype)
    return half, half.astype(_F32)


def _neg_zero(d: jax.Array) -> jax.Array:
    # A zero step is -0.0, so a param that does not move keeps every bit (p + -0.0 == p).
    return jnp.where(d == 0, jnp.asarray(-0.0, d.dtype), d)


def _emit(pf, target, dtype, exact: bool):
    """(update to emit, float32 value ``optax.apply_updates`` will land the param on).

    ``exact``: a float32 update ``target - p``, exact in float32 for two halves, which
    apply_updates adds in float32 and rounds to the param's dtype: it lands on
    ``target`` (also when the exponents are far apart: ``p`` is then below the rounding).
    Else the update is that difference rounded to the param's dtype, added by
    apply_updates in the param's dtype: that lands unless the step exceeds the target.
    """
    if exact:
        d = u = target - pf
    else:
        d, u = _round(target - pf, dtype)
    _, landed = _round(pf + u, dtype)
    return _neg_zero(d), landed


def _remainder_step(p, lo, u, exact):
    """New (update, remainder) of a bfloat16 param by a float32 step of its master."""
    pf = p.astype(_F32)
    m_new = join_remainder(p, lo) + u
    hi, _ = split_remainder(m_new)
    d, landed = _emit(pf, jax.lax.bitcast_convert_type(hi, _F32), jnp.bfloat16, exact)
    return d, remainder_against(m_new, jax.lax.bitcast_convert_type(landed, jnp.uint32))


def _kahan_step(p, c, u, exact):
    """New (update, compensation): `_mpfunc_common.rounding.kahan_update`, with the
    compensation taken against the param that lands."""
    pf = p.astype(_F32)
    y = u + c.astype(_F32)
    _, target = _round(pf + y, p.dtype)
    d, landed = _emit(pf, target, p.dtype, exact)
    c_new, _ = _round(y - (landed - pf), p.dtype)
    return d, c_new


def _stochastic_step(p, u, seed, step, exact):
    pf = p.astype(_F32)
    target = sr_bf16_pattern(pf + u, random_bits(seed, 0, step, p.shape))
    return _emit(pf, jax.lax.bitcast_convert_type(target, _F32), jnp.bfloat16, exact)[0]


@functools.partial(jit_when_eager, static_argnums=(2,))
def _masters(leaves: tuple, beside: tuple, storage: str) -> tuple:
    """The exact (float32) values of the half leaves (`param_storage`'s update)."""
    out = []
    for p, e in zip(leaves, beside):
        if not _is_half(p):
            out.append(p)
        elif storage == "remainder":
            out.append(join_remainder(p, e))
        elif storage == "kahan":
            out.append(p.astype(_F32) + e.astype(_F32))
        else:
            out.append(p.astype(_F32))
    return tuple(out)


@functools.partial(jit_when_eager, static_argnums=(3, 6))
def _steps(leaves: tuple, inner_updates: tuple, beside: tuple, storage: str, seed: jax.Array,
           step: jax.Array, exact: bool) -> tuple[tuple, tuple]:
    """(updates to emit, new remainders / compensation) of every leaf."""
    out, new_beside = [], []
    for p, u, e in zip(leaves, inner_updates, beside):
        if not _is_half(p):
            out.append(u.astype(p.dtype) if _is_float(p) else u)
            new_beside.append(e)
            continue
        u = u.astype(_F32)
        if storage == "remainder":
            d, e = _remainder_step(p, e, u, exact)
        elif storage == "kahan":
            d, e = _kahan_step(p, e, u, exact)
        else:
            d = _stochastic_step(p, u, seed, step, exact)
        out.append(d)
        new_beside.append(e)
    return tuple(out), tuple(new_beside)


def param_storage(inner: optax.GradientTransformationExtraArgs, storage: str,
                  seed: int) -> optax.GradientTransformationExtraArgs:
    """`master_weights` for ``storage`` "remainder", "kahan" or "stochastic" (checked
    by the caller); ``inner`` already an extra-args transformation. The work on the
    leaves around ``inner`` is two jitted functions of the whole tree (called eagerly:
    two compiles, not one per op and leaf)."""

    def init_fn(params):
        _check_params(storage, params)
        masters = jax.tree_util.tree_map(
            lambda x: x.astype(_F32) if _is_float(x) else x, params)
        inner_state = inner.init(masters)
        if storage == "stochastic":
            return StochasticRoundingState(seed=jnp.asarray(seed, jnp.uint32),
                                           step=jnp.zeros((), jnp.uint32),
                                           inner_state=inner_state)
        dtype = jnp.int16 if storage == "remainder" else None
        beside = jax.tree_util.tree_map(
            lambda x: jnp.zeros_like(x, dtype=dtype) if _is_half(x) else None, params)
        if storage == "remainder":
            return RemainderState(remainders=beside, inner_state=inner_state)
        return KahanState(compensation=beside, inner_state=inner_state)

    def update_fn(updates, state, params=None, **extra_args):
        if params is None:
            raise ValueError(f"`params` is required by master_weights(storage={storage!r})"
                             ".update: the params and the state together hold the exact "
                             "values.")
        _check_params(storage, params)
        leaves, treedef = jax.tree_util.tree_flatten(params)
        if storage == "stochastic":
            beside: list[Any] = [None] * len(leaves)
        else:
            beside = treedef.flatten_up_to(state[0])
        arrays = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array | np.ndarray)]
        masters = list(leaves)  # (non-array leaves, static to jit, pass as they are)
        for i, m in zip(arrays, _masters(tuple(leaves[i] for i in arrays),
                                         tuple(beside[i] for i in arrays), storage)):
            masters[i] = m
        grads = jax.tree_util.tree_map(lambda g: g.astype(_F32) if _is_float(g) else g,
                                       updates)
        inner_updates, inner_state = inner.update(
            grads, state.inner_state, treedef.unflatten(masters), **extra_args)
        # float32 updates land every param exactly; strict promotion refuses to add them
        # to half params, so there they are in the param's dtype (see the module doc).
        exact = (jax.config.jax_numpy_dtype_promotion  # pyright: ignore[reportAttributeAccessIssue]  # jax sets its options as attributes at run time
                 != "strict")
        inner_leaves = treedef.flatten_up_to(inner_updates)
        seed_, step_ = ((state.seed, state.step) if storage == "stochastic"
                        else (jnp.zeros((), jnp.uint32), jnp.zeros((), jnp.uint32)))
        out, new_beside = list(inner_leaves), list(beside)
        done = _steps(tuple(leaves[i] for i in arrays), tuple(inner_leaves[i] for i in arrays),
                      tuple(beside[i] for i in arrays), storage, seed_, step_, exact)
        for i, d, e in zip(arrays, *done):
            out[i], new_beside[i] = d, e
        updates = treedef.unflatten(out)
        if storage == "stochastic":
            return updates, StochasticRoundingState(
                seed=state.seed, step=state.step + jnp.uint32(1), inner_state=inner_state)
        return updates, type(state)(treedef.unflatten(new_beside), inner_state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
