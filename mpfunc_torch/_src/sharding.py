"""DTensor awareness for FSDP2 and tensor parallelism: local shards, mesh groups, casts.

Params sharded by ``torch.distributed.fsdp.fully_shard`` or
``torch.distributed.tensor.parallel.parallelize_module`` are DTensors, and so are their
gradients. mpfunc works on each rank's local shard (one fused kernel, no hidden
collective) and then reduces explicitly over every dimension of every device mesh the
params live on, so that an overflow in one rank's shard makes every rank skip.
`refuse_data_parallel_wrapper` and `refuse_sharded_after_conversion` say which order of
converting and wrapping or sharding works when a model comes in the other one.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, TypeGuard, cast

import torch
from torch import nn

from _mpfunc_common.amp_config import AmpPlan

if TYPE_CHECKING:  # imported lazily at run time (see `is_dtensor`)
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

__all__ = [
    "is_dtensor",
    "local",
    "locals_of",
    "mesh_groups",
    "cast_module_",
    "fsdp_units",
    "check_fsdp_units",
    "local_bytes",
    "refuse_data_parallel_wrapper",
    "refuse_sharded_after_conversion",
]



def is_dtensor(t: Any) -> TypeGuard[DTensor]:
    # A DTensor exists only once torch.distributed.tensor is imported (FSDP2 and
    # parallelize_module import it): importing it here, for every user, would cost
    # about a third of `import torch` (it loads sympy).
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(t, dtensor.DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``t`` (``t`` itself for a plain tensor); in-place ops on it
    change ``t``. Never a collective."""
    if is_dtensor(t):
        with torch.no_grad():
            return t.to_local()
    return t


def locals_of(tensors: Iterable[torch.Tensor | None]) -> list[torch.Tensor]:
    """`local` of each tensor that is not None."""
    return [local(t) for t in tensors if t is not None]


def mesh_groups(tensors: Iterable[torch.Tensor]) -> tuple[Any, ...]:
    """The process groups of every dimension of every device mesh among ``tensors``'
    DTensors, each once, in a deterministic order (first appearance, then mesh dims).

    MAX-reducing a flag over all of them in turn makes it global over every rank that
    holds a shard of these tensors, whatever their placements."""
    groups: list[Any] = []
    seen_meshes: list[Any] = []
    for t in tensors:
        if not is_dtensor(t):
            continue
        mesh = t.device_mesh
        if any(mesh is m or mesh == m for m in seen_meshes):
            continue
        seen_meshes.append(mesh)
        for dim in range(mesh.ndim):
            g = mesh.get_group(dim)
            if all(g is not h for h in groups):
                groups.append(g)
    return tuple(groups)


def _cast_fn(dtype: torch.dtype):
    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t

    return cast


def cast_module_(module: nn.Module, dtype: torch.dtype) -> None:
    """Casts ``module``'s own floating params and buffers (not its children's) to
    ``dtype`` in place, the way ``module.to(dtype)`` does.

    Plain params keep their identity and change their ``.data``; DTensor params (FSDP2,
    tensor parallelism) keep their identity too, through ``torch.utils.swap_tensors``,
    so that the local shard, the DTensor and what FSDP2 all-gathers agree. Setting
    ``param.data`` on a DTensor would change only the outer dtype and leave the shard in
    the old one.
    """
    module._apply(_cast_fn(dtype), recurse=False)


def fsdp_units(model: nn.Module) -> list[tuple[str, nn.Module, list[tuple[str, nn.Parameter]]]]:
    """``(name, module, params)`` for every ``fully_shard`` unit in ``model``: the params
    each one all-gathers (its subtree's, minus those of nested units)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        return []
    # fully_shard swaps each unit's class for a subclass of both FSDPModule and its own.
    units = [(n, cast(nn.Module, m)) for n, m in model.named_modules()
             if isinstance(m, FSDPModule)]
    out = []
    for name, unit in units:
        nested = {id(p) for n2, m2 in units if m2 is not unit
                  and n2.startswith(name + "." if name else "") for p in m2.parameters()}
        params = [(pn, p) for pn, p in unit.named_parameters() if id(p) not in nested]
        out.append((name, unit, params))
    return out


def check_fsdp_units(model: nn.Module, dtype_of: Callable[[nn.Parameter], torch.dtype]) -> None:
    """Before a cast that gives ``model``'s params the dtypes ``dtype_of`` says: refuses
    what FSDP2 cannot take, with what to do instead.

    * A ``fully_shard`` unit that already ran a forward has fixed its dtypes (FSDP2 reads
      them once, at its lazy init): convert before the first forward.
    * FSDP2 all-gathers each unit's params as one buffer, so they must share a dtype;
      otherwise its first forward fails with an AssertionError.
    """
    for name, unit, params in fsdp_units(model):
        where = f"`model.{name}`" if name else "`model`"
        try:
            state = cast("FSDPModule", unit)._get_fsdp_state()  # a fully_shard unit
        except (AttributeError, AssertionError):  # pragma: no cover - other torch versions
            state = None
        if getattr(state, "_is_root", None) is not None:
            raise ValueError(
                f"{where} (fully_shard) has already run a forward, which fixed its dtypes; "
                "call convert_to_amp after fully_shard and before the first forward.")
        dtypes = {dtype_of(p) for _, p in params if p.requires_grad}
        if len(dtypes) > 1:
            by_dtype: dict[torch.dtype, list[str]] = {}
            for pn, p in params:
                by_dtype.setdefault(dtype_of(p), []).append(pn)
            listing = "; ".join(f"{str(d).replace('torch.', '')}: {names[:3]}"
                                for d, names in by_dtype.items())
            raise ValueError(
                f"{where} is one fully_shard unit whose params would have several dtypes "
                f"after the cast ({listing}); FSDP2 all-gathers a unit in one dtype. Keep "
                "the float32 layers (norms) in units of their own: call fully_shard(norm) "
                "on each of them before fully_shard on its parent, or pass "
                "keep_batchnorm_fp32=False.")


def local_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of ``tensors`` held on this rank (local shards for DTensors)."""
    return sum(local(t).numel() * local(t).element_size() for t in tensors)


def _data_parallel_types() -> tuple[type, ...]:
    if not torch.distributed.is_available():
        return ()
    from torch.distributed import fsdp
    from torch.nn.parallel import DistributedDataParallel

    # FSDP2 (fully_shard) is not here: its DTensor params are cast shard by shard (see
    # sharding.check_fsdp_units for what it cannot take).
    return (DistributedDataParallel, fsdp.FullyShardedDataParallel)


def refuse_data_parallel_wrapper(model: nn.Module, plan: AmpPlan) -> None:
    """Casting params after DDP/FSDP wrapped the model breaks their gradient hooks and
    buckets silently (DDP stops averaging), so that order is an error."""
    wrappers = _data_parallel_types()
    mode = plan.mode + (f" {plan.opt_level}" if plan.opt_level else "")
    for name, module in model.named_modules():
        if not (wrappers and isinstance(module, wrappers)):
            continue
        where = f"`model.{name}`" if name else "`model`"
        problem = (f"{where} is a {type(module).__name__}, and mode {mode!r} would cast its "
                   f"params to {plan.cast_model_type} after it registered its gradient hooks")
        if "DistributedDataParallel" in type(module).__name__:
            raise ValueError(
                f"{problem}, which silently stops gradient averaging. Convert first, then "
                "wrap: `model, optimizer, criterion = convert_to_amp(net, optimizer, "
                "criterion, ...)`, then `model = DistributedDataParallel(model)`."
            )
        raise ValueError(
            f"{problem} and sharded them. FSDP keeps its own dtypes: give it a "
            "MixedPrecisionPolicy (fully_shard(..., mp_policy=...)) or "
            "FSDP(mixed_precision=...), or use a mode that keeps float32 params (torch, "
            "bf16, apex O1)."
        )


def refuse_sharded_after_conversion(module: nn.Module, converted: list) -> None:
    """``fully_shard`` (or ``parallelize_module``) after `convert_to_amp` replaces the
    model's params with DTensors, and the optimizer would go on stepping the old ones
    (silently training nothing). Say which order works."""
    now = list(module.parameters())
    if len(now) == len(converted) and all(p is q for p, q in zip(now, converted)):
        return
    if any(is_dtensor(p) and all(p is not q for q in converted) for p in now):
        raise ValueError(
            "the model's params were replaced by sharded DTensors (fully_shard or "
            "parallelize_module) after convert_to_amp, so the optimizer would step the "
            "old, unsharded ones. Shard first, then build the optimizer over the sharded "
            "params, then convert: `fully_shard(net)`, `opt = torch.optim.AdamW("
            "net.parameters())`, `model, opt, crit = convert_to_amp(net, opt, crit, ...)`.")
