"""A converted model's ``load_state_dict``, all or nothing.

torch's ``Module.load_state_dict`` copies every tensor that fits and raises afterwards
for those that do not; `guard_model_loads` makes the converted model check the whole
checkpoint first (`AmpOptimizer`'s own checkpoints: `mpfunc_torch._src.checkpoint.optimizer_state`).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from mpfunc_torch._src.master_weights import _LoadFollower, non_finite_names

__all__ = ["CheckpointError", "guard_model_loads", "check_model_state"]


class CheckpointError(ValueError, RuntimeError):
    """A refused model checkpoint: a ValueError, and the RuntimeError torch raises."""


def guard_model_loads(model: nn.Module) -> list[Any]:
    """Makes ``load_state_dict`` on ``model``, or on any of its submodules, all or nothing.

    torch copies every tensor that fits and raises afterwards for those that do not (a
    size mismatch, with ``strict`` a missing or unexpected key), so a caught failure
    leaves a half-loaded model, and with master weights half-loaded masters. A pre-hook
    on the module ``load_state_dict`` was called on checks the whole checkpoint first,
    as torch would, and refuses it before anything is copied; it also refuses inf/NaN in
    a trainable param (buffers may hold them: attention masks). ``model`` itself checks
    its part whenever it is loaded, also from a wrapper (DDP's ``load_state_dict``, with
    keys under ``module.``). Modules that load themselves (their own
    ``_load_from_state_dict``) or carry other load pre-hooks (which may rename keys) are
    left, with their submodules, to torch's own checks. Returns the hook handles."""
    return [m.register_load_state_dict_pre_hook(_guard_load if m is not model else _guard_root)
            for m in model.modules()]


def _guard_load(module, state_dict, prefix, *_):
    if not prefix:  # the module whose load_state_dict was called; submodules have one
        check_model_state(module, state_dict, _callers_strict())


def _guard_root(module, state_dict, prefix, *_):
    mine = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
    check_model_state(module, mine, _callers_strict())


def _callers_strict() -> bool:
    """The ``strict`` the caller gave ``load_state_dict``. torch passes True to every
    hook and applies the caller's value once all is copied, so it is read from torch's
    ``load_state_dict`` frame. Not found (another load path): False, and only what torch
    refuses whatever ``strict`` is gets checked."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code is nn.Module.load_state_dict.__code__:
            return bool(frame.f_locals.get("strict", False))
        frame = frame.f_back
    return False


def check_model_state(root: nn.Module, state_dict: Any, strict: bool) -> None:
    errors, missing, unexpected, finite = [], [], [], []
    skipped: list[str] = []
    for name, m in root.named_modules(remove_duplicate=False):
        prefix = f"{name}." if name else ""
        if any(prefix.startswith(s) for s in skipped):
            continue
        if _loads_itself(m):
            skipped.append(prefix)
            continue
        local = {n: t for n, t in m._parameters.items() if t is not None}
        local.update((n, t) for n, t in m._buffers.items()
                     if t is not None and n not in m._non_persistent_buffers_set)
        for n, t in local.items():
            key = prefix + n
            if key not in state_dict:
                batchnorm = isinstance(m, nn.modules.batchnorm._NormBase)
                if strict and not (batchnorm and n == "num_batches_tracked"):
                    missing.append(key)  # torch's BatchNorm fills that one in
                continue
            value = state_dict[key]
            if not torch.overrides.is_tensor_like(value):
                errors.append(f"`state_dict[{key!r}]` must be a tensor, got "
                              f"{type(value).__name__}")
                continue
            if nn.parameter.is_lazy(t):
                continue
            shape = value.shape
            if t.dim() == 0 and tuple(shape) == (1,):  # torch still loads 0.3-era scalars
                shape = t.shape
            if shape != t.shape:
                errors.append(f"size mismatch for {key}: the checkpoint's is "
                              f"{tuple(value.shape)}, the model's {tuple(t.shape)}")
            elif (isinstance(t, nn.Parameter) and t.requires_grad
                  and type(value) in (torch.Tensor, nn.Parameter)
                  and value.is_floating_point()):
                finite.append((key, value))
        if strict:
            for key in state_dict:
                rest = key[len(prefix):] if key.startswith(prefix) else None
                if rest and rest != "_extra_state" and (
                        rest.split(".", 1)[0] not in m._modules | local):
                    unexpected.append(key)
    bad = non_finite_names(finite)
    if bad:
        errors.append(f"{bad[:5]} hold inf/NaN values; a trainable param must be finite")
    if missing:
        errors.append(f"missing keys {missing[:10]}")
    if unexpected:
        errors.append(f"unexpected keys {unexpected[:10]}")
    if errors:
        raise CheckpointError(
            f"Error(s) in loading state_dict for {type(root).__name__}, nothing was loaded "
            "(a converted model checks the whole checkpoint first): " + "; ".join(errors)
            + ".")


def _loads_itself(m: nn.Module) -> bool:
    """A module whose load torch's default rules do not describe."""
    if (type(m)._load_from_state_dict is not nn.Module._load_from_state_dict
            and not isinstance(m, nn.modules.batchnorm._NormBase)):
        return True
    for h in m._load_state_dict_pre_hooks.values():
        fn = getattr(h, "hook", h)
        if fn not in (_guard_load, _guard_root) and not isinstance(
                getattr(fn, "__self__", None), _LoadFollower):
            return True
    return False
