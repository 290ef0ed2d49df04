"""Loss scaling as optax gradient transformations, with mesh-wide finite checks."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from _mpfunc_common.scale_config import UPDATE_RULE, ScaleConfig, resolve_scale_config

__all__ = [
    "LossScaleState",
    "all_finite",
    "dynamic_scale",
    "static_scale",
    "no_scale",
    "chain",
    "loss_scale",
    "scale_loss",
    "scale_metrics",
]

AxisName = Hashable | Sequence[Hashable] | None

_INT32_MAX = 2**31 - 1


class LossScaleState(NamedTuple):
    """State of `dynamic_scale`, `static_scale` and `no_scale`.

    Hyperparameters are not stored here: they live in the transformation, so they survive
    any ``jit``, ``tree_map`` or checkpoint round trip of this state untouched.

    Attributes:
      loss_scale: float32 scalar, the current scale.
      growth_tracker: int32, clean steps since the scale last changed (saturating).
      hysteresis_left: int32, overflows still absorbed before the scale backs off.
      skipped_steps: int32, total number of skipped (non-finite) steps (saturating).
      last_finite: bool, whether the most recent step's gradients were all finite.
      inner_state: the wrapped transformation's state (``optax.EmptyState()`` if none).
    """

    loss_scale: jax.Array
    growth_tracker: jax.Array
    hysteresis_left: jax.Array
    skipped_steps: jax.Array
    last_finite: jax.Array
    inner_state: Any


def _is_float(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray) and jnp.issubdtype(x.dtype, jnp.floating)


def _nonfinite_count(tree: Any) -> jax.Array:
    """Number of floating leaves of ``tree`` holding at least one inf or NaN (int32)."""
    flags = [
        jnp.any(~jnp.isfinite(x)).astype(jnp.int32)
        for x in jax.tree_util.tree_leaves(tree)
        if _is_float(x)
    ]
    if not flags:
        return jnp.zeros((), jnp.int32)
    return sum(flags[1:], flags[0])


def _varying_axes(x) -> frozenset | None:
    """Mesh axes over which ``x`` varies, per shard_map's type system, if it says.

    jax 0.10+ reports them as ``typeof(x).manual_axis_type.varying``, earlier versions
    as ``typeof(x).vma``; outside shard_map, or with ``check_vma=False``, the set is
    empty. Adapted here, in one place.
    """
    try:
        t = jax.typeof(x)
    except Exception:  # pragma: no cover - very old jax
        return None
    m = getattr(t, "manual_axis_type", None)
    if m is not None:
        return frozenset(m.varying)
    v = getattr(t, "vma", None)
    return frozenset(v) if v is not None else None


def _psum_over(count: jax.Array, axis_name: AxisName) -> jax.Array:
    """Sums ``count`` over ``axis_name`` so that every shard holds the same total.

    Under shard_map's varying-axes typing (``check_vma=True``, the default) the sum runs
    over the axes ``count`` varies over; over the others it is already the same on every
    shard (and jax rejects a psum there). Without that typing (``check_vma=False``,
    ``pmap``) it runs over every named axis.
    """
    axes = tuple(axis_name) if isinstance(axis_name, tuple | list) else (axis_name,)
    varying = _varying_axes(count)
    if varying:
        sum_axes = tuple(a for a in axes if a in varying)
        return jax.lax.psum(count, sum_axes) if sum_axes else count
    try:
        return jax.lax.psum(count, axes)
    except ValueError:
        # Typed as invariant over every axis: identical on all shards already.
        return count


def all_finite(tree: Any, axis_name: AxisName = None) -> jax.Array:
    """Whether every floating leaf of ``tree`` is finite, as one boolean device scalar.

    Non-floating leaves are ignored. With ``axis_name`` (a mesh axis name or a tuple of
    them), the per-shard count of non-finite leaves is ``psum``-med over those axes, so
    every shard under ``shard_map`` (or ``pmap``) gets the same answer. Under plain
    ``jit`` with sharded arrays no ``axis_name`` is needed: the reduction is already
    global.

    Args:
      tree: a pytree of arrays, e.g. gradients.
      axis_name: mesh axes to reduce over, or None.

    Returns:
      A bool scalar, identical on every shard of ``axis_name``.

    Examples:
      >>> import jax.numpy as jnp
      >>> bool(all_finite({"a": jnp.ones(2), "b": jnp.array([1.0, jnp.inf])}))
      False
    """
    count = _nonfinite_count(tree)
    if axis_name is not None:
        count = _psum_over(count, axis_name)
    return count == 0


def _unscale(tree: Any, inv_scale: jax.Array | None) -> Any:
    """Float32 copies of the floating leaves, multiplied by ``inv_scale`` (if given)."""

    def f(x):
        if not _is_float(x):
            return x
        x = x.astype(jnp.float32)
        return x if inv_scale is None else x * inv_scale

    return jax.tree_util.tree_map(f, tree)


def _cast_like(tree: Any, like: Any) -> Any:
    if jax.tree_util.tree_structure(tree) != jax.tree_util.tree_structure(like):
        return tree
    return jax.tree_util.tree_map(
        lambda x, ref: x.astype(ref.dtype) if _is_float(x) and x.dtype != ref.dtype else x,
        tree,
        like,
    )


def _select(pred: jax.Array, on_true: Any, on_false: Any) -> Any:
    # A select, never a multiply by a mask: 0 * inf would be nan.
    return jax.tree_util.tree_map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


def _keep_dtypes(new_state: Any, old_state: Any) -> Any:
    """``new_state`` cast leaf by leaf to ``old_state``'s dtypes.

    Keeps the inner state's dtypes fixed from init: an inner optimizer whose state was
    made from half params would otherwise drift to float32 under the float32 gradients
    it is given, retracing the step and mismatching the skip's branches.
    """
    return jax.tree_util.tree_map(
        lambda a, b: a.astype(b.dtype) if hasattr(a, "dtype") and a.dtype != b.dtype else a,
        new_state, old_state,
    )


def _zeros_like(tree: Any) -> Any:
    return jax.tree_util.tree_map(
        lambda x: jnp.zeros_like(x) if isinstance(x, jax.Array | np.ndarray) else x, tree
    )


def _next_scale(cfg: ScaleConfig, state: LossScaleState, finite: jax.Array):
    """One step of the update rule (`UPDATE_RULE`), without branching in Python."""
    f32 = jnp.float32
    scale = state.loss_scale
    # Overflow branch.
    hyst_after = jnp.maximum(state.hysteresis_left - 1, 0)
    backed = jnp.maximum(scale * f32(cfg.backoff_factor), f32(cfg.min_scale))
    over_scale = jnp.where(hyst_after == 0, backed, scale)
    # Clean branch.
    tracker = jnp.minimum(state.growth_tracker, _INT32_MAX - 1) + 1
    grow = tracker == cfg.growth_interval
    grown = jnp.minimum(scale * f32(cfg.growth_factor), f32(cfg.max_scale))
    clean_scale = jnp.where(grow & jnp.isfinite(grown), grown, scale)
    clean_tracker = jnp.where(grow, 0, tracker)
    clean_hyst = jnp.where(grow, jnp.int32(cfg.hysteresis), state.hysteresis_left)
    return (
        jnp.where(finite, clean_scale, over_scale),
        jnp.where(finite, clean_tracker, 0).astype(jnp.int32),
        jnp.where(finite, clean_hyst, hyst_after).astype(jnp.int32),
    )


def _scale_transform(
    inner: optax.GradientTransformation | None,
    *,
    cfg: ScaleConfig | None,
    static_value: float | None,
    axis_name: AxisName,
    skip_with: str = "select",
) -> optax.GradientTransformationExtraArgs:
    """Shared body of dynamic/static/no scaling; ``cfg=None`` means a fixed scale."""
    if inner is not None:
        if not isinstance(inner, optax.GradientTransformation | optax.GradientTransformationExtraArgs):
            raise TypeError(
                "`inner` must be an optax GradientTransformation (e.g. optax.adam(1e-3)) or "
                f"None, got {type(inner).__name__}."
            )
        inner = optax.with_extra_args_support(inner)
    if skip_with not in ("select", "cond"):
        raise ValueError(f"`skip_with` must be 'select' or 'cond', got {skip_with!r}.")
    initial = cfg.initial_scale if cfg is not None else static_value
    hysteresis = cfg.hysteresis if cfg is not None else 1
    unscale = not (cfg is None and static_value == 1.0)

    def init_fn(params):
        return LossScaleState(
            loss_scale=jnp.asarray(initial, jnp.float32),
            growth_tracker=jnp.zeros((), jnp.int32),
            hysteresis_left=jnp.asarray(hysteresis, jnp.int32),
            skipped_steps=jnp.zeros((), jnp.int32),
            last_finite=jnp.asarray(True),
            inner_state=inner.init(params) if inner is not None else optax.EmptyState(),
        )

    def update_fn(updates, state, params=None, **extra_args):
        if not isinstance(state, LossScaleState):
            raise TypeError(
                f"`state` must be the LossScaleState made by this transform's init, got "
                f"{type(state).__name__}."
            )
        inv = (jnp.float32(1.0) / state.loss_scale) if unscale else None
        grads = _unscale(updates, inv)
        finite = all_finite(grads, axis_name)

        if inner is None:
            # Chain form: never let inf/nan reach a later link; emit zeros instead.
            new_updates = _select(finite, grads, _zeros_like(grads))
            new_inner = state.inner_state
        elif skip_with == "select":
            inner_updates, inner_state = inner.update(
                grads, state.inner_state, params, **extra_args
            )
            inner_state = _keep_dtypes(inner_state, state.inner_state)
            new_updates = _select(finite, inner_updates, _zeros_like(inner_updates))
            new_inner = _select(finite, inner_state, state.inner_state)
        else:
            def apply(_):
                u, s = inner.update(grads, state.inner_state, params, **extra_args)
                return u, _keep_dtypes(s, state.inner_state)

            def skip(_):
                u, _s = jax.eval_shape(apply, None)
                zeros = jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype), u)
                return zeros, state.inner_state

            new_updates, new_inner = jax.lax.cond(finite, apply, skip, None)
        new_updates = _cast_like(new_updates, updates)

        if cfg is not None:
            scale, tracker, hyst = _next_scale(cfg, state, finite)
        else:
            scale, tracker, hyst = state.loss_scale, state.growth_tracker, state.hysteresis_left
        skipped = state.skipped_steps + jnp.where(
            finite | (state.skipped_steps >= _INT32_MAX), 0, 1
        ).astype(jnp.int32)
        return new_updates, LossScaleState(
            loss_scale=scale,
            growth_tracker=tracker,
            hysteresis_left=hyst,
            skipped_steps=skipped,
            last_finite=finite,
            inner_state=new_inner,
        )

    def rewrap(new_inner):
        return _scale_transform(
            new_inner, cfg=cfg, static_value=static_value, axis_name=axis_name,
            skip_with=skip_with,
        )

    # Lets `mpfunc.chain` turn a chain-form link into the wrapper form.
    init_fn._mpfunc_rewrap = rewrap  # type: ignore[attr-defined]
    init_fn._mpfunc_has_inner = inner is not None  # type: ignore[attr-defined]
    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


_DYNAMIC_DOC = """Dynamic loss scaling as an optax transformation.

    The train step multiplies its loss by the current scale (`scale_loss`), so the
    gradients reaching this transformation are scaled. It unscales them in float32,
    checks that every leaf is finite (over ``axis_name`` too), and updates the scale:

    .. code-block:: python

{rule}
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
      the unscaled float32 gradients; on an overflow step the updates are zero and
      ``inner``'s state is returned bit for bit unchanged. This is exactly torch's skipped
      ``optimizer.step()``. Every overflow step is skipped, including one that hysteresis
      absorbs (the scale then stays, but the step is still skipped).
    * Chain form, ``optax.chain(dynamic_scale(), optax.adam(1e-3))``: this link emits the
      unscaled gradients, or zeros on overflow, so no inf/NaN ever reaches a later link or
      the parameters. It cannot stop the later links from updating their own state,
      though: Adam still decays its moments, advances its step count and, through
      momentum, moves the parameters on a "skipped" step. For an exact skip, write
      ``mpfunc.chain(dynamic_scale(), optax.adam(1e-3))`` instead: it is ``optax.chain``
      with the rest of the chain moved inside the scale link (the wrapper form).

    Updates are returned in the dtype of the incoming gradients.

    Args:
      inner: the transformation to run on unscaled gradients (wrapper form), or None
        (chain form).
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

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a `LossScaleState`.

    Raises:
      ValueError: an unknown preset or a hyperparameter out of range (named).

    Examples:
      >>> import jax, jax.numpy as jnp, optax, mpfunc
      >>> params = {{"w": jnp.ones(3)}}
      >>> opt = mpfunc.dynamic_scale(optax.sgd(0.1), growth_interval=2)
      >>> state = opt.init(params)
      >>> loss = lambda p: jnp.sum(p["w"] ** 2)
      >>> grads = jax.grad(lambda p: mpfunc.scale_loss(loss(p), state))(params)
      >>> updates, state = opt.update(grads, state, params)
      >>> params = optax.apply_updates(params, updates)
      >>> float(mpfunc.loss_scale(state)), bool(state.last_finite)
      (65536.0, True)
    """


def dynamic_scale(
    inner: optax.GradientTransformation | None = None,
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
) -> optax.GradientTransformationExtraArgs:
    cfg = resolve_scale_config(
        preset,
        init_scale=init_scale,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval,
        hysteresis=hysteresis,
        min_scale=min_scale,
        max_scale=max_scale,
    )
    return _scale_transform(inner, cfg=cfg, static_value=None, axis_name=axis_name)


dynamic_scale.__doc__ = _DYNAMIC_DOC.format(rule=UPDATE_RULE)


def static_scale(
    scale: float,
    inner: optax.GradientTransformation | None = None,
    *,
    axis_name: AxisName = None,
) -> optax.GradientTransformationExtraArgs:
    """A fixed loss scale. Non-finite steps are still skipped (and counted).

    Same interface and state as `dynamic_scale`; the scale never changes.

    Args:
      scale: the loss scale, finite and > 0.
      inner: the wrapped transformation, or None for the chain form.
      axis_name: mesh axes for the finite check, as in `dynamic_scale`.

    Returns:
      An ``optax.GradientTransformationExtraArgs``.

    Examples:
      >>> import jax.numpy as jnp, optax, mpfunc
      >>> opt = mpfunc.static_scale(128.0, optax.sgd(0.1))
      >>> float(mpfunc.loss_scale(opt.init({"w": jnp.ones(2)})))
      128.0
    """
    import math

    if isinstance(scale, bool) or not isinstance(scale, int | float):
        raise TypeError(f"`scale` must be a real number, got {type(scale).__name__}: {scale!r}.")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"`scale` must be finite and > 0, got {scale!r}.")
    return _scale_transform(inner, cfg=None, static_value=float(scale), axis_name=axis_name)


def no_scale(
    inner: optax.GradientTransformation | None = None,
    *,
    axis_name: AxisName = None,
) -> optax.GradientTransformationExtraArgs:
    """No loss scaling (scale 1), but non-finite steps are still skipped and counted.

    Useful for bf16, whose range needs no scaling, while keeping the same state and
    metrics as the scaled modes.

    Args:
      inner: the wrapped transformation, or None for the chain form.
      axis_name: mesh axes for the finite check, as in `dynamic_scale`.

    Returns:
      An ``optax.GradientTransformationExtraArgs``.

    Examples:
      >>> import jax.numpy as jnp, optax, mpfunc
      >>> opt = mpfunc.no_scale(optax.adam(1e-3))
      >>> float(mpfunc.loss_scale(opt.init({"w": jnp.ones(2)})))
      1.0
    """
    return _scale_transform(inner, cfg=None, static_value=1.0, axis_name=axis_name)


def chain(*links: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """``optax.chain`` that skips exactly when its first link is a loss-scale link.

    ``mpfunc.chain(mpfunc.dynamic_scale(), a, b)`` is
    ``mpfunc.dynamic_scale(optax.chain(a, b))``: the rest of the chain moves inside the
    scale link, so an overflow step leaves every later link's state bit for bit unchanged
    (plain ``optax.chain`` cannot do that; see `dynamic_scale`). Without a leading scale
    link it is plain ``optax.chain``.

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
    for i, link in enumerate(links):
        if hasattr(link.init, "_mpfunc_rewrap") and i > 0:
            raise ValueError(
                f"`links[{i}]` is a loss-scale link; it must come first, or the links "
                "before it see scaled gradients."
            )
    if links and hasattr(links[0].init, "_mpfunc_rewrap"):
        if links[0].init._mpfunc_has_inner:
            raise ValueError(
                "`links[0]` already wraps an inner transformation; pass the rest of the "
                "chain to it, or use the chain form dynamic_scale() as the first link."
            )
        rest = optax.chain(*links[1:]) if len(links) > 1 else optax.identity()
        return links[0].init._mpfunc_rewrap(rest)
    return optax.chain(*links)


def _find_states(opt_state: Any) -> list[LossScaleState]:
    leaves = jax.tree_util.tree_leaves(
        opt_state, is_leaf=lambda x: isinstance(x, LossScaleState)
    )
    return [x for x in leaves if isinstance(x, LossScaleState)]


def _the_state(opt_state: Any) -> LossScaleState:
    found = _find_states(opt_state)
    if len(found) != 1:
        raise ValueError(
            f"`opt_state` must hold exactly one LossScaleState (from dynamic_scale, "
            f"static_scale or no_scale), found {len(found)}."
        )
    return found[0]


def loss_scale(opt_state: Any) -> jax.Array:
    """The current loss scale (float32 device scalar), found anywhere in ``opt_state``.

    Works through nested ``optax.chain`` states, ``optax.inject_hyperparams`` and
    ``optax.MultiSteps``.

    Args:
      opt_state: an optax state tree holding one `LossScaleState`.

    Returns:
      The scale, as a float32 scalar on the device.

    Raises:
      ValueError: ``opt_state`` holds no `LossScaleState`, or more than one.

    Examples:
      >>> import jax.numpy as jnp, optax, mpfunc
      >>> opt = optax.MultiSteps(mpfunc.dynamic_scale(optax.adam(1e-3)), 2)
      >>> float(mpfunc.loss_scale(opt.init({"w": jnp.ones(2)})))
      65536.0
    """
    return _the_state(opt_state).loss_scale


def scale_loss(loss: jax.Array, opt_state: Any) -> jax.Array:
    """``loss`` (cast to float32) multiplied by the current loss scale.

    The product is float32; its gradient flows back into a half-precision loss already
    multiplied by the scale, which is the point of loss scaling.

    Args:
      loss: the loss, any floating dtype.
      opt_state: an optax state tree holding one `LossScaleState`.

    Returns:
      The scaled loss, float32.

    Examples:
      >>> import jax.numpy as jnp, optax, mpfunc
      >>> state = mpfunc.static_scale(4.0, optax.sgd(1.0)).init({"w": jnp.ones(1)})
      >>> float(mpfunc.scale_loss(jnp.float16(1.5), state))
      6.0
    """
    return jnp.asarray(loss).astype(jnp.float32) * loss_scale(opt_state)


def scale_metrics(opt_state: Any) -> dict[str, jax.Array]:
    """Device scalars for logging: ``loss_scale``, ``skipped_steps``, ``last_finite``
    (and ``num_zeros_in_grad`` when the mode logs it).

    Nothing is copied to the host; convert with ``float()``/``int()`` when you log.

    Args:
      opt_state: an optax state tree holding one `LossScaleState`.

    Returns:
      A dict of device scalars.

    Examples:
      >>> import jax.numpy as jnp, optax, mpfunc
      >>> m = mpfunc.scale_metrics(mpfunc.no_scale(optax.sgd(1.0)).init({"w": jnp.ones(1)}))
      >>> sorted(m)
      ['last_finite', 'loss_scale', 'skipped_steps']
    """
    s = _the_state(opt_state)
    out = {
        "loss_scale": s.loss_scale,
        "skipped_steps": s.skipped_steps,
        "last_finite": s.last_finite,
    }
    # `convert_to_amp(..., log_num_zeros_in_grad=True)` adds a zero-count link.
    for leaf in jax.tree_util.tree_leaves(
        s.inner_state, is_leaf=lambda x: hasattr(x, "num_zeros_in_grad")
    ):
        if hasattr(leaf, "num_zeros_in_grad"):
            out["num_zeros_in_grad"] = leaf.num_zeros_in_grad
    return out
