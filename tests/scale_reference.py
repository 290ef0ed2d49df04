"""mpfunc's whole loss-scale rule, the warm start included, in plain Python.

Written from the rule's text (`_mpfunc_common.scale_config.UPDATE_RULE`) with NumPy
float32 scalars, independently of both implementations, which the tests hold to it bit
for bit. `closed_loop` runs a rule against a model of the training run: a step
overflows exactly when its scale is above a threshold.
"""

from __future__ import annotations

import dataclasses

import numpy as np

OFF, START, DOWN, UP = 0, 1, 2, 3
F32_MAX = np.finfo(np.float32).max


@dataclasses.dataclass
class State:
    scale: np.float32
    tracker: int
    hyst: int
    phase: int

    def row(self):
        return (float(self.scale), self.tracker, self.hyst, self.phase)


def init(cfg) -> State:
    return State(np.float32(min(cfg.init_scale, cfg.max_scale)), 0, cfg.hysteresis,
                 START if cfg.warm_start else OFF)


def step(cfg, s: State, finite: bool) -> State:
    f32 = np.float32
    top = f32(min(cfg.max_scale, F32_MAX))
    scale, tracker, hyst, phase = s.scale, s.tracker, s.hyst, s.phase
    if phase == START and finite:
        phase = OFF
    with np.errstate(over="ignore", under="ignore"):
        if phase != OFF:
            tracker, hyst = 0, cfg.hysteresis
            if finite and scale == top:
                phase = OFF
            elif finite:
                scale = min(f32(scale * f32(4.0)), top)
                phase = UP
            elif phase == UP:
                scale = max(f32(scale / f32(4.0)), f32(cfg.min_scale))
                phase = OFF
            else:
                scale = max(f32(scale * f32(2.0**-16)), f32(cfg.min_scale))
                phase = DOWN
        elif not finite:
            tracker = 0
            hyst = max(hyst - 1, 0)
            if hyst == 0:
                scale = max(f32(scale * f32(cfg.backoff_factor)), f32(cfg.min_scale))
        else:
            tracker += 1
            if tracker == cfg.growth_interval:
                tracker = 0
                hyst = cfg.hysteresis
                grown = min(f32(scale * f32(cfg.growth_factor)), f32(cfg.max_scale))
                if np.isfinite(grown):
                    scale = grown
    return State(f32(scale), tracker, hyst, phase)


def open_loop(cfg, seq):
    """The state after each step of a given finite/overflow sequence."""
    s, out = init(cfg), []
    for finite in seq:
        s = step(cfg, s, finite)
        out.append(s.row())
    return out


def closed_loop(cfg, threshold, steps):
    """A run whose steps overflow exactly when the scale they ran at is above
    ``threshold``: returns (the scale each step ran at, each step's finite flag)."""
    s, scales, flags = init(cfg), [], []
    for _ in range(steps):
        finite = bool(s.scale <= threshold)
        scales.append(float(s.scale))
        flags.append(finite)
        s = step(cfg, s, finite)
    return scales, flags
