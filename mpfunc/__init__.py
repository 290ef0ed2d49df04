"""mpfunc: functional mixed-precision training for JAX.

Precision policies, loss scaling as optax transformations, and AMP modes.
"""

from mpfunc._src.loss_scale import (
    LossScaleState,
    all_finite,
    chain,
    dynamic_scale,
    loss_scale,
    no_scale,
    scale_loss,
    scale_metrics,
    static_scale,
)
from mpfunc._src.policy import Policy, cast_floating, get_policy

__version__ = "0.1.0"

__all__ = [
    "LossScaleState",
    "Policy",
    "all_finite",
    "cast_floating",
    "chain",
    "dynamic_scale",
    "get_policy",
    "loss_scale",
    "no_scale",
    "scale_loss",
    "scale_metrics",
    "static_scale",
]
