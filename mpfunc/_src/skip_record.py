"""Which floating leaves made the last step skip: the loss-scale state's record.

`skip_record_init` makes the record (one flag per floating leaf of the params, in tree
order), `skip_record` keeps a skipped step's flags (the finite check's own reductions, at
no extra cost), and `skip_paths` names the leaves on the host, for
``scale_metrics(skip_leaves=params)``. The torch twin is ``mpfunc_torch``'s
``skip_record``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.core
import jax.numpy as jnp
import numpy as np

from mpfunc._src.distributed import _is_float

__all__ = ["skip_paths", "skip_record", "skip_record_init"]


def _host_flags(flags: Any) -> list[bool]:
    if isinstance(flags, jax.core.Tracer):
        raise TypeError("These flags are traced values: read them outside `jit` (return "
                        "them from the step first).")
    return np.asarray(jax.device_get(flags)).reshape(-1).tolist()


def _float_leaves(tree: Any) -> tuple[tuple[str, ...], list]:
    pairs = [(jax.tree_util.keystr(p), x)
             for p, x in jax.tree_util.tree_flatten_with_path(tree)[0] if _is_float(x)]
    return tuple(p for p, _ in pairs), [x for _, x in pairs]


def skip_record_init(params: Any) -> jax.Array:
    """The state's record before any skip: one False per floating leaf of ``params``."""
    return jnp.zeros((len(_float_leaves(params)[0]),), jnp.bool_)


def skip_record(prev: jax.Array | None, flags: jax.Array,
                finite: jax.Array) -> jax.Array | None:
    """``prev`` on a finite step; on a skipped one, the step's per-leaf flags (from the
    finite check's own reductions: `mpfunc.all_finite`'s, at no extra cost).

    A record of another length (gradients with other leaves than ``init``'s params, which
    the chain form accepts) is left as it was, and so is a missing one (None).
    """
    if prev is None or prev.shape != flags.shape:
        return prev
    return jnp.where(finite, prev, flags)


def skip_paths(record: Any, params: Any) -> list[str]:
    """The keystr paths of ``params``' floating leaves whose flag is set in ``record``
    (one read from the device)."""
    if record is None:
        raise ValueError(
            "`skip_leaves` needs the loss-scale state's skip record, and this state keeps "
            "none: build the transformation with `record_skip_leaves=True` "
            "(`mpfunc.dynamic_scale`, `static_scale`, `no_scale` or `convert_to_amp`) and "
            "init the state with it. `mpfunc.precision_report(grads)` names every "
            "non-finite leaf of a step without it.")
    paths = _float_leaves(params)[0]
    if len(paths) != record.shape[0]:
        raise ValueError(
            f"`skip_leaves` must be the params the loss-scale state was made for: it has "
            f"{len(paths)} floating leaves, the state's record has {record.shape[0]}.")
    return [p for p, f in zip(paths, _host_flags(record)) if f]
