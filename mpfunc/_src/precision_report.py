"""Which gradient leaf overflowed, and how close each one is to overflow or underflow.

`precision_report` reduces every floating gradient leaf on the device to a few numbers
(`_mpfunc_common.precision_report.LEAF_RULE`) and returns them as a `PrecisionReport`, a
pytree of device arrays: it runs inside a jitted step (or ``shard_map``) and is read on
the host only when asked. The torch twin is ``mpfunc_torch/_src/precision_report.py``.

With ``record_skip_leaves=True``, the loss-scale transformations also keep, in their
state, which leaves were non-finite at the last skipped step (`skip_record`, read by
``scale_metrics(..., skip_leaves=params)``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.core
import jax.numpy as jnp
import numpy as np
from jax import lax

from _mpfunc_common.precision_report import (
    FloatFormat,
    check_loss_scale,
    check_report_dtype,
    format_table,
    leaf_rows,
    nonfinite_names,
)
from mpfunc._src.cancelled_updates import check_like, update_counts, update_pairs
from mpfunc._src.distributed import AxisName, check_axis_name, reduce_leaf_stats
from mpfunc._src.eager_jit import jit_when_eager
from mpfunc._src.scale_state import _find_states
from mpfunc._src.skip_record import _float_leaves, _host_flags

__all__ = ["NamedFlags", "PrecisionReport", "precision_report", "reduce_flags"]

_F32, _I32, _U8 = jnp.float32, jnp.int32, jnp.uint8


@functools.partial(jax.tree_util.register_dataclass, data_fields=["flags"],
                   meta_fields=["names"])
@dataclasses.dataclass(frozen=True, repr=False)
class NamedFlags:
    """A bool device vector with a static name per element, in order: which modules'
    outputs held an inf or NaN in a watched forward (``mpfunc.watch_nonfinite``).

    A registered pytree (``names`` is static), so it passes through ``jit``, ``grad``'s
    ``has_aux`` and ``shard_map``. The flags are read on the host only by `set_names` and
    `first_set`.
    """

    flags: jax.Array
    names: tuple[str, ...]

    def __repr__(self) -> str:  # reads nothing from the device
        return f"NamedFlags({len(self.names)} names)"

    def set_names(self) -> list[str]:
        """The names whose flag is set, in order (one read from the device)."""
        return [n for n, f in zip(self.names, _host_flags(self.flags)) if f]

    def first_set(self) -> str | None:
        """The first name whose flag is set, or None (one read from the device)."""
        return next(iter(self.set_names()), None)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["nonfinite", "amax", "zeros", "underflows", "sizes", "loss_scale",
                 "forward", "update_counts"],
    meta_fields=["paths", "dtype"])
@dataclasses.dataclass(frozen=True, repr=False)
class PrecisionReport:
    """What `precision_report` returns: per-leaf device arrays, read on the host on demand.

    A registered pytree (``paths`` and ``dtype`` are static), so it can be returned
    from a jitted step, ``shard_map``-ped (replicated: ``out_specs=P()``) or stacked by
    ``lax.scan``. Nothing is copied to the host until `rows`, `nonfinite_paths`,
    `first_nonfinite_module` or ``str(report)`` is called (each reads it once).

    Attributes:
      nonfinite: bool ``[n]``, one per floating leaf, in tree order.
      amax: float32 ``[n]``: the largest finite ``|g|`` of each leaf (0 if none).
      zeros: int32 ``[n]``: exactly-zero elements.
      underflows: int32 ``[n]``: non-zero elements that ``dtype`` flushes to 0 at the scale.
      sizes: int32 ``[n]``: elements (summed over the shards of ``axis_name``).
      loss_scale: float32 scalar, the scale the report was made for.
      forward: the `watch_nonfinite` flags of the forward, or None.
      update_counts: int32 ``[n, 2]``: ``(updated, cancelled)`` per leaf (`CANCEL_RULE`;
        ``updated`` < 0 where the leaf has no floating update), or None without updates.
      paths: the leaves' ``jax.tree_util.keystr`` paths (static).
      dtype: the half-precision format's name (static).
    """

    nonfinite: jax.Array
    amax: jax.Array
    zeros: jax.Array
    underflows: jax.Array
    sizes: jax.Array
    loss_scale: jax.Array
    forward: NamedFlags | None
    paths: tuple[str, ...]
    dtype: str
    update_counts: jax.Array | None = None

    def __repr__(self) -> str:  # reads nothing from the device
        return f"PrecisionReport({len(self.paths)} leaves, dtype={self.dtype})"

    def _read(self) -> tuple[list[dict[str, Any]], float, list | None]:
        leaves = jax.tree_util.tree_leaves(self)
        if any(isinstance(x, jax.core.Tracer) for x in leaves):
            raise TypeError("The report holds traced values: read it outside `jit` (return "
                            "it from the step, then call rows() / str() on the result).")
        fwd = None if self.forward is None else self.forward.flags
        got = jax.device_get((self.nonfinite, self.amax, self.zeros, self.underflows,
                              self.sizes, self.loss_scale, fwd, self.update_counts))
        *arrays, fwd, upd = got
        nonfinite, amax, zeros, under, sizes, scale = (np.asarray(v) for v in arrays)
        upd = None if upd is None else np.asarray(upd).reshape(-1, 2)
        rows = leaf_rows(self.paths, nonfinite.reshape(-1), amax.reshape(-1),
                         zeros.reshape(-1), under.reshape(-1), sizes.reshape(-1),
                         float(scale), check_report_dtype(self.dtype, self.dtype),
                         None if upd is None else (upd[:, 0], upd[:, 1]))
        return rows, float(scale), None if fwd is None else np.asarray(fwd).reshape(-1).tolist()

    def rows(self) -> list[dict[str, Any]]:
        """One dict per leaf, in tree order: ``name`` (the keystr path), ``nonfinite``,
        ``amax``, ``zero_fraction``, ``underflow_fraction``, ``headroom_bits`` (and
        ``update_cancelled`` when made with ``updates``)."""
        return self._read()[0]

    def nonfinite_paths(self) -> list[str]:
        """The keystr paths of the leaves holding an inf or NaN, in tree order."""
        return nonfinite_names(self.rows())

    @property
    def first_nonfinite_module(self) -> str | None:
        """The first module, in the order its call returned, whose output held an inf or
        NaN in the watched forward (`watch_nonfinite`); None if none did, or if the
        report was made without ``forward=``."""
        if self.forward is None:
            return None
        return self.forward.first_set()

    def __str__(self) -> str:
        rows, scale, fwd = self._read()
        first = None
        if fwd is not None and self.forward is not None:
            first = next((n for n, f in zip(self.forward.names, fwd) if f), None)
        return format_table(rows, scale, check_report_dtype(self.dtype, self.dtype),
                            first, watched=fwd is not None)


def _dtype_format(dtype: Any) -> FloatFormat:
    try:
        name = jnp.dtype(dtype).name
    except TypeError:
        name = None
    return check_report_dtype(name, dtype)


def _scale_array(loss_scale: Any) -> jax.Array:
    """The scale as a float32 scalar; Python and NumPy numbers are checked (> 0, finite),
    device arrays are not read (a host sync)."""
    if loss_scale is None:
        return jnp.ones((), _F32)
    if isinstance(loss_scale, jax.Array):
        if loss_scale.shape != () or not jnp.issubdtype(loss_scale.dtype, jnp.floating):
            raise TypeError("`loss_scale` must be a floating scalar, got an array of dtype "
                            f"{loss_scale.dtype} and shape {loss_scale.shape}.")
        return loss_scale.astype(_F32)
    if isinstance(loss_scale, np.ndarray | np.generic) and np.shape(loss_scale) == ():
        loss_scale = loss_scale.item()
    if not isinstance(loss_scale, int | float) and len(found := _find_states(loss_scale)) == 1:
        return found[0].loss_scale  # read now: NNX's state is a mutable variable
    return jnp.asarray(check_loss_scale(loss_scale), _F32)


def _partitioned(x: jax.Array) -> bool:
    """Whether XLA's SPMD partitioner may split ``x`` over devices (plain ``jit`` over a
    multi-device mesh), rather than ``x`` living whole on each device (one device, or
    inside ``shard_map``, where every axis is manual)."""
    try:
        mesh = jax.typeof(x).sharding.mesh
    except Exception:  # pragma: no cover - no sharding in the type
        return False
    manual = jax.sharding.AxisType.Manual
    return not mesh.empty and mesh.size > 1 and any(t != manual for t in mesh.axis_types)


def _leaf_stats(x: jax.Array, threshold: jax.Array):
    """One leaf's ``(nonfinite, amax)`` (float32) and ``(zeros, underflows, size)``
    (int32), by `LEAF_RULE`.

    On whole arrays the four reductions are one variadic ``lax.reduce``: one pass over
    the leaf (on XLA:CPU 8x faster than four reductions, BENCHMARKS.md section 9). XLA's
    SPMD partitioner all-gathers a variadic reduction's operand, so a leaf it may split
    gets four plain reductions, each of which it reduces in place.
    """
    a = jnp.abs(x).astype(_F32)
    finite = lax.is_finite(a)
    # Zero by its bits: XLA on CPU reads float32 subnormals as 0, torch does not.
    nonzero = lax.bitcast_convert_type(a, _I32) != 0
    ops = (jnp.where(finite, _U8(0), _U8(1)), jnp.where(finite, a, _F32(0)),
           nonzero.astype(_I32),
           (nonzero & (a <= threshold)).astype(_I32))
    dims = tuple(range(a.ndim))
    if _partitioned(x):
        bad, amax, nonzeros, under = (jnp.max(ops[0], initial=_U8(0)),
                                      jnp.max(ops[1], initial=_F32(0)),
                                      jnp.sum(ops[2], dtype=_I32), jnp.sum(ops[3], dtype=_I32))
    else:
        bad, amax, nonzeros, under = lax.reduce(
            ops, (_U8(0), _F32(0), _I32(0), _I32(0)),
            lambda p, q: (lax.max(p[0], q[0]), lax.max(p[1], q[1]), lax.add(p[2], q[2]),
                          lax.add(p[3], q[3])), dims)
    size = jnp.asarray(a.size, _I32)
    return (jnp.stack([(bad > 0).astype(_F32), amax]),
            jnp.stack([size - nonzeros, under, size]))


@functools.partial(jit_when_eager, static_argnums=(2, 3))
def _grad_stats(leaves: tuple, scale: jax.Array, threshold: float, axis_name: AxisName):
    """The report's per-leaf columns of ``leaves`` (nonfinite, amax, zeros, underflows,
    sizes), reduced over ``axis_name``: one program of the whole tree where called
    eagerly (not one per op and leaf shape)."""
    limit = _F32(threshold) / scale  # once, as before: the same value for every leaf
    stats = reduce_leaf_stats([_leaf_stats(x, limit) for x in leaves], axis_name,
                              (lax.pmax, lax.psum))
    fl = jnp.stack([f for f, _ in stats]) if stats else jnp.zeros((0, 2), _F32)
    counts = jnp.stack([c for _, c in stats]) if stats else jnp.zeros((0, 3), _I32)
    return fl[:, 0] > 0, fl[:, 1], counts[:, 0], counts[:, 1], counts[:, 2]


@functools.partial(jit_when_eager, static_argnums=(1,))
def _update_stats(pairs: tuple, axis_name: AxisName) -> jax.Array:
    """The report's ``[n, 2]`` int32 (updated, cancelled), reduced as `_grad_stats`."""
    upd = reduce_leaf_stats(update_counts(pairs), axis_name, (lax.psum,))
    return jnp.stack([c for (c,) in upd]) if upd else jnp.zeros((0, 2), _I32)


def reduce_flags(flags: jax.Array, axis_name: AxisName) -> jax.Array:
    """A bool vector OR-ed over the axes of ``axis_name`` it varies over."""
    (out,) = reduce_leaf_stats([(flags.astype(_F32),)], axis_name, (lax.pmax,))[0]
    return out > 0


def precision_report(
    grads: Any,
    *,
    loss_scale: Any = None,
    dtype: Any = jnp.float16,
    axis_name: AxisName = None,
    params: Any = None,
    forward: NamedFlags | None = None,
    updates: Any = None,
) -> PrecisionReport:
    """Per-leaf overflow and underflow statistics of ``grads``, on the device.

    For every floating leaf, in tree order:

    .. code-block:: python

        # per gradient leaf g (its local shard, then reduced over the shards)
        a = abs(float32(g))                                  # elementwise, in float32
        nonfinite = any(not isfinite(a))                     # MAX over shards
        amax = max(a where isfinite(a), initial=0)           # float32; MAX over shards
        zeros = count(a == 0)                                # these three: SUM over shards
        underflows = count(a != 0 and a <= float32(tiny(dtype) / 2) / loss_scale)
        size = count(a)
        # on the host, from those numbers (shared code, so both frameworks agree bit for bit)
        zero_fraction = zeros / size                         # 0.0 for an empty leaf
        underflow_fraction = underflows / (size - zeros)     # 0.0 when nothing is non-zero
        headroom_bits = log2(max(dtype) / (amax * loss_scale))   # inf when amax == 0

        tiny(dtype) is dtype's smallest subnormal: a scaled value at or below half of it
        rounds to 0 in dtype (round to nearest, ties to even); the threshold is divided by
        the scale once, in float32. A negative headroom means the scaled gradient no longer
        fits in dtype: it would overflow to inf. Zeros are counted by their bits: XLA on
        CPU reads a float32 subnormal as 0 in arithmetic, torch does not, so such a value
        is an underflow (not a zero) in both.

    Given ``updates`` (with ``params``), each row also has ``update_cancelled``:

    .. code-block:: python

        # per leaf given an update u and its stored param p (local shards, then SUM-reduced)
        new = round_to(p.dtype, float32(p) + float32(u))   # to nearest even: p + u as applied
        updated = count(u != 0)
        cancelled = count(u != 0 and new == p)              # p does not move: u rounded away
        update_cancelled = cancelled / updated              # 0.0 when u is all zero

        An update below half an ulp of its param (2**-8 at 1.0 in bfloat16, 2**-11 in
        float16) is always cancelled. XLA on CPU flushes float32 subnormals (in p or u) to
        zero, which torch does not.

    Pass the updates given to ``optax.apply_updates``: for half params stepped directly
    it is the share of the step lost for good (training stalls as it nears 1). The
    updates of `master_weights` (any storage) land exactly where the master puts the
    param, so they show 0: to see what the master keeps that the param alone would
    lose, pass ``inner``'s update; to see what float32 masters lose, pass them as params.

    Pass unscaled gradients with the scale they are trained at (``loss_scale=state``),
    or gradients that already carry the scale (``jax.grad`` of `scale_loss`) with
    ``loss_scale=None``. Inside ``shard_map`` give the ``axis_name`` the finite check
    uses: each leaf's flags and amax are MAX-reduced and its counts summed over the axes
    it varies over, so every shard holds the report of the whole leaf. Under plain
    ``jit`` the reductions are global already.

    Args:
      grads: a pytree of gradients; non-floating leaves are left out.
      loss_scale: None (1), a number > 0, a float32 device scalar, the `LossScaleState`
        or an optax state holding one (``nnx.Optimizer``'s ``opt_state`` too: its value
        at this call is kept, so a later ``update`` does not change the report). Only
        Python / NumPy numbers are checked: a device scale is not read.
      dtype: the half-precision format the scaled gradients live in: ``jnp.float16``
        (default), ``jnp.bfloat16``, ``jnp.float32``, ``jnp.float8_e4m3fn``,
        ``jnp.float8_e5m2`` (or their names).
      axis_name: mesh axes under ``shard_map``, as for `all_finite`.
      params: optional; ``grads`` must then have the structure and leaf shapes of it.
      forward: the flags of a watched forward (`watch_nonfinite`), for
        `PrecisionReport.first_nonfinite_module`.
      updates: optional, with ``params`` (the stored params they are added to), in their
        structure: adds ``update_cancelled`` (above) to each row.

    Returns:
      A `PrecisionReport`.

    Raises:
      TypeError: a non-floating ``dtype``, a ``loss_scale`` of the wrong type.
      ValueError: a scale that is not finite or not > 0, ``grads`` or ``updates`` that do
        not match ``params`` (or ``updates`` without them), leaves varying over mesh axes
        not in ``axis_name``.

    Examples:
      >>> import jax.numpy as jnp, mpfunc
      >>> grads = {"a": jnp.array([1e-12, 0.5]), "b": jnp.array([jnp.inf, 1.0])}
      >>> report = mpfunc.precision_report(grads, loss_scale=1024.0)
      >>> report.nonfinite_paths()
      ["['b']"]
      >>> row = report.rows()[0]
      >>> row["underflow_fraction"], row["zero_fraction"], round(row["headroom_bits"], 2)
      (0.5, 0.0, 7.0)
      >>> params = {"a": jnp.ones(2, jnp.bfloat16), "b": jnp.ones(2, jnp.bfloat16)}
      >>> updates = {"a": jnp.array([1e-4, 1e-2]), "b": jnp.array([1e-4, 0.0])}
      >>> report = mpfunc.precision_report(grads, params=params, updates=updates)
      >>> [row["update_cancelled"] for row in report.rows()]
      [0.5, 1.0]
    """
    fmt = _dtype_format(dtype)
    axis_name = check_axis_name(axis_name)
    scale = _scale_array(loss_scale)
    if params is not None:
        check_like(grads, params, "grads", "the gradients of these params (jax.grad of "
                   "the loss with respect to them)")
    if updates is not None:
        if params is None:
            raise ValueError("`updates` need `params`: give the stored params they are "
                             "added to (params=...), to know what rounding cancels.")
        check_like(updates, params, "updates", "the updates of these params (what "
                   "optax.apply_updates adds to them)")
    if forward is not None and not isinstance(forward, NamedFlags):
        raise TypeError("`forward` must be the `.flags` of mpfunc.watch_nonfinite, got "
                        f"{type(forward).__name__}.")
    paths, leaves = _float_leaves(grads)
    nonfinite, amax, zeros, under, sizes = _grad_stats(tuple(leaves), scale, fmt.threshold,
                                                       axis_name)
    if forward is not None:
        forward = NamedFlags(reduce_flags(forward.flags, axis_name), forward.names)
    upd = None
    if updates is not None:
        upd = _update_stats(update_pairs(params, updates, paths), axis_name)
    return PrecisionReport(
        nonfinite=nonfinite, amax=amax, zeros=zeros, underflows=under, sizes=sizes,
        loss_scale=scale, forward=forward, paths=paths, dtype=fmt.name,
        update_counts=upd)
