"""The loss-scale rule on torch tensors: the same rule, presets and state as mpfunc's."""

from __future__ import annotations

import math
from typing import Any

import torch

from _mpfunc_common.scale_config import UPDATE_RULE, ScaleConfig, resolve_scale_config
from mpfunc_torch._src import fused

__all__ = ["LossScaler", "SharedScale"]

_INT32_MAX = 2**31 - 1


def _is_power_of_two(x: float) -> bool:
    m, _ = math.frexp(x)
    return math.isfinite(x) and x > 0 and m == 0.5


class LossScaler:
    """Device-resident loss scale: dynamic, static or none (scale 1).

    The state lives in 0-dim tensors on ``device`` and is updated in place with tensor
    ops, so no step needs a host sync. Read numbers with `metrics(as_python=True)`.

    Dynamic update rule (identical to ``mpfunc.dynamic_scale``):

    .. code-block:: python

{rule}
    Where the rule reduces to torch's GradScaler (hysteresis 1, no floor or ceiling,
    power-of-two factors) the update runs as torch's single fused kernel; the result is
    the same bit for bit.

    Args:
      kind: ``"dynamic"``, ``"static"`` or ``"none"``.
      config: the rule's `ScaleConfig` (dynamic only); default: the ``"torch"`` preset.
      static_scale: the fixed scale (static only).
      device: where the state lives.

    Examples:
      >>> import torch
      >>> s = LossScaler("dynamic")
      >>> s.update(torch.tensor(1.0))  # an overflow
      >>> s.metrics(as_python=True)
      {{'loss_scale': 32768.0, 'skipped_steps': 1, 'last_finite': False}}
    """

    def __init__(
        self,
        kind: str = "dynamic",
        config: ScaleConfig | None = None,
        static_scale: float = 1.0,
        device: torch.device | str = "cpu",
    ):
        if kind not in ("dynamic", "static", "none"):
            raise ValueError(f"`kind` must be 'dynamic', 'static' or 'none', got {kind!r}.")
        if kind == "dynamic" and config is None:
            config = resolve_scale_config("torch")
        if kind != "dynamic" and config is not None:
            raise ValueError(f"`config` only applies to kind='dynamic', got kind={kind!r}.")
        if not (math.isfinite(static_scale) and static_scale > 0):
            raise ValueError(f"`static_scale` must be finite and > 0, got {static_scale!r}.")
        self.kind = kind
        self.config = config
        device = torch.device(device)
        initial = (
            config.initial_scale if kind == "dynamic"
            else static_scale if kind == "static" else 1.0
        )
        f32, i32 = torch.float32, torch.int32
        self._scale = torch.full((), initial, dtype=f32, device=device)
        self._growth_tracker = torch.zeros((), dtype=i32, device=device)
        hyst = config.hysteresis if config is not None else 1
        self._hysteresis_left = torch.full((), hyst, dtype=i32, device=device)
        self._skipped = torch.zeros((), dtype=i32, device=device)
        self._last_finite = torch.ones((), dtype=torch.bool, device=device)
        if config is not None:
            self._growth = torch.tensor(config.growth_factor, dtype=f32, device=device)
            self._backoff = torch.tensor(config.backoff_factor, dtype=f32, device=device)
            self._min = torch.tensor(config.min_scale, dtype=f32, device=device)
            self._max = torch.tensor(config.max_scale, dtype=f32, device=device)
            self._hyst_full = torch.tensor(config.hysteresis, dtype=i32, device=device)
            # torch's kernel has no floor; clamping its result to min_scale afterwards is
            # the same rule (the floor only ever applies to a backed-off scale).
            self._use_torch_kernel = (
                config.hysteresis == 1
                and math.isinf(config.max_scale)
                and _is_power_of_two(config.growth_factor)
                and _is_power_of_two(config.backoff_factor)
            )

    @property
    def device(self) -> torch.device:
        return self._scale.device

    @property
    def scale(self) -> torch.Tensor:
        """The current scale, a float32 0-dim device tensor (updated in place)."""
        return self._scale

    @property
    def skipped_steps(self) -> torch.Tensor:
        return self._skipped

    @property
    def last_finite(self) -> torch.Tensor:
        return self._last_finite

    def inv_scale(self) -> torch.Tensor:
        """``1 / scale``, correctly rounded in float32 as on the JAX side (a new tensor)."""
        return torch.reciprocal(self._scale)

    def update(self, found_inf: torch.Tensor, step_found_inf: torch.Tensor | None = None) -> None:
        """Advances the state by one step.

        Args:
          found_inf: 0-dim float tensor, 1 if this scale's gradients overflowed; the
            scale follows it.
          step_found_inf: the step's overall flag, when several scales share one step
            (``num_losses > 1``: any loss overflowing skips the step). ``skipped_steps``
            and ``last_finite`` follow it. Default: ``found_inf``.
        """
        found_inf = found_inf.to(self.device, torch.float32)
        finite = found_inf == 0
        step_finite = finite if step_found_inf is None else step_found_inf.to(self.device) == 0
        self._last_finite.copy_(step_finite)
        self._skipped.add_((~step_finite & (self._skipped < _INT32_MAX)).to(torch.int32))
        if self.kind != "dynamic":
            return
        if self._use_torch_kernel:
            fused.update_scale_(
                self._scale, self._growth_tracker, found_inf,
                self.config.growth_factor, self.config.backoff_factor,
                self.config.growth_interval,
            )
            torch.maximum(self._scale, self._min, out=self._scale)
            # Keep hysteresis_left as the rule defines it (for hysteresis 1 it never
            # changes a decision, but the state then matches mpfunc's bit for bit).
            refill = finite & (self._growth_tracker == 0)
            self._hysteresis_left.copy_(
                torch.where(finite, torch.where(refill, self._hyst_full, self._hysteresis_left),
                            torch.zeros_like(self._hysteresis_left)))
            return
        scale, tracker, hyst = self._scale, self._growth_tracker, self._hysteresis_left
        # Overflow branch.
        hyst_after = torch.clamp(hyst - 1, min=0)
        backed = torch.maximum(scale * self._backoff, self._min)
        over_scale = torch.where(hyst_after == 0, backed, scale)
        # Clean branch.
        t = torch.clamp(tracker, max=_INT32_MAX - 1) + 1
        grow = t == self.config.growth_interval
        grown = torch.minimum(scale * self._growth, self._max)
        clean_scale = torch.where(grow & torch.isfinite(grown), grown, scale)
        clean_tracker = torch.where(grow, torch.zeros_like(t), t)
        clean_hyst = torch.where(grow, self._hyst_full, hyst)
        new_scale = torch.where(finite, clean_scale, over_scale)
        new_tracker = torch.where(finite, clean_tracker, torch.zeros_like(t))
        new_hyst = torch.where(finite, clean_hyst, hyst_after)
        scale.copy_(new_scale)
        tracker.copy_(new_tracker)
        hyst.copy_(new_hyst)

    def metrics(self, as_python: bool = False) -> dict[str, Any]:
        """``loss_scale``, ``skipped_steps``, ``last_finite``: device tensors, or Python
        numbers with ``as_python=True`` (which syncs with the device)."""
        out = {
            "loss_scale": self._scale,
            "skipped_steps": self._skipped,
            "last_finite": self._last_finite,
        }
        if as_python:
            return {
                "loss_scale": float(self._scale),
                "skipped_steps": int(self._skipped),
                "last_finite": bool(self._last_finite),
            }
        return out

    def state_dict(self) -> dict[str, Any]:
        """Keys: ``kind``, ``loss_scale``, ``growth_tracker``, ``hysteresis_left``,
        ``skipped_steps``, ``last_finite`` (tensors) and ``config`` (a dict of numbers, or
        None). Loadable with ``torch.load(..., weights_only=True)``."""
        return {
            "kind": self.kind,
            "loss_scale": self._scale.detach().clone(),
            "growth_tracker": self._growth_tracker.detach().clone(),
            "hysteresis_left": self._hysteresis_left.detach().clone(),
            "skipped_steps": self._skipped.detach().clone(),
            "last_finite": self._last_finite.detach().clone(),
            "config": None if self.config is None else {
                k: getattr(self.config, k) for k in self.config.__dataclass_fields__
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores `state_dict`'s output; the kind and config must match this scaler's."""
        expected = self.state_dict()
        missing = sorted(set(expected) - set(state))
        if missing:
            raise ValueError(f"loss-scaler `state_dict` is missing keys {missing}.")
        if state["kind"] != self.kind:
            raise ValueError(f"loss-scaler kind mismatch: saved {state['kind']!r}, "
                             f"this scaler is {self.kind!r}.")
        if state["config"] != expected["config"]:
            raise ValueError(f"loss-scaler config mismatch: saved {state['config']}, "
                             f"this scaler has {expected['config']}.")
        for key, dst in (("loss_scale", self._scale), ("growth_tracker", self._growth_tracker),
                         ("hysteresis_left", self._hysteresis_left),
                         ("skipped_steps", self._skipped), ("last_finite", self._last_finite)):
            dst.copy_(state[key].to(dst.device, dst.dtype))


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


LossScaler.__doc__ = LossScaler.__doc__.format(rule=UPDATE_RULE)
