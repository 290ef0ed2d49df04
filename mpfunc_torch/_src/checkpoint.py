"""`AmpOptimizer` checkpoints: what is saved, and an all-or-nothing load.

Everything in a checkpoint is validated before anything is written, so a failed load
leaves the optimizer, its loss scalers and its master weights exactly as they were.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from _mpfunc_common.amp_config import AmpPlan
from mpfunc_torch._src.master_weights import check_saved_masters, copy_masters_to_model_

if TYPE_CHECKING:
    from mpfunc_torch._src.optimizer import AmpOptimizer

__all__ = ["save", "check", "load"]

FORMAT = 1
_KEYS = ("format", "mode", "opt_level", "optimizer", "scalers", "master_weights")


def save(opt: AmpOptimizer) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "mode": opt.plan.mode,
        "opt_level": opt.plan.opt_level,
        "optimizer": opt.optimizer.state_dict(),
        "scalers": [s.state_dict() for s in opt._scalers],
        "master_weights": [m.detach().clone() for _, m in opt._pairs] or None,
    }


def check(opt: AmpOptimizer, state_dict: dict[str, Any]) -> tuple[list, list]:
    """Every check of `load`, changing nothing; returns the scaler values and masters."""
    _check_header(state_dict, opt.plan)
    scalers = state_dict["scalers"]
    if not isinstance(scalers, list | tuple) or len(scalers) != len(opt._scalers):
        n = len(scalers) if isinstance(scalers, list | tuple) else type(scalers).__name__
        raise ValueError(f"`state_dict['scalers']` must list {len(opt._scalers)} loss-scaler "
                         f"states (one per loss), got {n}.")
    values = [s.check_state(sd, f"state_dict['scalers'][{i}]")
              for i, (s, sd) in enumerate(zip(opt._scalers, scalers))]
    masters = check_saved_masters(state_dict["master_weights"], opt._pairs,
                                  "state_dict['master_weights']")
    _check_inner_state(state_dict["optimizer"], "state_dict['optimizer']")
    return values, masters


def load(opt: AmpOptimizer, state_dict: dict[str, Any]) -> None:
    values, masters = check(opt, state_dict)
    # torch's own load validates the groups before it replaces anything.
    opt.optimizer.load_state_dict(state_dict["optimizer"])
    for s, v in zip(opt._scalers, values):
        s._apply(v)
    with torch.no_grad():
        for (_, m), saved in zip(opt._pairs, masters):
            m.copy_(saved)
    copy_masters_to_model_(opt._pairs)


def _check_header(state_dict: Any, plan: AmpPlan) -> None:
    if not isinstance(state_dict, dict):
        raise ValueError("`state_dict` must be a dict from AmpOptimizer.state_dict(), got "
                         f"{type(state_dict).__name__}.")
    missing = [k for k in _KEYS if k not in state_dict]
    if missing:
        raise ValueError(f"`state_dict` is missing keys {missing}; was it made by "
                         "AmpOptimizer.state_dict()?")
    if state_dict["format"] != FORMAT:
        raise ValueError(f"`state_dict['format']` must be {FORMAT}, got "
                         f"{state_dict['format']!r}.")
    if (state_dict["mode"], state_dict["opt_level"]) != (plan.mode, plan.opt_level):
        raise ValueError(
            f"`state_dict` is from mode {state_dict['mode']!r} (opt_level "
            f"{state_dict['opt_level']!r}); this optimizer runs mode {plan.mode!r} "
            f"(opt_level {plan.opt_level!r})."
        )


def _check_inner_state(inner: Any, where: str) -> None:
    """The inner optimizer's state_dict: its shape is torch's to check; here, that no
    floating state tensor holds an inf/NaN (one host read for all of them)."""
    if not isinstance(inner, dict) or "state" not in inner or "param_groups" not in inner:
        raise ValueError(f"`{where}` must be a torch optimizer state_dict (keys 'state' and "
                         "'param_groups').")
    found = []
    for pid, st in inner["state"].items():
        if not isinstance(st, dict):
            continue
        for key, t in st.items():
            if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()):
                if t.is_sparse:  # e.g. SGD's momentum for nn.Embedding(sparse=True)
                    t = t.coalesce().values()
                found.append((f"{where}['state'][{pid!r}][{key!r}]", torch.isfinite(t).all()))
    if found and not bool(torch.stack([f.cpu() for _, f in found]).all()):
        name = next(n for n, f in found if not bool(f))
        raise ValueError(f"`{name}` holds inf/NaN values; optimizer state must be finite.")
