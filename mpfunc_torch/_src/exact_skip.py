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
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from mpfunc_torch._src import fused
from mpfunc_torch._src.chunked_step import ChunkedStep, finish_chunked_step_
from mpfunc_torch._src.distributed import all_reduce_found_inf_
from mpfunc_torch._src.grads import check_, grads_of
from mpfunc_torch._src.master_weights import copy_masters_to_model_
from mpfunc_torch._src.wrapped_optimizer import mark_step_called

__all__ = ["step_in_kernel_", "take_or_drop_"]


def step_in_kernel_(optimizer: torch.optim.Optimizer, owned: Sequence[torch.Tensor],
                    grad_scale: torch.Tensor | None, found_inf: torch.Tensor,
                    groups: Sequence) -> None:
    """Checks the still-scaled grads of ``owned``, reduces the flag over ``groups``, and
    lets the fused ``optimizer`` unscale by ``grad_scale``, step and skip on the flag.

    Pass 1 is a check only (inverse scale 1); pass 2 is the optimizer's kernel, which
    also undoes its step count where it skipped. ``found_inf`` holds the flag after.
    """
    found_inf.zero_()
    check_(grads_of(owned), found_inf)
    all_reduce_found_inf_(found_inf, groups)  # the path ShardedGradScaler misses
    fused.step_with_found_inf_(optimizer, grad_scale, found_inf)


def take_or_drop_(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor,
                  pairs: Sequence, *, in_kernel: bool, host_skip: bool = False,
                  chunked: ChunkedStep | None = None) -> None:
    """Runs ``optimizer``'s step if ``found_inf`` is 0, and copies masters to the model.

    Args:
      optimizer: the inner optimizer, over the unscaled (and checked) gradients.
      found_inf: the reduced flag: 0-dim float32, non-zero where a gradient was inf/NaN.
      pairs: ``(model param, float32 master)`` pairs; empty without master weights.
      in_kernel: the optimizer is fused: its kernel takes ``found_inf`` and decides
        (no host read).
      host_skip: decide on the host even so (see `fused.fused_sgd_first_step_pending`).
      chunked: the `prepare_chunked_step_` result, for a step made chunk by chunk.
    """
    if in_kernel:
        inner = functools.partial(fused.step_with_found_inf_, optimizer, None, found_inf)
    else:
        inner = optimizer.step
    take = (in_kernel and not host_skip) or not found_inf.item()  # the one host read, where there is one
    if chunked is not None:
        finish_chunked_step_(chunked, found_inf, inner, take)
    elif take:
        inner()
    if take:
        copy_masters_to_model_(pairs)
    else:
        mark_step_called(optimizer)
