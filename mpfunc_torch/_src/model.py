"""The model and loss wrappers of `convert_to_amp`, and the model cast of the half modes."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from _mpfunc_common.amp_config import AmpPlan
from mpfunc_torch._src.autocast import Fp32Functions

__all__ = ["AmpModel", "AmpCriterion", "cast_model", "DTYPES", "HALF"]

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
HALF = (torch.float16, torch.bfloat16)


def _norm_types() -> tuple[type, ...]:
    types = [nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm, nn.LayerNorm,
             nn.GroupNorm, nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d,
             nn.LocalResponseNorm]
    if hasattr(nn, "RMSNorm"):
        types.append(nn.RMSNorm)
    return tuple(types)


def _map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_map_tensors(fn, x) for x in obj))
    if isinstance(obj, list | tuple):
        return type(obj)(_map_tensors(fn, x) for x in obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(fn, v) for k, v in obj.items()}
    return obj


def _caster(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t

    return cast


class AmpModel(nn.Module):
    """A model running in its mode's precision.

    Floating inputs are cast to the model's dtype (half-precision models), the forward
    runs under ``torch.autocast`` (and apex O1's fp32 list) when the mode says so, and
    floating outputs are cast as the mode says. ``state_dict`` and ``load_state_dict``
    use the wrapped module's own keys, so checkpoints load into the unwrapped model.

    Examples:
      >>> import torch, mpfunc_torch
      >>> net = torch.nn.Linear(4, 2)
      >>> opt = torch.optim.SGD(net.parameters(), lr=0.1)
      >>> model, opt, _ = mpfunc_torch.convert_to_amp(net, opt, mode="bf16")
      >>> model(torch.randn(3, 4)).dtype
      torch.bfloat16
    """

    def __init__(self, module: nn.Module, plan: AmpPlan, device_type: str):
        super().__init__()
        self.module = module
        self.plan = plan
        self.device_type = device_type
        half_model = plan.enabled and plan.cast_model_type in ("float16", "bfloat16")
        self._input_cast = _caster(DTYPES[plan.cast_model_type]) if half_model else None
        out = plan.cast_model_outputs if plan.enabled else None
        self._output_cast = _caster(DTYPES[out]) if out else None
        self._fp32_functions = Fp32Functions(device_type) if plan.apex_fp32_functions else None

    def forward(self, *args, **kwargs):
        if self._input_cast is not None:
            args, kwargs = _map_tensors(self._input_cast, (args, kwargs))
        with contextlib.ExitStack() as stack:
            if self.plan.enabled and self.plan.autocast_dtype is not None:
                stack.enter_context(
                    torch.autocast(self.device_type, dtype=DTYPES[self.plan.autocast_dtype])
                )
            if self._fp32_functions is not None:
                stack.enter_context(self._fp32_functions)
            out = self.module(*args, **kwargs)
        if self._output_cast is not None:
            out = _map_tensors(self._output_cast, out)
        return out

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)


class AmpCriterion(nn.Module):
    """A loss computed in float32: half inputs are upcast and autocast is off inside."""

    def __init__(self, criterion: Callable, device_type: str):
        super().__init__()
        if not callable(criterion):
            raise TypeError(f"`criterion` must be callable, got {type(criterion).__name__}.")
        self.criterion = criterion
        self.device_type = device_type
        self._cast = _caster(torch.float32)

    def forward(self, *args, **kwargs):
        args, kwargs = _map_tensors(self._cast, (args, kwargs))
        with torch.autocast(self.device_type, enabled=False):
            return self.criterion(*args, **kwargs)


def cast_model(model: nn.Module, dtype: torch.dtype, keep_norm_fp32: bool) -> None:
    """Casts ``model``'s floating params and buffers to ``dtype`` in place; with
    ``keep_norm_fp32`` normalisation layers stay float32 and compute in float32."""
    norms = _norm_types()
    with torch.no_grad():
        for module in model.modules():
            if keep_norm_fp32 and isinstance(module, norms):
                continue
            for p in module.parameters(recurse=False):
                if p.is_floating_point():
                    p.data = p.data.to(dtype)
            for name, b in module.named_buffers(recurse=False):
                if b is not None and b.is_floating_point():
                    module._buffers[name] = b.to(dtype)
    if keep_norm_fp32:
        for module in model.modules():
            if isinstance(module, norms):
                module.register_forward_pre_hook(_norm_pre_hook)
                module.register_forward_hook(_norm_post_hook(dtype))


def _norm_pre_hook(module, args):
    # Normalisation runs in float32: its params are float32 and so is its computation.
    return _map_tensors(_caster(torch.float32), args)


def _norm_post_hook(dtype):
    def hook(module, args, output):
        return _map_tensors(_caster(dtype), output)

    return hook
