"""Shardings for optimizer state that follow the params' (FSDP / ZeRO under ``jit``)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding

__all__ = ["state_sharding"]


def _param_kind(x: Any) -> str:
    if isinstance(x, PartitionSpec):
        return "spec"
    if isinstance(x, Sharding):
        return "sharding"
    if isinstance(x, jax.Array):
        return "array"
    raise TypeError(
        "`params` leaves must be jax Arrays (placed with the sharding you want), "
        "jax.sharding.Sharding objects or PartitionSpecs, found "
        f"{type(x).__name__}. Place the params first, e.g. "
        "jax.device_put(params, NamedSharding(mesh, P('data')))."
    )


def state_sharding(optimizer: optax.GradientTransformation, params: Any) -> Any:
    """Where each leaf of ``optimizer.init(params)`` should live: with its parameter.

    ``jax.jit(opt.init)(params)`` shards only what XLA's propagation reaches: float32
    master weights (a cast of the params) follow the params, but Adam's ``zeros_like``
    moments come out *replicated*, a full fp32 copy per device. This returns, for every
    leaf of the state, the sharding of the parameter it belongs to (found with optax's
    own ``optax.tree_map_params``) when the shapes match, and a replicated sharding on
    the same mesh otherwise (the loss scale, step counts, factored statistics). Use it
    as ``out_shardings`` of the init and of the train step:

    .. code-block:: python

        shardings = mpfunc.state_sharding(opt, params)
        opt_state = jax.jit(opt.init, out_shardings=shardings)(params)

    Given ``PartitionSpec`` leaves instead (a shard_map ``in_specs`` tree), it returns
    ``PartitionSpec`` leaves (``P()`` for non-parameter leaves): the state's ``in_specs``
    / ``out_specs``. Without the params' shapes it cannot place state of another shape
    in a param's slot (adafactor's factored statistics): that is a ``ValueError`` asking
    for placed arrays (whose results' ``.spec`` then serve shard_map).

    Args:
      optimizer: any optax transformation, including mpfunc's loss-scale and
        master-weight wrappers.
      params: the params as placed jax Arrays, or a matching tree of ``Sharding`` objects,
        or of ``PartitionSpec`` objects.

    Returns:
      A pytree with the structure of ``optimizer.init(params)`` whose leaves are
      ``Sharding`` objects (or ``PartitionSpec`` objects for ``PartitionSpec`` input).

    Raises:
      ValueError: factored state with ``PartitionSpec`` / ``Sharding`` leaves (above).
      TypeError: ``optimizer`` is not an optax transformation; a ``params`` leaf is none
        of the accepted kinds, the leaves mix kinds, or
        a sharding is neither a ``NamedSharding`` nor a single-device one.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, mpfunc
      >>> from jax.sharding import PartitionSpec as P
      >>> opt = mpfunc.dynamic_scale(mpfunc.master_weights(optax.sgd(0.1, momentum=0.9)))
      >>> specs = mpfunc.state_sharding(opt, {"w": P("data", None)})
      >>> specs.inner_state.master_params["w"], specs.loss_scale
      (P('data', None), P())
    """
    if not isinstance(optimizer, optax.GradientTransformation):
        hint = " (a factory: call it, e.g. optax.adam(1e-3))" if callable(optimizer) else ""
        raise TypeError("`optimizer` must be an optax GradientTransformation, got "
                        f"{type(optimizer).__name__}{hint}.")
    is_leaf = lambda x: isinstance(x, PartitionSpec | Sharding)  # noqa: E731
    leaves = jax.tree.leaves(params, is_leaf=is_leaf)
    kinds = {_param_kind(x) for x in leaves}
    if len(kinds) > 1:
        raise TypeError(f"`params` leaves must be all of one kind (arrays, shardings or "
                        f"PartitionSpecs), found a mix: {sorted(kinds)}.")
    kind = kinds.pop() if kinds else "spec"

    if kind == "spec":
        replicated = PartitionSpec()
    else:
        first = leaves[0].sharding if kind == "array" else leaves[0]
        if isinstance(first, NamedSharding):
            replicated = NamedSharding(first.mesh, PartitionSpec())
        elif isinstance(first, SingleDeviceSharding):
            replicated = first
        else:
            raise TypeError("`params` must be placed with NamedSharding (or on one device), "
                            f"found {type(first).__name__}.")

    if kind == "array":
        abstract_params = params
    else:
        # Only the placement is known: stand-in scalars give the state's structure.
        abstract_params = jax.tree.map(
            lambda _: jax.ShapeDtypeStruct((), jnp.float32), params, is_leaf=is_leaf)
    abstract_state = jax.eval_shape(optimizer.init, abstract_params)

    def for_param(state_leaf, param):
        if kind != "array":
            if getattr(state_leaf, "shape", None) != ():
                # A params-shaped slot holding another shape (factored statistics): its
                # real shape, and so its placement, needs the params' shapes.
                raise ValueError(
                    "`optimizer` keeps state of another shape than its param in a param's "
                    "slot (e.g. adafactor's factored statistics), so its placement needs "
                    "the params' shapes: pass `params` as arrays placed with their "
                    "sharding (jax.device_put(p, NamedSharding(mesh, spec))), not as bare "
                    "PartitionSpecs or Shardings (for shard_map's out_specs, take each "
                    "result's .spec).")
            return param
        if getattr(state_leaf, "shape", None) != param.shape:
            return replicated  # a params-shaped slot holding another shape (factored)
        return param.sharding

    return optax.tree_map_params(
        optimizer, for_param, abstract_state, params,
        transform_non_params=lambda _: replicated,
    )
