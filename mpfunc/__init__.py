"""mpfunc: functional mixed-precision training for JAX.

Precision policies, op-level autocast, loss scaling as optax transformations, master
weights, and the torch / apex-like / naive / bf16 AMP modes.
"""

from mpfunc._src.autocast import AutocastLists, autocast
from mpfunc._src.distributed import all_finite
from mpfunc._src.flax_policy import LinenPolicy, linen_policy, nnx_apply_policy, norm_classes
from mpfunc._src.loss_scale import (
    LossScaleState,
    ScaledValueAndGrad,
    chain,
    dynamic_scale,
    no_scale,
    static_scale,
)
from mpfunc._src.master_weights import MasterWeightsState, master_weights
from mpfunc._src.modes import AmpSetup, convert_to_amp, is_norm_param
from mpfunc._src.policy import Policy, cast_floating, get_policy
from mpfunc._src.scale_state import loss_scale, scale_loss, scale_metrics, value_and_grad

__version__ = "0.1.0"

__all__ = [
    "AmpSetup",
    "AutocastLists",
    "LinenPolicy",
    "LossScaleState",
    "MasterWeightsState",
    "Policy",
    "ScaledValueAndGrad",
    "all_finite",
    "autocast",
    "cast_floating",
    "chain",
    "convert_to_amp",
    "dynamic_scale",
    "get_policy",
    "is_norm_param",
    "linen_policy",
    "loss_scale",
    "master_weights",
    "nnx_apply_policy",
    "no_scale",
    "norm_classes",
    "scale_loss",
    "scale_metrics",
    "static_scale",
    "value_and_grad",
]
