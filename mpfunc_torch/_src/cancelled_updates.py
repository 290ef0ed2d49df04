"""How much of an update rounding cancels when it is added to its stored param: the
``update_cancelled`` column of `mpfunc_torch.precision_report`
(`_mpfunc_common.precision_report.CANCEL_RULE`). The JAX twin is
``mpfunc/_src/cancelled_updates.py``.

Also the matching of per-param tensors given beside a model (gradients, updates).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from _mpfunc_common.suggest import did_you_mean
from mpfunc_torch._src.sharding import local

__all__ = ["match_tensors", "update_counts"]


def match_tensors(named: list, given: Any, name: str, owner: str = "`model`") -> list:
    """One tensor or None per ``(param name, param)`` of ``named``, from ``given``: a
    sequence in that order or a dict by name. Raises errors naming ``name`` and, for
    the params, ``owner``."""
    if isinstance(given, Mapping):
        unknown = sorted(set(given) - {n for n, _ in named})
        if unknown:
            raise ValueError(f"`{name}` names {unknown[:3]}, which are not params of "
                             f"{owner} (it has {[n for n, _ in named][:3]}...)"
                             f"{did_you_mean(unknown, [n for n, _ in named])}.")
        chosen = [given.get(n) for n, _ in named]
    elif isinstance(given, Sequence) and not isinstance(given, str):
        if len(given) != len(named):
            raise ValueError(f"`{name}` has {len(given)} entries, {owner} has {len(named)} "
                             "params: give one per param (None for none), in "
                             "named_parameters() order.")
        chosen = list(given)
    else:
        raise TypeError(f"`{name}` must be None, a sequence of tensors or a dict from "
                        f"param name to tensor, got {type(given).__name__}.")
    for (n, p), g in zip(named, chosen):
        if g is not None and (not isinstance(g, torch.Tensor) or g.shape != p.shape):
            got = tuple(g.shape) if isinstance(g, torch.Tensor) else type(g).__name__
            raise ValueError(f"`{name}` for {n!r} must be a tensor of the param's shape "
                             f"{tuple(p.shape)}, got {got}.")
    return chosen


def update_counts(pairs: Sequence[tuple[torch.Tensor, torch.Tensor | None]],
                  device: torch.device) -> torch.Tensor:
    """``(updated, cancelled)`` per ``(param, update)`` pair, an int64 ``[n, 2]`` tensor
    on ``device`` (`CANCEL_RULE`; ``(-1, 0)`` where the update is None or a param or
    update is not floating). Local shards; nothing is read from the device."""
    out = torch.zeros((len(pairs), 2), dtype=torch.int64, device=device)
    for i, (p, u) in enumerate(pairs):
        if u is None or not (p.is_floating_point() and u.is_floating_point()):
            out[i, 0] = -1
            continue
        p, v = local(p.detach()), local(u.detach()).to(device, torch.float32)
        new = (p.to(device, torch.float32) + v).to(p.dtype)
        nonzero = v != 0  # torch keeps subnormals: the report's count by bits
        cancelled = nonzero & (new == p.to(device))
        out[i] = torch.stack([torch.count_nonzero(nonzero), torch.count_nonzero(cancelled)])
    return out
