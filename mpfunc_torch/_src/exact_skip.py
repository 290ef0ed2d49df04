"""The exact skip of a torch optimizer step: taken only if every gradient is finite.

The torch side of ``mpfunc/_src/exact_skip.py``. A skipped step leaves params, master
weights and optimizer state bit for bit as they were; the step counts as this
iteration's optimizer step all the same (for LR schedulers). There are two ways to skip:

* **In the kernel** (`step_in_kernel_`): a fused optimizer (``Adam``/``AdamW``/``SGD``
  with ``fused=True``) takes ``found_inf`` and ``grad_scale``, unscales inside its kernel
  and leaves everything alone where ``found_inf`` is set. No host sync.
* **Take or drop** (`take_or_drop_`): any other optimizer runs or not, decided by one
  read of ``found_inf`` on the host (as ``torch.amp.GradScaler`` does); a fused one
  (unscaled before, for master weights, clipping or several losses) still decides in
  its kernel. Master weights are copied into the model only
  when the step was taken.

`exact_step_` is `AmpOptimizer.step` after its checks: unscale, clip, then one of the two.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from mpfunc_torch._src import fused, fused_sgd
from mpfunc_torch._src.chunked_step import (
    ChunkedStep,
    finish_chunked_step_,
    prepare_chunked_step_,
)
from mpfunc_torch._src.clipping import global_zero_count
from mpfunc_torch._src.distributed import all_reduce_found_inf_
from mpfunc_torch._src.grads import check_, grads_of
from mpfunc_torch._src.master_weights import copy_masters_to_model_
from mpfunc_torch._src.skip_record import (
    new_step_flags,
    skip_flags_every_step_,
    skip_flags_on_skip_,
)
from mpfunc_torch._src.wrapped_optimizer import mark_step_called

__all__ = ["exact_step_", "step_in_kernel_", "take_or_drop_"]


def step_in_kernel_(optimizer: torch.optim.Optimizer, owned: Sequence[torch.Tensor],
                    grad_scale: torch.Tensor | None, found_inf: torch.Tensor,
                    groups: Sequence, before_step: Any = None,
                    flags: torch.Tensor | None = None) -> None:
    """Checks the still-scaled grads of ``owned``, reduces the flag over ``groups``, and
    lets the fused ``optimizer`` unscale by ``grad_scale``, step and skip on the flag.

    Pass 1 is a check only (inverse scale 1); pass 2 is the optimizer's kernel, which
    also undoes its step count where it skipped. ``found_inf`` holds the flag after.
    ``before_step`` (no arguments) runs between the two, on the reduced flag; ``flags``
    (one per gradient) gets each gradient's own flag from the check.
    """
    found_inf.zero_()
    check_(grads_of(owned), found_inf, flags)
    all_reduce_found_inf_(found_inf, groups)  # the path ShardedGradScaler misses
    if before_step is not None:
        before_step()
    fused.step_with_found_inf_(optimizer, grad_scale, found_inf)


def take_or_drop_(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor,
                  pairs: Sequence, *, in_kernel: bool, host_skip: bool = False,
                  chunked: ChunkedStep | None = None, on_skip: Any = None,
                  low_precision: Any = None) -> None:
    """Runs ``optimizer``'s step if ``found_inf`` is 0, and copies masters to the model.

    Args:
      optimizer: the inner optimizer, over the unscaled (and checked) gradients.
      found_inf: the reduced flag: 0-dim float32, non-zero where a gradient was inf/NaN.
      pairs: ``(model param, float32 master)`` pairs; empty without master weights.
      in_kernel: the optimizer is fused: its kernel takes ``found_inf`` and decides
        (no host read).
      host_skip: decide on the host even so (see `fused_sgd.fused_sgd_first_step_pending`).
      chunked: the `prepare_chunked_step_` result, for a step made chunk by chunk.
      on_skip: called (with nothing) where the host read that the step is skipped,
        before any gradient is released.
      low_precision: the optimizer's `LowPrecision` (masters or state below float32):
        its write-back runs around the inner step, so the skip is decided on the host.
    """
    if in_kernel:
        inner = functools.partial(fused.step_with_found_inf_, optimizer, None, found_inf)
    else:
        inner = optimizer.step
    if low_precision is not None:
        inner, host_skip = low_precision.wrap(inner), True
    take = (in_kernel and not host_skip) or not found_inf.item()  # the one host read, where there is one
    if not take and on_skip is not None:
        on_skip()
    if chunked is not None:
        finish_chunked_step_(chunked, found_inf, inner, take)
    elif take:
        inner()
    if take and low_precision is not None:
        low_precision.advance()
    if take and (low_precision is None or low_precision.storage is None):
        copy_masters_to_model_(pairs)
    elif not take:
        mark_step_called(optimizer)


def exact_step_(opt, scaled: bool) -> torch.Tensor:
    """The step of `AmpOptimizer` ``opt`` after its checks: unscale (if ``scaled``, the
    gradients still hold the loss scale), clip and count as its plan says, then step or
    skip. Returns ``found_inf``, the reduced flag (0 where the step was taken)."""
    scaler = opt._scalers[0]
    # torch's fused SGD bug (see fused_sgd.fused_sgd_first_step_pending): until the
    # momentum buffers exist, skips are decided on the host.
    host_skip = opt._sgd_first = (
        opt._sgd_first and fused_sgd.fused_sgd_first_step_pending(opt.optimizer))
    if opt._sgd_late:  # and its params that get their first grads late
        opt._sgd_late = not fused_sgd.start_late_momentum_buffers_(opt.optimizer, {
            id(q) for q, src in zip(opt._owned, opt._sources)
            if q.grad is not None or src.grad is not None})
    found = opt._found_inf
    plan = opt.plan
    # Which params make a step skip (scale_metrics(skip_leaves=True)): recorded on the
    # device every step where the host never reads the flag (from the check's own
    # per-gradient flags), else only on a skip.
    lowp = getattr(opt, "_lowp", None)  # mpfunc_torch._src.low_precision: host skips
    every_step = opt._fused and not host_skip and not lowp and opt._record_skips_every_step
    if opt._kernel_unscales and scaled and not host_skip:
        step_in_kernel_(opt.optimizer, opt._owned,
                        scaler.scale if scaler.kind != "none" else None, found, opt._groups,
                        before_step=(lambda: skip_flags_every_step_(opt, found))
                        if every_step else None,
                        flags=new_step_flags(opt))
        return found
    chunked = None
    if opt._step_chunks > 1 and scaled:
        chunked = prepare_chunked_step_(
            opt._copy_order, opt._owned, opt._sources, scaler, found, opt._groups,
            opt._clip_groups, opt._step_chunks, plan.clip_grad,
            count_zeros=bool(plan.log_num_zeros_in_grad))
        opt._found_inf_per_loss[0].copy_(found)
        if chunked.clip is not None:
            opt.grad_norm = chunked.clip[1]
    else:
        if scaled:
            opt.unscale_()
        if plan.clip_grad:
            opt.grad_norm = opt.clip_grad_norm(plan.clip_grad)
        if plan.log_num_zeros_in_grad:
            opt.num_zeros_in_grad = global_zero_count(
                opt._owned, process_group=opt._clip_groups, mark_sources=opt._sources)
    if every_step:
        skip_flags_every_step_(opt, found)
    take_or_drop_(opt.optimizer, found, opt._pairs, in_kernel=opt._fused,
                  host_skip=host_skip, chunked=chunked,
                  on_skip=None if opt._fused and not (host_skip or lowp)
                  else lambda: skip_flags_on_skip_(opt), low_precision=lowp)
    if chunked and chunked.zeros is not None:
        opt.num_zeros_in_grad = global_zero_count(
            opt._owned, process_group=opt._clip_groups, mark_sources=opt._sources,
            counts=chunked.zeros)
    return found
