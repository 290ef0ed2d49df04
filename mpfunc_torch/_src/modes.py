"""`convert_to_amp`: the torch / apex-like / naive / bf16 modes for PyTorch."""

from __future__ import annotations

import enum
import inspect
import logging
from collections.abc import Callable
from typing import Any, overload

import torch
from torch import nn

from _mpfunc_common.amp_config import check_bool, resolve_amp
from _mpfunc_common.mixed_precision import MixedPrecisionConfig, mode_and_config
from mpfunc_torch._src.cast_ahead import cast_ahead_of, release_cast_ahead
from mpfunc_torch._src.checkpoint.convert import guard_inner_load, refuse_optimizer_state
from mpfunc_torch._src.checkpoint.model_load import guard_model_loads
from mpfunc_torch._src.chunked_step import check_step_chunks
from mpfunc_torch._src.distributed import normalize_groups
from mpfunc_torch._src.fp8.convert import convert_to_fp8
from mpfunc_torch._src.master_weights import (
    follow_model_loads,
    keep_half_masters,
    make_masters,
)
from mpfunc_torch._src.model import (
    DTYPES,
    HALF,
    AmpCriterion,
    AmpModel,
    cast_model,
    is_norm_module,
    params_cast,
    refuse_converted_model,
)
from mpfunc_torch._src.optimizer import AmpOptimizer
from mpfunc_torch._src.optimizer_checks import (
    check_optimizer_params,
    refuse_broken_fused_sgd,
    refuse_vanishing_eps,
)
from mpfunc_torch._src.sharding import check_fsdp_units, refuse_data_parallel_wrapper
from mpfunc_torch._src.skip_record import attach_model
from mpfunc_torch._src.storage_mode import apply_storage, keeps_masters

__all__ = ["AMP_TYPE", "convert_to_amp"]
_LOG = logging.getLogger(__name__)  # what a conversion resolved to, at INFO level


class AMP_TYPE(str, enum.Enum):  # noqa: N801 - the name users know from Colossal-AI
    """The AMP modes (a string enum: ``AMP_TYPE.NAIVE == "naive"``)."""

    TORCH = "torch"
    APEX = "apex"
    NAIVE = "naive"
    BF16 = "bf16"
    FP8 = "fp8"


def _device_of(model: nn.Module, requested: Any) -> torch.device:
    params = list(model.parameters())
    if not params:
        raise ValueError("`model` has no parameters.")
    device = params[0].device
    if requested is None:
        return device
    try:
        req = torch.device(requested)
    except (RuntimeError, TypeError):
        req = None
    if req is None or req.type not in ("cpu", "cuda"):
        raise ValueError("`device` must be 'cpu', 'cuda' (or 'cuda:N', or a torch.device of "
                         f"those) or None, got {requested!r}.")
    if req.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"`device={requested!r}` was requested but CUDA is not available "
                           "(this torch build or machine has no GPU); use device='cpu'.")
    if device.type != req.type or (req.index is not None and device.index != req.index):
        raise ValueError(f"`device={requested!r}` but the model's params are on {device}; "
                         f"move the model first (model.to({str(req)!r})).")
    return device


def _check_fsdp_units(model: nn.Module, target: torch.dtype, keep_norm_fp32: bool,
                      is_norm: Callable[[str, nn.Module], bool]) -> None:
    """FSDP2 units the cast would break are refused before anything is cast."""
    kept: set[int] = set()
    if keep_norm_fp32:
        for name, module in model.named_modules():
            if is_norm(name, module):
                kept.update(id(p) for p in module.parameters())
    check_fsdp_units(model, lambda p: torch.float32 if id(p) in kept or
                     not p.is_floating_point() else target)


def _amax_groups(plan, groups: tuple, fp8_amax_group: Any) -> tuple:
    """The groups the fp8 amaxes are reduced over, ``fp8_amax_group``'s, for per-tensor
    recipes (a blockwise/rowwise scale is local). ``process_group`` (the inf check's and
    clipping's groups) may hold pipeline stages, whose layers differ: an amax reduction
    there deadlocked, so with it the amax groups must be named (``()`` for none)."""
    explicit = fp8_amax_group is not None
    extra = normalize_groups(fp8_amax_group, name="fp8_amax_group")
    recipe = plan.fp8_recipe if plan.enabled else None
    if extra and recipe is None:
        raise ValueError("`fp8_amax_group` applies to mode='fp8' only (the amax reduction "
                         f"of fp8 scales); this is {plan.describe()}. Remove it.")
    if recipe is None or recipe.block("input") is not None:
        if extra and recipe is not None:  # (without a recipe, refused above)
            raise ValueError("`fp8_amax_group` applies to per-tensor fp8 recipes "
                             "(tensorwise, delayed); the recipe "
                             f"{recipe.describe()!r} scales blocks or rows "
                             "locally. Remove it.")
        return ()
    if groups and not explicit:
        raise ValueError(
            "mode='fp8' with a per-tensor recipe and `process_group`: name the groups to "
            "MAX-reduce the fp8 amaxes over in `fp8_amax_group` (a hand-split tensor-"
            "parallel group, a data-parallel group), or fp8_amax_group=() for none. "
            "`process_group` may hold pipeline stages, whose layers differ: reducing amaxes "
            "over them would pair unrelated layers (and deadlocked a pipeline).")
    return extra


@overload
def convert_to_amp(
    model: nn.Module, optimizer: torch.optim.Optimizer, criterion: Callable | None = None,
    mode: str | AMP_TYPE | MixedPrecisionConfig | None = None, *,
    mixed_precision: str | MixedPrecisionConfig | None = None, process_group: Any = None,
    fp8_amax_group: Any = None, device: str | torch.device | None = None,
    is_norm: Callable[[str, nn.Module], bool] | None = None, step_chunks: int = 1,
    record_skip_leaves: bool = False, **config: Any,
) -> tuple[AmpModel, AmpOptimizer, AmpCriterion | None]: ...


@overload
def convert_to_amp(
    model: nn.Module, optimizer: list[torch.optim.Optimizer] | tuple[torch.optim.Optimizer, ...],
    criterion: Callable | None = None,
    mode: str | AMP_TYPE | MixedPrecisionConfig | None = None, *,
    mixed_precision: str | MixedPrecisionConfig | None = None, process_group: Any = None,
    fp8_amax_group: Any = None, device: str | torch.device | None = None,
    is_norm: Callable[[str, nn.Module], bool] | None = None, step_chunks: int = 1,
    record_skip_leaves: bool = False, **config: Any,
) -> tuple[AmpModel, list[AmpOptimizer], AmpCriterion | None]: ...


def convert_to_amp(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer]
    | tuple[torch.optim.Optimizer, ...],
    criterion: Callable | None = None,
    mode: str | AMP_TYPE | MixedPrecisionConfig | None = None,
    *,
    mixed_precision: str | MixedPrecisionConfig | None = None,
    process_group: Any = None,
    fp8_amax_group: Any = None,
    device: str | torch.device | None = None,
    is_norm: Callable[[str, nn.Module], bool] | None = None,
    step_chunks: int = 1,
    record_skip_leaves: bool = False,
    **config: Any,
) -> tuple[AmpModel, AmpOptimizer | list[AmpOptimizer], AmpCriterion | None]:
    """Converts a model, its optimizer and its loss to mixed precision.

    The modes (the same names, keys and defaults as Colossal-AI's ``convert_to_amp``, and
    the same meaning as ``mpfunc.convert_to_amp`` on the JAX side):

    ======  =========================================================================
    mode    what it does
    ======  =========================================================================
    torch   ``torch.autocast`` (float16, or ``dtype="bfloat16"``), float32 params,
            dynamic scale with the ``"torch"`` preset (GradScaler's rule).
            Keys: init_scale, growth_factor, backoff_factor, growth_interval, enabled,
            dtype.
    apex    apex's O0-O3 natively (no apex needed). O1: autocast + apex's fp32 list;
            O2: float16 params, float32 norms, float32 master weights, losses, softmax
            and norms in float32 (`HalfModelFp32Functions`); O3: pure float16;
            O0: float32. Dynamic levels use the ``"apex"`` preset. Keys: enabled,
            opt_level, cast_model_type, patch_torch_functions, keep_batchnorm_fp32,
            master_weights, loss_scale, cast_model_outputs, num_losses, verbosity,
            min_loss_scale, max_loss_scale.
    naive   every param float16, float32 master weights, losses, softmax and norms
            in float32 (as O2), dynamic scale with the ``"naive"`` preset (hysteresis 2)
            and a warm start (at most 3 steps skipped at the start, from 2**32;
            ``warm_start=False``: Colossal-AI's exact trajectory). Keys:
            log_num_zeros_in_grad, initial_scale, min_scale, growth_factor,
            backoff_factor, growth_interval, hysteresis, max_scale, clip_grad, verbose,
            warm_start.
    bf16    ``torch.autocast`` to bfloat16, no loss scaling (non-finite steps are still
            skipped). Keys: master_weights (bfloat16 params, all, whose exact values are
            kept as "float32" masters, "remainder", "kahan" or "stochastic"; see
            ``docs/no-master-weights.md``), state_dtype, state_rounding, seed.
    fp8     bf16, with every ``nn.Linear`` swapped for an `Fp8Linear` (see
            `convert_to_fp8`): its three matmuls run in fp8 with ``recipe`` (a preset
            name or an `Fp8Recipe`; default ``"tensorwise"``). Key: recipe.
    ======  =========================================================================

    The loss-scale rule is ``mpfunc.dynamic_scale``'s (see `LossScaler`), so given the
    same config and overflows both frameworks follow the same scale trajectory.

    Args:
      model: the model; float32 params for every mode (the half modes cast it).
      optimizer: a torch optimizer over (some of) the model's params, with no state yet;
        or a list of them, which then share one loss scale (as several optimizers share
        one GradScaler): each skips or steps on its own gradients, and the scale updates
        once, after the last of them has stepped in the iteration.
      criterion: the loss function, wrapped to compute in float32; or None.
      mode: ``"torch"``, ``"apex"``, ``"naive"``, ``"bf16"``, ``"fp8"`` or an `AMP_TYPE`;
        None means ``"torch"``. ``"apex-O2"`` is ``"apex"`` with ``opt_level="O2"`` (so
        for O0-O3). A Booster name or config object is accepted here too.
      mixed_precision: Colossal-AI Booster's spelling of the mode, instead of ``mode``:
        ``"fp16"`` (torch), ``"fp16_apex"``, ``"fp16_naive"``, ``"bf16"``, ``"fp8"``, or a config
        object such as ``FP16NaiveMixedPrecision(hysteresis=3)``. Each means exactly
        the same mode and keys.
      process_group: a ``ProcessGroup`` or a sequence of them: the groups the model is
        split over by hand (tensor-parallel and pipeline groups). ``found_inf`` is
        MAX-all-reduced over each, so all their ranks skip or step together, and
        ``clip_grad_norm`` sums plain gradients over them (params marked with
        `mark_replicated` counted once). DTensor params (FSDP2 ``fully_shard``,
        ``parallelize_module``) need nothing here: every dimension of their device
        meshes is found from the params. None: no reduction (with plain DDP the
        gradients are already identical on every rank; naming a data-parallel group
        is harmless for the skip but would count its averaged gradients N times in
        the clipping norm). FSDP2 / tensor parallelism go first: shard, build the
        optimizer over the sharded params, then convert, before the first forward
        (the other order is refused at the first forward). The fp8 mode's amaxes are
        reduced over ``fp8_amax_group`` only, which must then be given.
      fp8_amax_group: the fp8 mode only, per-tensor recipes: the groups over which the
        amaxes are MAX-reduced (a hand-split tensor-parallel group, so a split tensor
        gets one scale; the data-parallel group, so every rank has the same scales and
        delayed histories), or ``()`` for none. Required with ``process_group``, which
        may hold pipeline stages (different layers: never reduce amaxes over them).
      device: ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or a ``torch.device``, to assert where
        the model runs; None = its params'.
      is_norm: ``(qualified_name, module) -> bool`` choosing the normalisation layers
        that stay float32 where the mode keeps norms in float32 (apex O2,
        ``keep_batchnorm_fp32=True``); default `is_norm_module` (torch's norms and
        classes named ``*Norm``, such as HuggingFace's ``LlamaRMSNorm``).
      step_chunks: with float32 master weights (naive, apex O2), an int > 1 steps the
        inner optimizer in about that many chunks of equal size (a larger tensor is a
        chunk of its own): each chunk's half grads are copied into float32 master grads,
        unscaled, clipped, stepped and freed before the next, so only one chunk's float32 grads
        exist at a time. With Adam the step then peaks at 16 + 4 / step_chunks
        bytes/param (plus the largest tensor's float32 grad where it is bigger than a
        chunk) instead of 18. The result is bit for bit that of one step; the check
        that decides the skip reads the half grads, before any chunk steps. Costs: the
        inner optimizer's ``step`` runs once per chunk (its own and torch's global step
        hooks fire per chunk), and the master grads are never all alive (call
        `AmpOptimizer.unscale_` or ``clip_grad_norm`` before ``step`` to have them all,
        which makes that step unchunked). Needs a ``torch.optim`` optimizer that updates
        each param from its own state (SGD, Adam, AdamW, Adamax, NAdam, RAdam, RMSprop,
        Rprop, Adagrad, Adadelta, ASGD, Adafactor, Muon) and one loss. The ``clip_grad``
        key works: the norm is taken from the chunks in a first pass (one more copy of
        the half grads). ``log_num_zeros_in_grad`` too: each chunk's zeros are counted
        once its grads are unscaled and clipped (on a skipped step, in a counting pass
        over the chunks). Default 1: one step over all params.
      record_skip_leaves: also record which params make a step skip with a fused
        optimizer (`AmpOptimizer.record_skip_leaves`; a non-fused one always does), for
        ``scale_metrics(skip_leaves=True)``; ``mpfunc.convert_to_amp`` takes the same.
      **config: the mode's keys (above).

    Returns:
      ``(model, optimizer, criterion)``: `AmpModel`, `AmpOptimizer` (a list of them for
      a list of optimizers) and `AmpCriterion` (or None).

    Raises:
      ValueError: unknown mode, opt level or config key (the message lists the valid
        ones), a value out of range (named as you spelled the key), inconsistent config,
        ``step_chunks > 1`` where it does not apply (see above),
        a half-precision model where float32 is needed, an optimizer that already has
        state, or one that holds none of the model's params.
      TypeError: a value or ``process_group`` of the wrong type.
      RuntimeError: ``device="cuda"`` without CUDA.

    Examples:
      >>> import torch, mpfunc_torch
      >>> net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
      >>> opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
      >>> model, opt, crit = mpfunc_torch.convert_to_amp(
      ...     net, opt, torch.nn.MSELoss(), mode="naive", growth_interval=100)
      >>> net[0].weight.dtype, opt.param_groups[0]["params"][0].dtype
      (torch.float16, torch.float32)
    """
    check_bool("record_skip_leaves", record_skip_leaves)  # before anything is changed
    if not isinstance(model, nn.Module):
        raise TypeError(f"`model` must be a torch.nn.Module, got {type(model).__name__}.")
    optimizers = list(optimizer) if isinstance(optimizer, list | tuple) else [optimizer]
    for opt in optimizers:
        if not isinstance(opt, torch.optim.Optimizer) or isinstance(opt, AmpOptimizer):
            raise TypeError("`optimizer` must be a torch.optim.Optimizer (not already "
                            f"converted) or a list of them, got {type(opt).__name__}.")
    if not optimizers:
        raise ValueError("`optimizer` is an empty list.")
    for opt in optimizers:
        closure = inspect.signature(type(opt).step).parameters.get("closure")
        if closure is not None and closure.default is inspect.Parameter.empty:
            raise ValueError(
                f"`optimizer` {type(opt).__name__} needs a closure on every step() (it "
                "re-evaluates the loss inside the step, as LBFGS does); the converted "
                "optimizer's step() takes none: it checks the gradients of the backward "
                "before it. Use an optimizer whose closure is optional.")
    plan = resolve_amp(*mode_and_config(mode, mixed_precision, config))
    refuse_converted_model(model)
    if is_norm is not None:
        if not callable(is_norm):
            raise TypeError("`is_norm` must be a callable (name, module) -> bool, got "
                            f"{type(is_norm).__name__}.")
        if not (plan.enabled and plan.keep_norm_fp32):
            raise ValueError(
                "`is_norm` chooses the layers that stay float32, but this mode keeps no "
                f"layer in float32 ({plan.describe()}); it applies to apex O2 or "
                "keep_batchnorm_fp32=True. Remove it, or choose such a mode."
            )
    if len(optimizers) > 1 and plan.num_losses > 1:
        raise ValueError("`num_losses > 1` with several optimizers is not supported; use "
                         "one optimizer with per-loss scales, or one shared scale.")
    dev = _device_of(model, device)
    check_optimizer_params(model, optimizers)
    groups = normalize_groups(process_group)
    amax_groups = _amax_groups(plan, groups, fp8_amax_group)
    ahead = cast_ahead_of(model, plan)  # a trainer cast it before wrapping it in DDP
    half = [n for n, p in model.named_parameters()
            if p.dtype in HALF and (ahead is None or p not in ahead.originals)]
    if half and plan.enabled and plan.cast_model_type in (None, "float32"):
        raise ValueError(
            f"mode {plan.mode!r}{' ' + plan.opt_level if plan.opt_level else ''} needs "
            f"float32 params, but {half[:3]}{'...' if len(half) > 3 else ''} are half "
            "precision. Gradients of half params cannot be unscaled safely; give the model "
            "in float32 and use mode='naive' (or apex O2), which keep float32 master "
            "weights, or call model.float() first."
        )
    if half and plan.enabled and plan.cast_model_type in ("float16", "bfloat16"):
        raise ValueError(
            f"`model` params {half[:3]} are already half precision; give the model in "
            "float32 so the float32 master weights start from the exact values."
        )
    masters: dict[int, nn.Parameter] | None = None
    # The dtype each optimizer param is stepped in (where it has no master), known
    # before anything is cast, so that a refusal leaves the model as it was.
    stepped = {id(p): torch.float32 if ahead is not None and p in ahead.originals else p.dtype
               for opt in optimizers for g in opt.param_groups for p in g["params"]}
    if plan.enabled and plan.cast_model_type is not None:
        target = DTYPES[plan.cast_model_type]
        if target in HALF and ahead is None:
            refuse_data_parallel_wrapper(model, plan)
        _check_fsdp_units(model, target, plan.keep_norm_fp32, is_norm or is_norm_module)
        if keeps_masters(plan):
            refuse_optimizer_state(optimizers)
        if not keeps_masters(plan):
            stepped.update((i, target) for i in params_cast(
                model, plan.keep_norm_fp32, is_norm or is_norm_module) if i in stepped)
    refuse_broken_fused_sgd(optimizers, stepped)
    refuse_vanishing_eps(optimizers, stepped)
    if ahead is not None:
        ahead.float32_state_(optimizers)
    if plan.enabled and plan.cast_model_type is not None:
        if keeps_masters(plan):
            masters = make_masters(optimizers, None if ahead is None else ahead.float32_value)
        if ahead is None:
            cast_model(model, target, plan.keep_norm_fp32, is_norm or is_norm_module)
        if masters is not None:
            masters = keep_half_masters(masters, optimizers)
    if plan.enabled and plan.fp8_recipe is not None:
        convert_to_fp8(model, plan.fp8_recipe, process_group=amax_groups or None)
    check_step_chunks(step_chunks, plan, optimizers, masters)
    if plan.verbose:  # apex's verbosity / naive's verbose: logged, never printed
        _LOG.info("mpfunc_torch.convert_to_amp: %s", plan.describe())
    amp_model = AmpModel(model, plan, dev.type)
    first = AmpOptimizer(optimizers[0], plan, device=dev, masters=masters,
                         process_groups=groups, step_chunks=step_chunks)
    shared = first._shared
    shared.n = len(optimizers)
    amp_opts = [first] + [
        AmpOptimizer(opt, plan, device=dev, masters=masters, process_groups=groups,
                     shared=shared, step_chunks=step_chunks)
        for opt in optimizers[1:]
    ]
    apply_storage(plan, amp_opts)  # bf16's master_weights / state_dtype
    guard_inner_load(optimizers)  # our format, loaded into the optimizers we wrapped
    amp_model._load_guards = guard_model_loads(model)  # before the masters' load hooks
    attach_model(amp_opts, model)  # names for precision_report and skip_leaves
    for opt in amp_opts:
        opt.record_skip_leaves(record_skip_leaves)
    pairs = [pair for opt in amp_opts for pair in opt._pairs]
    if pairs:
        versions = {id(p): opt._versions for opt in amp_opts for p, _ in opt._pairs}
        amp_model._master_hooks = follow_model_loads(model, pairs, versions)
    release_cast_ahead(model)  # the masters hold the float32 values they need
    amp_crit = AmpCriterion(criterion, dev.type) if criterion is not None else None
    out_opt = amp_opts if isinstance(optimizer, list | tuple) else amp_opts[0]
    return amp_model, out_opt, amp_crit
