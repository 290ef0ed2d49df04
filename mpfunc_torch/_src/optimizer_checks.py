"""What `convert_to_amp` refuses about the optimizers it is given, before it changes
anything: one over none of the model's params, and a step that would silently train
nothing (torch's fused CPU SGD on half params) or turn zeros into NaN (an ``eps`` that is
0 in float16).
"""

from __future__ import annotations

import torch
from torch import nn

from mpfunc_torch._src import fused_sgd
from mpfunc_torch._src.model import HALF

__all__ = ["check_optimizer_params", "refuse_broken_fused_sgd", "refuse_vanishing_eps"]


def check_optimizer_params(model: nn.Module, optimizers) -> None:
    model_ids = {id(p) for p in model.parameters()}
    if not any(id(p) in model_ids for opt in optimizers for g in opt.param_groups
               for p in g["params"]):
        raise ValueError(
            "`optimizer` holds none of `model`'s parameters, so training would never change "
            "the model. Build the optimizer over this model's parameters "
            "(torch.optim.X(model.parameters(), ...)), or convert the model it belongs to.")


def refuse_broken_fused_sgd(optimizers, stepped) -> None:
    """torch 2.11-2.13's fused SGD on CPU leaves float16/bfloat16 params unchanged but
    for their last elements (2.14 fixed it). A half-precision mode would then train
    nothing, silently, so that combination is refused where the installed torch has the
    bug (`fused_sgd.fused_cpu_sgd_updates_half` asks it).
    ``stepped``: id(param) -> the dtype the optimizer steps it in."""
    for opt in optimizers:
        if not (isinstance(opt, torch.optim.SGD) and opt.defaults.get("fused")):
            continue
        for g in opt.param_groups:
            for p in g["params"]:
                dtype = stepped[id(p)]
                if dtype in HALF and p.device.type == "cpu" and \
                        not fused_sgd.fused_cpu_sgd_updates_half(dtype):
                    raise ValueError(
                        f"`optimizer` is SGD(fused=True) stepping {dtype} params on CPU, "
                        f"which torch {torch.__version__}'s fused CPU SGD kernel does not "
                        "update (fixed in torch 2.14). Use fused=False, or a mode with "
                        "float32 master weights (naive, apex O2).")


def refuse_vanishing_eps(optimizers, stepped) -> None:
    """An optimizer stepping float16 params itself (apex O3: no master weights) computes
    in float16, where an ``eps`` below 2**-25 is 0: every element whose gradient and
    moments are 0 (an embedding row not in the batch) then becomes 0/0 = NaN in the
    first step, a step whose gradients were finite. Refused, naming the value."""
    for opt in optimizers:
        for i, g in enumerate(opt.param_groups):
            eps = g.get("eps")
            if not isinstance(eps, float | int) or isinstance(eps, bool) or eps <= 0:
                continue
            if torch.tensor(float(eps), dtype=torch.float16).item() != 0:
                continue
            if any(stepped[id(p)] == torch.float16 for p in g["params"]):
                raise ValueError(
                    f"`optimizer` {type(opt).__name__} (param group {i}) has eps={eps!r}, "
                    "which is 0 in float16, and steps float16 params itself (no master "
                    "weights): an element with a zero gradient would become 0/0 = NaN in "
                    "the first step. Pass eps >= 1e-4 (float16 training's usual value), or "
                    "use a mode with float32 master weights (naive, apex O2).")
