"""Forward attribution: which module's output first went non-finite in the last forward.

`watch_nonfinite` registers forward hooks that record, per module call, a device flag
(one reduction of its output); nothing is read on the host until a precision report is.
The JAX twin (flax Linen and NNX) is ``mpfunc/_src/nonfinite_watch.py``.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

__all__ = ["NonfiniteWatch", "watch_nonfinite", "watch_of"]

_WATCHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _target(model: nn.Module) -> nn.Module:
    inner = model.__dict__.get("_modules", {}).get("module")
    return inner if type(model).__name__ == "AmpModel" and inner is not None else model


def _nonfinite(t: torch.Tensor) -> torch.Tensor:
    """Whether ``t`` holds an inf or NaN: one ``aminmax`` reduction (a NaN propagates to
    both ends, an inf to one). On CPU it ran 14x faster than ``isfinite(t).all()``."""
    low, high = torch.aminmax(t)
    return ~(torch.isfinite(low) & torch.isfinite(high))


class NonfiniteWatch:
    """The hooks `watch_nonfinite` registered; `remove` takes them off.

    Each forward of the watched model starts a new record: for every module whose
    forward returns during it (in the order they return, so a layer comes before the
    block that holds it), whether any floating tensor in its output holds an inf or NaN.
    Recomputations outside the model's forward (activation checkpointing in backward)
    are not recorded.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self._names: list[str] = []
        self._flags: list[torch.Tensor] = []
        self._depth = 0
        self._handles = [model.register_forward_pre_hook(self._start)]
        for name, module in model.named_modules():
            self._handles.append(module.register_forward_hook(self._hook(name or "(root)")))
        # After the root's own record: the forward ends with it.
        self._handles.append(model.register_forward_hook(self._stop, always_call=True))

    def _start(self, module, args):
        if self._depth == 0:
            self._names, self._flags = [], []
        self._depth += 1

    def _stop(self, module, args, output):
        self._depth = max(self._depth - 1, 0)

    def _hook(self, name: str):
        def hook(module, args, output):
            if self._depth == 0:
                return
            outs = [t for t in tree_leaves(output)
                    if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()]
            if not outs:
                return
            flags = [_nonfinite(t.detach()) for t in outs]
            self._names.append(name)
            self._flags.append(flags[0] if len(flags) == 1 else torch.stack(flags).any())

        return hook

    def snapshot(self, device: torch.device) -> tuple[list[str], torch.Tensor]:
        """The last forward's module names and flags (a bool tensor on ``device``)."""
        if not self._flags:
            return [], torch.zeros((0,), dtype=torch.bool, device=device)
        return list(self._names), torch.stack([f.to(device) for f in self._flags])

    def first_nonfinite_module(self) -> str | None:
        """The first module whose output held an inf or NaN in the last forward, or None
        (reads the flags from the device)."""
        names, flags = self.snapshot(torch.device("cpu"))
        return next((n for n, f in zip(names, flags.tolist()) if f), None)

    def remove(self) -> None:
        """Removes the hooks; the model is no longer watched."""
        for h in self._handles:
            h.remove()
        self._handles = []
        if _WATCHES.get(self.model) is self:
            del _WATCHES[self.model]


def watch_nonfinite(model: nn.Module) -> NonfiniteWatch:
    """Records, in every forward of ``model``, which modules' outputs went non-finite.

    Opt-in and off by default: one forward hook per module, each one reduction of the
    module's floating outputs to a device flag (``aminmax``: a NaN reaches both ends, an
    inf one), with no host sync. `precision_report` (and ``AmpOptimizer.precision_report``) then name the first
    module, in the order the forwards returned, whose output held an inf or NaN:
    ``report.first_nonfinite_module``. Watching a model twice replaces the first watch.

    Args:
      model: the model (an ``AmpModel`` is looked through: names are the wrapped
        module's, as in ``named_modules()``; the root is ``"(root)"``).

    Returns:
      A `NonfiniteWatch`; call ``.remove()`` to stop watching.

    Raises:
      TypeError: ``model`` is not a ``torch.nn.Module``.

    Examples:
      >>> import torch, mpfunc_torch
      >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
      >>> watch = mpfunc_torch.watch_nonfinite(net)
      >>> with torch.no_grad():
      ...     _ = net[0].weight.fill_(float("inf"))
      ...     _ = net(torch.ones(1, 2))
      >>> watch.first_nonfinite_module()
      '0'
      >>> watch.remove()
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"`model` must be a torch.nn.Module, got {type(model).__name__}.")
    target = _target(model)
    old = _WATCHES.get(target)
    if old is not None:
        old.remove()
    watch = NonfiniteWatch(target)
    _WATCHES[target] = watch
    return watch


def watch_of(model: Any) -> NonfiniteWatch | None:
    """The watch on ``model`` (or the module an ``AmpModel`` wraps), or None."""
    return _WATCHES.get(_target(model)) if isinstance(model, nn.Module) else None
