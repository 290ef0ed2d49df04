"""Master weights for half-precision parameters, as an optax wrapper: float32 masters, or
their stand-ins (a remainder, a Kahan compensation, stochastic rounding; see
`mpfunc._src.param_storage`)."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from _mpfunc_common.storage import check_master_storage, check_seed
from mpfunc._src.eager_jit import jit_when_eager
from mpfunc._src.param_storage import param_storage
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


def master_weights(
    inner: optax.GradientTransformation, storage: str = "float32", seed: int = 0
) -> optax.GradientTransformationExtraArgs:
    """Keeps the exact values of half-precision params and steps ``inner`` on them.

    ``storage`` says where the exact value of a half param lives between steps (bytes per
    param beside the 2 of a bfloat16 param, Adam's moments not counted):

    * ``"float32"`` (default; the naive/O2 setting): a float32 master (4 bytes).
    * ``"remainder"``: an int16 remainder (2 bytes); param and remainder *are* the
      float32 master (the param is the master rounded to nearest, ties away from zero),
      so the trajectory is ``"float32"``'s bit for bit. bfloat16 params only.
    * ``"kahan"``: a compensation in the param's dtype (2 bytes), Kahan-summing each
      update (optimi's method). bfloat16 or float16 params.
    * ``"stochastic"``: nothing (the state holds a seed and a step count); the params are
      rounded stochastically with counter-based random bits of (``seed``, step, element
      index), the same bits as ``mpfunc_torch`` and for any sharding. bfloat16 only.

    With ``"float32"``:
    ``inner`` runs on the float32 masters with float32 gradients, so updates smaller
    than half precision's resolution still accumulate. The emitted update of a half
    param is ``round(new_master) - param``, so that ``optax.apply_updates(params,
    updates)`` gives the rounded master. Under JAX's default (standard) promotion it is
    float32 and exact, and every param lands on its rounded master. Under strict
    promotion it is rounded to the param's dtype: exact whenever the new value is within
    a factor of two of the old one (Sterbenz's lemma), i.e. for any step small relative
    to the parameter; a step that moves a parameter by more than its own magnitude can
    land one rounding (of the step's size) away: no half-precision update can always
    hit the target then. The master itself is always exact, and each
    step recomputes from it, so such an error is corrected on the next step and never
    accumulates. float32 parameters get ``inner``'s own updates and stay identical to
    their masters.

    Composes with loss scaling: ``dynamic_scale(master_weights(adam))`` unscales first,
    and a skipped step leaves the masters (part of this state) untouched.

    The other storages run ``inner`` on the exact values (float32) as well. The params
    passed to the next ``update`` must be ``optax.apply_updates(params, updates)`` (the
    params and the state together hold the exact values). Under JAX's default (standard)
    dtype promotion the updates of half params are float32, ``target - param``, which
    ``apply_updates`` lands exactly on the target, however large the step. Under strict
    promotion, which refuses bfloat16 + float32, they are in the param's dtype: then a
    step that carries a param past zero or shrinks it by more than half can land one
    rounding (of the step's size) off; a remainder then saturates (the trajectory leaves
    float32 masters' there), a Kahan compensation absorbs the difference (see
    `mpfunc._src.param_storage`). A skipped step (`mpfunc.dynamic_scale`) leaves params,
    remainders, compensation and the step count bit for bit. Where a float32 subnormal
    (below 2**-126) appears, XLA on CPU flushes it to zero, which NumPy and torch do not.

    Args:
      inner: the optimizer to run on the float32 masters (an optax transformation, or an
        ``optax.MultiSteps``; `mpfunc.state_dtype` to store its state smaller).
      storage: ``"float32"``, ``"remainder"``, ``"kahan"`` or ``"stochastic"``.
      seed: the random bits' seed (an int in [0, 2**32 - 1]), for ``"stochastic"``; a
        nonzero seed with another storage is an error (it would have no effect).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a `MasterWeightsState`,
      `RemainderState`, `KahanState` or `StochasticRoundingState`. Its ``update`` needs
      ``params``.

    Raises:
      ValueError: an unknown ``storage`` (with the closest name), a param dtype the
        storage does not support (float16 with "remainder" or "stochastic"), a seed
        out of range or without effect.

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
      >>> opt = mpfunc.master_weights(optax.sgd(1e-3), storage="remainder")
      >>> params = {"w": jnp.ones(3, jnp.bfloat16)}
      >>> state = opt.init(params)
      >>> updates, state = opt.update({"w": jnp.ones(3, jnp.bfloat16)}, state, params)
      >>> params = optax.apply_updates(params, updates)
      >>> params["w"].dtype, state.remainders["w"].dtype, int(state.remainders["w"][0])
      (dtype(bfloat16), dtype('int16'), -16777)
    """
    storage = check_master_storage(storage, "storage", allow_none=False)
    seed = check_seed(seed)
    if seed and storage != "stochastic":
        raise ValueError(f"`seed={seed}` has no effect with storage={storage!r}: only "
                         "storage='stochastic' draws random bits (mpfunc.state_dtype "
                         "takes its own seed).")
    inner = as_transformation(inner)
    if storage != "float32":
        return param_storage(inner, storage, seed)

    def init_fn(params):
        # The masters are their own buffers, float32 params included (apex O2's norms):
        # aliasing a param, they could not both be donated to a step.
        leaves, treedef = jax.tree_util.tree_flatten(params)
        at = [i for i, x in enumerate(leaves) if _is_float(x)]
        master = list(leaves)
        for i, m in zip(at, _copies_f32(tuple(leaves[i] for i in at))):
            master[i] = m
        master = treedef.unflatten(master)
        return MasterWeightsState(master_params=master, inner_state=inner.init(master))

    def update_fn(updates, state, params=None, **extra_args):
        if params is None:
            raise ValueError("`params` is required by master_weights.update (the updates "
                             "are computed against the current half-precision params).")
        grads = _to_f32(updates)
        inner_updates, inner_state = inner.update(
            grads, state.inner_state, state.master_params, **extra_args
        )
        # Standard promotion: float32 updates, which apply_updates adds in float32 and
        # rounds once, landing every param on its rounded master; strict promotion
        # refuses bfloat16 + float32, so there they are in the param's dtype.
        exact = (jax.config.jax_numpy_dtype_promotion  # pyright: ignore[reportAttributeAccessIssue]  # jax sets its options as attributes at run time
                 != "strict")
        leaves, treedef = jax.tree_util.tree_flatten(params)
        upd = treedef.flatten_up_to(inner_updates)
        masters = treedef.flatten_up_to(state.master_params)
        at = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array | np.ndarray)]
        out, new_master = list(upd), list(masters)
        for i, d, m in zip(at, *_emit_all(tuple(leaves[i] for i in at),
                                          tuple(upd[i] for i in at),
                                          tuple(masters[i] for i in at), exact)):
            out[i], new_master[i] = d, m
        return treedef.unflatten(out), MasterWeightsState(
            master_params=treedef.unflatten(new_master), inner_state=inner_state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


@jit_when_eager
def _copies_f32(xs: tuple) -> tuple:
    """float32 copies (new buffers: a jitted function's outputs are its own)."""
    return tuple(x.astype(jnp.float32) for x in xs)


@functools.partial(jit_when_eager, static_argnums=(3,))
def _emit_all(params: tuple, updates: tuple, masters: tuple, exact: bool) -> tuple:
    """(emitted updates, new masters) of the array leaves: the new master is the old one
    plus the inner update (``optax.apply_updates``); a half param's update lands it on
    the rounded new master (see `master_weights`)."""
    out, new = [], []
    for p, u, m in zip(params, updates, masters):
        m_new = jnp.asarray(m + u).astype(m.dtype)  # optax.apply_updates, on one leaf
        new.append(m_new)
        if not _is_float(p):
            out.append(u)
        elif p.dtype == jnp.float32:
            out.append(u.astype(jnp.float32))
        elif exact:  # float32, exact: apply_updates lands on the rounded master
            d = m_new.astype(p.dtype).astype(jnp.float32) - p.astype(jnp.float32)
            out.append(jnp.where(d == 0, jnp.float32(-0.0), d))
        else:
            d = (m_new.astype(p.dtype) - p).astype(p.dtype)
            # A zero step is -0.0, so that a parameter whose rounded master did not
            # move keeps every bit (p + -0.0 == p, where -0.0 + +0.0 would be +0.0).
            out.append(jnp.where(d == 0, jnp.asarray(-0.0, p.dtype), d))
    return tuple(out), tuple(new)
