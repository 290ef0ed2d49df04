"""mpfunc: functional mixed-precision training for JAX.

Precision policies, op-level autocast, loss scaling as optax transformations, master
weights (float32, or bfloat16 params with remainders, Kahan compensation or stochastic
rounding), optimizer state in bfloat16 or 8-bit blocks, and the torch / apex-like /
naive / bf16 AMP modes.

Needs the `jax` extra (``pip install 'mpfunc[jax]'``); the flax helpers (`linen_policy`,
`nnx_apply_policy`, `norm_classes`) need the `flax` extra, imported only when called.
"""

try:  # a missing framework names the extra to install, not a bare "No module named"
    import jax  # noqa: F401
    import optax  # noqa: F401
except ModuleNotFoundError as _error:
    from _mpfunc_common.extras import missing_extra_error

    raise missing_extra_error("mpfunc (the JAX package)", "jax", _error) from _error

from _mpfunc_common.fp8 import Fp8Recipe
from _mpfunc_common.mixed_precision import (
    BF16MixedPrecision,
    FP8MixedPrecision,
    FP16ApexMixedPrecision,
    FP16NaiveMixedPrecision,
    FP16TorchMixedPrecision,
)
from _mpfunc_common.version import __version__ as __version__
from mpfunc._src.autocast import AutocastLists, autocast
from mpfunc._src.checkpoint.convert import convert_checkpoint
from mpfunc._src.clipping import clip_by_global_norm, global_norm
from mpfunc._src.distributed import all_finite
from mpfunc._src.flax_policy import (
    DeclaredDtypeWarning,
    LinenPolicy,
    linen_policy,
    norm_classes,
)
from mpfunc._src.fp8.convert import Fp8Function, convert_to_fp8
from mpfunc._src.fp8.matmul import Fp8DotState, Fp8Meta, fp8_dot, fp8_dot_state
from mpfunc._src.fp8.quantize import dequantize_fp8, quantize_fp8
from mpfunc._src.loss_scale import (
    chain,
    dynamic_scale,
    no_scale,
    static_scale,
)
from mpfunc._src.master_weights import MasterWeightsState, master_weights
from mpfunc._src.modes import AmpSetup, convert_to_amp, is_norm_param
from mpfunc._src.nnx_policy import nnx_apply_policy
from mpfunc._src.nonfinite_watch import NonfiniteWatch, watch_nonfinite
from mpfunc._src.param_storage import KahanState, RemainderState, StochasticRoundingState
from mpfunc._src.policy import (
    Policy,
    cast_floating,
    cast_to_full,
    cast_to_half,
    get_policy,
    half_dtype,
)
from mpfunc._src.precision_report import PrecisionReport, precision_report
from mpfunc._src.scale_state import (
    LossScaleState,
    ScaledValueAndGrad,
    loss_scale,
    scale_loss,
    scale_metrics,
    value_and_grad,
)
from mpfunc._src.sharding import state_sharding
from mpfunc._src.state_dtype import StateDtypeState, state_dtype

__all__ = [
    "AmpSetup",
    "AutocastLists",
    "BF16MixedPrecision",
    "DeclaredDtypeWarning",
    "FP8MixedPrecision",
    "FP16ApexMixedPrecision",
    "FP16NaiveMixedPrecision",
    "FP16TorchMixedPrecision",
    "Fp8DotState",
    "Fp8Function",
    "Fp8Meta",
    "Fp8Recipe",
    "KahanState",
    "LinenPolicy",
    "LossScaleState",
    "MasterWeightsState",
    "NonfiniteWatch",
    "Policy",
    "PrecisionReport",
    "RemainderState",
    "ScaledValueAndGrad",
    "StateDtypeState",
    "StochasticRoundingState",
    "all_finite",
    "autocast",
    "cast_floating",
    "cast_to_full",
    "cast_to_half",
    "chain",
    "clip_by_global_norm",
    "convert_checkpoint",
    "convert_to_amp",
    "convert_to_fp8",
    "dequantize_fp8",
    "dynamic_scale",
    "fp8_dot",
    "fp8_dot_state",
    "get_policy",
    "global_norm",
    "half_dtype",
    "is_norm_param",
    "linen_policy",
    "loss_scale",
    "master_weights",
    "nnx_apply_policy",
    "precision_report",
    "no_scale",
    "norm_classes",
    "quantize_fp8",
    "scale_loss",
    "scale_metrics",
    "state_dtype",
    "state_sharding",
    "static_scale",
    "value_and_grad",
    "watch_nonfinite",
]
