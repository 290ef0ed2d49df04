"""What the checkpoint and low-precision code read of an `AmpOptimizer`, as a Protocol.

``checkpoint`` and ``low_precision`` work on an `AmpOptimizer`'s parts, and
``optimizer`` calls them from ``state_dict``, ``load_state_dict`` and ``step``. Typing
their argument with this Protocol, a floor below all three, keeps them from importing
``optimizer`` back (even for types only).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from _mpfunc_common.amp_config import AmpPlan
from mpfunc_torch._src.loss_scale import LossScaler

__all__ = ["AmpOptimizerParts"]


class AmpOptimizerParts(Protocol):
    """The attributes of `AmpOptimizer` that its checkpoint and low-precision code use."""

    optimizer: torch.optim.Optimizer  # the inner optimizer
    plan: AmpPlan
    _pairs: list[tuple[torch.Tensor, torch.Tensor]]  # (model param, master)
    _scalers: list[LossScaler]
    _owned: list[torch.Tensor]  # what the inner optimizer steps
    _kernel_unscales: bool
    _lowp: Any  # low_precision.LowPrecision, or None

    def _index_params(self) -> None: ...
