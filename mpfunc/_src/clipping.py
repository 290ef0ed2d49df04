"""Global-norm clipping whose norm is global over mesh axes (for ``shard_map``)."""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec

from mpfunc._src.distributed import _varying_axes, check_axis_name

__all__ = ["clip_by_global_norm", "global_norm", "sharded_sum"]

AxisName = Hashable | Sequence[Hashable] | None


def _is_float(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray) and jnp.issubdtype(x.dtype, jnp.floating)


def _axes(axis_name: AxisName) -> tuple:
    return tuple(axis_name) if isinstance(axis_name, tuple | list) else (axis_name,)


def _typed_by_vma(axes: tuple) -> bool:
    """Whether shard_map's varying-axes typing is on here (``check_vma=True``).

    Probed by casting a constant to "varying over ``axes``": with the typing on, its type
    then says so; with ``check_vma=False`` (or ``pmap``) the type stays empty.
    """
    zero = jnp.zeros((), jnp.float32)
    probe = jax.lax.pcast(zero, axes, to="varying")
    return bool(_varying_axes(probe))


def _is_spec(x: Any) -> bool:
    return x is None or isinstance(x, PartitionSpec)


def _spec_axes(spec: PartitionSpec | None) -> frozenset:
    """Mesh axes a ``PartitionSpec`` shards over (``None`` or ``P()``: replicated)."""
    if spec is None:
        return frozenset()
    out = set()
    for entry in spec:
        if isinstance(entry, tuple | list):
            out.update(entry)
        elif entry is not None and isinstance(entry, Hashable) and not _is_unconstrained(entry):
            out.add(entry)
    return frozenset(out)


def _is_unconstrained(entry: Any) -> bool:
    return entry is getattr(PartitionSpec, "UNCONSTRAINED", object())


def _leaf_specs(specs: Any, tree: Any) -> list:
    """One spec per leaf of ``tree``; ``specs`` is a pytree prefix of it (as in shard_map)."""
    try:
        per_leaf = jax.tree.map(
            lambda spec, sub: jax.tree.map(lambda _: spec, sub), specs, tree, is_leaf=_is_spec
        )
    except (ValueError, TypeError) as e:
        raise ValueError(
            "`specs` must be a PartitionSpec (or None) or a pytree prefix of the gradients "
            "with PartitionSpec/None leaves, e.g. the `in_specs` entry of the params given "
            f"to shard_map; its structure does not match the gradients': {e}"
        ) from None
    leaves = jax.tree.leaves(per_leaf, is_leaf=_is_spec)
    for s in leaves:
        if not _is_spec(s):
            raise ValueError(
                "`specs` leaves must be jax.sharding.PartitionSpec or None, found "
                f"{type(s).__name__}: {s!r}."
            )
    return leaves


def global_norm(tree: Any, axis_name: AxisName = None, *, specs: Any = None) -> jax.Array:
    """The L2 norm of all floating leaves of ``tree``, global over mesh axes.

    Squares are summed in float32. Without ``axis_name`` this is ``optax.tree.norm``
    (global already under plain ``jit``, where GSPMD reduces sharded arrays). Inside
    ``shard_map`` each device holds only blocks of the gradients; with ``axis_name``
    (the model-parallel axes: tensor, pipeline stage, FSDP), each leaf's squared sum is
    ``psum``-med over the named axes it is *sharded* over, and a leaf replicated across
    an axis (a norm weight, a row-parallel bias) is counted once, not once per device.

    Which axes a leaf is sharded over comes from shard_map's varying-axes typing
    (``check_vma=True``, the default), or, with ``check_vma=False``, from ``specs``: a
    ``PartitionSpec`` per leaf, e.g. the params' ``in_specs`` (a pytree prefix is
    enough). Given ``specs`` always wins. Gradients must already be reduced over
    data-parallel axes (``pmean``), as for any optimizer.

    Args:
      tree: gradients (a pytree of arrays); non-floating leaves are ignored.
      axis_name: mesh axis name(s) to reduce over, or None.
      specs: optional per-leaf ``PartitionSpec`` pytree (prefix) saying how each leaf is
        sharded; needed with ``check_vma=False``.

    Returns:
      A float32 scalar, the same on every device of ``axis_name``.

    Raises:
      TypeError: ``axis_name`` is not None, a name or a non-empty tuple of names.
      ValueError: ``specs`` does not match ``tree``; or ``axis_name`` is given under
        ``check_vma=False`` without ``specs``; or ``specs`` without ``axis_name``.

    Examples:
      >>> import jax.numpy as jnp, mpfunc
      >>> float(mpfunc.global_norm({"a": jnp.array([3.0]), "b": jnp.array([4.0])}))
      5.0
    """
    leaves = jax.tree.leaves(tree)
    sq = [jnp.sum(jnp.square(x.astype(jnp.float32))) if _is_float(x) else None
          for x in leaves]
    return jnp.sqrt(sharded_sum(sq, tree, axis_name, specs, jnp.float32))


def sharded_sum(per_leaf: list, tree: Any, axis_name: AxisName, specs: Any,
                dtype: Any) -> jax.Array:
    """The sum over the model of one scalar per leaf of ``tree`` (None: skipped), each
    ``psum``-med over the axes of ``axis_name`` its leaf is sharded over (from the
    varying-axes typing, or ``specs``), so a replicated leaf counts once: `global_norm`'s
    reduction, shared with `mpfunc.count_zeros`. Raises as `global_norm` does."""
    axis_name = check_axis_name(axis_name)
    leaves = jax.tree.leaves(tree)
    if specs is not None and axis_name is None:
        raise ValueError("`specs` says how leaves are sharded over mesh axes; pass the "
                         "axes to reduce over as `axis_name` too (e.g. axis_name='model').")
    if axis_name is None:
        return sum((s for s in per_leaf if s is not None), jnp.zeros((), dtype))
    axes = _axes(axis_name)
    if specs is not None:
        leaf_axes = [_spec_axes(s) for s in _leaf_specs(specs, tree)]
    elif _typed_by_vma(axes):
        leaf_axes = [_varying_axes(x) or frozenset() for x in leaves]
    else:
        raise ValueError(
            "`specs` is required for `axis_name` under shard_map(check_vma=False) (or "
            "pmap): without the varying-axes typing, mpfunc cannot tell a leaf sharded over "
            f"{axes!r} from one replicated across it. Pass specs=<the params' in_specs>, "
            "or use check_vma=True."
        )
    if rest := set().union(*leaf_axes) - set(axes):
        names = tuple(sorted(rest, key=str))
        raise ValueError(
            f"Leaves are sharded over (or vary over) mesh axes {names} that are not in "
            f"`axis_name` ({axis_name!r}): each shard along them would take its own norm "
            "and clip by its own factor. Add them if the leaves are split over them "
            f"(tensor, pipeline stages): axis_name={tuple(axes) + names!r}; or reduce "
            "the gradients over them first (jax.lax.pmean over a data-parallel axis).")
    # One psum per distinct set of axes: leaves sharded alike are summed locally first.
    groups: dict[tuple, jax.Array] = {}
    for s, la in zip(per_leaf, leaf_axes):
        if s is None:
            continue
        key = tuple(a for a in axes if a in la)
        groups[key] = groups[key] + s if key in groups else s
    total = jnp.zeros((), dtype)
    for key, s in groups.items():
        total = total + (jax.lax.psum(s, key) if key else s)
    return total


def clip_by_global_norm(
    max_norm: float, *, axis_name: AxisName = None, specs: Any = None
) -> optax.GradientTransformation:
    """``optax.clip_by_global_norm`` with the norm taken over the whole sharded model.

    Inside ``shard_map``, ``optax.clip_by_global_norm`` sees only the local blocks, so
    each device clips by its own norm: tensor-parallel shards of one weight get scaled
    differently and replicated params diverge across devices. This transform uses
    `global_norm` (``psum`` over ``axis_name``, replicated leaves counted once), so every
    device applies the same factor and sharded training equals unsharded training. The
    rule is optax's: updates are left alone if the norm is below ``max_norm``, else
    multiplied by ``max_norm / norm``.

    Compose it inside a loss-scale link so that it sees unscaled gradients, e.g.
    ``mpfunc.dynamic_scale(optax.chain(mpfunc.clip_by_global_norm(1.0, axis_name="model"),
    optax.adam(1e-3)), axis_name=("data", "model"))``.

    Args:
      max_norm: the largest global norm allowed; finite and > 0.
      axis_name: model-parallel mesh axis name(s) to reduce the norm over (None under
        plain ``jit``, where the norm is global already).
      specs: per-leaf ``PartitionSpec`` pytree (prefix) for ``check_vma=False``; see
        `global_norm`.

    Returns:
      An ``optax.GradientTransformation`` with an empty state.

    Raises:
      TypeError: ``max_norm`` is not a real number, or ``axis_name`` not a name or names.
      ValueError: ``max_norm`` is not finite and > 0.

    Examples:
      >>> import jax.numpy as jnp, mpfunc
      >>> clip = mpfunc.clip_by_global_norm(1.0)
      >>> u, _ = clip.update({"w": jnp.array([3.0, 4.0])}, clip.init(None))
      >>> u["w"].tolist()
      [0.6000000238418579, 0.800000011920929]
    """
    if isinstance(max_norm, bool) or not isinstance(max_norm, int | float | np.number):
        raise TypeError(f"`max_norm` must be a real number, got {type(max_norm).__name__}: "
                        f"{max_norm!r}.")
    if not (math.isfinite(float(max_norm)) and max_norm > 0):
        raise ValueError(f"`max_norm` must be finite and > 0, got {max_norm!r}; to disable "
                         "clipping, leave this transformation out.")
    max_norm = float(max_norm)
    axis_name = check_axis_name(axis_name)  # at construction, not at the first update

    def update_fn(updates, state, params=None):
        del params
        g_norm = global_norm(updates, axis_name, specs=specs)
        trigger = g_norm < max_norm

        def clip(t):
            if not _is_float(t):
                return t
            return jax.lax.select(trigger, t, (t / g_norm.astype(t.dtype)) * max_norm)

        return jax.tree.map(clip, updates), state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)
