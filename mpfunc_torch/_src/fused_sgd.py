"""torch's fused SGD: what its kernels get wrong, asked of the installed torch, and the
workarounds `AmpOptimizer` applies (the skip decided on the host until the momentum
buffers exist, late params' buffers started at zero, O3's refusal on CPU)."""

from __future__ import annotations

import torch

__all__ = [
    "fused_cpu_sgd_updates_half",
    "is_fused_sgd_with_momentum",
    "fused_sgd_first_step_pending",
    "start_late_momentum_buffers_",
]


_SGD_HALF_CPU: dict[torch.dtype, bool] = {}


def fused_cpu_sgd_updates_half(dtype: torch.dtype) -> bool:
    """Whether torch's fused SGD on CPU updates every element of a ``dtype`` param.

    torch 2.11-2.13's kernel does not (a 1000-element float16 or bfloat16 param moved
    only in its last 8 elements); 2.14's does. Asked of the installed torch once per
    dtype: one step of a 1000-element param, compared with the for-loop SGD's.
    """
    if dtype not in _SGD_HALF_CPU:
        moved = []
        for fused in (True, False):
            p = torch.nn.Parameter(torch.ones(1000, dtype=dtype))
            p.grad = torch.full_like(p, 0.125)
            torch.optim.SGD([p], lr=0.5, fused=fused, foreach=None if fused else False).step()
            moved.append(p.detach())
        _SGD_HALF_CPU[dtype] = bool(torch.equal(*moved))
    return _SGD_HALF_CPU[dtype]


def is_fused_sgd_with_momentum(optimizer: torch.optim.Optimizer) -> bool:
    return (isinstance(optimizer, torch.optim.SGD) and bool(optimizer.defaults.get("fused"))
            and any(g["momentum"] != 0 for g in optimizer.param_groups))


def fused_sgd_first_step_pending(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a momentum group of a fused SGD has no momentum buffers yet.

    torch's fused SGD (2.13) allocates the buffers with ``empty_like`` on its first step
    and lets the kernel fill them; when that step is skipped (``found_inf``) they stay
    uninitialised, yet exist, so the next step uses garbage as momentum. Until this
    returns False a skip must be decided before calling the optimizer.
    """
    state = optimizer.state
    return any(
        g["momentum"] != 0 and all(state.get(p, {}).get("momentum_buffer") is None
                                   for p in g["params"])
        for g in optimizer.param_groups)


def start_late_momentum_buffers_(optimizer: torch.optim.Optimizer,
                                 stepped: set[int] | None = None) -> bool:
    """Makes the momentum buffer of each param that first gets a gradient after others
    in its group have theirs (a branch used late, a layer unfrozen, an expert routed to
    for the first time); returns whether every param of a momentum group has one now.

    torch's fused SGD (2.13) passes such a param's missing buffer to its kernel as None
    and fails with ``TypeError: expected Tensor as element i``. Its for-loop and
    foreach paths start the buffer as the gradient itself (``buf = grad``); the fused
    kernel, from a zero buffer, computes ``momentum * 0 + (1 - dampening) * grad``, the
    same value when ``dampening`` is 0. So the buffer starts as zeros here, and a step
    that is then skipped leaves it zero (which is how torch would start it anyway).

    Args:
      optimizer: a fused SGD.
      stepped: ids of the params this step updates (default: those with a ``.grad``);
        master params get their gradients only later, in a chunked step.

    Raises:
      ValueError: such a param in a group with ``dampening != 0``, where no start value
        gives torch's ``buf = grad``.
    """
    done = True
    for i, group in enumerate(optimizer.param_groups):
        if group["momentum"] == 0:
            continue
        state = [optimizer.state.get(p, {}).get("momentum_buffer") for p in group["params"]]
        if all(b is None for b in state):  # torch's own first step makes them all
            done = done and not group["params"]
            continue
        for p, buf in zip(group["params"], state):
            if buf is not None:
                continue
            if (p.grad is None) if stepped is None else (id(p) not in stepped):
                done = False
                continue
            if group["dampening"] != 0:
                raise ValueError(
                    f"param group {i} of the fused SGD has dampening="
                    f"{group['dampening']!r} and a param that gets its first gradient "
                    "after the others have momentum buffers: torch's fused SGD cannot "
                    "step it (its kernel gets None), and with dampening no zero start "
                    "gives torch's buf = grad. Use SGD(foreach=True), or dampening=0.")
            optimizer.state[p]["momentum_buffer"] = torch.zeros_like(
                p, memory_format=torch.preserve_format)
    return done
