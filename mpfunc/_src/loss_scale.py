"""Loss scaling as optax gradient transformations, with mesh-wide finite checks."""

from __future__ import annotations

from typing import Any

import optax

from _mpfunc_common.scale_config import (
    FLOAT32_MAX,
    FLOAT32_MIN_NORMAL,
    as_python_number,
    resolve_scale_config,
    to_float32,
)
from mpfunc._src.distributed import AxisName
from mpfunc._src.scale_rule import (
    as_transformation,
)
from mpfunc._src.scale_transform import _scale_transform

__all__ = [
    "as_transformation",
    "chain",
    "dynamic_scale",
    "no_scale",
    "static_scale",
]

def dynamic_scale(
    inner: Any = None,
    *,
    preset: str = "torch",
    init_scale: float | None = None,
    growth_factor: float | None = None,
    backoff_factor: float | None = None,
    growth_interval: int | None = None,
    hysteresis: int | None = None,
    min_scale: float | None = None,
    max_scale: float | None = None,
    axis_name: AxisName = None,
    record_skip_leaves: bool = False,
    warm_start: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """Dynamic loss scaling as an optax transformation.

    The train step multiplies its loss by the current scale (`scale_loss`), so the
    gradients reaching this transformation are scaled. It unscales them in float32,
    checks that every leaf is finite (over ``axis_name`` too), and updates the scale:

    .. code-block:: python

        # once per optimizer step; finite = every gradient leaf is finite (on every shard)
        if warm_phase == START and finite:               # warm_start=True only; a
            warm_phase = OFF                             # good initial scale is kept
        if warm_phase != OFF:                            # the warm start
            growth_tracker, hysteresis_left = 0, hysteresis
            top = min(max_scale, FLOAT32_MAX)
            if finite and loss_scale == top:             # nothing above to look for
                warm_phase = OFF
            elif finite:                                 # climb, x4 per finite step
                loss_scale = min(loss_scale * 4, top)
                warm_phase = UP
            elif warm_phase == UP:                       # the climb's first overflow:
                loss_scale = max(loss_scale / 4, min_scale)   # the last finite scale
                warm_phase = OFF                         # (or top / 4)
            else:                                        # no finite step yet
                loss_scale = max(loss_scale * 2**-16, min_scale)
                warm_phase = DOWN
        elif not finite:                                 # the step is skipped
            growth_tracker = 0
            hysteresis_left = max(hysteresis_left - 1, 0)
            if hysteresis_left == 0:
                loss_scale = max(loss_scale * backoff_factor, min_scale)
        else:
            growth_tracker += 1
            if growth_tracker == growth_interval:
                growth_tracker = 0
                hysteresis_left = hysteresis              # refills only when the scale grows
                grown = min(loss_scale * growth_factor, max_scale)
                if isfinite(grown):
                    loss_scale = grown

    All arithmetic is float32: every hyperparameter is rounded to float32 once, at
    construction (a value that does not survive that rounding is a ValueError), and each
    product is rounded to the nearest float32. With power-of-two factors every product
    is exact, which is why the presets reproduce their anchors bit for bit. The initial
    scale is min(init_scale, max_scale), as apex does. min_scale defaults to 1.0 and is
    at least 2**-126 (the smallest normal float32), so the scale is never 0, subnormal,
    inf or NaN; GradScaler and apex have no floor and follow the same trajectory as
    long as theirs stays >= 1.

    warm_phase starts at START with warm_start=True (naive mode's default) and at OFF
    otherwise, where the rule is exactly Megatron's / GradScaler's. The warm start costs
    at most 3 skipped steps from 2**32 down to any overflow threshold >= 1, and settles
    within 2x below the scale the plain rule settles at (both on the powers of two from
    the initial scale; within 4x otherwise).

    Presets (explicit arguments override them):

    ========  ==========  ======  =======  ========  ==========  =====  =========
    preset    init_scale  growth  backoff  interval  hysteresis  min    max
    ========  ==========  ======  =======  ========  ==========  =====  =========
    torch     2**16       2.0     0.5      2000      1           1      inf
    apex      2**16       2.0     0.5      2000      1           1      2**24
    naive     2**32       2.0     0.5      1000      2           1      2**32
    jmp       2**15       2.0     0.5      2000      1           1      inf
    ========  ==========  ======  =======  ========  ==========  =====  =========

    ``torch`` reproduces ``torch.amp.GradScaler``, ``apex`` apex's dynamic
    ``LossScaler``, ``naive`` Megatron-LM's / Colossal-AI's ``DynamicGradScaler``
    (with Colossal's naive-AMP defaults) and ``jmp`` ``jmp.DynamicLossScale``, bit for
    bit, given the same overflows. GradScaler and apex have no floor; ours is 1.0 by
    default, so their trajectories are reproduced exactly as long as theirs stays >= 1.

    **Two forms, and which one skips exactly.**

    * Wrapper form, ``dynamic_scale(optax.adam(1e-3))``: on a finite step ``inner`` runs on
      the unscaled float32 gradients; on an overflow step the updates are ``-0.0`` (so
      ``optax.apply_updates`` leaves every parameter bit alone, ``-0.0`` included) and
      ``inner``'s state is returned bit for bit unchanged. This is exactly torch's
      skipped ``optimizer.step()``. Every overflow step is skipped, including one that
      hysteresis absorbs. The skip costs no copy of the optimizer state under buffer
      donation (the select is fused where ``inner`` writes each state leaf).
    * Chain form, ``optax.chain(dynamic_scale(), optax.adam(1e-3))``: this link emits the
      unscaled gradients, or ``-0.0`` on overflow, so no inf/NaN ever reaches a later
      link or the parameters. It cannot stop the later links from updating their own
      state, though: Adam still decays its moments, advances its step count and, through
      momentum, moves the parameters on a "skipped" step. For an exact skip, write
      ``mpfunc.chain(dynamic_scale(), optax.adam(1e-3))`` instead: it is ``optax.chain``
      with the rest of the chain moved inside the scale link (the wrapper form).

    ``update`` takes the scaled gradients of ``scale_loss(loss, state)``, or the
    `ScaledValueAndGrad` that `mpfunc.value_and_grad` returns (already unscaled).
    Updates are returned in the dtype of the incoming gradients. A state restored from
    another configuration has its trackers clamped into this one's ranges; a state from
    another inner optimizer is a ``ValueError`` when ``update`` is traced.

    Args:
      inner: the transformation to run on unscaled gradients (wrapper form): an optax
        ``GradientTransformation`` or an ``optax.MultiSteps``; or None (chain form).
      preset: ``"torch"`` (default), ``"apex"``, ``"naive"`` or ``"jmp"``.
      init_scale: initial scale (clamped to ``max_scale``).
      growth_factor: factor applied after ``growth_interval`` clean steps; > 1.
      backoff_factor: factor applied on overflow; in (0, 1).
      growth_interval: clean steps between growths; >= 1.
      hysteresis: overflows absorbed before backing off; >= 1 (1 = back off at once).
      min_scale: floor of the scale, >= 2**-126 (default 1.0). Below 1, unscaling
        multiplies by more than 1; the finite check runs after unscaling, so an
        overflow it creates is still caught.
      max_scale: ceiling of the scale (inf = none).
      axis_name: mesh axis name(s) over which the finite check is ``psum``-med, for use
        inside ``shard_map``/``pmap``. Not needed under plain ``jit``.
      record_skip_leaves: keep, in the state, which gradient leaves held an inf or NaN
        at the last skipped step, for ``scale_metrics(state, skip_leaves=params)``. Off
        by default: the finite check then reduces up to 16 alike leaves at once (one
        compiled kernel each on XLA:CPU); the record needs one reduction per leaf.
      warm_start: search for the scale at the start (``warm_phase`` above; naive
        mode's default, no preset's): from 2**32 at most 3 skipped steps, settling
        within 2x below where the plain rule settles. A finite first step ends it.

    Hyperparameters may be Python numbers or concrete NumPy/JAX scalars
    (``jnp.float32(2.**15)``, ``growth_interval=5.``), as jmp users write them; each is
    rounded to float32 once.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a `LossScaleState`.

    Raises:
      ValueError: an unknown preset or a hyperparameter out of range (named).
      TypeError: a hyperparameter, ``inner`` or ``axis_name`` of the wrong type.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, mpfunc
      >>> params = {"w": jnp.ones(3)}
      >>> opt = mpfunc.dynamic_scale(optax.sgd(0.1), growth_interval=2)
      >>> state = opt.init(params)
      >>> loss = lambda p: jnp.sum(p["w"] ** 2)
      >>> grads = jax.grad(lambda p: mpfunc.scale_loss(loss(p), state))(params)
      >>> updates, state = opt.update(grads, state, params)
      >>> params = optax.apply_updates(params, updates)
      >>> float(mpfunc.loss_scale(state)), bool(state.last_finite)
      (65536.0, True)
    """
    cfg = resolve_scale_config(
        preset, init_scale=init_scale, growth_factor=growth_factor,
        backoff_factor=backoff_factor, growth_interval=growth_interval,
        hysteresis=hysteresis, min_scale=min_scale, max_scale=max_scale,
        warm_start=warm_start)
    return _scale_transform(inner, cfg=cfg, static_value=None, axis_name=axis_name,
                            record_skip_leaves=record_skip_leaves)


def static_scale(
    scale: float,
    inner: Any = None,
    *,
    axis_name: AxisName = None,
    record_skip_leaves: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """A fixed loss scale. Non-finite steps are still skipped (and counted).

    Same interface and state as `dynamic_scale`; the scale never changes.

    Args:
      scale: the loss scale: a Python number or a concrete NumPy/JAX scalar, rounded to
        float32; it must be a normal float32 (in [2**-126, 3.4e38]).
      inner: the wrapped transformation, or None for the chain form.
      axis_name: mesh axes for the finite check, as in `dynamic_scale`.
      record_skip_leaves: keep the skip record, as in `dynamic_scale`.

    Returns:
      An ``optax.GradientTransformationExtraArgs``.

    Raises:
      TypeError: ``scale`` is not a real number.
      ValueError: ``scale`` is out of range once rounded to float32.

    Examples:
      >>> import jax.numpy as jnp, optax, mpfunc
      >>> opt = mpfunc.static_scale(128.0, optax.sgd(0.1))
      >>> float(mpfunc.loss_scale(opt.init({"w": jnp.ones(2)})))
      128.0
    """
    given = as_python_number("scale", scale)
    value = to_float32(given)
    if not FLOAT32_MIN_NORMAL <= value <= FLOAT32_MAX:
        shown = f"{given!r}" + (f" (float32: {value!r})" if value != given else "")
        raise ValueError(f"`scale` must be in [2**-126, 3.4e38] (a normal float32), got "
                         f"{shown}.")
    return _scale_transform(inner, cfg=None, static_value=value, axis_name=axis_name,
                            record_skip_leaves=record_skip_leaves)


def no_scale(
    inner: Any = None,
    *,
    axis_name: AxisName = None,
    record_skip_leaves: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """No loss scaling (scale 1), but non-finite steps are still skipped and counted.

    Useful for bf16, whose range needs no scaling, while keeping the same state and
    metrics as the scaled modes.

    Args:
      inner: the wrapped transformation, or None for the chain form.
      axis_name: mesh axes for the finite check, as in `dynamic_scale`.
      record_skip_leaves: keep the skip record, as in `dynamic_scale`.

    Returns:
      An ``optax.GradientTransformationExtraArgs``.

    Examples:
      >>> import jax.numpy as jnp, optax, mpfunc
      >>> opt = mpfunc.no_scale(optax.adam(1e-3))
      >>> float(mpfunc.loss_scale(opt.init({"w": jnp.ones(2)})))
      1.0
    """
    return _scale_transform(inner, cfg=None, static_value=1.0, axis_name=axis_name,
                            record_skip_leaves=record_skip_leaves)


def chain(*links: Any) -> optax.GradientTransformationExtraArgs:
    """``optax.chain`` that skips exactly when its first link is a loss-scale link.

    ``mpfunc.chain(mpfunc.dynamic_scale(), a, b)`` is
    ``mpfunc.dynamic_scale(optax.chain(a, b))``: the rest of the chain moves inside the
    scale link, so an overflow step leaves every later link's state bit for bit unchanged
    (plain ``optax.chain`` cannot do that; see `dynamic_scale`). Without a leading scale
    link it is plain ``optax.chain``. Links may be ``optax.MultiSteps`` too.

    Args:
      *links: optax transformations.

    Returns:
      An ``optax.GradientTransformationExtraArgs``.

    Raises:
      ValueError: a scale link appears anywhere but first (the links before it would see
        scaled gradients), or the leading scale link already wraps an inner transform.

    Examples:
      >>> import optax, mpfunc
      >>> opt = mpfunc.chain(mpfunc.dynamic_scale(), optax.clip_by_global_norm(1.0),
      ...                    optax.adam(1e-3))
    """
    links = tuple(as_transformation(link, f"links[{i}]") for i, link in enumerate(links))
    for i, link in enumerate(links):
        if hasattr(link.init, "_mpfunc_rewrap") and i > 0:
            raise ValueError(
                f"`links[{i}]` is a loss-scale link; it must come first, or the links "
                "before it see scaled gradients."
            )
    rewrap = getattr(links[0].init, "_mpfunc_rewrap", None) if links else None
    if rewrap is not None:
        if getattr(links[0].init, "_mpfunc_has_inner", False):
            raise ValueError(
                "`links[0]` already wraps an inner transformation; pass the rest of the "
                "chain to it, or use the chain form dynamic_scale() as the first link."
            )
        rest = optax.chain(*links[1:]) if len(links) > 1 else optax.identity()
        return rewrap(rest)
    return optax.chain(*links)
