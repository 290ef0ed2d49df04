"""The loss-scale rule on device scalars, and the checks on a state it is given.

The JAX twin of ``mpfunc_torch.LossScaler.update``: the same rule (`UPDATE_RULE`), the
same float32 arithmetic, so both frameworks follow the same trajectory bit for bit.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from _mpfunc_common.scale_config import (
    FLOAT32_MAX,
    WARM_CLIMB,
    WARM_DOWN,
    WARM_DROP,
    WARM_OFF,
    WARM_START,
    WARM_UP,
    ScaleConfig,
)

__all__ = ["as_transformation", "check_inner_state", "next_scale"]


def as_transformation(tx: Any, name: str = "inner") -> optax.GradientTransformationExtraArgs:
    """``tx`` as an optax transformation with extra-args support.

    Accepts a ``GradientTransformation`` or anything with ``.gradient_transformation()``,
    such as ``optax.MultiSteps``.

    Raises:
      TypeError: naming ``name``, what was expected and what was found.
    """
    if not isinstance(tx, optax.GradientTransformation):
        get = getattr(tx, "gradient_transformation", None)
        if callable(get) and isinstance(out := get(), optax.GradientTransformation):
            tx = out
        else:
            raise TypeError(
                f"`{name}` must be an optax GradientTransformation (e.g. optax.adam(1e-3)) "
                "or have `.gradient_transformation()` (e.g. optax.MultiSteps), got "
                f"{type(tx).__name__}."
            )
    return optax.with_extra_args_support(tx)


def leaf_shapes(tree: Any) -> list:
    return [jnp.shape(x) for x in jax.tree_util.tree_leaves(tree)]


def _short(x: Any, n: int = 400) -> str:
    return s if len(s := str(x)) < n else s[:n] + " ..."


def check_inner_state(inner, state: Any, like: Any) -> None:
    """At trace time (free at run time): the inner state has the structure and shapes
    that ``inner.init`` gives, so a state from another optimizer fails clearly."""
    try:
        expected = jax.eval_shape(inner.init, like)
    except jax.errors.JAXTypeError:  # an init that needs concrete values (it reads
        return                          # them on the host): nothing to compare with
    got = jax.tree_util.tree_structure(state.inner_state)
    want = jax.tree_util.tree_structure(expected)
    shapes, short = leaf_shapes, _short
    if got != want or shapes(state.inner_state) != shapes(expected):
        raise ValueError(
            "`state.inner_state` does not match this transformation's inner optimizer: "
            f"expected {short(want)}, got {short(got)} (with leaf shapes "
            f"{short(shapes(state.inner_state))}, expected {short(shapes(expected))}). Was "
            "the state made by a different optimizer, or for different params? Create it "
            "with this transformation's `init`."
        )


def check_updates_fit(updates: Any, params: Any) -> None:
    """At trace time, after the inner update failed: gradients with other leaf shapes
    than ``params`` are named as such (jax's own error is a broadcasting failure)."""
    if params is None:
        return
    got, want = jax.tree_util.tree_structure(updates), jax.tree_util.tree_structure(params)
    if got != want or leaf_shapes(updates) != leaf_shapes(params):
        raise ValueError(
            "`updates` (the gradients) must have the structure and leaf shapes of `params`: "
            f"got shapes {_short(leaf_shapes(updates))}, params have "
            f"{_short(leaf_shapes(params))}.")


def next_scale(cfg: ScaleConfig, state: Any, finite: jax.Array):
    """One step of the update rule (`UPDATE_RULE`), without branching in Python.

    A restored state's trackers are clamped into their ranges first (a scale into
    ``[min_scale, max_scale]``, NaN to ``min_scale``; ``growth_tracker`` into
    ``[0, growth_interval - 1]``; ``hysteresis_left`` into ``[0, hysteresis]``). States
    this transformation made are always in range, so this never changes their trajectory.
    Returns ``(loss_scale, growth_tracker, hysteresis_left, warm_phase)``: the phase is
    None for a state without one (it runs the plain rule), 0 where ``cfg`` has no warm
    start.
    """
    f32, i32 = jnp.float32, jnp.int32
    hi = cfg.max_scale if np.isfinite(cfg.max_scale) else FLOAT32_MAX
    scale = jnp.clip(state.loss_scale, f32(cfg.min_scale), f32(hi))
    scale = jnp.where(jnp.isnan(state.loss_scale), f32(cfg.min_scale), scale)
    tracker = jnp.clip(state.growth_tracker, 0, cfg.growth_interval - 1)
    hyst = jnp.clip(state.hysteresis_left, 0, cfg.hysteresis)
    # Overflow branch.
    hyst_after = jnp.maximum(hyst - 1, 0)
    backed = jnp.maximum(scale * f32(cfg.backoff_factor), f32(cfg.min_scale))
    over_scale = jnp.where(hyst_after == 0, backed, scale)
    # Clean branch.
    tracker = tracker + 1
    grow = tracker == cfg.growth_interval
    grown = jnp.minimum(scale * f32(cfg.growth_factor), f32(cfg.max_scale))
    clean_scale = jnp.where(grow & jnp.isfinite(grown), grown, scale)
    clean_tracker = jnp.where(grow, 0, tracker)
    clean_hyst = jnp.where(grow, i32(cfg.hysteresis), hyst)
    new_scale = jnp.where(finite, clean_scale, over_scale)
    new_tracker = jnp.where(finite, clean_tracker, 0).astype(i32)
    new_hyst = jnp.where(finite, clean_hyst, hyst_after).astype(i32)
    if state.warm_phase is None:
        return new_scale, new_tracker, new_hyst, None
    if not cfg.warm_start:
        return new_scale, new_tracker, new_hyst, jnp.zeros((), i32)
    # The warm start (`UPDATE_RULE`); a phase out of range counts as done.
    phase = jnp.asarray(state.warm_phase, i32)
    phase = jnp.where((phase < WARM_OFF) | (phase > WARM_UP), WARM_OFF, phase)
    phase = jnp.where((phase == WARM_START) & finite, WARM_OFF, phase)
    climbed = jnp.minimum(scale * f32(WARM_CLIMB), f32(hi))
    dropped = jnp.maximum(scale * f32(WARM_DROP), f32(cfg.min_scale))
    back = jnp.maximum(scale * f32(1 / WARM_CLIMB), f32(cfg.min_scale))
    warm_scale = jnp.where(finite, climbed, jnp.where(phase == WARM_UP, back, dropped))
    warm_phase = jnp.where(
        finite, jnp.where(scale < f32(hi), WARM_UP, WARM_OFF),
        jnp.where(phase == WARM_UP, WARM_OFF, WARM_DOWN)).astype(i32)
    warm = phase != WARM_OFF
    return (
        jnp.where(warm, warm_scale, new_scale),
        jnp.where(warm, 0, new_tracker).astype(i32),
        jnp.where(warm, i32(cfg.hysteresis), new_hyst).astype(i32),
        jnp.where(warm, warm_phase, WARM_OFF).astype(i32),
    )
