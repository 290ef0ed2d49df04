"""apex O1's fp32 function list, enforced on top of ``torch.autocast`` (also in the
recompute of activation checkpointing: `checkpoint_context_fn`).

``torch.autocast`` already runs many precision-sensitive ops in float32 on CUDA, but
its lists differ by device (on CPU, fp16 autocast runs softmax, exp, layer_norm and sum
in float16). `Fp32Functions` is a ``TorchFunctionMode``: inside it, every function on
apex O1's fp32 list gets its half-precision inputs cast to float32 and runs with
autocast off, whatever the device's autocast lists say.

It works under ``torch.compile`` (dynamo traces the mode into the graph as casts), both
when the mode is entered inside the compiled code and when a compiled module is called
inside the mode. For the second case the mode keeps no per-instance state but its
device: dynamo guards on the attributes of modes that are active when a compiled frame
starts, and a frozenset of functions there breaks its guards (torch 2.13:
``NameError: ___get_torch_function_mode_stack_at``). The list is one module-level
constant instead.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map_only

from _mpfunc_common.amp_config import APEX_O1_FP32_FUNCTIONS

__all__ = ["Fp32Functions", "fp32_callables", "checkpoint_context_fn"]

_HALF = (torch.float16, torch.bfloat16)


def fp32_callables(names=APEX_O1_FP32_FUNCTIONS) -> frozenset:
    """The torch, ``torch.nn.functional`` and ``Tensor`` callables for ``names``."""
    found = set()
    for name in names:
        for owner in (torch, F, torch.Tensor):
            fn = getattr(owner, name, None)
            if callable(fn):
                found.add(fn)
    return frozenset(found)


_FP32_CALLABLES = fp32_callables()


def _to_f32(x: torch.Tensor) -> torch.Tensor:
    return x.float() if x.dtype in _HALF else x


class Fp32Functions(TorchFunctionMode):
    """Runs apex O1's fp32 functions in float32 (inputs upcast, autocast disabled).

    Examples:
      >>> import torch
      >>> x = torch.randn(3, dtype=torch.float16)
      >>> with Fp32Functions("cpu"):
      ...     torch.exp(x).dtype, torch.tanh(x).dtype
      (torch.float32, torch.float16)
    """

    def __init__(self, device_type: str):
        super().__init__()
        self.device_type = device_type

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FP32_CALLABLES:
            args, kwargs = tree_map_only(torch.Tensor, _to_f32, (args, kwargs))
            with torch.autocast(self.device_type, enabled=False):
                return func(*args, **kwargs)
        return func(*args, **kwargs)


def checkpoint_context_fn(model: torch.nn.Module) -> Callable[[], tuple[Any, Any]]:
    """The ``context_fn`` that makes activation checkpointing recompute in the mode.

    ``torch.utils.checkpoint.checkpoint`` restores ``torch.autocast`` for the recompute
    but no other torch function mode, so in apex O1 the ops on its fp32 list recompute
    at autocast's precision, not in float32 as in the forward. The non-reentrant
    checkpoint then raises ``CheckpointError`` (the recomputed tensors' dtypes differ);
    the reentrant one does not check. Pass this as ``context_fn`` (non-reentrant only,
    torch's rule): the recompute runs under the fp32 list too, and training equals the
    run without checkpointing bit for bit. In the other modes it adds nothing, so it can
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
    from mpfunc_torch._src.model import AmpModel, _AmpForward, _uncompiled

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
    o1 = (isinstance(forward, _AmpForward) and forward.fp32_functions
          and forward.autocast_dtype is not None)
    return functools.partial(_checkpoint_contexts, forward.device_type if o1 else None)


def _checkpoint_contexts(device_type: str | None) -> tuple[Any, Any]:
    if torch.compiler.is_compiling():
        # The compiled graph recomputes with the mode's casts already in it, and torch
        # takes only its selective-checkpoint modes here: recompute everything.
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        return create_selective_checkpoint_contexts(_recompute_all)
    recompute = Fp32Functions(device_type) if device_type else contextlib.nullcontext()
    return contextlib.nullcontext(), recompute


def _recompute_all(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.PREFER_RECOMPUTE
