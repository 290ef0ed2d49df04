"""The model and loss wrappers of `convert_to_amp`, and the model cast of the half modes.

Conversion happens on the user's module itself: its params are cast (half modes) and
its ``forward`` is replaced by one that runs in the mode's precision (input cast,
``torch.autocast`` and apex O1's fp32 list, output cast), as ``accelerate`` does. So
the precision holds wherever the module is called from: through the returned
`AmpModel`, directly, or from its own methods such as HuggingFace's ``generate``.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from _mpfunc_common.amp_config import AmpPlan
from mpfunc_torch._src import fused
from mpfunc_torch._src.autocast import (
    Fp32Functions,
    HalfModelFp32Functions,
    HalfModelFunctions,
    function_mode,
    mode_active,
)
from mpfunc_torch._src.sharding import cast_module_, is_dtensor, refuse_sharded_after_conversion

__all__ = [
    "AmpModel",
    "AmpCriterion",
    "cast_model",
    "cast_floats",
    "is_norm_module",
    "refuse_converted_model",
    "DTYPES",
    "HALF",
]

_HALF_MODES = {"half": HalfModelFp32Functions, "half-pure": HalfModelFunctions}
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
HALF = (torch.float16, torch.bfloat16)


def cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    """``tree`` with its floating tensors cast to ``dtype``, containers kept.

    Containers are whatever ``torch.utils._pytree`` knows: tuples, lists, dicts,
    ``OrderedDict``, namedtuples, and the types registered with it, such as HuggingFace's
    ``ModelOutput``. A dataclass that is not registered is copied with its fields cast.
    Anything else (a HuggingFace ``Cache``, a string) is returned as it is.
    """

    def leaf(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.to(dtype) if x.is_floating_point() and x.dtype != dtype else x
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            new = copy.copy(x)
            for f in dataclasses.fields(x):
                object.__setattr__(new, f.name, cast_floats(getattr(x, f.name), dtype))
            return new
        return x

    return tree_map(leaf, tree)


class _AmpForward:
    """A converted module's ``forward``: the original one, in the mode's precision.

    A plain object rather than a bound method, so the module still pickles
    (``torch.save(model)``) and deep-copies with it.
    """

    def __init__(self, module: nn.Module, plan: AmpPlan, device_type: str):
        self.module = module
        self.original = vars(module).get("forward")  # an instance-level forward, if any
        self.device_type = device_type
        half = plan.cast_model_type
        self.input_dtype = DTYPES[half] if half in ("float16", "bfloat16") else None
        out = plan.cast_model_outputs
        self.output_dtype = DTYPES[out] if out else None
        self.autocast_dtype = DTYPES[plan.autocast_dtype] if plan.autocast_dtype else None
        self.fp32_functions = plan.apex_fp32_functions
        self.function_mode = function_mode(plan)  # 'o1', 'half', 'half-pure' or None

    @property
    def __signature__(self) -> inspect.Signature:
        # The original forward's: code that reads it (HuggingFace's Trainer keeps only
        # the batch columns named there) sees the same arguments after conversion.
        if self.original is not None:
            return inspect.signature(self.original)
        return inspect.signature(type(self.module).forward.__get__(self.module))

    @staticmethod
    def needed(plan: AmpPlan) -> bool:
        return plan.enabled and bool(
            plan.cast_model_type in ("float16", "bfloat16") or plan.cast_model_outputs
            or plan.autocast_dtype
        )

    def _run(self, args, kwargs):
        if self.original is not None:
            return self.original(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    def __call__(self, *args, **kwargs):
        if self.input_dtype is not None:
            args, kwargs = cast_floats((args, kwargs), self.input_dtype)
        kind = self.function_mode
        if kind in _HALF_MODES and not torch.compiler.is_compiling() and \
                mode_active(_HALF_MODES[kind]):
            kind = None  # a trainer's step context runs it already (Lightning's steps)
        # Plain nested `with` statements: dynamo traces them into one graph.
        if kind == "half":
            with HalfModelFp32Functions():
                out = self._run(args, kwargs)
        elif kind == "half-pure":
            with HalfModelFunctions():
                out = self._run(args, kwargs)
        elif self.autocast_dtype is None:
            out = self._run(args, kwargs)
        elif self.fp32_functions:
            with torch.autocast(self.device_type, dtype=self.autocast_dtype), \
                    Fp32Functions(self.device_type):
                out = self._run(args, kwargs)
        else:
            with torch.autocast(self.device_type, dtype=self.autocast_dtype):
                out = self._run(args, kwargs)
        if self.output_dtype is not None:
            out = cast_floats(out, self.output_dtype)
        return out


def _uncompiled(module: nn.Module) -> nn.Module:
    """The module inside ``torch.compile(module)``: converting it puts the casts and
    autocast regions into the compiled graph."""
    while (inner := fused.compiled_inner(module)) is not None:
        module = inner
    return module


class AmpModel(nn.Module):
    """A model running in its mode's precision.

    Floating inputs are cast to the model's dtype (half-precision models), the forward
    runs under ``torch.autocast`` (and apex O1's fp32 list) when the mode says so, and
    floating outputs are cast as the mode says; containers such as HuggingFace's
    ``ModelOutput`` keep their type. The wrapped module is converted in place, so its own
    methods (``generate``) run in the same precision.

    Attributes the wrapper does not have are the wrapped module's (``model.config``,
    ``model.generate(...)``, ``model.save_pretrained(...)``), and setting one the wrapped
    module has sets it there. ``state_dict`` and ``load_state_dict`` use the wrapped
    module's own keys, so checkpoints load into the unwrapped model.

    Examples:
      >>> import torch, mpfunc_torch
      >>> net = torch.nn.Linear(4, 2)
      >>> opt = torch.optim.SGD(net.parameters(), lr=0.1)
      >>> model, opt, _ = mpfunc_torch.convert_to_amp(net, opt, mode="bf16")
      >>> model(torch.randn(3, 4)).dtype, model.in_features
      (torch.bfloat16, 4)
    """

    def __init__(self, module: nn.Module, plan: AmpPlan, device_type: str):
        super().__init__()
        self.module = module
        self.plan = plan
        if _AmpForward.needed(plan):
            target = _uncompiled(module)
            target.forward = _AmpForward(target, plan, device_type)
        # The params the optimizer was converted over: checked once, at the first forward.
        self._converted_params: list[nn.Parameter] | None = list(module.parameters())
        self.register_load_state_dict_pre_hook(_nest_keys)

    def forward(self, *args, **kwargs):
        """The wrapped module's forward in the mode's precision (checks, at the first
        call, that the params were not sharded after conversion)."""
        if self._converted_params is not None and not torch.compiler.is_compiling():
            refuse_sharded_after_conversion(self.module, self._converted_params)
            self._converted_params = None
        return self.module(*args, **kwargs)

    def _wrapped(self) -> nn.Module | None:
        return self.__dict__.get("_modules", {}).get("module")

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self._wrapped()
            if inner is None:
                raise
        return getattr(inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        inner = self._wrapped()
        if (inner is not None and not self._is_own(name) and hasattr(inner, name)):
            setattr(inner, name, value)
        else:
            super().__setattr__(name, value)

    def _is_own(self, name: str) -> bool:
        d = self.__dict__
        return (name in d or hasattr(type(self), name) or name in d["_parameters"]
                or name in d["_buffers"] or name in d["_modules"])

    def __dir__(self):
        inner = self._wrapped()
        return sorted(set(super().__dir__()) | set(dir(inner) if inner is not None else ()))

    def state_dict(self, *args, **kwargs):
        """The wrapped module's ``state_dict`` (its keys, no ``module.`` prefix): the
        float32 masters' values where the mode keeps master weights."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Loads into the wrapped module, as ``nn.Module.load_state_dict``; with master
        weights the values become the masters exactly (see docs/checkpoints.md)."""
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)


def _nest_keys(amp_model, state_dict, prefix, *_):
    """`AmpModel.state_dict` has the wrapped module's keys, also inside a parent (DDP's
    ``module.0.weight``); a parent's load reaches the wrapped module under ``module.``,
    so every key under this prefix moves there (the wrapper has no state of its own),
    and the parent's ``load_state_dict(parent.state_dict())`` round-trips."""
    moved = {prefix + "module." + k[len(prefix):]: state_dict.pop(k)
             for k in [k for k in state_dict if k.startswith(prefix)]}
    state_dict.update(moved)


class AmpCriterion(nn.Module):
    """A loss computed in float32: half inputs are upcast and autocast is off inside."""

    def __init__(self, criterion: Callable, device_type: str):
        super().__init__()
        if not callable(criterion):
            raise TypeError(f"`criterion` must be callable, got {type(criterion).__name__}.")
        self.criterion = criterion
        self.device_type = device_type

    def forward(self, *args, **kwargs):
        """The criterion on float32 inputs, with autocast off."""
        args, kwargs = cast_floats((args, kwargs), torch.float32)
        with torch.autocast(self.device_type, enabled=False):
            return self.criterion(*args, **kwargs)


# ---------------------------------------------------------------------------------------
# Which layers are norms, and the model cast of the half modes.

def _torch_norm_types() -> tuple[type, ...]:
    types_ = [nn.modules.batchnorm._NormBase, nn.SyncBatchNorm, nn.LayerNorm, nn.GroupNorm,
              nn.LocalResponseNorm]
    if hasattr(nn, "RMSNorm"):
        types_.append(nn.RMSNorm)
    return tuple(types_)


_TORCH_NORMS = _torch_norm_types()
# A class name ending in "Norm", optionally with a size suffix or "Gated": LayerNorm,
# LlamaRMSNorm, T5LayerNorm, FrozenBatchNorm2d, GroupNorm32, MambaRMSNormGated. Not
# Normal, Normalize, or a model named NormFormer (a match keeps the whole subtree fp32).
_NORM_NAME = re.compile(r"Norm(\d+d?)?(Gated)?$")


def is_norm_module(name: str, module: nn.Module) -> bool:
    """Default test for "normalisation layer" (apex O2, ``keep_batchnorm_fp32``).

    True for torch's norm layers (batch, instance, layer, group, local-response, RMS
    norms and their subclasses) and for any module whose class, or a base class, is
    named ``*Norm``, optionally followed by a size (``*Norm2d``, ``*Norm32``) or
    ``Gated``: HuggingFace's ``LlamaRMSNorm`` and ``T5LayerNorm``, timm's ``LayerNorm2d``,
    ``FrozenBatchNorm2d``, and so on (not ``Normal``, ``Normalize`` or ``NormFormer``). Pass your own ``is_norm(name, module)`` to
    `convert_to_amp` to change it; ``name`` is the module's qualified name in the model.

    Examples:
      >>> import torch
      >>> class LlamaRMSNorm(torch.nn.Module): ...
      >>> is_norm_module("model.norm", LlamaRMSNorm()), is_norm_module("fc", torch.nn.Linear(2, 2))
      (True, False)
    """
    del name
    if isinstance(module, _TORCH_NORMS):
        return True
    return any(_NORM_NAME.search(c.__name__) for c in type(module).__mro__)


def _cast_walk(model: nn.Module, keep_norm_fp32: bool,
               is_norm: Callable[[str, nn.Module], bool]):
    """``(module, kept)`` for `cast_model`: kept norms (whose insides stay float32 and
    are not visited) and the modules whose own params and buffers are cast."""
    inside_norm: set[int] = set()
    for name, module in model.named_modules():  # parents before children
        if id(module) in inside_norm:
            continue
        kept = keep_norm_fp32 and is_norm(name, module)
        if kept:
            inside_norm.update(id(m) for m in module.modules())
        yield module, kept


def params_cast(model: nn.Module, keep_norm_fp32: bool,
                is_norm: Callable[[str, nn.Module], bool] = is_norm_module) -> set[int]:
    """The ids of the params `cast_model` would cast (changing nothing)."""
    return {id(p) for module, kept in _cast_walk(model, keep_norm_fp32, is_norm) if not kept
            for p in module.parameters(recurse=False) if p.is_floating_point()}


def cast_model(model: nn.Module, dtype: torch.dtype, keep_norm_fp32: bool,
               is_norm: Callable[[str, nn.Module], bool] = is_norm_module) -> None:
    """Casts ``model``'s floating params and buffers to ``dtype`` in place. With
    ``keep_norm_fp32``, every module ``is_norm`` selects stays float32 with everything
    inside it, computes in float32 and returns ``dtype``."""
    norms: list[nn.Module] = []
    with torch.no_grad():
        for module, kept in list(_cast_walk(model, keep_norm_fp32, is_norm)):
            if kept:
                norms.append(module)
                continue
            if any(is_dtensor(p) for p in module.parameters(recurse=False)):
                cast_module_(module, dtype)  # FSDP2 / DTensor: the shards are cast too
                continue
            for p in module.parameters(recurse=False):
                if p.is_floating_point():
                    p.data = p.data.to(dtype)
            for key, b in module.named_buffers(recurse=False):
                if b is not None and b.is_floating_point():
                    module._buffers[key] = b.to(dtype)
    for module in norms:
        module.register_forward_pre_hook(_norm_pre_hook, with_kwargs=True)
        module.register_forward_hook(_norm_post_hook(dtype))


def _norm_pre_hook(module, args, kwargs):
    # Normalisation runs in float32: its params are float32 and so is its computation.
    return cast_floats((args, kwargs), torch.float32)


def _norm_post_hook(dtype):
    def hook(module, args, output):
        return cast_floats(output, dtype)

    return hook


def refuse_converted_model(model: nn.Module) -> None:
    """A model converted twice would cast and autocast twice; say so instead."""
    for name, module in model.named_modules():
        if isinstance(module, AmpModel) or isinstance(vars(module).get("forward"),
                                                       _AmpForward):
            where = f"`model.{name}`" if name else "`model`"
            raise ValueError(
                f"{where} was already converted by convert_to_amp; pass the original "
                "float32 model once (to change modes, rebuild it or load its float32 "
                "weights into a fresh one)."
            )
