"""Mode ``"bf16"``'s storage keys in `convert_to_amp`: training without float32 masters.

``master_weights`` (``"float32"``, ``"remainder"``, ``"kahan"``, ``"stochastic"``)
makes the params bfloat16, all of them (a half model, as naive's float16, with its
float32 functions: `autocast.function_mode` is ``"half"``), and ``state_dtype`` stores
the optimizer state below float32 (with ``state_rounding`` and ``seed``); the keys and
their validation are `_mpfunc_common.storage`'s, as on the JAX side, where
``mpfunc.convert_to_amp`` wraps the optimizer in ``mpfunc.master_weights`` /
``mpfunc.state_dtype``. Here `convert_to_amp` converts as with float32 masters, then
`apply_storage` hands each converted optimizer to `use_low_precision`, which keeps the
masters and state as asked (`mpfunc_torch._src.low_precision`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from _mpfunc_common.storage import STATE_BLOCK
from mpfunc_torch._src.low_precision import use_low_precision

__all__ = ["keeps_masters", "apply_storage"]


def keeps_masters(plan: Any) -> bool:
    """Whether the converted optimizer steps float32 masters (kept as float32 tensors, or
    below float32 by `apply_storage`) in place of the model's half params
    (`AmpPlan.keeps_masters`)."""
    return plan.keeps_masters


def _lowers(plan: Any) -> bool:
    """Whether anything is kept below float32 (else float32 masters or params as today)."""
    return plan.enabled and (plan.master_storage not in (None, "float32")
                             or plan.state_dtype not in (None, "float32"))


def apply_storage(plan: Any, optimizers: Sequence[Any]) -> None:
    """Switches each converted `AmpOptimizer` of ``plan`` (a mode ``"bf16"`` plan) to its
    storage and state dtype, before any step (see the module)."""
    if not _lowers(plan):
        return
    state = plan.state_dtype if plan.state_dtype != "float32" else None
    for opt in optimizers:
        use_low_precision(opt, plan.master_storage or "float32", state,
                          plan.state_rounding if state is not None else "nearest",
                          seed=plan.seed, block=STATE_BLOCK)
