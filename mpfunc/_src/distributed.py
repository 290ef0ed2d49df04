"""The finite check, reduced over mesh axes so that every shard decides alike.

The JAX mirror of ``mpfunc_torch/_src/distributed.py`` (which all-reduces ``found_inf``
over process groups).
"""

from __future__ import annotations

import numbers
import re
from collections.abc import Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["AxisName", "all_finite", "check_axis_name", "finite_and_flags",
           "finite_from_count", "nonfinite_count", "nonfinite_leaf_flags", "reduce_leaf_stats",
           "unbound_axis_error"]

AxisName = Hashable | Sequence[Hashable] | None


def _is_name(x: Any) -> bool:
    # jax accepts any hashable axis name; a number is almost surely a mistake (a
    # misplaced positional argument), and a bool or None is never a mesh axis.
    return (
        x is not None
        and not isinstance(x, numbers.Number | bool | np.number | np.bool_)
        and isinstance(x, Hashable)
        and not (isinstance(x, str) and not x)  # '' is never a mesh axis
    )


def check_axis_name(axis_name: Any, name: str = "axis_name") -> AxisName:
    """``axis_name`` if it is None, a mesh axis name, or a tuple/list of names.

    Returns a hashable value (lists become tuples).

    Raises:
      TypeError: naming ``name``, what was expected and what was found.
      ValueError: a name repeated in the tuple.
    """
    if axis_name is None or (_is_name(axis_name) and not isinstance(axis_name, tuple)):
        return axis_name
    if isinstance(axis_name, tuple | list):
        bad = [a for a in axis_name if not _is_name(a)]
        if axis_name and not bad:
            if len(set(axis_name)) != len(axis_name):  # a psum over it would fail, or
                raise ValueError(                     # count the axis twice
                    f"`{name}` names an axis twice: {axis_name!r}.")
            return tuple(axis_name)
    raise TypeError(
        f"`{name}` must be None, a mesh axis name (e.g. 'data') or a non-empty tuple of "
        f"names (e.g. ('data', 'model')), got {type(axis_name).__name__}: {axis_name!r}. "
        "Pass the names your `shard_map`/`pmap` uses."
    )


def _is_float(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray) and jnp.issubdtype(x.dtype, jnp.floating)


# Leaves checked by one kernel. XLA:CPU compiles a kernel per check (and per reduction),
# about 2 ms each: one per leaf doubled a 96-layer step's compile time. Sixteen operands
# per kernel compile fastest (measured 4, 8, 16, 32, 64, 192); larger kernels cost more
# again (BENCHMARKS.md section 6).
_GROUP = 16


def _group_key(path, x) -> tuple:
    """Leaves with equal keys are checked together: the same role (the key path with
    layer numbers dropped), shape and dtype, and, where jax knows it at trace time, the
    same sharding and shard_map varying axes. Combining them elementwise then needs no
    data movement: ``layers_3/attn/q`` and ``layers_7/attn/q`` are laid out alike."""
    role = re.sub(r"\d+", "#", jax.tree_util.keystr(path))
    return role, tuple(x.shape), x.dtype, str(jax.typeof(x).sharding), _varying_axes(x)


def _group_last_bad(xs: list) -> jax.Array:
    """Which of the equally shaped ``xs`` (at most 16) holds an inf or NaN, as a uint8
    scalar: 0 if none does, else ``i + 1`` for the last such ``xs[i]``.

    Elementwise, a balanced tree combines each pair of ``(finite, index)`` into
    ``(finite_l & finite_r, index_r if not finite_r else index_l)``; then
    ``max(where(finite, 0, index))`` in uint8. The elementwise part fuses into one XLA
    kernel over every leaf of the group, and the reduction is one more, over one byte
    per element of *one* leaf: the check's kernels, now naming a leaf. It is zero exactly
    when every leaf is finite (the skip decision).

    Measured alternatives: a boolean ``any`` compiles to a ``pred`` array, a transposed
    copy and a windowed reduction; ``lax.select`` between two ``lax.full_like`` arrays
    (instead of ``jnp.where`` with scalars) left XLA:CPU a strided transpose of a float16
    model's weight gradients in the check (1.25x plain Adam's step); so did a
    ``where(isfinite(x_i), 0, i + 1)`` per leaf combined by selects (24 transposes
    against plain Adam's 16 here), and combined by an elementwise max it took the step's
    peak from 1.005x to 1.059x plain Adam's (tests pin both); ``max(|x|)`` would skip the
    ``isfinite``, but XLA:CPU's float max reduction drops NaN (a test pins that every
    NaN and inf is seen). A bit per leaf OR-ed together would name every bad leaf, but
    XLA's SPMD partitioner (plain ``jit`` over sharded gradients) has no all-reduce for
    an OR reduction, and a variadic max reduction (one flag per leaf) made it all-gather
    the gradients.
    """
    u8 = jnp.uint8
    items = [(lax.is_finite(x), u8(i + 1)) for i, x in enumerate(xs)]
    # A balanced tree: XLA's simplifier sinks a transposed gradient's transpose through
    # one link per pass, so a chain of 16 ran the simplification passes 16 more times.
    while len(items) > 1:
        items = [_combine(*items[i:i + 2]) if i + 1 < len(items) else items[i]
                 for i in range(0, len(items), 2)]
    finite, index = items[0]
    return jnp.max(jnp.where(finite, u8(0), index))


def _combine(left: tuple, right: tuple) -> tuple:
    """Two ``(finite, index of the last non-finite leaf)`` pairs, elementwise, as one."""
    return (lax.bitwise_and(left[0], right[0]), jnp.where(right[0], left[1], right[1]))


def nonfinite_leaf_flags(tree: Any, *, exact: bool = False) -> jax.Array:
    """One int32 per floating leaf of ``tree``, in tree order: 1 for a leaf that the
    check found holding an inf or NaN, else 0.

    Leaves are checked in groups of up to ``_GROUP`` that share a role, shape, dtype and
    layout (`_group_key`), one reduction per group (`_group_last_bad`). A group with a
    non-finite leaf flags one of them: the last in tree order (so the flags sum to the
    number of such groups, zero exactly when every leaf is finite). Each leaf's flag is
    picked out of the groups' marks by one gather. With ``exact``, each leaf is a group
    of its own: every non-finite leaf is flagged, for one reduction (and, on XLA:CPU,
    one compiled kernel) per leaf.
    """
    size = 1 if exact else _GROUP
    groups: dict[tuple, list] = {}
    n = 0
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if _is_float(x):
            if x.size:
                groups.setdefault(_group_key(path, x), []).append((n, x))
            n += 1
    # An empty leaf points at a zero mark and expects 1 from it: never flagged.
    marks, where, mark = [], np.full(n, -1, np.int32), np.ones(n, np.uint8)
    for members in groups.values():
        for i in range(0, len(members), size):
            chunk = members[i:i + size]
            for j, (leaf, _) in enumerate(chunk):
                where[leaf], mark[leaf] = len(marks), j + 1
            marks.append(_group_last_bad([x for _, x in chunk]))
    if not marks:
        return jnp.zeros((n,), jnp.int32)
    marks.append(jnp.zeros((), jnp.uint8))  # for the empty leaves
    where[where < 0] = len(marks) - 1
    return (jnp.stack(marks)[where] == mark).astype(jnp.int32)


def nonfinite_count(tree: Any) -> jax.Array:
    """Number of floating leaves of ``tree`` holding an inf or NaN (int32); zero exactly
    when every floating leaf is finite. See `nonfinite_leaf_flags`."""
    return jnp.sum(nonfinite_leaf_flags(tree), dtype=jnp.int32)


def finite_from_count(count: jax.Array) -> jax.Array:
    """``count == 0``, computed once per program rather than once per consumer.

    XLA copies cheap scalar arithmetic into every fusion that reads it. The count is a
    sum of one flag per gradient leaf, and every state leaf's select reads the decision,
    so ``count == 0`` would land in ~3L fusions with L terms each: O(L**2) HLO, and
    compile time growing with the square of the depth (15x plain Adam's at 48 leaves).
    A square root is exact here (the count is a small non-negative integer, so
    ``sqrt(count) == 0`` exactly when ``count == 0``) and XLA counts it as expensive, so
    it computes the decision once. A test pins the HLO size.
    """
    return jnp.sqrt(count.astype(jnp.float32)) == 0


def _varying_axes(x) -> frozenset | None:
    """Mesh axes over which ``x`` varies, per shard_map's type system, if it says.

    jax 0.10+ reports them as ``typeof(x).manual_axis_type.varying``, earlier versions
    as ``typeof(x).vma``; outside shard_map, or with ``check_vma=False``, the set is
    empty. Adapted here, in one place.
    """
    t = jax.typeof(x)
    m = getattr(t, "manual_axis_type", None)
    if m is not None:
        return frozenset(m.varying)
    v = getattr(t, "vma", None)
    return frozenset(v) if v is not None else None


def psum_over(count: jax.Array, axis_name: AxisName) -> jax.Array:
    """Sums ``count`` over ``axis_name`` so that every shard holds the same total.

    Under shard_map's varying-axes typing (``check_vma=True``, the default) the sum runs
    over the axes ``count`` varies over; over the others it is already the same on every
    shard (and jax rejects a psum there). Without that typing (``check_vma=False``,
    ``pmap``) it runs over every named axis.
    """
    axes = tuple(axis_name) if isinstance(axis_name, tuple | list) else (axis_name,)
    varying = _varying_axes(count)
    if varying:
        if rest := varying - set(axes):
            names = ", ".join(map(str, sorted(rest, key=str)))
            raise ValueError(
                f"The non-finite count is varying over {{{names}}}, mesh axes that are not "
                f"in `axis_name` ({axis_name!r}): the shards along "
                "them would decide differently whether to skip, and one would step while "
                "another does not. Add them: "
                f"axis_name={tuple(axes) + tuple(sorted(rest, key=str))!r}.")
        sum_axes = tuple(a for a in axes if a in varying)
        return jax.lax.psum(count, sum_axes) if sum_axes else count
    try:
        return jax.lax.psum(count, axes)
    except ValueError:
        # Typed as invariant over every axis: identical on all shards already.
        return count
    except NameError as e:  # jax's "unbound axis name"
        raise unbound_axis_error(axis_name, e) from None


def unbound_axis_error(axis_name: AxisName, e: NameError) -> ValueError:
    """The error for an ``axis_name`` used outside shard_map (jax's own names neither)."""
    return ValueError(
        f"`axis_name` ({axis_name!r}) names mesh axes that are not bound here: it is for "
        "use inside jax.shard_map (or pmap). Under plain jit with sharded arrays the "
        f"reductions are already global: leave axis_name out. ({e})")


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

    Raises:
      TypeError: ``axis_name`` is not None, a name or a tuple of names.

    Examples:
      >>> import jax.numpy as jnp
      >>> bool(all_finite({"a": jnp.ones(2), "b": jnp.array([1.0, jnp.inf])}))
      False
    """
    return finite_and_flags(tree, check_axis_name(axis_name))[0]


def finite_and_flags(tree: Any, axis_name: AxisName = None, *,
                     exact: bool = False) -> tuple[jax.Array, jax.Array]:
    """`all_finite` and, from the same reductions, which leaves are not finite.

    Returns:
      ``(finite, flags)``: the bool scalar of `all_finite`, and a bool vector with one
      flag per floating leaf of ``tree`` in tree order (`nonfinite_leaf_flags`, with
      ``exact``), True where the leaf holds an inf or NaN on any shard of
      ``axis_name``. The per-leaf flags are ``psum``-med over ``axis_name`` in one
      collective, and the decision is taken from their sum.
    """
    flags = nonfinite_leaf_flags(tree, exact=exact)
    if axis_name is not None:
        flags = psum_over(flags, axis_name)
    elif varying := _varying_axes(flags):
        names = tuple(sorted(varying, key=str))
        raise ValueError(
            f"The non-finite count is varying over mesh axes {names} (inside shard_map) "
            "and no `axis_name` was given: the shards would decide differently whether "
            f"to skip, and one would step while another does not. Pass axis_name={names!r} "
            "(to dynamic_scale / static_scale / no_scale, value_and_grad or all_finite).")
    return finite_from_count(jnp.sum(flags, dtype=jnp.int32)), flags > 0


def reduce_leaf_stats(values: list, axis_name: AxisName, ops: tuple) -> list:
    """Each of ``values`` (one array per leaf) reduced over the axes of ``axis_name`` it
    varies over, with ``ops[k]`` (``lax.pmax`` / ``lax.psum``) for column block k; as
    `mpfunc.all_finite` reduces its count. Leaves varying alike are reduced together
    (`mpfunc.precision_report`'s columns)."""
    by_axes: dict = {}
    for i, v in enumerate(values):
        by_axes.setdefault(_varying_axes(v[0]), []).append(i)
    out = list(values)
    axes = (() if axis_name is None else
            tuple(axis_name) if isinstance(axis_name, tuple) else (axis_name,))
    for varying, idx in by_axes.items():
        if not axes:
            if varying:
                names = tuple(sorted(varying, key=str))
                raise ValueError(
                    f"Gradients vary over mesh axes {names} (inside shard_map) and no "
                    f"`axis_name` was given: pass axis_name={names!r}, the axes the finite "
                    "check reduces over, so that every shard reports the whole leaf.")
            continue
        if varying and (rest := varying - set(axes)):
            raise ValueError(
                f"Gradients vary over {sorted(rest, key=str)}, mesh axes not in "
                f"`axis_name` ({axis_name!r}); add them, as for the finite check.")
        over = tuple(a for a in axes if a in varying) if varying else axes
        stacked = [jnp.stack([values[i][k] for i in idx]) for k in range(len(ops))]
        try:
            reduced = [op(s, over) for op, s in zip(ops, stacked)]
        except ValueError:  # typed invariant over every axis: the same on every shard
            continue
        except NameError as e:
            raise unbound_axis_error(axis_name, e) from None
        for j, i in enumerate(idx):
            out[i] = tuple(r[j] for r in reduced)
    return out
