"""The mode's function modes in the recompute of activation checkpointing.

``torch.utils.checkpoint`` restores ``torch.autocast`` for the recompute but no other
torch function mode; `checkpoint_context_fn` gives it the converted model's (apex O1's
fp32 list, the half-model modes of naive and apex O2), so the recompute computes what
the forward did. It sits above both ``autocast`` (the modes) and ``model`` (which tells
a converted model by its forward), so neither imports the other back.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch

from mpfunc_torch._src.autocast import Fp32Functions, HalfModelFp32Functions, HalfModelFunctions
from mpfunc_torch._src.model import AmpModel, _AmpForward, _uncompiled

__all__ = ["checkpoint_context_fn"]


def checkpoint_context_fn(model: torch.nn.Module) -> Callable[[], tuple[Any, Any]]:
    """The ``context_fn`` that makes activation checkpointing recompute in the mode.

    ``torch.utils.checkpoint.checkpoint`` restores ``torch.autocast`` for the recompute
    but no other torch function mode, so in apex O1 the ops on its fp32 list recompute
    at autocast's precision, not in float32 as in the forward, and in naive and apex O2
    the functions of `HalfModelFp32Functions` recompute in float16. The non-reentrant
    checkpoint then raises ``CheckpointError`` (the recomputed tensors' dtypes differ);
    the reentrant one does not check. Pass this as ``context_fn`` (non-reentrant only,
    torch's rule): the recompute runs under the mode's function mode too, and training
    equals the run without checkpointing bit for bit. In the other modes it adds
    nothing, so it can
    always be passed, also under ``torch.compile`` (which takes only selective-checkpoint
    contexts there: it gets ones that recompute everything, and the compiled graph
    recomputes with the mode's casts in it).

    Args:
      model: the model from `convert_to_amp`, the module it converted, or either
        wrapped in ``DistributedDataParallel``.

    Returns:
      A callable returning torch's ``(forward_context, recompute_context)`` pair.

    Examples:
      >>> import torch, mpfunc_torch
      >>> from torch.utils.checkpoint import checkpoint
      >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Softmax(-1))
      >>> model, opt, _ = mpfunc_torch.convert_to_amp(
      ...     net, torch.optim.SGD(net.parameters(), lr=0.1), mode="apex", opt_level="O1",
      ...     verbosity=0)
      >>> fn = mpfunc_torch.checkpoint_context_fn(model)
      >>> with torch.autocast("cpu", dtype=torch.float16):
      ...     y = checkpoint(net, torch.randn(2, 4), use_reentrant=False, context_fn=fn)
      >>> # HuggingFace: model.activation_checkpointing_enable(activation_checkpointing_kwargs=
      >>> #     {"use_reentrant": False, "context_fn": fn})
    """
    module, wrapped = model, False
    while isinstance(module, AmpModel | torch.nn.parallel.DistributedDataParallel):
        wrapped = wrapped or isinstance(module, AmpModel)
        module = module.module
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"`model` must be a model from convert_to_amp, got "
                        f"{type(model).__name__}.")
    forward = vars(_uncompiled(module)).get("forward")
    if not wrapped and not isinstance(forward, _AmpForward):
        raise TypeError("`model` must be a model from convert_to_amp (the model it returned, "
                        f"or the module it converted), got an unconverted "
                        f"{type(module).__name__}.")
    if not isinstance(forward, _AmpForward):
        return functools.partial(_checkpoint_contexts, None, None)
    kind = forward.function_mode
    return functools.partial(_checkpoint_contexts, kind,
                             forward.device_type if kind == "o1" else None)


def _checkpoint_contexts(kind: str | None, device_type: str | None) -> tuple[Any, Any]:
    if torch.compiler.is_compiling():
        # The compiled graph recomputes with the mode's casts already in it, and torch
        # takes only its selective-checkpoint modes here: recompute everything.
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        return create_selective_checkpoint_contexts(_recompute_all)
    if kind == "o1" and device_type is not None:
        recompute = Fp32Functions(device_type)
    elif kind == "half":
        recompute = HalfModelFp32Functions()
    elif kind == "half-pure":
        recompute = HalfModelFunctions()
    else:
        recompute = contextlib.nullcontext()
    return contextlib.nullcontext(), recompute


def _recompute_all(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.PREFER_RECOMPUTE
