"""Explicit cross-rank reduction of the inf check (no hidden global process group), and
host values put on the device without a host sync."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["normalize_groups", "all_reduce_found_inf_", "host_values"]


def host_values(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of the Python ``values`` on ``device``, with no host sync.

    ``torch.tensor(values, device="cuda")`` copies from pageable host memory with
    ``non_blocking=False``, which synchronizes the stream (torch's ``memcpy_and_sync``):
    the host would wait for every kernel queued before it. Here the values go through
    pinned memory and a non-blocking copy, which the stream orders like a kernel. Every
    tensor the library builds from host data in a step comes from here (a test checks).
    """
    t = torch.tensor(values, dtype=dtype)
    device = torch.device(device)
    if device.type == "cpu":
        return t
    if device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def normalize_groups(process_group: Any, name: str = "process_group") -> tuple[Any, ...]:
    """``None`` -> (), one group -> (group,), a sequence of groups -> tuple of groups.

    Errors name ``name``, the argument the user passed.
    """
    if process_group is None:
        return ()
    if isinstance(process_group, Sequence) and not isinstance(process_group, str):
        groups = tuple(process_group)
    else:
        groups = (process_group,)
    if groups and not torch.distributed.is_available():
        raise RuntimeError(f"`{name}` was given but torch.distributed is not available.")
    for g in groups:
        if isinstance(g, int) and g == torch.distributed.GroupMember.NON_GROUP_MEMBER:
            raise ValueError(
                f"`{name}` holds a group this rank ({torch.distributed.get_rank()}) is not a "
                "member of (torch.distributed.new_group returns NON_GROUP_MEMBER on the "
                "others): pass each rank the groups it belongs to.")
        if not isinstance(g, torch.distributed.ProcessGroup):
            raise TypeError(
                f"`{name}` must be a torch.distributed.ProcessGroup or a sequence of "
                f"them, got {type(g).__name__}: {g!r}."
            )
    if groups and not torch.distributed.is_initialized():
        raise RuntimeError(
            f"`{name}` was given but torch.distributed is not initialized; call "
            "torch.distributed.init_process_group first."
        )
    return groups


def all_reduce_found_inf_(found_inf: torch.Tensor, groups: Sequence[Any]) -> torch.Tensor:
    """MAX-reduces ``found_inf`` in place over each group, so every rank agrees.

    The reduction stays on the device (no host sync); with NCCL it is asynchronous to the
    host like any collective.
    """
    for group in groups:
        torch.distributed.all_reduce(found_inf, op=torch.distributed.ReduceOp.MAX, group=group)
    return found_inf
