"""Float32 master weights for half-precision parameters, as an optax wrapper."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mpfunc._src.scale_rule import as_transformation

__all__ = ["MasterWeightsState", "master_weights"]


class MasterWeightsState(NamedTuple):
    """State of `master_weights`.

    Attributes:
      master_params: float32 copies of the floating parameters (other leaves as given).
      inner_state: the wrapped transformation's state, over ``master_params``.
    """

    master_params: Any
    inner_state: Any


def _is_float(x):
    return isinstance(x, jax.Array | np.ndarray) and jnp.issubdtype(x.dtype, jnp.floating)


def _to_f32(tree):
    return jax.tree_util.tree_map(lambda x: x.astype(jnp.float32) if _is_float(x) else x, tree)


def master_weights(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """Keeps float32 master weights and steps ``inner`` on them (the naive/O2 setting).

    ``inner`` runs on the float32 masters with float32 gradients, so updates smaller
    than half precision's resolution still accumulate. The emitted updates are in each
    parameter's dtype: ``round(new_master) - param``, rounded to that dtype, so that
    ``optax.apply_updates(params, updates)`` gives the rounded master. That is exact
    whenever the new value is within a factor of two of the old one (Sterbenz's lemma),
    i.e. for any step small relative to the parameter. A step that moves a parameter by
    more than its own magnitude can land one rounding (of the step's size) away: no
    half-precision update can always hit the target then. The master itself is always exact, and each
    step recomputes from it, so such an error is corrected on the next step and never
    accumulates. float32 parameters get ``inner``'s own updates and stay identical to
    their masters.

    Composes with loss scaling: ``dynamic_scale(master_weights(adam))`` unscales first,
    and a skipped step leaves the masters (part of this state) untouched.

    Args:
      inner: the optimizer to run on the float32 masters (an optax transformation, or an
        ``optax.MultiSteps``).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a `MasterWeightsState`.
      Its ``update`` needs ``params``.

    Examples:
      >>> import jax.numpy as jnp, optax, mpfunc
      >>> params = {"w": jnp.ones(2, jnp.float16)}
      >>> opt = mpfunc.master_weights(optax.sgd(1e-4))
      >>> state = opt.init(params)
      >>> for _ in range(100):  # 1e-4 steps are below float16's resolution at 1.0
      ...     updates, state = opt.update({"w": jnp.ones(2, jnp.float16)}, state, params)
      ...     params = optax.apply_updates(params, updates)
      >>> round(float(params["w"][0]), 3)  # plain float16 SGD would still be at 1.0
      0.99
    """
    inner = as_transformation(inner)

    def init_fn(params):
        # The masters are their own buffers, float32 params included (apex O2's norms):
        # aliasing a param, they could not both be donated to a step.
        master = jax.tree_util.tree_map(
            lambda x: jnp.array(x, jnp.float32, copy=True) if _is_float(x) else x, params)
        return MasterWeightsState(master_params=master, inner_state=inner.init(master))

    def update_fn(updates, state, params=None, **extra_args):
        if params is None:
            raise ValueError("`params` is required by master_weights.update (the updates "
                             "are computed against the current half-precision params).")
        grads = _to_f32(updates)
        inner_updates, inner_state = inner.update(
            grads, state.inner_state, state.master_params, **extra_args
        )
        new_master = optax.apply_updates(state.master_params, inner_updates)

        def emit(p, u, m_new):
            if not _is_float(p):
                return u
            if p.dtype == jnp.float32:
                return u.astype(jnp.float32)
            d = (m_new.astype(p.dtype) - p).astype(p.dtype)
            # A zero step is -0.0, so that a parameter whose rounded master did not
            # move keeps every bit (p + -0.0 == p, where -0.0 + +0.0 would be +0.0).
            return jnp.where(d == 0, jnp.asarray(-0.0, p.dtype), d)

        out = jax.tree_util.tree_map(emit, params, inner_updates, new_master)
        return out, MasterWeightsState(master_params=new_master, inner_state=inner_state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
