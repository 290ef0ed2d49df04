"""Loss scaling as optax gradient transformations, with mesh-wide finite checks."""

from __future__ import annotations

from typing import Any, cast

import jax
import jax.numpy as jnp
import optax

from _mpfunc_common.amp_config import check_bool
from _mpfunc_common.scale_config import (
    FLOAT32_MAX,
    FLOAT32_MIN_NORMAL,
    WARM_START,
    ScaleConfig,
    as_python_number,
    resolve_scale_config,
    to_float32,
)
from mpfunc._src.distributed import AxisName, _is_float, check_axis_name, finite_and_flags
from mpfunc._src.exact_skip import cond_skip_update, neg_zeros_like, skip_update
from mpfunc._src.precision_report import skip_record, skip_record_init
from mpfunc._src.scale_rule import (
    as_transformation,
    check_inner_state,
    check_updates_fit,
    leaf_shapes,
    next_scale,
)
from mpfunc._src.scale_state import LossScaleState, ScaledValueAndGrad, _unscale

__all__ = [
    "as_transformation",
    "chain",
    "dynamic_scale",
    "no_scale",
    "static_scale",
]

_INT32_MAX = 2**31 - 1


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
