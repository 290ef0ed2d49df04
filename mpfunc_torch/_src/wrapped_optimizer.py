"""`WrappedOptimizer`: a ``torch.optim.Optimizer`` that is a view of another one.

``param_groups``, ``state`` and ``defaults`` are the inner optimizer's own objects, so LR
schedulers, ``add_param_group`` and code that edits ``param_groups`` reach it; the hook
registries (step, state_dict, load_state_dict; pre and post) are the wrapper's own, as
torch's hook handles need. `AmpOptimizer` builds on it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["WrappedOptimizer", "mark_step_called"]


def mark_step_called(optimizer: torch.optim.Optimizer) -> None:
    """A skipped step is still this iteration's optimizer step. torch's LR schedulers
    wrap the inner optimizer's ``step`` to check, at their first ``step()``, that the
    optimizer stepped first; a skipped step never reaches the inner ``step``, so record
    the call as that wrapper does. Otherwise a correctly ordered loop whose first steps
    overflow (naive starts at 2**32) gets a call-order warning (GradScaler users do)."""
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        optimizer._opt_called = True  # pyright: ignore[reportAttributeAccessIssue]  # the scheduler's wrapper sets it on the optimizer too


class WrappedOptimizer(torch.optim.Optimizer):
    """Forwards the torch optimizer interface to ``optimizer``; runs its own hooks.

    Args:
      optimizer: the inner ``torch.optim.Optimizer``.

    Examples:
      >>> import torch
      >>> inner = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
      >>> WrappedOptimizer(inner).param_groups is inner.param_groups
      True
    """

    def __init__(self, optimizer: torch.optim.Optimizer):
        # Deliberately not calling Optimizer.__init__: param_groups/state/defaults are
        # the inner optimizer's own (see the properties below).
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError("`optimizer` must be a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}.")
        self.optimizer = optimizer
        for kind in ("step", "state_dict", "load_state_dict"):
            for when in ("pre", "post"):
                setattr(self, f"_optimizer_{kind}_{when}_hooks", OrderedDict())

    @property
    def param_groups(self):
        """The wrapped optimizer's ``param_groups`` (the same list, read and set)."""
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.optimizer.param_groups = value

    @property
    def state(self):
        """The wrapped optimizer's ``state``."""
        return self.optimizer.state

    @property
    def defaults(self):
        """The wrapped optimizer's ``defaults``."""
        return self.optimizer.defaults

    def __getstate__(self):
        raise TypeError(f"{type(self).__name__} is not picklable; save its state_dict() "
                        "instead.")

    def _state_dict_with_hooks(self, save: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """``save()`` between the ``register_state_dict_pre/post_hook`` hooks."""
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        out = save()
        for hook in self._optimizer_state_dict_post_hooks.values():
            result = hook(self, out)
            if result is not None:
                out = result
        return out

    def _load_state_dict_with_hooks(self, state_dict: dict[str, Any],
                                    load: Callable[[dict[str, Any]], None]) -> None:
        """``load(state_dict)`` between the ``register_load_state_dict_pre/post_hook``
        hooks (a pre hook may return a replacement)."""
        state_dict = dict(state_dict) if isinstance(state_dict, dict) else state_dict
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        load(state_dict)
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)
