"""apex O1's fp32 function list, enforced on top of ``torch.autocast``.

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

import torch
import torch.nn.functional as F  # noqa: N812
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map_only

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
