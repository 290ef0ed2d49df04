"""`boost` and `backward`: Colossal-AI's Booster training loop, ported line for line.

``model, optimizer, criterion, dataloader, lr_scheduler = booster.boost(...)`` and
``booster.backward(loss, optimizer)`` become `boost` and `backward`. Only the mixed
precision is done here (by `convert_to_amp`); Colossal's plugins (DDP, ZeRO, ...) are
not re-implemented: set up distribution with torch, and name its process groups.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from _mpfunc_common.mixed_precision import MixedPrecisionConfig
from mpfunc_torch._src.model import AmpCriterion, AmpModel
from mpfunc_torch._src.modes import convert_to_amp
from mpfunc_torch._src.optimizer import AmpOptimizer

__all__ = ["boost", "backward"]


def boost(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    criterion: Callable | None = None,
    dataloader: Any = None,
    lr_scheduler: Any = None,
    *,
    mixed_precision: str | MixedPrecisionConfig,
    process_group: Any = None,
    fp8_amax_group: Any = None,
    device: str | None = None,
    step_chunks: int = 1,
) -> tuple[AmpModel, AmpOptimizer, AmpCriterion | None, Any, Any]:
    """``Booster(mixed_precision=...).boost(...)`` as one function.

    Converts ``model``, ``optimizer`` and ``criterion`` with `convert_to_amp` and returns
    ``dataloader`` and ``lr_scheduler`` unchanged (the same objects). A scheduler built on
    ``optimizer`` keeps driving it: the wrapped optimizer steps the same param groups
    (master weights included), so the learning rates it sets are the ones used.

    Args:
      model: the float32 model.
      optimizer: its torch optimizer, with no state yet.
      criterion: the loss function, or None.
      dataloader: anything; returned as is (mpfunc does not shard data).
      lr_scheduler: a scheduler on ``optimizer``, or None; returned as is.
      mixed_precision: ``"fp16"``, ``"fp16_apex"``, ``"fp16_naive"``, ``"bf16"``,
        ``"fp8"`` or a config object (`FP16TorchMixedPrecision`, ...), as in ``Booster``.
      process_group: process group(s) the inf check is reduced over (see
        `convert_to_amp`).
      fp8_amax_group: ``"fp8"`` only: the data-parallel group(s) the fp8 amaxes are
        reduced over (see `convert_to_amp`).
      device: ``"cpu"``/``"cuda"`` to assert where the model runs, or None.
      step_chunks: with master weights, step the optimizer in chunks to save memory
        (see `convert_to_amp`).

    Returns:
      ``(model, optimizer, criterion, dataloader, lr_scheduler)``.

    Raises:
      ValueError: an unknown ``mixed_precision`` (listing the valid ones), a scheduler
        on another optimizer, or anything `convert_to_amp` refuses.

    Examples:
      >>> import torch, mpfunc_torch
      >>> net = torch.nn.Linear(4, 2)
      >>> opt = torch.optim.SGD(net.parameters(), lr=0.1)
      >>> sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
      >>> model, opt, crit, loader, sched = mpfunc_torch.boost(
      ...     net, opt, torch.nn.CrossEntropyLoss(), None, sched, mixed_precision="fp16_naive")
      >>> net.weight.dtype, opt.param_groups[0]["params"][0].dtype
      (torch.float16, torch.float32)
    """
    if mixed_precision is None:
        raise ValueError("`mixed_precision` is None; pass a Booster name ('fp16', "
                         "'fp16_apex', 'fp16_naive', 'bf16') or a config object.")
    if lr_scheduler is not None:
        inner = getattr(lr_scheduler, "optimizer", None)
        optimizers = list(optimizer) if isinstance(optimizer, list | tuple) else [optimizer]
        if inner is not None and not any(inner is o for o in optimizers):
            raise ValueError(
                f"`lr_scheduler` ({type(lr_scheduler).__name__}) drives "
                f"{type(inner).__name__} object {id(inner):#x}, not the `optimizer` given "
                "to boost; build the scheduler on that optimizer."
            )
    model, optimizer, criterion = convert_to_amp(
        model, optimizer, criterion, mixed_precision=mixed_precision,
        process_group=process_group, fp8_amax_group=fp8_amax_group, device=device,
        step_chunks=step_chunks,
    )
    return model, optimizer, criterion, dataloader, lr_scheduler


def backward(loss: torch.Tensor, optimizer: AmpOptimizer, **kwargs: Any) -> None:
    """``booster.backward(loss, optimizer)``: scales ``loss`` and back-propagates.

    The same as ``optimizer.backward(loss, **kwargs)`` (``loss_id=``, ``retain_graph=``).

    Raises:
      TypeError: ``optimizer`` is not the one `boost` / `convert_to_amp` returned.
    """
    if not isinstance(optimizer, AmpOptimizer):
        raise TypeError(
            "`optimizer` must be the optimizer returned by mpfunc_torch.boost or "
            f"convert_to_amp (an AmpOptimizer), got {type(optimizer).__name__}; without "
            "it the loss would not be scaled."
        )
    optimizer.backward(loss, **kwargs)
