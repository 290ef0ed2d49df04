"""The loss-scale transformation itself: one optax transform for every kind of scale.

`_scale_transform` is what `dynamic_scale`, `static_scale`, `no_scale` (``loss_scale``)
and `convert_to_amp` (``modes``) build: it unscales (or takes `value_and_grad`'s
already unscaled gradients), checks them finite over the mesh, steps the inner
transformation or skips it exactly, and advances the scale (``scale_rule``).
"""

from __future__ import annotations

from typing import Any, cast

import jax
import jax.numpy as jnp
import optax

from _mpfunc_common.amp_config import check_bool
from _mpfunc_common.scale_config import (
    FLOAT32_MAX,
    WARM_START,
    ScaleConfig,
)
from mpfunc._src.distributed import AxisName, _is_float, check_axis_name, finite_and_flags
from mpfunc._src.exact_skip import cond_skip_update, neg_zeros_like, skip_update
from mpfunc._src.master_weights import MasterWeightsState
from mpfunc._src.param_storage import KahanState, RemainderState, StochasticRoundingState
from mpfunc._src.scale_rule import (
    as_transformation,
    check_inner_state,
    check_updates_fit,
    leaf_shapes,
    next_scale,
)
from mpfunc._src.scale_state import LossScaleState, ScaledValueAndGrad, _unscale
from mpfunc._src.skip_record import skip_record, skip_record_init

__all__ = ["_scale_transform"]

_INT32_MAX = 2**31 - 1


_STORAGE_STATES = (MasterWeightsState, RemainderState, KahanState, StochasticRoundingState)


def _holds_a_storage(inner_state: Any) -> bool:
    """Whether ``inner_state`` has `master_weights`' state in it (float32 masters,
    remainder, kahan, stochastic). Its float32 updates land every param exactly (see
    `mpfunc.master_weights`); rounded to the param's dtype, a large step may land one
    rounding off (a remainder then saturates), so they are passed on as they are."""
    return any(isinstance(x, _STORAGE_STATES) for x in jax.tree_util.tree_leaves(
        inner_state, is_leaf=lambda x: isinstance(x, _STORAGE_STATES)))


def _cast_like(tree: Any, like: Any) -> Any:
    if jax.tree_util.tree_structure(tree) != jax.tree_util.tree_structure(like):
        return tree
    return jax.tree_util.tree_map(
        lambda x, ref: x.astype(ref.dtype) if _is_float(x) and x.dtype != ref.dtype else x,
        tree,
        like,
    )


def _scale_transform(
    inner: Any,
    *,
    cfg: ScaleConfig | None,
    static_value: float | None,
    axis_name: AxisName,
    skip_with: str = "fused",
    record_skip_leaves: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """Shared body of dynamic/static/no scaling; ``cfg=None`` means a fixed scale.

    ``skip_with`` picks how a wrapper-form skip is built: ``"fused"`` (the default; see
    `mpfunc._src.exact_skip`), ``"select"`` (a select on the outputs) or ``"cond"``
    (``lax.cond``). All three give bit-identical results; the benchmarks compare their
    memory and compile time. ``record_skip_leaves``: see `dynamic_scale`.
    """
    if inner is not None:
        inner = as_transformation(inner)
    axis_name = check_axis_name(axis_name)
    if skip_with not in ("fused", "select", "cond"):
        raise ValueError(f"`skip_with` must be 'fused', 'select' or 'cond', got {skip_with!r}.")
    check_bool("record_skip_leaves", record_skip_leaves)
    initial = cfg.initial_scale if cfg is not None else static_value
    hysteresis = cfg.hysteresis if cfg is not None else 1
    unscale = not (cfg is None and static_value == 1.0)
    # At a scale >= 1 unscaling multiplies by at most 1: it can neither make a finite
    # gradient non-finite nor the reverse. Below 1 it can overflow, so the check must
    # see the unscaled values (as torch's GradScaler does; mpfunc_torch does the same).
    below_one = (cfg.may_go_below_one if cfg is not None
                 else static_value is not None and static_value < 1.0)

    def init_fn(params):
        # One array per leaf: leaves sharing a buffer cannot all be donated to a step.
        return LossScaleState(
            loss_scale=jnp.asarray(initial, jnp.float32),
            growth_tracker=jnp.zeros((), jnp.int32),
            hysteresis_left=jnp.asarray(hysteresis, jnp.int32),
            skipped_steps=jnp.zeros((), jnp.int32),
            consecutive_skips=jnp.zeros((), jnp.int32),
            last_finite=jnp.asarray(True),
            inner_state=inner.init(params) if inner is not None else optax.EmptyState(),
            skip_leaves=skip_record_init(params) if record_skip_leaves else None,
            warm_phase=(jnp.asarray(WARM_START, jnp.int32)
                        if cfg is not None and cfg.warm_start else None),
        )

    def update_fn(updates, state, params=None, **extra_args):
        if not isinstance(state, LossScaleState):
            raise TypeError(
                f"`state` must be the LossScaleState made by this transform's init, got "
                f"{type(state).__name__}."
            )
        if isinstance(updates, ScaledValueAndGrad):  # from mpfunc.value_and_grad
            grads = checked = _unscale(updates.grads, None)
            like = params if params is not None else updates.grads
        else:
            inv = (jnp.float32(1.0) / state.loss_scale) if unscale else None
            grads, like = _unscale(updates, inv), updates
            # The check reads the gradients as they came where it gives the same answer,
            # so that it does not need the unscaled ones materialised for it.
            checked = grads if below_one else updates
        finite, leaf_flags = finite_and_flags(checked, axis_name, exact=record_skip_leaves)
        if checked is updates and unscale:
            # That holds at a scale >= 1 only: a state restored from a config that went
            # below 1 (or holding 0 or NaN) skips this step, and the next scale is in range.
            finite = finite & (state.loss_scale >= 1) & (state.loss_scale <= FLOAT32_MAX)

        if inner is None:
            # Chain form: never let inf/nan reach a later link; emit -0.0 instead.
            new_updates = jax.tree_util.tree_map(
                lambda g: jnp.where(finite, g, neg_zeros_like(g)) if _is_float(g) else g, grads)
            new_inner = state.inner_state
        else:
            # A state from another optimizer (or for other params) fails inside `inner`,
            # or comes back reshaped; only then is it compared with `inner.init`'s, so a
            # good state costs no trace of `inner.init`.
            try:
                if skip_with == "cond":
                    new_updates, new_inner = cond_skip_update(
                        inner.update, finite, grads, state.inner_state, params, extra_args)
                else:
                    new_updates, new_inner = skip_update(
                        inner.update, finite, grads, state.inner_state, params, extra_args,
                        fused=skip_with == "fused")
            except Exception:
                check_inner_state(inner, state, params if params is not None else grads)
                check_updates_fit(grads, params)
                raise
            if leaf_shapes(new_inner) != leaf_shapes(state.inner_state):
                check_inner_state(inner, state, params if params is not None else grads)
        if not _holds_a_storage(state.inner_state):
            new_updates = _cast_like(new_updates, like)

        if cfg is not None:
            scale, tracker, hyst, warm = next_scale(cfg, state, finite)
        else:
            scale, tracker, hyst = jnp.float32(static_value), jnp.int32(0), jnp.int32(1)
            warm = None if state.warm_phase is None else jnp.zeros((), jnp.int32)
        skipped = jnp.maximum(state.skipped_steps, 0)
        in_a_row = jnp.clip(state.consecutive_skips, 0, _INT32_MAX - 1)
        return new_updates, LossScaleState(
            loss_scale=scale,
            growth_tracker=tracker,
            hysteresis_left=hyst,
            skipped_steps=skipped + jnp.where(finite | (skipped == _INT32_MAX), 0, 1),
            consecutive_skips=jnp.where(finite, 0, in_a_row + 1),
            last_finite=finite,
            inner_state=new_inner,
            skip_leaves=(skip_record(state.skip_leaves, leaf_flags, finite)
                         if record_skip_leaves else state.skip_leaves),
            warm_phase=warm,
        )

    def rewrap(new_inner):
        return _scale_transform(
            new_inner, cfg=cfg, static_value=static_value, axis_name=axis_name,
            skip_with=skip_with, record_skip_leaves=record_skip_leaves,
        )

    # Lets `mpfunc.chain` turn a chain-form link into the wrapper form.
    init_fn._mpfunc_rewrap = rewrap
    init_fn._mpfunc_has_inner = inner is not None
    # optax types a state as a chex `ArrayTree`, which leaves out None (an empty pytree
    # node, which optax handles): this state holds None where a feature is off.
    return optax.GradientTransformationExtraArgs(
        cast(optax.TransformInitFn, init_fn), cast(optax.TransformUpdateExtraArgsFn, update_fn))
