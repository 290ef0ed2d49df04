"""Float32 master weights for half-precision params (naive mode, apex O2).

The inner optimizer steps float32 masters; each master has a source, the model's half
param its gradient comes from and its value goes back to. Gradients go model -> master
in one foreach copy, values master -> model in another.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

__all__ = [
    "make_masters",
    "keep_half_masters",
    "copy_grads_to_masters_",
    "copy_masters_to_model_",
    "release_master_grads_",
]

Pairs = Sequence[tuple[torch.Tensor, torch.Tensor]]  # (model param, its master)


def make_masters(optimizers: Sequence[torch.optim.Optimizer]) -> dict[int, nn.Parameter]:
    """One float32 master per optimizer param, keyed by ``id(param)``; call before the
    model is cast. The master aliases the float32 storage the model is about to drop:
    exact values and no extra copy."""
    return {id(p): nn.Parameter(p.detach(), requires_grad=p.requires_grad)
            for opt in optimizers for g in opt.param_groups for p in g["params"]}


def keep_half_masters(masters: dict[int, nn.Parameter],
                      optimizers: Sequence[torch.optim.Optimizer]) -> dict[int, nn.Parameter]:
    """The masters whose param was cast to half precision (the others need none)."""
    dtypes = {id(p): p.dtype for opt in optimizers for g in opt.param_groups
              for p in g["params"]}
    return {k: m for k, m in masters.items() if dtypes[k] != torch.float32}


def copy_grads_to_masters_(pairs: Pairs) -> None:
    """Model (half) grads -> float32 master grads in one foreach copy; the half grads
    are released right after (nothing reads them again before the next backward)."""
    model_grads, master_grads = [], []
    for p, m in pairs:
        if p.grad is None:
            m.grad = None
            continue
        if m.grad is None:
            m.grad = torch.empty_like(m)
        model_grads.append(p.grad)
        master_grads.append(m.grad)
    if model_grads:
        torch._foreach_copy_(master_grads, model_grads)
    for p, _ in pairs:
        p.grad = None


def copy_masters_to_model_(pairs: Pairs) -> None:
    """Master values -> model params (rounded to the params' dtype), one foreach copy."""
    if pairs:
        torch._foreach_copy_([p.data for p, _ in pairs], [m.data for _, m in pairs])


def release_master_grads_(pairs: Pairs) -> None:
    """Master grads are dead once the step is taken (or skipped); freeing them keeps
    them from sitting beside the next forward's activations."""
    for _, m in pairs:
        m.grad = None
