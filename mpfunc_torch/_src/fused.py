"""The one place that calls torch's private fused AMP kernels.

* ``torch._amp_foreach_non_finite_check_and_unscale_``: one fused pass that multiplies
  every gradient by ``inv_scale`` in place and raises ``found_inf`` if any is inf/NaN.
* ``torch._amp_update_scale_``: torch's one-kernel GradScaler update, used only where it
  computes exactly our rule (see `mpfunc_torch._src.loss_scale`).

Both exist on CPU and CUDA in every torch this project supports (>= 2.11).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch

__all__ = ["unscale_and_check_", "update_scale_", "count_zeros"]


def _group(tensors: Iterable[torch.Tensor]) -> dict[tuple, list[torch.Tensor]]:
    groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        if t is None:
            continue
        if t.is_sparse:
            t = t.coalesce()._values()
        groups[(t.device, t.dtype)].append(t)
    return groups


def unscale_and_check_(
    grads: Iterable[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor
) -> torch.Tensor:
    """Multiplies ``grads`` by ``inv_scale`` in place; sets ``found_inf`` to 1 on inf/NaN.

    One fused kernel per (device, dtype) group. ``found_inf`` (float32, 0-dim) is only
    ever raised, never cleared, so several calls accumulate. Pass ``inv_scale`` = 1 for a
    check without unscaling. Nothing is copied to the host.

    Returns:
      ``found_inf``.
    """
    if found_inf.dtype != torch.float32 or found_inf.dim() != 0:
        raise ValueError(f"`found_inf` must be a 0-dim float32 tensor, got {found_inf.dtype} "
                         f"with shape {tuple(found_inf.shape)}.")
    for (device, _dtype), group in _group(grads).items():
        fi = found_inf if found_inf.device == device else torch.zeros((), device=device)
        inv = inv_scale if inv_scale.device == device else inv_scale.to(device)
        torch._amp_foreach_non_finite_check_and_unscale_(group, fi, inv)
        if fi is not found_inf:
            found_inf.copy_(torch.maximum(found_inf, fi.to(found_inf.device)))
    return found_inf


def update_scale_(
    scale: torch.Tensor,
    growth_tracker: torch.Tensor,
    found_inf: torch.Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
) -> None:
    """torch's GradScaler update, in place, in one kernel."""
    torch._amp_update_scale_(
        scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval
    )


def count_zeros(grads: Iterable[torch.Tensor]) -> torch.Tensor:
    """Number of exactly-zero elements over ``grads``, as a device tensor (no host sync)."""
    grads = [g for g in grads if g is not None]
    if not grads:
        return torch.zeros((), dtype=torch.int64)
    total = sum(g.numel() for g in grads)
    nonzero = torch.zeros((), dtype=torch.float64, device=grads[0].device)
    for (_device, _dtype), group in _group(grads).items():
        # The L0 "norm" counts non-zero elements: one foreach call per group, accumulated
        # in float64 so that counts are exact (a float16 count would overflow at 65504).
        norms = torch._foreach_norm(group, 0, dtype=torch.float64)
        nonzero = nonzero + torch.stack(norms).sum().to(nonzero.device)
    return (total - nonzero).to(torch.int64)
