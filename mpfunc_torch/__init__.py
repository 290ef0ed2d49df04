"""mpfunc_torch: the PyTorch side of mpfunc.

`convert_to_amp` offers the torch, apex-like (O0-O3), naive and bf16 modes, with the
same loss-scale rule and presets as the JAX package (`LossScaler`), exact skips, and an
inf check reduced over the process groups you name.

Needs the `torch` extra (``pip install 'mpfunc[torch]'``); it never imports JAX.
"""

try:  # a missing framework names the extra to install, not a bare "No module named"
    import torch  # noqa: F401
except ModuleNotFoundError as _error:
    from _mpfunc_common.extras import missing_extra_error

    raise missing_extra_error("mpfunc_torch (the PyTorch package)", "torch", _error) from _error

from _mpfunc_common.fp8 import Fp8Recipe
from _mpfunc_common.mixed_precision import (
    BF16MixedPrecision,
    FP8MixedPrecision,
    FP16ApexMixedPrecision,
    FP16NaiveMixedPrecision,
    FP16TorchMixedPrecision,
)
from _mpfunc_common.scale_config import ScaleConfig
from _mpfunc_common.version import __version__ as __version__
from mpfunc_torch._src.activation_checkpoint import checkpoint_context_fn
from mpfunc_torch._src.checkpoint.convert import convert_checkpoint
from mpfunc_torch._src.checkpoint.dcp import get_state_dict, set_state_dict
from mpfunc_torch._src.clipping import clip_grad_norm_, mark_replicated
from mpfunc_torch._src.fp8.convert import Fp8Linear, convert_to_fp8
from mpfunc_torch._src.fp8.quantize import dequantize_fp8, quantize_fp8
from mpfunc_torch._src.loss_scale import LossScaler
from mpfunc_torch._src.model import AmpCriterion, AmpModel, is_norm_module
from mpfunc_torch._src.modes import AMP_TYPE, convert_to_amp
from mpfunc_torch._src.nonfinite_watch import NonfiniteWatch, watch_nonfinite
from mpfunc_torch._src.optimizer import AmpOptimizer
from mpfunc_torch._src.precision_report import PrecisionReport, precision_report
from mpfunc_torch._src.trainers.booster import backward, boost

__all__ = [
    "AMP_TYPE",
    "AmpCriterion",
    "AmpModel",
    "AmpOptimizer",
    "BF16MixedPrecision",
    "FP8MixedPrecision",
    "FP16ApexMixedPrecision",
    "FP16NaiveMixedPrecision",
    "FP16TorchMixedPrecision",
    "Fp8Linear",
    "Fp8Recipe",
    "LossScaler",
    "NonfiniteWatch",
    "PrecisionReport",
    "ScaleConfig",
    "backward",
    "boost",
    "checkpoint_context_fn",
    "clip_grad_norm_",
    "convert_checkpoint",
    "convert_to_amp",
    "convert_to_fp8",
    "dequantize_fp8",
    "get_state_dict",
    "is_norm_module",
    "mark_replicated",
    "precision_report",
    "quantize_fp8",
    "set_state_dict",
    "watch_nonfinite",
]
