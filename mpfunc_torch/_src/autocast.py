"""apex O1's fp32 function list, enforced on top of ``torch.autocast``, its half-model
counterpart for naive and apex O2 (`HalfModelFp32Functions`), the one-dtype rule of every
half-param mode (`HalfModelFunctions`), and all of them around a trainer's step
(`step_context`); ``activation_checkpoint`` runs them in the recompute of activation
checkpointing.

``torch.autocast`` already runs many precision-sensitive ops in float32 on CUDA, but
its lists differ by device (on CPU, fp16 autocast runs softmax, exp, layer_norm and sum
in float16). `Fp32Functions` is a ``TorchFunctionMode``: inside it, every function on
apex O1's fp32 list gets its half-precision inputs cast to float32 and runs with
autocast off, whatever the device's autocast lists say.

It works under ``torch.compile`` (dynamo traces the mode into the graph as casts), both
when the mode is entered inside the compiled code and when a compiled module is called
inside the mode. For the second case the mode keeps no per-instance state but its
device: dynamo guards on the attributes of modes that are active when a compiled frame
starts, and a frozenset of functions there breaks its guards (torch 2.13:
``NameError: ___get_torch_function_mode_stack_at``). The list is one module-level
constant instead.

The half-model modes (naive, apex O2) run no autocast: every param and activation is
float16, so a loss computed inside ``forward`` (HuggingFace models given ``labels=``,
nanoGPT) or a functional softmax / layer norm would compute in float16.
`HalfModelFp32Functions` runs the precision-sensitive part of apex's list in float32
there, around the converted model's forward: the losses and ``log_softmax`` return
float32 (a loss, or the log-probabilities a loss reads), and the softmax and norm
functions return the dtype of their half input, which the next layer computes in (a
float32 result would promote the activations after it, and a float16 matmul refuses a
float32 operand). The pointwise functions and plain reductions of apex's list are left
out: with the result rounded back to float16 they would cost a float32 copy for the
same value (torch's half kernels already compute them in float32).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack
from torch.utils._pytree import tree_leaves, tree_map_only

from _mpfunc_common.amp_config import APEX_O1_FP32_FUNCTIONS

__all__ = ["Fp32Functions", "HalfModelFunctions", "HalfModelFp32Functions",
           "HALF_MODEL_FP32_FUNCTIONS", "SAME_DTYPE_FUNCTIONS", "fp32_callables",
           "function_mode", "mode_active", "step_context"]

_HALF = (torch.float16, torch.bfloat16)

# naive / apex O2: computed in float32 whatever their inputs. The first group returns
# float32 (losses; log-probabilities), the second the dtype of its half input.
HALF_MODEL_FP32_FUNCTIONS = {
    "float32 result": (
        "log_softmax", "cross_entropy", "nll_loss", "binary_cross_entropy",
        "binary_cross_entropy_with_logits", "poisson_nll_loss", "kl_div", "l1_loss",
        "mse_loss", "smooth_l1_loss", "huber_loss", "soft_margin_loss",
        "multilabel_soft_margin_loss", "multilabel_margin_loss", "multi_margin_loss",
        "hinge_embedding_loss", "cosine_embedding_loss", "margin_ranking_loss",
        "triplet_margin_loss",
    ),
    "input dtype result": (
        "softmax", "softmin", "layer_norm", "rms_norm", "group_norm",
        "local_response_norm", "normalize", "cosine_similarity",
    ),
}


# Every half-param mode: ops whose kernels take their operands in one floating dtype. A
# float32 operand that is not a Parameter is cast to the call's half dtype.
SAME_DTYPE_FUNCTIONS = (
    "linear", "bilinear", "matmul", "mm", "bmm", "mv", "addmm", "addmv", "addbmm",
    "baddbmm", "einsum", "conv1d", "conv2d", "conv3d", "conv_transpose1d",
    "conv_transpose2d", "conv_transpose3d", "scaled_dot_product_attention",
    "multi_head_attention_forward", "batch_norm", "instance_norm", "layer_norm",
    "group_norm", "rms_norm", "embedding_bag", "prelu",
)
# The attention masks, left as they are (by keyword, and by position for the functions
# that take them positionally).
_MASK_NAMES = frozenset({"attn_mask", "key_padding_mask"})


def fp32_callables(names=APEX_O1_FP32_FUNCTIONS) -> frozenset:
    """The torch, ``torch.nn.functional`` and ``Tensor`` callables for ``names``."""
    found = set()
    for name in names:
        for owner in (torch, F, torch.Tensor):
            fn = getattr(owner, name, None)
            if callable(fn):
                found.add(fn)
    return frozenset(found)


_FP32_CALLABLES = fp32_callables()
_HALF_MODEL_F32_OUT = fp32_callables(HALF_MODEL_FP32_FUNCTIONS["float32 result"])
_HALF_MODEL_F32_IN = fp32_callables(HALF_MODEL_FP32_FUNCTIONS["input dtype result"])
_SAME_DTYPE = fp32_callables(SAME_DTYPE_FUNCTIONS)
_MASK_POSITIONS = {F.scaled_dot_product_attention: (3,),
                   F.multi_head_attention_forward: (14, 16)}


def _to_f32(x: torch.Tensor) -> torch.Tensor:
    return x.float() if x.dtype in _HALF else x


class Fp32Functions(TorchFunctionMode):
    """Runs apex O1's fp32 functions in float32 (inputs upcast, autocast disabled).

    Examples:
      >>> import torch
      >>> x = torch.randn(3, dtype=torch.float16)
      >>> with Fp32Functions("cpu"):
      ...     torch.exp(x).dtype, torch.tanh(x).dtype
      (torch.float32, torch.float16)
    """

    def __init__(self, device_type: str):
        super().__init__()
        self.device_type = device_type

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FP32_CALLABLES:
            args, kwargs = tree_map_only(torch.Tensor, _to_f32, (args, kwargs))
            with torch.autocast(self.device_type, enabled=False):
                return func(*args, **kwargs)
        return func(*args, **kwargs)


def function_mode(plan) -> str | None:
    """The function mode a converted forward runs under: ``"o1"`` (apex O1's fp32 list
    on top of autocast), ``"half"`` (`HalfModelFp32Functions`: the half-precision
    models with master weights: naive, apex O2, bf16 with ``master_weights``),
    ``"half-pure"`` (`HalfModelFunctions` only: any other mode with half params, such as apex O3, which
    stays pure float16) or None."""
    if not plan.enabled:
        return None
    if plan.apex_fp32_functions and plan.autocast_dtype is not None:
        return "o1"
    if plan.cast_model_type in ("float16", "bfloat16") and plan.autocast_dtype is None:
        return "half" if plan.keeps_masters else "half-pure"
    return None


@contextlib.contextmanager
def step_context(plan, device_type: str) -> Iterator[None]:
    """The precision a trainer's step runs in, around code outside the model's forward
    (Lightning's ``training_step``, HF's ``compute_loss``): the mode's autocast and its
    function mode (`function_mode`), as inside the converted forward. So a loss computed
    there from the model's half outputs runs in float32 in naive and apex O2, as it would
    inside ``forward``, and a float32 tensor made there meets a half layer in its dtype.

    Examples:
      >>> import torch
      >>> from _mpfunc_common.amp_config import resolve_amp
      >>> logits = torch.randn(4, 8, dtype=torch.float16)
      >>> with step_context(resolve_amp("naive", {}), "cpu"):
      ...     torch.nn.functional.cross_entropy(logits, torch.arange(4)).dtype
      torch.float32
    """
    kind = function_mode(plan)
    with contextlib.ExitStack() as stack:
        if plan.enabled and plan.autocast_dtype is not None:
            stack.enter_context(torch.autocast(device_type,
                                               dtype=getattr(torch, plan.autocast_dtype)))
        if kind == "o1":
            stack.enter_context(Fp32Functions(device_type))
        elif kind == "half":
            stack.enter_context(HalfModelFp32Functions())
        elif kind == "half-pure":
            stack.enter_context(HalfModelFunctions())
        yield


def _first_half_dtype(tree: Any) -> torch.dtype | None:
    for x in tree_leaves(tree):
        if isinstance(x, torch.Tensor) and x.dtype in _HALF:
            return x.dtype
    return None


def _operands(args: tuple, kwargs: dict, masks: tuple) -> Iterator[Any]:
    """The tensors of a call, one level into lists (``einsum``'s), masks left out."""
    for i, a in enumerate(args):
        if i not in masks:
            yield from a if isinstance(a, list | tuple) else (a,)
    for k, v in kwargs.items():
        if k not in _MASK_NAMES:
            yield from v if isinstance(v, list | tuple) else (v,)


def _made_in_forward(x: Any) -> bool:
    return (isinstance(x, torch.Tensor) and x.dtype == torch.float32
            and not isinstance(x, torch.nn.Parameter))


def _one_dtype(func, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``args, kwargs`` of a `SAME_DTYPE_FUNCTIONS` call with their float32 tensors
    (not Parameters, not masks) cast to the first half dtype among them, if any."""
    masks = _MASK_POSITIONS.get(func, ())
    half, mixed = None, False
    for x in _operands(args, kwargs, masks):
        if isinstance(x, torch.Tensor):
            if half is None and x.dtype in _HALF:
                half = x.dtype
            mixed = mixed or _made_in_forward(x)
    if half is None or not mixed:
        return args, kwargs

    def cast(x: Any) -> Any:
        if isinstance(x, list | tuple):
            return type(x)(cast(y) for y in x)
        return x.to(half) if _made_in_forward(x) else x

    return (tuple(a if i in masks else cast(a) for i, a in enumerate(args)),
            {k: v if k in _MASK_NAMES else cast(v) for k, v in kwargs.items()})


def mode_active(mode_type: type) -> bool:
    """Whether a torch function mode of exactly ``mode_type`` is active (eager only): a
    converted forward called inside a trainer's `step_context` then runs under the
    mode once, not twice."""
    return any(type(m) is mode_type for m in _get_current_function_mode_stack())


class HalfModelFunctions(TorchFunctionMode):
    """Every mode with half-precision params: an op that takes one dtype computes in the
    half dtype of its operands.

    Inside it, a call of `SAME_DTYPE_FUNCTIONS` (matmuls, convolutions, attention, norms)
    that has a half-precision tensor gets its float32 tensors cast to that half dtype,
    except Parameters (a float32 norm weight stays float32) and attention masks. A
    float32 tensor made inside ``forward`` (``torch.zeros``, ``.float()``) then meets a
    float16 layer as Lightning's ``precision="16-true"`` would have made it, instead of
    raising "expected m1 and m2 to have the same dtype"; pointwise ops are left alone
    (they promote). `convert_to_amp` enters it around the converted model's forward in
    every mode with half params.

    Examples:
      >>> import torch
      >>> w = torch.nn.Parameter(torch.randn(2, 3, dtype=torch.float16))
      >>> pe = torch.zeros(4, 3)  # float32, made in forward
      >>> with HalfModelFunctions():
      ...     torch.nn.functional.linear(pe, w).dtype
      torch.float16
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SAME_DTYPE:
            args, kwargs = _one_dtype(func, args, kwargs)
        return func(*args, **kwargs)


class HalfModelFp32Functions(HalfModelFunctions):
    """naive / apex O2: the precision-sensitive functions compute in float32.

    Inside it, each function of `HALF_MODEL_FP32_FUNCTIONS` called with a half-precision
    tensor gets its half tensors (input, weight, bias, class weights) cast to float32.
    The losses and ``log_softmax`` return float32; the softmax and norm functions
    return the dtype of their first half tensor (the activation's). A call that names
    its own ``dtype`` (``softmax(x, -1, dtype=torch.float32)``) or ``out`` runs as
    written. The other functions follow `HalfModelFunctions`. `convert_to_amp` enters
    it around the converted model's forward.

    Examples:
      >>> import torch
      >>> x = torch.randn(4, 8, dtype=torch.float16)
      >>> y = torch.randint(0, 8, (4,))
      >>> with HalfModelFp32Functions():
      ...     torch.nn.functional.cross_entropy(x, y).dtype, torch.softmax(x, -1).dtype
      (torch.float32, torch.float16)
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        f32_out = func in _HALF_MODEL_F32_OUT
        if not (f32_out or func in _HALF_MODEL_F32_IN) or kwargs.get("dtype") is not None \
                or kwargs.get("out") is not None:
            if func in _SAME_DTYPE:
                args, kwargs = _one_dtype(func, args, kwargs)
            return func(*args, **kwargs)
        half = _first_half_dtype((args, kwargs))
        if half is None:
            return func(*args, **kwargs)
        args, kwargs = tree_map_only(torch.Tensor, _to_f32, (args, kwargs))
        out = func(*args, **kwargs)
        if f32_out:
            return out
        return tree_map_only(torch.Tensor,
                             lambda t: t.to(half) if t.dtype == torch.float32 else t, out)
