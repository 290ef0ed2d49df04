"""apex O1's function lists (apex/amp/lists), by function name.

The fp16 list runs in half precision under O1; the fp32 list is enforced on top of the
framework's autocast wherever the autocast would run the function in half. Re-exported
by `_mpfunc_common.amp_config`.
"""

from __future__ import annotations

__all__ = ["APEX_O1_FP16_FUNCTIONS", "APEX_O1_FP32_FUNCTIONS"]

APEX_O1_FP16_FUNCTIONS = (
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
    "conv_transpose3d", "linear", "prelu", "addmm", "addmv", "addr", "matmul", "mm", "mv",
    "addbmm", "baddbmm", "bmm",
)
APEX_O1_FP32_FUNCTIONS = (
    # pointwise
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "reciprocal",
    "rsqrt", "sinh", "tan", "pow", "softplus", "softmin", "softmax", "log_softmax",
    # reductions
    "cumprod", "cumsum", "dist", "norm", "prod", "std", "sum", "var", "renorm",
    # normalisation
    "layer_norm", "group_norm", "local_response_norm", "normalize", "cosine_similarity",
    # losses
    "binary_cross_entropy", "poisson_nll_loss", "cosine_embedding_loss", "cross_entropy",
    "hinge_embedding_loss", "kl_div", "l1_loss", "mse_loss", "margin_ranking_loss",
    "multilabel_margin_loss", "multilabel_soft_margin_loss", "multi_margin_loss",
    "nll_loss", "binary_cross_entropy_with_logits", "smooth_l1_loss", "soft_margin_loss",
    "triplet_margin_loss",
)
