"""Which params made the last step of an `AmpOptimizer` skip, for
``scale_metrics(skip_leaves=True)``, and the names the optimizer knows them by.

Where the host reads ``found_inf`` to decide a skip (a non-fused optimizer), the flags
are taken only on a skipped step, for free. Where a fused optimizer decides in its
kernel, and the user asked for it (`AmpOptimizer.record_skip_leaves`), the check fills
one flag per gradient (`fused.unscale_and_check_`, the same bytes, one launch per
gradient) and the record keeps them on the device when the step skips. Flags are
MAX-reduced over the meshes of DTensor params; plain process groups are not reduced
(their ranks may hold different params: pipeline stages), so each rank names its own.
The JAX twin is ``LossScaleState.skip_leaves``.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from mpfunc_torch._src import fused
from mpfunc_torch._src.distributed import all_reduce_found_inf_, host_values
from mpfunc_torch._src.sharding import local, mesh_groups

__all__ = ["attach_model", "current_grads", "new_step_flags", "param_names",
           "skip_flags_every_step_", "skip_flags_on_skip_", "skip_names"]


def _dense(g: torch.Tensor) -> torch.Tensor:
    g = local(g.detach())
    return g.coalesce().values() if g.is_sparse else g


def attach_model(optimizers: Sequence[Any], model: nn.Module) -> None:
    """Tells each ``AmpOptimizer`` its model: the params' names and any forward watch."""
    names = {id(p): n for n, p in model.named_parameters()}
    for opt in optimizers:
        opt._param_names = names
        opt._model_ref = weakref.ref(model)


def param_names(opt) -> list[str]:
    """The names of the owned params, in order: the model's, else their place."""
    known = getattr(opt, "_param_names", {})
    out, i = [], 0
    for gi, group in enumerate(opt.optimizer.param_groups):
        for pi, _ in enumerate(group["params"]):
            out.append(known.get(id(opt._sources[i]), f"param_groups[{gi}][{pi}]"))
            i += 1
    return out


def current_grads(opt) -> list:
    """Per owned param, the gradient the step will use now: the owned (master) one if it
    exists, else its source's (the model's half gradient before `unscale_`)."""
    return [q.grad if q.grad is not None else src.grad
            for q, src in zip(opt._owned, opt._sources)]


def _flags(opt) -> torch.Tensor:
    """Per owned param, whether its current gradient holds an inf or NaN (a float32
    vector on the device; `fused.nonfinite_flags_`), MAX-reduced over the meshes of
    DTensor params."""
    flags = torch.zeros(len(opt._owned), dtype=torch.float32, device=opt._device)
    for i, g in enumerate(current_grads(opt)):
        if g is not None:
            fused.nonfinite_flags_([_dense(g)], flags[i:i + 1])
    all_reduce_found_inf_(flags, mesh_groups(opt._owned + opt._sources))
    return flags


def new_step_flags(opt) -> torch.Tensor | None:
    """Where a fused optimizer decides the skip on the device, a flag vector (one per
    gradient the check reads) for the check to fill (see `fused.unscale_and_check_`),
    kept for `skip_flags_every_step_`; None elsewhere (a skip is recorded on the host)."""
    opt._step_flags = None
    if not opt._fused or not opt._record_skips_every_step:
        return None
    index = [i for i, q in enumerate(opt._owned) if q.grad is not None]
    flags = torch.zeros(len(index), dtype=torch.float32, device=opt._device)
    opt._step_flags = (index, flags)
    return flags


def skip_flags_every_step_(opt, found_inf: torch.Tensor) -> None:
    """Where the skip is decided on the device (a fused optimizer): before the step,
    records this step's per-param flags if ``found_inf`` is set (no host sync). They
    come from the check's own per-gradient flags (`new_step_flags`); where the check ran
    without them (a chunked step), from one more check-only pass."""
    kept, opt._step_flags = getattr(opt, "_step_flags", None), None
    if kept is None:
        flags = _flags(opt)
    else:
        index, flags = kept
        if len(index) != len(opt._owned):  # some params have no gradient this step
            full = torch.zeros(len(opt._owned), dtype=torch.float32, device=opt._device)
            full[host_values(index, torch.int64, opt._device)] = flags  # one scatter
            flags = full
        all_reduce_found_inf_(flags, mesh_groups(opt._owned + opt._sources))
    prev = getattr(opt, "_skip_flags", None)
    if prev is None or prev.shape != flags.shape:
        prev = torch.zeros_like(flags)
    opt._skip_flags = torch.where(found_inf.to(flags.device) > 0, flags, prev)


def skip_flags_on_skip_(opt) -> None:
    """Where the host already read that this step is skipped: records its flags."""
    opt._skip_flags = _flags(opt)


def skip_names(opt) -> list[str]:
    """The names of the params that held an inf or NaN at the last skipped step (one
    read from the device); ``[]`` before any skip."""
    flags = getattr(opt, "_skip_flags", None)
    if flags is None:
        return []
    return [n for n, f in zip(param_names(opt), flags.cpu().tolist()) if f]
