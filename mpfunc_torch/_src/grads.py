"""Gradient bookkeeping for `AmpOptimizer`: sparse coalescing and per-loss unscaling.

``owned`` are the tensors the inner optimizer steps (float32 masters where there are
master weights); ``sources[i]`` is the model param whose ``.grad`` feeds ``owned[i]``
(the same tensor without master weights).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mpfunc_torch._src import fused
from mpfunc_torch._src.distributed import all_reduce_found_inf_
from mpfunc_torch._src.sharding import local

__all__ = ["grads_of", "coalesce_sparse_", "set_aside_", "add_back_unscaled_", "check_",
           "inv_scale_or_none", "unscale_checked_", "unscale_owned_", "recheck_unscaled_"]


def grads_of(owned: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The gradients of ``owned``: each rank's local shard for DTensors (FSDP2, tensor
    parallelism), so the fused kernels run on local data and run no collective."""
    return [local(q.grad) for q in owned if q.grad is not None]


def coalesce_sparse_(owned: Sequence[torch.Tensor]) -> None:
    """As GradScaler does: coalesce sparse grads into ``.grad``, so that unscaling
    reaches the gradient itself (an uncoalesced tensor's coalesced values are a
    temporary copy) and the check sees the summed duplicates."""
    for q in owned:
        if q.grad is not None and q.grad.is_sparse and not q.grad.is_coalesced():
            q.grad = q.grad.coalesce()


def check_(grads: Sequence[torch.Tensor], found_inf: torch.Tensor,
           flags: torch.Tensor | None = None) -> None:
    """Raises ``found_inf`` if any of ``grads`` holds an inf/NaN (no unscaling); with
    ``flags``, also ``flags[i]`` for ``grads[i]`` (see `fused.unscale_and_check_`)."""
    fused.unscale_and_check_(grads, found_inf, torch.ones((), device=found_inf.device), flags)


def inv_scale_or_none(scaler) -> torch.Tensor | None:
    """``scaler``'s ``1 / scale`` (a new device tensor), or None where it does not scale."""
    return None if scaler.kind == "none" else scaler.inv_scale()


def unscale_checked_(grads: Sequence[torch.Tensor], found_inf: torch.Tensor,
                     inv_scale: torch.Tensor | None, may_go_below_one: bool,
                     flags: torch.Tensor | None = None) -> None:
    """Multiplies ``grads`` by ``inv_scale`` in place (None: no unscaling) and raises
    ``found_inf`` on inf/NaN: one fused pass, which checks the values before unscaling;
    where the scale can be below 1 (or nothing is unscaled) a check-only pass follows.
    With ``flags``, each gradient's own flag too (see `fused.unscale_and_check_`)."""
    if inv_scale is not None:
        fused.unscale_and_check_(grads, found_inf, inv_scale, flags)
    if inv_scale is None or may_go_below_one:
        check_(grads, found_inf, flags)


def set_aside_(owned: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> list:
    """Takes the gradients accumulated so far out of ``.grad`` and returns them."""
    stash = [q.grad for q in owned]
    for q, src in zip(owned, sources):
        q.grad = None
        src.grad = None
    return stash


def add_back_unscaled_(owned, sources, stash, scaler, found_inf: torch.Tensor) -> None:
    """Unscales the gradients back-propagated since `set_aside_` with ``scaler``'s scale
    (in the owned dtype: float32 for master weights), checks them after unscaling into
    ``found_inf``, and adds the gradients set aside.

    Each half gradient is released as soon as it is converted, and a dense fresh
    gradient is added into the one set aside in place (as autograd accumulates), each
    released as it is added: float32 grads peak at two sets (stash and fresh), not three.
    """
    fresh = []
    for q, src in zip(owned, sources):
        g = src.grad
        if g is not None and src is not q:
            g = g.to(q.dtype)
            src.grad = None
        fresh.append(g.coalesce() if g is not None and g.is_sparse else g)
    grads = [local(g) for g in fresh if g is not None]
    unscale_checked_(grads, found_inf, inv_scale_or_none(scaler), scaler.may_go_below_one)
    del grads
    for i, q in enumerate(owned):
        g, old = fresh[i], stash[i]
        fresh[i] = stash[i] = None  # so that each pair is freed once added
        if g is None or old is None:
            total = old if g is None else g
        elif (g.is_sparse or old.is_sparse or old.dtype != g.dtype or old.requires_grad
              or g.requires_grad):
            total = g + old  # sparse, mixed dtypes or a create_graph grad: out of place
        else:
            total = old.add_(g)
        q.grad = total.coalesce() if total is not None and total.is_sparse else total


def zero_grads_(params: Sequence[torch.Tensor], set_to_none: bool) -> None:
    """``Optimizer.zero_grad`` over ``params`` (each distinct tensor once)."""
    for p in {id(t): t for t in params}.values():
        if p.grad is None:
            continue
        if set_to_none:
            p.grad = None
        else:
            p.grad.detach_()
            p.grad.zero_()


def unscale_owned_(owned: Sequence[torch.Tensor], found: torch.Tensor, scaler, groups,
                   flags: torch.Tensor | None) -> None:
    """`AmpOptimizer.unscale_` with one scale: unscales and checks ``owned``'s gradients
    in one fused pass, then reduces ``found`` over ``groups``."""
    coalesce_sparse_(owned)
    unscale_checked_(grads_of(owned), found, inv_scale_or_none(scaler),
                     scaler.may_go_below_one, flags)
    all_reduce_found_inf_(found, groups)


def recheck_unscaled_(owned: Sequence[torch.Tensor], found: torch.Tensor,
                      found_per_loss: Sequence[torch.Tensor], groups,
                      flags: torch.Tensor | None) -> None:
    """`AmpOptimizer.unscale_` with several losses, each already unscaled after its
    backward: checks again what the step will use (a gradient may have changed since its
    backward, e.g. a manual all-reduce) and folds in every loss's flag, reduced over
    ``groups``."""
    coalesce_sparse_(owned)
    check_(grads_of(owned), found, flags)
    all_reduce_found_inf_(found, groups)
    for f in found_per_loss:
        all_reduce_found_inf_(f, groups)
        torch.maximum(found, f, out=found)
