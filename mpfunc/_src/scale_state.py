"""Using the loss-scale state in a train step: scale the loss, read metrics, and a
flax-style ``value_and_grad``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.core
import jax.numpy as jnp

from mpfunc._src.distributed import AxisName, _is_float, all_finite, check_axis_name
from mpfunc._src.skip_record import skip_paths

__all__ = [
    "LossScaleState",
    "ScaledValueAndGrad",
    "loss_scale",
    "scale_loss",
    "scale_metrics",
    "value_and_grad",
]


class LossScaleState(NamedTuple):
    """State of `dynamic_scale`, `static_scale` and `no_scale`.

    Hyperparameters are not stored here: they live in the transformation, so they survive
    any ``jit``, ``tree_map`` or checkpoint round trip of this state untouched.

    Attributes:
      loss_scale: float32 scalar, the current scale.
      growth_tracker: int32, clean steps since the scale last changed.
      hysteresis_left: int32, overflows still absorbed before the scale backs off.
      skipped_steps: int32, total number of skipped (non-finite) steps (saturating).
      consecutive_skips: int32, skipped steps in a row, 0 after a finite step
        (saturating); optax's ``notfinite_count``.
      last_finite: bool, whether the most recent step's gradients were all finite.
      inner_state: the wrapped transformation's state (``optax.EmptyState()`` if none).
      skip_leaves: None, or with ``record_skip_leaves=True`` a bool ``[n]``: one flag
        per floating leaf of the params given to ``init``, in tree order, set for the
        leaves that held an inf or NaN at the last skipped step (all False before any).
        It comes from the finite check's reductions (one per leaf then). Read it by name
        with ``scale_metrics(opt_state, skip_leaves=params)``. Gradients with other
        leaves than ``init``'s params leave it as it was. Without it the state has the
        seven fields' leaves it had before the record existed.
      warm_phase: None, or with ``warm_start=True`` (naive mode's default) an int32
        scalar: where the warm start of the scale stands (1 before any step, 2 after a
        skip and before the first finite step, 3 while it climbs back, 0 once done; see
        `dynamic_scale`). A state without it (``None``, as every state saved before the
        warm start existed) runs the plain rule, so its trajectory continues unchanged.
    """

    loss_scale: jax.Array
    growth_tracker: jax.Array
    hysteresis_left: jax.Array
    skipped_steps: jax.Array
    consecutive_skips: jax.Array
    last_finite: jax.Array
    inner_state: Any
    skip_leaves: jax.Array | None = None
    warm_phase: jax.Array | None = None


class ScaledValueAndGrad(NamedTuple):
    """What `mpfunc.value_and_grad` returns; pass it whole to a loss-scale ``update``.

    Attributes:
      value: ``fun``'s output, unscaled: the loss, or ``(loss, aux)`` with ``has_aux``.
      grads: the gradients, unscaled, float32.
      finite: bool scalar, the decision the loss-scale ``update`` takes for them.
    """

    value: Any
    grads: Any
    finite: jax.Array


def _unscale(tree: Any, inv_scale: jax.Array | None) -> Any:
    """Float32 copies of the floating leaves, multiplied by ``inv_scale`` (if given)."""

    def f(x):
        if not _is_float(x):
            return x
        x = x.astype(jnp.float32)
        return x if inv_scale is None else x * inv_scale

    return jax.tree_util.tree_map(f, tree)


def _value(x: Any) -> Any:
    """An array read from ``x`` now: ``nnx.Optimizer`` holds its state in mutable NNX
    variables, which a later ``update`` overwrites in place. Arrays (immutable) and None
    are returned as they are."""
    return x if x is None or isinstance(x, jax.Array) else jnp.asarray(x)


def _find_states(opt_state: Any) -> list[LossScaleState]:
    """The `LossScaleState`s in ``opt_state``, their fields (but ``inner_state``) read as
    values (`_value`)."""
    leaves = jax.tree_util.tree_leaves(
        opt_state, is_leaf=lambda x: isinstance(x, LossScaleState)
    )
    return [x._replace(**{f: _value(getattr(x, f)) for f in x._fields if f != "inner_state"})
            for x in leaves if isinstance(x, LossScaleState)]


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
      >>> opt = optax.chain(optax.clip(1.0), mpfunc.dynamic_scale(optax.adam(1e-3)))
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


def scale_metrics(opt_state: Any, *, skip_leaves: Any = None) -> dict[str, Any]:
    """Device scalars for logging: ``loss_scale``, ``skipped_steps``,
    ``consecutive_skips``, ``last_finite`` (and ``num_zeros_in_grad`` when the mode
    logs it).

    Nothing is copied to the host; convert with ``float()``/``int()`` when you log. The
    values are read at this call, also from ``nnx.Optimizer``'s mutable state (a later
    ``update`` does not change them).
    ``consecutive_skips`` is optax's ``notfinite_count``: compare it with a limit at log
    time to stop a run that is stuck skipping (see the README, "Loss scaling").

    Given the params as ``skip_leaves`` (outside ``jit``, when you log), the dict also
    holds ``skip_leaves``: the keystr paths of the gradient leaves that held an inf or
    NaN at the last skipped step (``[]`` before any), read from the device then. That
    needs the state's record: build the transformation with
    ``record_skip_leaves=True``.

    Args:
      opt_state: an optax state tree holding one `LossScaleState`.
      skip_leaves: the params the state was made for (their paths name the leaves), or
        None.

    Returns:
      A dict of device scalars (and a list of paths with ``skip_leaves``).

    Raises:
      ValueError: ``opt_state`` holds no `LossScaleState` (or several); ``skip_leaves``
        with another number of floating leaves than the state's record, or for a state
        that keeps no record.
      TypeError: ``skip_leaves`` inside ``jit`` (the names are read on the host).

    Examples:
      >>> import jax.numpy as jnp, optax, mpfunc
      >>> m = mpfunc.scale_metrics(mpfunc.no_scale(optax.sgd(1.0)).init({"w": jnp.ones(1)}))
      >>> sorted(m)
      ['consecutive_skips', 'last_finite', 'loss_scale', 'skipped_steps']
    """
    s = _the_state(opt_state)
    out: dict[str, Any] = {
        "loss_scale": s.loss_scale,
        "skipped_steps": s.skipped_steps,
        "consecutive_skips": s.consecutive_skips,
        "last_finite": s.last_finite,
    }
    # `convert_to_amp(..., log_num_zeros_in_grad=True)` adds a zero-count link.
    for leaf in jax.tree_util.tree_leaves(
        s.inner_state, is_leaf=lambda x: hasattr(x, "num_zeros_in_grad")
    ):
        if hasattr(leaf, "num_zeros_in_grad"):
            out["num_zeros_in_grad"] = _value(leaf.num_zeros_in_grad)
    if skip_leaves is not None:
        out["skip_leaves"] = skip_paths(s.skip_leaves, skip_leaves)
    return out


def value_and_grad(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    axis_name: AxisName = None,
) -> Callable[..., ScaledValueAndGrad]:
    """flax's ``DynamicScale.value_and_grad``, on the loss-scale state in ``opt_state``.

    ``value_and_grad(fun)(opt_state, *args)`` differentiates ``fun(*args)`` with its loss
    multiplied by the current scale, and returns a `ScaledValueAndGrad`: the loss as
    ``fun`` returned it (``(loss, aux)`` with ``has_aux``), the gradients unscaled in
    float32 exactly as the loss-scale transformation unscales them, and ``finite``, the
    decision it will take. Pass the result whole to the transformation's ``update`` (or
    ``TrainState.apply_gradients(grads=...)``): it takes the gradients as already
    unscaled, skips exactly when ``finite`` is false and advances the scale. Passing
    ``.grads`` alone would unscale them twice.

    Unlike flax, the scale is advanced by ``update`` (the optax state is the single
    source of truth), and growth follows the torch rule: flax 0.12.8 grows after
    ``growth_interval + 1`` clean steps, mpfunc after ``growth_interval``.

    Args:
      fun: the loss function; returns a scalar, or ``(scalar, aux)`` with ``has_aux``.
      argnums: which positional arguments of ``fun`` to differentiate, as in
        ``jax.grad``.
      has_aux: whether ``fun`` returns ``(loss, aux)``.
      axis_name: as in flax: the gradients are averaged (``pmean``) over these mesh axes
        before the check, inside ``shard_map``/``pmap``.

    Returns:
      ``f(opt_state, *args, **kwargs) -> ScaledValueAndGrad(value, grads, finite)``.

    Examples:
      >>> import jax.numpy as jnp, optax, mpfunc
      >>> params = {"w": jnp.ones(2)}
      >>> opt = mpfunc.dynamic_scale(optax.sgd(0.5))
      >>> state = opt.init(params)
      >>> loss_fn = lambda p: jnp.sum(p["w"] ** 2)
      >>> out = mpfunc.value_and_grad(loss_fn)(state, params)
      >>> float(out.value), out.grads["w"].tolist(), bool(out.finite)
      (2.0, [2.0, 2.0], True)
      >>> updates, state = opt.update(out, state, params)
      >>> updates["w"].tolist()
      [-1.0, -1.0]
    """
    if not callable(fun):
        raise TypeError(f"`fun` must be callable, got {type(fun).__name__}.")
    axis_name = check_axis_name(axis_name)

    def wrapped(opt_state, *args, **kwargs):
        scale = loss_scale(opt_state)

        def scaled(*a, **k):
            out = fun(*a, **k)
            loss = out[0] if has_aux else out
            return jnp.asarray(loss).astype(jnp.float32) * scale, out

        grads, value = jax.grad(scaled, argnums=argnums, has_aux=True)(*args, **kwargs)
        grads = _unscale(grads, jnp.float32(1.0) / scale)
        if axis_name is not None:
            grads = jax.lax.pmean(grads, axis_name)
        return ScaledValueAndGrad(value, grads, all_finite(grads, axis_name))

    return wrapped
