"""`convert_to_amp` for JAX: the torch / apex-like / naive / bf16 modes."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from _mpfunc_common.amp_config import AmpPlan, resolve_amp
from _mpfunc_common.mixed_precision import MixedPrecisionConfig, mode_and_config
from _mpfunc_common.storage import rounds_stochastically
from mpfunc._src.autocast import autocast, half_model
from mpfunc._src.clipping import clip_by_global_norm, sharded_sum
from mpfunc._src.distributed import check_axis_name
from mpfunc._src.fp8.convert import fp8_mode_apply
from mpfunc._src.master_weights import master_weights
from mpfunc._src.model_state import amp_io, map_leaves
from mpfunc._src.policy import Policy
from mpfunc._src.scale_rule import as_transformation
from mpfunc._src.scale_transform import _scale_transform
from mpfunc._src.state_dtype import state_dtype

__all__ = ["AmpSetup", "ZeroCountState", "convert_to_amp", "count_zeros", "is_norm_param"]

# What a conversion resolved to (apex's verbosity, naive's verbose), at INFO level.
_LOG = logging.getLogger(__name__)

_JNP = {"float16": jnp.float16, "bfloat16": jnp.bfloat16, "float32": jnp.float32}

_NORM_RE = re.compile(r"(norm|^ln(_|\d|$)|_ln(_|\d|$)|^bn(_|\d|$)|_bn(_|\d|$))", re.IGNORECASE)


def is_norm_param(path: tuple, leaf: Any) -> bool:
    """Default test for "normalisation-layer parameter": a path component named like a
    norm layer (``LayerNorm_0``, ``BatchNorm``, ``RMSNorm``, ``GroupNorm``, ``ln_f``,
    ``bn1``, anything containing ``norm``). Pass your own to `convert_to_amp`."""
    del leaf
    for entry in path:
        key = getattr(entry, "key", getattr(entry, "name", getattr(entry, "idx", entry)))
        if isinstance(key, str) and _NORM_RE.search(key):
            return True
    return False


class ZeroCountState(NamedTuple):
    """State of `count_zeros`: the number of exactly-zero gradient elements last step."""

    num_zeros_in_grad: jax.Array


def count_zeros(axis_name: Any = None, *, specs: Any = None) -> optax.GradientTransformation:
    """An identity link that records the number of zero gradient elements (int32).

    Inside ``shard_map``, give the mesh axes as ``axis_name``: each leaf's count is then
    ``psum``-med over the axes it is sharded over and a replicated leaf counts once (as
    `mpfunc.global_norm` sums squares; ``specs`` as there, for ``check_vma=False``), so
    every device records the count of the whole model, as Megatron reduces it.
    """
    axis_name = check_axis_name(axis_name)

    def init_fn(params):
        del params
        return ZeroCountState(jnp.zeros((), jnp.int32))

    def update_fn(updates, state, params=None):
        del params, state
        counts = [jnp.sum(x == 0, dtype=jnp.int32) if jnp.issubdtype(x.dtype, jnp.floating)
                  else None for x in jax.tree_util.tree_leaves(updates)]
        return updates, ZeroCountState(
            sharded_sum(counts, updates, axis_name, specs, jnp.int32))

    return optax.GradientTransformation(init_fn, update_fn)


class AmpSetup(NamedTuple):
    """What `convert_to_amp` returns.

    Attributes:
      apply_fn: the model function in the mode's precision; outputs come back in the
        policy's output dtype (float32), so the loss you compute on them is float32.
      optimizer: the optax transformation (loss scaling and master weights as the mode
        requires); use `mpfunc.scale_loss` / `mpfunc.scale_metrics` with its state.
      policy: the mode's `Policy` (params / compute / output dtypes).
      cast_params: casts float32 params to the mode's storage dtypes (norm params stay
        float32 where the mode keeps norms in float32; mutable state such as a flax
        variables dict's ``batch_stats`` stays float32), into new buffers in every mode,
        so that a step donating them leaves the arrays passed in alive.
      plan: the resolved mode (shared with the torch side).
    """

    apply_fn: Callable
    optimizer: optax.GradientTransformationExtraArgs
    policy: Policy
    cast_params: Callable[[Any], Any]
    plan: AmpPlan


def _cast_tree(tree, dtype, keep: Callable | None):
    """``tree``'s floating arrays in ``dtype`` (float32 where ``keep`` and for mutable
    state), each a new buffer (as the cast ones are), so that donating the result never
    deletes the caller's."""
    def f(path, x, state):
        if not (isinstance(x, jax.Array | np.ndarray) and jnp.issubdtype(x.dtype, jnp.floating)):
            return x
        want = jnp.float32 if state or (keep is not None and keep(path, x)) else dtype
        if x.dtype != want:
            return x.astype(want)
        return jnp.array(x, copy=True) if isinstance(x, jax.Array) else x

    return map_leaves(tree, f)


def convert_to_amp(
    apply_fn: Callable,
    optimizer: optax.GradientTransformation,
    mode: str | MixedPrecisionConfig | None = None,
    *,
    mixed_precision: str | MixedPrecisionConfig | None = None,
    is_norm: Callable[[tuple, Any], bool] = is_norm_param,
    axis_name: Any = None,
    specs: Any = None,
    record_skip_leaves: bool = False,
    **config: Any,
) -> AmpSetup:
    """Sets up a mixed-precision train step: the JAX mirror of ``mpfunc_torch.convert_to_amp``.

    Modes, keys and defaults are the torch side's (one shared table):

    ======  ======================  ===========  ====================  ==============
    mode    params                  compute      loss scale            master weights
    ======  ======================  ===========  ====================  ==============
    torch   float32                 autocast     dynamic, "torch"      no
                                    f16/bf16
    apex    O0 f32 / O1 f32 /       O1           O0, O3: static 1;     O2
            O2 f16 + f32 norms /    autocast     O1, O2: dynamic,
            O3 f16                               "apex"
    naive   float16 (all)           float16      dynamic, "naive"      yes
                                                 (hysteresis 2),
                                                 warm start
    bf16    float32 (or bfloat16,   autocast     none (non-finite      no (or
            all, with               bf16 (or     steps still skipped)  master_weights)
            ``master_weights``)     bfloat16)
    fp8     float32                 as bf16;     none, as bf16         no
                                    dense
                                    matmuls fp8
    ======  ======================  ===========  ====================  ==============

    bf16's ``master_weights`` (``"float32"``, ``"remainder"``, ``"kahan"``,
    ``"stochastic"``) makes the params bfloat16 (a half model, as naive's float16) and
    wraps the optimizer in `mpfunc.master_weights` with that storage; ``state_dtype``
    wraps it in `mpfunc.state_dtype` (with ``state_rounding`` and ``seed``).

    ``apply_fn(params, *args, **kwargs)`` is wrapped: with autocast modes it runs under
    `mpfunc.autocast`; otherwise floating inputs are cast to the compute dtype. Outputs
    are cast to float32 (JAX has no criterion wrapper; this is its analogue). In O2 the
    params `is_norm` selects stay float32; an op applying one to an activation runs in
    float32 and returns the compute dtype (a norm's output goes back to half precision, as
    the torch side's norm hooks do). In O2, O3 and naive, matmuls run in the compute dtype
    with float32 accumulation, whatever upcast reached them (a flax NNX layer's ``dtype``,
    fixed when it is built, would otherwise keep them float32), and the precision-sensitive
    ops (autocast's ``AutocastLists().float32_ops``: the sums behind means, variances, norms
    and softmax) run in float32 whatever dtype a layer declares; where such a statistic
    meets an activation the op runs in float32 and returns the compute dtype. Mutable state
    (the collections of a flax variables dict other than ``"params"``, such as
    ``batch_stats``, and NNX variables other than ``nnx.Param``) stays float32 into and out
    of ``apply_fn`` and through ``cast_params``, in every mode; with flax's ``mutable=`` the
    returned collections are float32. In fp8 the dense matmuls
    (`mpfunc.convert_to_fp8`) run in fp8 with ``recipe``; with delayed scaling
    ``apply_fn`` takes ``fp8_state=`` (``amp.apply_fn.init(params, *args)``), whose
    gradient is the next step's state; ``axis_name`` also MAX-reduces the per-tensor
    amaxes.

    Args:
      apply_fn: ``apply_fn(params, *args, **kwargs)``.
      optimizer: the optax optimizer, e.g. ``optax.adamw(1e-3)``.
      mode: ``"torch"``, ``"apex"``, ``"naive"``, ``"bf16"`` or ``"fp8"``; None means
        ``"torch"``. ``"apex-O2"`` is ``"apex"`` with ``opt_level="O2"`` (so for O0-O3).
        A Booster name or config object is accepted here too.
      mixed_precision: Colossal-AI Booster's spelling of the mode, instead of ``mode``:
        ``"fp16"`` (torch), ``"fp16_apex"``, ``"fp16_naive"``, ``"bf16"``, ``"fp8"``, or a config
        object such as ``mpfunc.FP16NaiveMixedPrecision(hysteresis=3)`` (hashable, so it
        can be a static ``jit`` argument). Each means exactly the same mode and keys.
      is_norm: ``(path, leaf) -> bool`` marking normalisation params (O2).
      axis_name: mesh axes under ``shard_map`` (a name or a tuple): the finite check is
        reduced over them, and so are the ``clip_grad`` norm and the
        ``log_num_zeros_in_grad`` count (each leaf over the axes it is sharded over, a
        replicated leaf counted once; see `mpfunc.global_norm`).
      specs: with ``shard_map(check_vma=False)``, the params' ``PartitionSpec`` pytree
        (their ``in_specs``), which tells the norm and the count how each gradient is
        sharded; not needed with ``check_vma=True`` (the default).
      record_skip_leaves: keep which gradient leaves made the last step skip, for
        ``scale_metrics(state, skip_leaves=params)`` (see `mpfunc.dynamic_scale`).
      **config: the mode's keys (see ``mpfunc_torch.convert_to_amp``).

    Returns:
      An `AmpSetup`.

    Raises:
      ValueError: unknown mode, opt level or key (listing the valid ones), an
        inconsistent config, or ``num_losses > 1`` (per-loss scales: torch side only).
      TypeError: a non-callable ``apply_fn`` or ``is_norm``, a bad ``axis_name``.

    Examples:
      >>> import jax.numpy as jnp, optax, mpfunc
      >>> amp = mpfunc.convert_to_amp(lambda p, x: x @ p["w"], optax.sgd(0.1), mode="naive")
      >>> params = amp.cast_params({"w": jnp.ones((3, 2))})
      >>> params["w"].dtype, amp.apply_fn(params, jnp.ones((1, 3))).dtype
      (dtype('float16'), dtype('float32'))
    """
    if not callable(apply_fn):
        raise TypeError(f"`apply_fn` must be callable, got {type(apply_fn).__name__}.")
    optimizer = as_transformation(optimizer, "optimizer")
    if not callable(is_norm):
        raise TypeError("`is_norm` must be a callable `(path, leaf) -> bool` marking "
                        f"normalisation params, got {type(is_norm).__name__}: {is_norm!r}. "
                        "Use the default `mpfunc.is_norm_param` or e.g. "
                        "`lambda path, leaf: 'ln' in jax.tree_util.keystr(path)`.")
    axis_name = check_axis_name(axis_name)
    if specs is not None and axis_name is None:
        raise ValueError("`specs` says how the gradients are sharded over mesh axes, for "
                         "the clip_grad norm and the zero count under shard_map; pass "
                         "those axes as `axis_name` too, or leave `specs` out.")
    plan = resolve_amp(*mode_and_config(mode, mixed_precision, config))
    if plan.num_losses != 1:
        raise ValueError(
            f"`num_losses={plan.num_losses}`: per-loss scales are not supported on JAX. A "
            "JAX train step differentiates one scalar with one scale: add the losses "
            "(`loss = loss_a + loss_b`) and use one `mpfunc.scale_loss`, or build one "
            "optimizer per loss (`mpfunc.dynamic_scale(...)` each, with its own state). "
            "Remove `num_losses` (the torch side supports it with `loss_id=`).")
    if plan.verbose:  # apex's verbosity / naive's verbose, as on the torch side
        _LOG.info("mpfunc.convert_to_amp: %s", plan.describe())
    f32 = jnp.float32
    if not plan.enabled:
        # Plain float32. The state still has a (unit) loss scale, so the same train step
        # runs with AMP on and off; non-finite steps are still skipped (free under jit).
        policy = Policy(f32, f32, f32)
        tx = _scale_transform(optimizer, cfg=None, static_value=1.0, axis_name=axis_name,
                              record_skip_leaves=record_skip_leaves)
        return AmpSetup(apply_fn, tx, policy, lambda p: jax.tree.map(  # new buffers, as below
            lambda x: jnp.array(x, copy=True) if isinstance(x, jax.Array) else x, p), plan)

    param_dtype = _JNP[plan.cast_model_type] if plan.cast_model_type else f32
    compute = _JNP[plan.autocast_dtype] if plan.autocast_dtype else param_dtype
    output = _JNP[plan.cast_model_outputs] if plan.cast_model_outputs else f32
    policy = Policy(param_dtype, compute, output)

    keep = is_norm if plan.keep_norm_fp32 else None

    def cast_params(params):
        return _cast_tree(params, param_dtype, keep)

    if plan.fp8_recipe is not None:  # bf16 autocast, dense matmuls in fp8
        wrapped = fp8_mode_apply(apply_fn, plan.fp8_recipe, compute, policy.cast_to_output,
                                 axis_name)
    else:
        if plan.autocast_dtype is not None:
            inner_apply = autocast(apply_fn, compute_dtype=compute)
        elif compute != f32:
            # A half model (naive, O3; O2 with float32 norms): matmuls in the compute
            # dtype whatever upcast reached them (an NNX layer's `dtype` is fixed when it
            # is built: nnx.Embed's float32 would otherwise make every later matmul
            # float32), statistics in float32, and a norm's output back in the compute
            # dtype (as the torch side's norm hooks do).
            inner_apply = half_model(apply_fn, compute)
        else:
            inner_apply = apply_fn
        # Autocast decides per op; the other modes cast the inputs. State (batch_stats,
        # caches, NNX variables that are not params) stays float32 in and out.
        cast_in, cast_out = amp_io(policy, cast_inputs=plan.autocast_dtype is None)

        def wrapped(params, *args, **kwargs):
            params, args, kwargs = cast_in(params, args, kwargs)
            return cast_out(inner_apply(params, *args, **kwargs), kwargs)

    links = []
    if plan.log_num_zeros_in_grad:
        links.append(count_zeros(axis_name, specs=specs))
    if plan.clip_grad:  # under plain jit the norm is global already: optax's transform
        links.append(optax.clip_by_global_norm(plan.clip_grad) if axis_name is None else
                     clip_by_global_norm(plan.clip_grad, axis_name=axis_name, specs=specs))
    links.append(optimizer)
    inner = optax.chain(*links) if len(links) > 1 else optimizer
    if plan.state_dtype is not None:  # each seed only where it draws bits (else an error)
        inner = state_dtype(inner, plan.state_dtype, plan.state_rounding, plan.seed if
                            rounds_stochastically(None, plan.state_dtype, plan.state_rounding)
                            else 0)
    if plan.master_storage is not None:
        inner = master_weights(inner, plan.master_storage,
                               plan.seed if plan.master_storage == "stochastic" else 0)
    if plan.scale_kind == "dynamic":
        tx = _scale_transform(inner, cfg=plan.scale_config, static_value=None,
                              axis_name=axis_name, record_skip_leaves=record_skip_leaves)
    else:
        value = plan.static_scale if plan.scale_kind == "static" else 1.0
        tx = _scale_transform(inner, cfg=None, static_value=value, axis_name=axis_name,
                              record_skip_leaves=record_skip_leaves)
    return AmpSetup(wrapped, tx, policy, cast_params, plan)
