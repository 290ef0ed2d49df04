"""The loss-scale rule on torch tensors: the same rule, presets and state as mpfunc's."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from _mpfunc_common.scale_config import (
    FLOAT32_MAX,
    FLOAT32_MIN_NORMAL,
    SCALE_PRESETS,
    WARM_CLIMB,
    WARM_DOWN,
    WARM_DROP,
    WARM_OFF,
    WARM_START,
    WARM_UP,
    ScaleConfig,
    as_python_number,
    resolve_scale_config,
    to_float32,
)
from mpfunc_torch._src import fused
from mpfunc_torch._src.scale_rule import check_saved_state

__all__ = ["LossScaler"]

_INT32_MAX = 2**31 - 1


def _is_power_of_two(x: float) -> bool:
    m, _ = math.frexp(x)
    return math.isfinite(x) and x > 0 and m == 0.5


def _device(device: Any) -> torch.device:
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"`device` must be a torch.device or a device string such as 'cpu' "
                         f"or 'cuda', got {device!r}.") from e


class LossScaler:
    """Device-resident loss scale: dynamic, static or none (scale 1).

    The state lives in 0-dim tensors on ``device`` and is updated in place with tensor
    ops, so no step needs a host sync. Read numbers with `metrics(as_python=True)`.

    Dynamic update rule (identical to ``mpfunc.dynamic_scale``):

    .. code-block:: python

        # once per optimizer step; finite = every gradient leaf is finite (on every shard)
        if warm_phase == START and finite:               # warm_start=True only; a
            warm_phase = OFF                             # good initial scale is kept
        if warm_phase != OFF:                            # the warm start
            growth_tracker, hysteresis_left = 0, hysteresis
            top = min(max_scale, FLOAT32_MAX)
            if finite and loss_scale == top:             # nothing above to look for
                warm_phase = OFF
            elif finite:                                 # climb, x4 per finite step
                loss_scale = min(loss_scale * 4, top)
                warm_phase = UP
            elif warm_phase == UP:                       # the climb's first overflow:
                loss_scale = max(loss_scale / 4, min_scale)   # the last finite scale
                warm_phase = OFF                         # (or top / 4)
            else:                                        # no finite step yet
                loss_scale = max(loss_scale * 2**-16, min_scale)
                warm_phase = DOWN
        elif not finite:                                 # the step is skipped
            growth_tracker = 0
            hysteresis_left = max(hysteresis_left - 1, 0)
            if hysteresis_left == 0:
                loss_scale = max(loss_scale * backoff_factor, min_scale)
        else:
            growth_tracker += 1
            if growth_tracker == growth_interval:
                growth_tracker = 0
                hysteresis_left = hysteresis              # refills only when the scale grows
                grown = min(loss_scale * growth_factor, max_scale)
                if isfinite(grown):
                    loss_scale = grown

    All arithmetic is float32: every hyperparameter is rounded to float32 once, at
    construction (a value that does not survive that rounding is a ValueError), and each
    product is rounded to the nearest float32. With power-of-two factors every product
    is exact, which is why the presets reproduce their anchors bit for bit. The initial
    scale is min(init_scale, max_scale), as apex does. min_scale defaults to 1.0 and is
    at least 2**-126 (the smallest normal float32), so the scale is never 0, subnormal,
    inf or NaN; GradScaler and apex have no floor and follow the same trajectory as
    long as theirs stays >= 1.

    warm_phase starts at START with warm_start=True (naive mode's default) and at OFF
    otherwise, where the rule is exactly Megatron's / GradScaler's. The warm start costs
    at most 3 skipped steps from 2**32 down to any overflow threshold >= 1, and settles
    within 2x below the scale the plain rule settles at (both on the powers of two from
    the initial scale; within 4x otherwise).

    Where the rule reduces to torch's GradScaler (hysteresis 1, no ceiling, power-of-two
    factors) the update runs as torch's single fused kernel followed by the floor; the
    result is the same bit for bit. ``consecutive_skips`` counts the skipped steps since
    the last finite one (0 after a finite step; saturates at 2**31 - 1).

    Args:
      kind: ``"dynamic"``, ``"static"`` or ``"none"``.
      config: the rule's `ScaleConfig`, or a preset name (``"torch"``, ``"apex"``,
        ``"naive"``, ``"jmp"``); dynamic only. Default: the ``"torch"`` preset.
      static_scale: the fixed scale (static only), a normal float32 in [2**-126, 3.4e38].
      device: where the state lives (a ``torch.device`` or a string like ``"cuda:0"``).

    Examples:
      >>> import torch
      >>> s = LossScaler("dynamic")
      >>> s.update(torch.tensor(1.0))  # an overflow
      >>> s.metrics(as_python=True)
      {'loss_scale': 32768.0, 'skipped_steps': 1, 'consecutive_skips': 1, 'last_finite': False}
    """

    def __init__(
        self,
        kind: str = "dynamic",
        config: ScaleConfig | str | None = None,
        static_scale: float = 1.0,
        device: torch.device | str = "cpu",
    ):
        if kind not in ("dynamic", "static", "none"):
            raise ValueError(f"`kind` must be 'dynamic', 'static' or 'none', got {kind!r}.")
        if kind != "dynamic" and config is not None:
            raise ValueError(f"`config` only applies to kind='dynamic', got kind={kind!r}.")
        cfg: ScaleConfig | None = None  # set exactly when kind is "dynamic"
        if kind == "dynamic":
            if config is None or isinstance(config, str):
                if config is not None and config not in SCALE_PRESETS:
                    raise ValueError(f"`config` must be a ScaleConfig or one of the presets "
                                     f"{sorted(SCALE_PRESETS)}, got {config!r}.")
                cfg = resolve_scale_config(config or "torch")
            elif isinstance(config, ScaleConfig):
                cfg = config
            else:
                raise TypeError(
                    "`config` must be a ScaleConfig (mpfunc_torch.ScaleConfig.from_preset("
                    "preset, **overrides)) or a preset name, got "
                    f"{type(config).__name__}: {config!r}.")
        static = to_float32(as_python_number("static_scale", static_scale))
        if not FLOAT32_MIN_NORMAL <= static <= FLOAT32_MAX:
            raise ValueError("`static_scale` must be a normal float32 in [2**-126, 3.4e38], "
                             f"got {static_scale!r}.")
        self.kind = kind
        self.config = cfg
        device = _device(device)
        initial = (
            cfg.initial_scale if cfg is not None
            else static if kind == "static" else 1.0
        )
        self._static = initial
        f32, i32 = torch.float32, torch.int32
        self._scale = torch.full((), initial, dtype=f32, device=device)
        self._growth_tracker = torch.zeros((), dtype=i32, device=device)
        hyst = cfg.hysteresis if cfg is not None else 1
        self._hysteresis_left = torch.full((), hyst, dtype=i32, device=device)
        self._skipped = torch.zeros((), dtype=i32, device=device)
        self._consecutive = torch.zeros((), dtype=i32, device=device)
        self._last_finite = torch.ones((), dtype=torch.bool, device=device)
        warm = cfg is not None and cfg.warm_start
        self._warm_phase = torch.full((), WARM_START if warm else WARM_OFF, dtype=i32,
                                      device=device)
        if cfg is not None:
            self._growth = torch.tensor(cfg.growth_factor, dtype=f32, device=device)
            self._backoff = torch.tensor(cfg.backoff_factor, dtype=f32, device=device)
            self._min = torch.tensor(cfg.min_scale, dtype=f32, device=device)
            self._max = torch.tensor(cfg.max_scale, dtype=f32, device=device)
            self._hyst_full = torch.tensor(cfg.hysteresis, dtype=i32, device=device)
            self._f32_max = torch.tensor(FLOAT32_MAX, dtype=f32, device=device)
            # torch's kernel has no floor; clamping its result to min_scale afterwards is
            # the same rule (the floor only ever applies to a backed-off scale).
            self._use_torch_kernel = (
                not cfg.warm_start
                and cfg.hysteresis == 1
                and math.isinf(cfg.max_scale)
                and _is_power_of_two(cfg.growth_factor)
                and _is_power_of_two(cfg.backoff_factor)
            )

    @property
    def device(self) -> torch.device:
        """Where the state tensors live."""
        return self._scale.device

    @property
    def scale(self) -> torch.Tensor:
        """The current scale, a float32 0-dim device tensor (updated in place)."""
        return self._scale

    @property
    def skipped_steps(self) -> torch.Tensor:
        """Steps skipped so far, an int32 0-dim device tensor (saturates at 2**31 - 1)."""
        return self._skipped

    @property
    def consecutive_skips(self) -> torch.Tensor:
        """Skipped steps since the last finite one, an int32 0-dim device tensor."""
        return self._consecutive

    @property
    def last_finite(self) -> torch.Tensor:
        """Whether the last step's gradients were finite, a bool 0-dim device tensor."""
        return self._last_finite

    @property
    def may_go_below_one(self) -> bool:
        """Whether the scale can be < 1, where unscaling multiplies by more than 1 and can
        turn a finite gradient into an inf: gradients must then be checked after
        unscaling too."""
        return self.smallest_scale < 1.0

    @property
    def smallest_scale(self) -> float:
        """The smallest scale this scaler can reach (a host number, from its config)."""
        if self.config is not None:  # dynamic
            return min(self.config.min_scale, self.config.initial_scale)
        return self._static

    def inv_scale(self) -> torch.Tensor:
        """``1 / scale``, correctly rounded in float32 as on the JAX side (a new tensor)."""
        return torch.reciprocal(self._scale)

    def update(self, found_inf: torch.Tensor, step_found_inf: torch.Tensor | None = None) -> None:
        """Advances the state by one step.

        Args:
          found_inf: 0-dim float tensor, 1 if this scale's gradients overflowed; the
            scale follows it.
          step_found_inf: the step's overall flag, when several scales share one step
            (``num_losses > 1``: any loss overflowing skips the step). ``skipped_steps``,
            ``consecutive_skips`` and ``last_finite`` follow it. Default: ``found_inf``.
        """
        found_inf = found_inf.to(self.device, torch.float32)
        finite = found_inf == 0
        step_finite = finite if step_found_inf is None else step_found_inf.to(self.device) == 0
        self._last_finite.copy_(step_finite)
        self._skipped.add_((~step_finite & (self._skipped < _INT32_MAX)).to(torch.int32))
        c = self._consecutive
        c.copy_(torch.where(step_finite, torch.zeros_like(c), c + (c < _INT32_MAX).to(c.dtype)))
        cfg = self.config
        if cfg is None:  # not dynamic
            return
        if self._use_torch_kernel:
            fused.update_scale_(
                self._scale, self._growth_tracker, found_inf,
                cfg.growth_factor, cfg.backoff_factor, cfg.growth_interval,
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
        grow = t == cfg.growth_interval
        grown = torch.minimum(scale * self._growth, self._max)
        clean_scale = torch.where(grow & torch.isfinite(grown), grown, scale)
        clean_tracker = torch.where(grow, torch.zeros_like(t), t)
        clean_hyst = torch.where(grow, self._hyst_full, hyst)
        new_scale = torch.where(finite, clean_scale, over_scale)
        new_tracker = torch.where(finite, clean_tracker, torch.zeros_like(t))
        new_hyst = torch.where(finite, clean_hyst, hyst_after)
        if cfg.warm_start:
            self._warm_start(cfg, finite, new_scale, new_tracker, new_hyst)
            return
        scale.copy_(new_scale)
        tracker.copy_(new_tracker)
        hyst.copy_(new_hyst)

    def _warm_start(self, cfg: ScaleConfig, finite, new_scale, new_tracker, new_hyst) -> None:
        """The warm start of `UPDATE_RULE` over the plain rule's results (tensor ops,
        no host sync); mpfunc's `next_scale` computes the same, bit for bit."""
        scale, phase = self._scale, self._warm_phase
        phase.copy_(torch.where(finite & (phase == WARM_START), WARM_OFF, phase))
        hi = self._max if math.isfinite(cfg.max_scale) else self._f32_max
        climbed = torch.minimum(scale * WARM_CLIMB, hi)
        dropped = torch.maximum(scale * WARM_DROP, self._min)
        back = torch.maximum(scale * (1 / WARM_CLIMB), self._min)
        up = phase == WARM_UP
        warm_scale = torch.where(finite, climbed, torch.where(up, back, dropped))
        warm_phase = torch.where(finite, torch.where(scale < hi, WARM_UP, WARM_OFF),
                                 torch.where(up, WARM_OFF, WARM_DOWN)).to(torch.int32)
        warm = phase != WARM_OFF
        scale.copy_(torch.where(warm, warm_scale, new_scale))
        self._growth_tracker.copy_(torch.where(warm, 0, new_tracker))
        self._hysteresis_left.copy_(torch.where(warm, self._hyst_full, new_hyst))
        phase.copy_(torch.where(warm, warm_phase, WARM_OFF))

    def metrics(self, as_python: bool = False) -> dict[str, Any]:
        """``loss_scale``, ``skipped_steps``, ``consecutive_skips``, ``last_finite``: device
        tensors, or Python numbers with ``as_python=True`` (which syncs with the device)."""
        out = {
            "loss_scale": self._scale,
            "skipped_steps": self._skipped,
            "consecutive_skips": self._consecutive,
            "last_finite": self._last_finite,
        }
        if as_python:
            return {
                "loss_scale": float(self._scale),
                "skipped_steps": int(self._skipped),
                "consecutive_skips": int(self._consecutive),
                "last_finite": bool(self._last_finite),
            }
        return out

    def state_dict(self) -> dict[str, Any]:
        """The state, loadable with ``torch.load(..., weights_only=True)``.

        Keys: ``kind``, ``loss_scale``, ``growth_tracker``, ``hysteresis_left``,
        ``skipped_steps``, ``consecutive_skips``, ``last_finite``, ``warm_phase`` (0-dim
        tensors) and ``config`` (the hyperparameters it was saved with, a dict, or None).
        A state without ``warm_phase`` (saved before the warm start existed) loads as
        done (0), so its trajectory continues unchanged.
        `load_state_dict` restores the state but keeps the loading scaler's own
        hyperparameters, so a run may resume with a changed config.
        """
        return {
            "kind": self.kind,
            "loss_scale": self._scale.detach().clone(),
            "growth_tracker": self._growth_tracker.detach().clone(),
            "hysteresis_left": self._hysteresis_left.detach().clone(),
            "skipped_steps": self._skipped.detach().clone(),
            "consecutive_skips": self._consecutive.detach().clone(),
            "last_finite": self._last_finite.detach().clone(),
            "warm_phase": self._warm_phase.detach().clone(),
            "config": None if self.config is None else {
                k: getattr(self.config, k) for k in self.config.__dataclass_fields__
            },
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores a `state_dict`, all or nothing: every value is checked first.

        The state (scale, trackers, skip counters) is loaded; the hyperparameters stay
        this scaler's own, as on the JAX side (where they live in the transformation, not
        the state), so a run may resume with a changed config. This differs from
        ``torch.amp.GradScaler.load_state_dict``, which takes the saved growth and
        backoff factors and growth interval. Where the saved state does not fit this
        scaler's config, it is brought inside: the scale is clamped to [min_scale,
        max_scale], the growth tracker to ``growth_interval - 1`` and ``hysteresis_left``
        to ``hysteresis``. A static or unit scaler keeps its scale.

        Raises:
          ValueError: a missing key, another kind, or a value that no scaler can hold
            (non-finite, zero, negative or subnormal scale; a counter out of range; a
            tracker beyond what the saved config allows); the message names the key.
        """
        self._apply(self.check_state(state))

    def check_state(self, state: Any, where: str = "state") -> dict[str, Any]:
        """Validates a `state_dict` (naming keys as ``where['key']``) and returns the
        values `load_state_dict` would write, changing nothing."""
        return check_saved_state(state, self.kind, self.config, self._static, where)

    def _apply(self, values: dict[str, Any]) -> None:
        for key, dst in (("loss_scale", self._scale), ("growth_tracker", self._growth_tracker),
                         ("hysteresis_left", self._hysteresis_left),
                         ("skipped_steps", self._skipped),
                         ("consecutive_skips", self._consecutive),
                         ("last_finite", self._last_finite),
                         ("warm_phase", self._warm_phase)):
            dst.fill_(values[key])
