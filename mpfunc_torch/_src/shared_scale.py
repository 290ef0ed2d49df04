"""`SharedScale`: one set of loss scalers behind the optimizers converted together."""

from __future__ import annotations

import torch

from mpfunc_torch._src.loss_scale import LossScaler

__all__ = ["SharedScale"]


class SharedScale:
    """One set of loss scalers shared by the optimizers converted together.

    As with one ``torch.amp.GradScaler`` driving several optimizers: each optimizer skips
    or steps on its own gradients, and the scale is updated once per iteration, after
    the last of them has stepped, with the overflow flag of all of them.
    """

    def __init__(self, scalers: list[LossScaler], n_optimizers: int, device):
        self.scalers = scalers
        self.n = n_optimizers
        self.members: list = []
        self.stepped = 0
        self.found = torch.zeros((), dtype=torch.float32, device=device)

    def record(self, found_inf: torch.Tensor) -> bool:
        """Adds one optimizer's flag; True when the iteration's last optimizer stepped."""
        if self.n == 1:
            return True
        torch.maximum(self.found, found_inf, out=self.found)
        self.stepped += 1
        return self.stepped == self.n

    def take(self, found_inf: torch.Tensor) -> torch.Tensor:
        if self.n == 1:
            return found_inf
        self.stepped = 0
        out = self.found.clone()
        self.found.zero_()
        return out

    def update_after_step(self, found_inf: torch.Tensor,
                          found_per_loss: list[torch.Tensor]) -> None:
        """Updates the scales after one optimizer's step whose overflow flag (over every
        loss) was ``found_inf``; with one loss once per iteration, after the last
        optimizer sharing the scale (`record`). With several losses each scale follows
        its own loss's overflows (``found_per_loss``), and a skipped step is counted on
        every scaler."""
        if len(self.scalers) == 1:
            if self.record(found_inf):
                self.scalers[0].update(self.take(found_inf))
            return
        for scaler, found in zip(self.scalers, found_per_loss):
            scaler.update(found, step_found_inf=found_inf)

    def check_none_unscaled(self, opt) -> None:
        """Every optimizer sharing this scale gets a backward's gradients: one of them
        already unscaled (``opt`` or another) would add scaled gradients to unscaled
        ones, unchecked, so a backward then raises."""
        unscaled = [i for i, m in enumerate(self.members) if m._stage == "unscaled"]
        if unscaled:
            who = ("" if unscaled == [self.members.index(opt)] else
                   f" (of the optimizers sharing this loss scale, number {unscaled[0]} "
                   "in convert_to_amp's list)")
            raise RuntimeError("backward()/scale_loss() after unscale_()/clip_grad_norm()"
                               f"{who} and before step(): gradients of one step must share "
                               "one scale.")

    def mark_backward(self) -> None:
        """One backward feeds every optimizer sharing this scale (e.g. two models, two
        losses): each one ready for a step now has gradients."""
        for member in self.members:
            if member._stage == "ready":
                member._stage = "backward"
