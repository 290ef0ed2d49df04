"""mpfunc_torch: the PyTorch side of mpfunc.

`convert_to_amp` offers the torch, apex-like (O0-O3), naive and bf16 modes, with the
same loss-scale rule and presets as the JAX package (`LossScaler`), exact skips, and an
inf check reduced over the process groups you name.
"""

from _mpfunc_common.fp8 import Fp8Recipe
from mpfunc_torch._src.amp import (
    AMP_TYPE,
    AmpCriterion,
    AmpModel,
    AmpOptimizer,
    convert_to_amp,
)
from mpfunc_torch._src.fp8 import dequantize_fp8, quantize_fp8
from mpfunc_torch._src.fp8_convert import Fp8Linear, convert_to_fp8
from mpfunc_torch._src.scaler import LossScaler

__version__ = "0.1.0"

__all__ = [
    "AMP_TYPE",
    "AmpCriterion",
    "AmpModel",
    "AmpOptimizer",
    "Fp8Linear",
    "Fp8Recipe",
    "LossScaler",
    "convert_to_amp",
    "convert_to_fp8",
    "dequantize_fp8",
    "quantize_fp8",
]
