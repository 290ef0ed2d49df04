"""The half modes' model cast done ahead of `convert_to_amp`, before a wrapper that holds
hooks on the params (DistributedDataParallel) is built around the model.

DDP registers its gradient hooks and buckets on the params it sees when it is built;
casting them after that silently breaks the averaging, which is why `convert_to_amp`
refuses a wrapped model. A trainer that wraps the model itself (Lightning's DDP
strategies, which call the precision plugin's ``convert_module`` first and build the
optimizers after the wrap) casts the params here instead: in place (the same param
objects, as `convert_to_amp` casts them), keeping each cast param's float32 value. The
float32 master weights that `convert_to_amp` makes when the optimizers arrive start from
those values, so the run is bit for bit the one converted in a single call.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from _mpfunc_common.amp_config import AmpPlan
from mpfunc_torch._src.model import (
    DTYPES,
    HALF,
    cast_model,
    is_norm_module,
    params_cast,
    refuse_converted_model,
)
from mpfunc_torch._src.sharding import refuse_data_parallel_wrapper

__all__ = ["cast_ahead", "CastAhead", "cast_ahead_of", "release_cast_ahead",
           "sync_cast_ahead_"]


class CastAhead:
    """What `cast_ahead` did to one model: the dtype, whether norms stayed float32, and
    each cast param's float32 value (held weakly by param: a param that is gone needs
    none)."""

    def __init__(self, dtype: torch.dtype, keep_norm_fp32: bool):
        self.dtype, self.keep_norm_fp32 = dtype, keep_norm_fp32
        self.originals = WeakIdKeyDictionary()  # param -> its float32 value

    def float32_value(self, param: torch.Tensor) -> torch.Tensor:
        """``param``'s float32 value from before the cast, on the param's device; where
        something wrote the param since (its value no longer rounds from it), the
        param's own value in float32."""
        original = self.originals[param].to(param.device)
        if torch.equal(original.to(param.dtype), param.data):
            return original
        return param.data.float()


    def float32_state_(self, optimizers) -> None:
        """State the optimizers made at construction (Adagrad's sums) over the cast
        params, in float32, as over the float32 params in one conversion (exact for
        state that starts at zero; a nonzero start was rounded to the half dtype)."""
        for opt in optimizers:
            for p, state in opt.state.items():
                if p not in self.originals:
                    continue
                for k, v in state.items():
                    if isinstance(v, torch.Tensor) and v.dtype == p.dtype and \
                            v.shape == p.shape:
                        state[k] = v.float()


_CAST = WeakIdKeyDictionary()  # model -> CastAhead


def cast_ahead(model: nn.Module, plan: AmpPlan,
               is_norm: Callable[[str, nn.Module], bool] | None = None) -> bool:
    """Casts ``model``'s params in place as `convert_to_amp` with ``plan`` would, and
    keeps their float32 values for the master weights; True if it cast (the plan has
    half params and the model was not cast yet), False if there was nothing to do."""
    if not (plan.enabled and plan.cast_model_type in ("float16", "bfloat16")):
        return False
    if model in _CAST:
        return False
    refuse_converted_model(model)
    half = [n for n, p in model.named_parameters() if p.dtype in HALF]
    if half:
        raise ValueError(
            f"`model` params {half[:3]} are already half precision; give the model in "
            "float32 so the float32 master weights start from the exact values.")
    target = DTYPES[plan.cast_model_type]
    refuse_data_parallel_wrapper(model, plan)
    norm = is_norm or is_norm_module
    record = CastAhead(target, plan.keep_norm_fp32)
    cast = params_cast(model, plan.keep_norm_fp32, norm)
    for p in model.parameters():
        if id(p) in cast:
            record.originals[p] = p.data
    cast_model(model, target, plan.keep_norm_fp32, norm)
    _CAST[model] = record
    return True


def cast_ahead_of(model: nn.Module, plan: AmpPlan) -> CastAhead | None:
    """The `cast_ahead` record of ``model`` (None if it was not cast ahead); it must be
    the cast ``plan`` makes."""
    record = _CAST.get(model)
    if record is None:
        return None
    target = DTYPES.get(plan.cast_model_type) if plan.enabled and plan.cast_model_type else None
    if (target, plan.keep_norm_fp32) != (record.dtype, record.keep_norm_fp32):
        raise ValueError(
            f"`model` was cast to {record.dtype} (norms kept in float32: "
            f"{record.keep_norm_fp32}) ahead of the conversion, but the mode "
            f"{plan.describe()} casts to {plan.cast_model_type} (norms kept: "
            f"{plan.keep_norm_fp32}); convert with the mode it was cast for.")
    return record


def release_cast_ahead(model: nn.Module) -> None:
    """Drops ``model``'s record once `convert_to_amp` made the masters from it (apex O3
    makes none: its float32 values are freed here)."""
    _CAST.pop(model, None)


def sync_cast_ahead_(model: nn.Module, process_group) -> None:
    """Broadcasts the float32 values `cast_ahead` kept from the group's first rank, as
    ``DistributedDataParallel`` broadcast the params when it was built: every rank's
    master weights then start from the same float32 values (rank 0's)."""
    record = _CAST.get(model)
    if record is None:
        return
    import torch.distributed as dist

    src = dist.get_global_rank(process_group, 0)
    for p in model.parameters():
        if p in record.originals:
            value = record.originals[p].to(p.device)
            dist.broadcast(value, src=src, group=process_group)
            record.originals[p] = value
