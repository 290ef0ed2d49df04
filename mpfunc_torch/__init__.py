"""mpfunc_torch: the PyTorch side of mpfunc.

`convert_to_amp` offers the torch, apex-like (O0-O3), naive and bf16 modes, with the
same loss-scale rule and presets as the JAX package (`LossScaler`), exact skips, and an
inf check reduced over the process groups you name.
"""

from _mpfunc_common.mixed_precision import (
    BF16MixedPrecision,
    FP16ApexMixedPrecision,
    FP16NaiveMixedPrecision,
    FP16TorchMixedPrecision,
)
from mpfunc_torch._src.booster import backward, boost
from mpfunc_torch._src.loss_scale import LossScaler
from mpfunc_torch._src.model import AmpCriterion, AmpModel
from mpfunc_torch._src.modes import AMP_TYPE, convert_to_amp
from mpfunc_torch._src.optimizer import AmpOptimizer

__version__ = "0.1.0"

__all__ = [
    "AMP_TYPE",
    "AmpCriterion",
    "AmpModel",
    "AmpOptimizer",
    "BF16MixedPrecision",
    "FP16ApexMixedPrecision",
    "FP16NaiveMixedPrecision",
    "FP16TorchMixedPrecision",
    "LossScaler",
    "backward",
    "boost",
    "convert_to_amp",
]
