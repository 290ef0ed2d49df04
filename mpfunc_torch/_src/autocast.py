"""apex O1's fp32 function list, enforced on top of ``torch.autocast``.

``torch.autocast`` already runs many precision-sensitive ops in float32 on CUDA, but
its lists differ by device (on CPU, fp16 autocast runs softmax, exp, layer_norm and sum
in float16). `Fp32Functions` is a public ``TorchFunctionMode``: inside it, every
function on apex O1's fp32 list gets its half-precision inputs cast to float32 and runs
with autocast off, whatever the device's autocast lists say.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from _mpfunc_common.amp_config import APEX_O1_FP32_FUNCTIONS

__all__ = ["Fp32Functions", "fp32_callables"]

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


def _to_f32(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.dtype in _HALF:
        return x.float()
    return x


class Fp32Functions(TorchFunctionMode):
    """Runs the listed functions in float32 (inputs upcast, autocast disabled)."""

    def __init__(self, device_type: str, functions: frozenset | None = None):
        super().__init__()
        self.device_type = device_type
        self.functions = fp32_callables() if functions is None else functions

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.functions:
            args, kwargs = tree_map(_to_f32, (args, kwargs))
            with torch.autocast(self.device_type, enabled=False):
                return func(*args, **kwargs)
        return func(*args, **kwargs)
