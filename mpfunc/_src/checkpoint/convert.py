"""`convert_checkpoint`: a run's params and optimizer state moved to another mode.

The JAX twin of ``mpfunc_torch.convert_checkpoint``. A JAX state records no mode, so
both setups are named: from a mode with float32 master weights (naive, apex O2; the
masters live in the `MasterWeightsState` inside the optax state) to one without, the
masters become the params; the other way, the float32 params become the masters. The
state of the optimizer you passed to `convert_to_amp` (Adam's moments, its step count)
runs on float32 values in every mode that keeps float32 params or masters, and carries
over as it is.

Modes without float32 masters (mode ``"bf16"`` with ``master_weights`` ``"remainder"``,
``"kahan"`` or ``"stochastic"``, and/or a ``state_dtype``) go through the float32
values: a source's exact values are rebuilt (`_mpfunc_common.rounding`'s
`join_remainder`, `kahan_master`, a stochastic param as it is), its state widened to
float32, and a target's storage derived from them (`split_remainder`,
`kahan_from_master`, round to nearest) with its state rounded to nearest.
"""

from __future__ import annotations

from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax

from _mpfunc_common.scale_config import WARM_OFF, WARM_UP
from mpfunc._src.checkpoint.storage import STORED, applied_steps, store, stored_masters
from mpfunc._src.master_weights import MasterWeightsState
from mpfunc._src.modes import AmpSetup
from mpfunc._src.param_storage import StochasticRoundingState
from mpfunc._src.scale_state import LossScaleState
from mpfunc._src.state_dtype import StateDtypeState, decode_state, encode_state

__all__ = ["convert_checkpoint"]



def convert_checkpoint(params: Any, opt_state: Any, source: Any, target: Any) -> tuple[Any, Any]:
    """``(params, opt_state)`` of ``source``'s setup, converted for ``target``'s.

    From naive or apex O2 to a mode without master weights (torch, bf16, apex O0/O1/O3,
    or a plain optax optimizer), the float32 masters become the params (cast as the
    target stores them). The other way, the params in float32 become the masters. The
    optimizer's own state (Adam's moments and count) carries over; a dynamic loss scale
    carries over into a mode with a dynamic scale (its scale, growth tracker and
    hysteresis brought into the target's range, as a torch resume does; its warm start
    goes on where it was, or counts as done where the source had none), and anywhere
    else the target starts from its own initial state. The links `convert_to_amp` adds
    (``clip_grad``, ``log_num_zeros_in_grad``) start afresh. Nothing passed in changes.

    Mode ``"bf16"`` without float32 masters, to and from any of these (between two
    such setups too), goes through the float32 values:

    * ``master_weights="remainder"``: from a master, the bfloat16 param and int16
      remainder that rebuild it bit for bit (the param rounded to nearest, ties away
      from zero), so training goes on float32 masters' trajectory; back, that master.
    * ``"kahan"``: the param is the master rounded to nearest, the compensation its
      residual (master - param) rounded to bfloat16; back, ``param + compensation``.
    * ``"stochastic"``: the param is the master rounded to nearest (one rounding: half
      the error bound of a stochastic one); the seed is the target's, and the step count
      the random bits go on from is the source's count of applied steps (its storage's
      or state's ``step``, else the largest optax ``count`` in its state, else 0).
      Back, the param's value.
    * ``state_dtype``: the float32 state rounded to nearest (8-bit: quantised to
      nearest), once; back, widened (8-bit codes dequantised).

    Args:
      params: the params of the run, as ``source`` keeps them (``amp.cast_params``'s).
      opt_state: its optimizer state (``source.optimizer.init(...)``, stepped).
      source: the `AmpSetup` the run used, or the plain optax optimizer of a float32
        run without mpfunc.
      target: the `AmpSetup` to go on with (from `convert_to_amp` with the same optax
        optimizer), or a plain optax optimizer (the result is then that optimizer's
        state over float32 params).

    Returns:
      ``(params, opt_state)`` for ``target``.

    Raises:
      TypeError: ``source`` or ``target`` is neither an `AmpSetup` nor an optax
        optimizer.
      ValueError: ``opt_state`` is not ``source``'s (it lacks the masters, storage or
        stored state ``source`` keeps, or ``params`` do not fit it), or the optimizer
        states of the two do not fit (they were built with different optax optimizers).

    Examples:
      >>> import jax.numpy as jnp, optax, mpfunc
      >>> f = lambda p, x: x @ p["w"]
      >>> naive = mpfunc.convert_to_amp(f, optax.sgd(1e-4), mode="naive", initial_scale=1024.0)
      >>> bf16 = mpfunc.convert_to_amp(f, optax.sgd(1e-4), mode="bf16")
      >>> params = naive.cast_params({"w": jnp.ones((2, 2))})
      >>> state = naive.optimizer.init(params)
      >>> grads = {"w": jnp.full((2, 2), 1024.0, jnp.float16)}  # 1, scaled
      >>> updates, state = naive.optimizer.update(grads, state, params)
      >>> params = optax.apply_updates(params, updates)
      >>> p2, s2 = mpfunc.convert_checkpoint(params, state, naive, bf16)
      >>> float(params["w"][0, 0]), float(p2["w"][0, 0])  # the float16 param, its master
      (1.0, 0.9998999834060669)
      >>> rem = mpfunc.convert_to_amp(f, optax.sgd(1e-4), mode="bf16",
      ...                             master_weights="remainder")
      >>> p3, s3 = mpfunc.convert_checkpoint(params, state, naive, rem)
      >>> p3["w"].dtype, int(s3.inner_state.remainders["w"][0, 0])  # bf16 1.0, 16 bits below
      (dtype(bfloat16), -1678)
    """
    truth, user, scale, step = _source(params, opt_state, source)
    if _is_plain(target):
        return truth, user
    if not isinstance(target, AmpSetup):
        raise TypeError("`target` must be an AmpSetup (from mpfunc.convert_to_amp) or an "
                        f"optax optimizer, got {type(target).__name__}.")
    plan = target.plan
    new_params = target.cast_params(truth)
    # The target's structure and first state: every mode's outermost transform is the loss
    # scale (a unit one when AMP is off), so the state is a `LossScaleState`; inside it
    # the masters or their storage (`master_weights`), then `state_dtype`'s.
    fresh = cast(LossScaleState, target.optimizer.init(new_params))
    inner = outer = fresh.inner_state
    if plan.master_storage is not None:
        inner = inner.inner_state
    stored = None
    if plan.state_dtype is not None:
        stored, inner = inner, decode_state(inner.inner_state, inner.scales)
    chained = plan.enabled and bool(plan.log_num_zeros_in_grad or plan.clip_grad)
    user = _fit(user, inner[-1] if chained else inner)
    if chained:
        user = (*inner[:-1], user)
    count = jnp.asarray(step, jnp.uint32)
    if stored is not None and plan.state_dtype is not None:  # rounded to nearest, once
        values, scales = encode_state(user, plan.state_dtype, stored.seed, count, False)
        user = stored._replace(inner_state=values, scales=scales, step=count)
    if plan.master_storage == "float32":
        user = MasterWeightsState(master_params=_copy(truth), inner_state=user)
    elif plan.master_storage is not None:
        new_params, user = store(plan.master_storage, truth, new_params, outer, user, count)
    state = fresh._replace(inner_state=user)
    if (scale is not None and plan.enabled and plan.scale_kind == "dynamic"
            and (c := plan.scale_config) is not None):
        # The warm start goes on where it was; a source without one is past it.
        warm = state.warm_phase
        if warm is not None:
            warm = (jnp.clip(scale.warm_phase, WARM_OFF, WARM_UP).astype(jnp.int32)
                    if scale.warm_phase is not None and c.warm_start
                    else jnp.zeros((), jnp.int32))
        state = state._replace(
            loss_scale=jnp.clip(scale.loss_scale, c.min_scale, c.max_scale).astype(jnp.float32),
            growth_tracker=jnp.minimum(scale.growth_tracker, c.growth_interval - 1),
            hysteresis_left=jnp.minimum(scale.hysteresis_left, c.hysteresis),
            skipped_steps=scale.skipped_steps, consecutive_skips=scale.consecutive_skips,
            last_finite=scale.last_finite, warm_phase=warm)
    return new_params, state


def _is_plain(x: Any) -> bool:
    return not isinstance(x, AmpSetup) and isinstance(x, optax.GradientTransformation)


def _is_float(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray) and jnp.issubdtype(x.dtype, jnp.floating)


def _copy(tree: Any) -> Any:
    """Float32 copies of the floating leaves (own buffers: a step may donate them)."""
    return jax.tree_util.tree_map(
        lambda x: jnp.array(x, jnp.float32, copy=True) if _is_float(x) else x, tree)


def _source(params: Any, opt_state: Any, source: Any) -> tuple[Any, Any, Any, Any]:
    """The float32 truth of the params, the optax optimizer's state (float32), the
    `LossScaleState` if ``source`` scales dynamically (else None), and its count of
    applied steps (see `_steps`)."""
    if _is_plain(source):
        return _copy(params), opt_state, None, applied_steps(opt_state, None)
    if not isinstance(source, AmpSetup):
        raise TypeError("`source` must be an AmpSetup (from mpfunc.convert_to_amp) or an "
                        f"optax optimizer, got {type(source).__name__}.")
    plan = source.plan
    if not isinstance(opt_state, LossScaleState):
        raise ValueError("`opt_state` must be the state of `source.optimizer` (a "
                         f"LossScaleState at its root), got {type(opt_state).__name__}.")
    inner, truth, step = opt_state.inner_state, None, None
    storage = plan.master_storage
    want = MasterWeightsState if storage == "float32" else STORED.get(storage or "")
    if want is not None and not isinstance(inner, want):
        raise ValueError(f"`opt_state` holds no {want.__name__}, but `source` ("
                         f"{plan.describe()}) keeps its masters as {storage!r}: is it this "
                         f"setup's state? Found {type(inner).__name__}.")
    if isinstance(inner, MasterWeightsState):
        truth, inner = _copy(inner.master_params), inner.inner_state
    elif storage in STORED:
        truth = stored_masters(storage, params, inner)
        step = inner.step if isinstance(inner, StochasticRoundingState) else None
        inner = inner.inner_state
    if plan.state_dtype is not None:
        if not isinstance(inner, StateDtypeState):
            raise ValueError("`opt_state` holds no StateDtypeState, but `source` stores its "
                             f"optimizer state in {plan.state_dtype!r}: is it this setup's "
                             f"state? Found {type(inner).__name__}.")
        step = inner.step if step is None else step
        inner = decode_state(inner.inner_state, inner.scales)
    if plan.enabled and (plan.log_num_zeros_in_grad or plan.clip_grad):
        inner = inner[-1]  # the optimizer after the links convert_to_amp chained before it
    dynamic = plan.enabled and plan.scale_kind == "dynamic"
    return truth if truth is not None else _copy(params), inner, (
        opt_state if dynamic else None), applied_steps(inner, step)


def _fit(state: Any, like: Any) -> Any:
    """``state`` checked against ``like`` (the target's fresh optimizer state): the same
    tree and shapes; floating leaves take ``like``'s dtype."""
    if jax.tree_util.tree_structure(state) != jax.tree_util.tree_structure(like):
        raise ValueError(
            "the optimizer state in `opt_state` does not fit `target`'s optimizer (another "
            "tree): build `target` with the same optax optimizer as `source` (a change of "
            f"optimizer needs its own state mapping). Got {jax.tree_util.tree_structure(state)}"
            f", expected {jax.tree_util.tree_structure(like)}.")

    def leaf(path, x, y):
        if hasattr(y, "shape") and np.shape(x) != np.shape(y):
            raise ValueError(f"the optimizer state leaf {jax.tree_util.keystr(path)} has "
                             f"shape {np.shape(x)}; `target`'s has {np.shape(y)}.")
        return jnp.asarray(x, y.dtype) if _is_float(y) and _is_float(x) else x

    return jax.tree_util.tree_map_with_path(leaf, state, like)
