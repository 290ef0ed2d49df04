"""`AmpOptimizer` checkpoints: what is saved, and an all-or-nothing load.

Everything in a checkpoint is validated before anything is written, so a failed load
leaves the optimizer, its loss scalers and its master weights exactly as they were. The
converted model's own load is checked in `mpfunc_torch._src.checkpoint.model_load`.
"""

from __future__ import annotations

import itertools
import math
import numbers
from collections import OrderedDict, defaultdict
from typing import Any

import torch

from _mpfunc_common.amp_config import AmpPlan
from _mpfunc_common.scale_config import (
    FLOAT32_MAX,
    FLOAT32_MIN_NORMAL,
    as_python_number,
    to_float32,
)
from mpfunc_torch._src.loss_scale import LossScaler
from mpfunc_torch._src.low_precision import low_precision_of
from mpfunc_torch._src.master_weights import (
    FROM_MODEL,
    check_saved_masters,
    copy_masters_to_model_,
    non_finite_names,
)
from mpfunc_torch._src.optimizer_parts import AmpOptimizerParts
from mpfunc_torch._src.state_dtype import is_scale_key

__all__ = ["FORMAT", "FROM_MODEL", "save", "check", "load", "master_names"]

FORMAT = 1
_KEYS = ("format", "mode", "opt_level", "optimizer", "scalers", "master_weights")
# torch.amp.GradScaler.state_dict() (ShardedGradScaler's too), of a run moving from it.
_GRAD_SCALER_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval",
                     "_growth_tracker")
# torch.optim's optimizers whose per-param state tensors are scalars or of the param's
# shape (not Adafactor's factored rows and columns). A state of another shape loads
# into torch without complaint and then fails in the step, or, in a fused CPU kernel,
# reads and writes out of bounds.
_PARAM_SHAPED = tuple(getattr(torch.optim, n) for n in (
    "SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Rprop", "Adagrad",
    "Adadelta", "ASGD", "SparseAdam", "Muon") if hasattr(torch.optim, n))
# ... and those whose state is tensors, None or numbers, with a step count under "step"
_ADAFACTOR = getattr(torch.optim, "Adafactor", None)  # row and column factors
_TORCH_OPTIM = _PARAM_SHAPED + ((_ADAFACTOR,) if _ADAFACTOR is not None else ())
# How this process runs the step, not training state: kept from the loading optimizer.
# torch's load takes them from the checkpoint, so a fused optimizer resumed from a
# foreach run steps foreach, and the fused path's grad_scale / found_inf then fail.
_IMPLEMENTATION = ("foreach", "fused", "capturable", "differentiable")


def save(opt: AmpOptimizerParts) -> dict[str, Any]:
    lowp = low_precision_of(opt)
    stored = lowp is not None and lowp.storage is not None  # no float32 masters to save
    out = {
        "format": FORMAT,
        "mode": opt.plan.mode,
        "opt_level": opt.plan.opt_level,
        "optimizer": opt.optimizer.state_dict(),
        "scalers": [s.state_dict() for s in opt._scalers],
        "master_weights": None if stored else [m.detach().clone() for _, m in opt._pairs]
        or None,
        # the model's names for each master's param (every name of a tied one), so that
        # `convert_checkpoint` can put the masters into the model's checkpoint
        "master_names": master_names(opt),
    }
    if lowp is not None:  # masters or state below float32 (low_precision.LowPrecision)
        out["low_precision"] = lowp.state_dict()
    return out


def master_names(opt: AmpOptimizerParts) -> list[list[str]] | None:
    ref = getattr(opt, "_model_ref", None)
    model = ref() if ref is not None else None
    if not opt._pairs or model is None:
        return None
    names: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    return [names.get(id(p), []) for p, _ in opt._pairs]


def check(opt: AmpOptimizerParts,
          state_dict: dict[str, Any]) -> tuple[list | None, list | None, dict, Any]:
    """Every check of `load`, changing nothing; returns the scaler values, the masters,
    the inner state_dict to load (with this optimizer's implementation flags) and the
    `LowPrecision` values (or None)."""
    _check_header(state_dict, opt.plan)
    scalers = state_dict["scalers"]
    if scalers is not None and (not isinstance(scalers, list | tuple)
                                or len(scalers) != len(opt._scalers)):
        n = len(scalers) if isinstance(scalers, list | tuple) else type(scalers).__name__
        raise ValueError(f"`state_dict['scalers']` must list {len(opt._scalers)} loss-scaler "
                         f"states (one per loss), got {n}.")
    values = None if scalers is None else [  # None: this optimizer's own initial scale
        s.check_state(sd, f"state_dict['scalers'][{i}]")
        for i, (s, sd) in enumerate(zip(opt._scalers, scalers))]
    lowp, low = low_precision_of(opt), None
    if lowp is not None:
        low = lowp.check(state_dict.get("low_precision"), "state_dict['low_precision']")
    elif state_dict.get("low_precision") is not None:
        raise ValueError("`state_dict['low_precision']` is from a run that kept its masters "
                         f"as {state_dict['low_precision'].get('storage')!r} (or its state "
                         "below float32); this optimizer keeps float32 masters and state. "
                         "Convert the checkpoint (convert_checkpoint).")
    saved = state_dict["master_weights"]
    masters = None if (isinstance(saved, str) and saved == FROM_MODEL) or (
        lowp is not None and lowp.storage is not None) else check_saved_masters(
        saved, opt._pairs, "state_dict['master_weights']")
    _check_inner_state(state_dict["optimizer"], "state_dict['optimizer']")
    if lowp is not None and lowp.state is not None:
        lowp.state.check_saved(state_dict["optimizer"]["state"], "state_dict['optimizer']['state']")
    inner = _check_inner_fits(opt.optimizer, state_dict["optimizer"], "state_dict['optimizer']")
    return values, masters, inner, low


def load(opt: AmpOptimizerParts, state_dict: dict[str, Any]) -> None:
    if isinstance(state_dict, dict) and set(state_dict) == {"state", "param_groups"}:
        # A plain torch run's optimizer.state_dict(), moving to mpfunc_torch: the inner
        # optimizer's part only (its params are in the same order, masters in place of
        # half params); the masters come from the model's float32 checkpoint.
        _check_inner_state(state_dict, "state_dict")
        opt.optimizer.load_state_dict(_check_inner_fits(opt.optimizer, state_dict,
                                                        "state_dict"))
        if (lp := low_precision_of(opt)) is not None:
            lp.after_inner_load_()
        return
    if isinstance(state_dict, dict) and "_growth_tracker" in state_dict:
        # ... and its GradScaler's state_dict(): the scale and growth tracker continue.
        values = [grad_scaler_values(s, state_dict, "state_dict") for s in opt._scalers]
        for s, v in zip(opt._scalers, values):
            s._apply(v)
        return
    values, masters, inner, low = check(opt, state_dict)
    # `check` ran torch's own load on a scratch copy, so this one does not fail.
    opt.optimizer.load_state_dict(inner)
    if low is not None and (lp := low_precision_of(opt)) is not None:  # one with the other
        lp.after_inner_load_()
        lp.load(low)
    for s, v in zip(opt._scalers, values or ()):
        s._apply(v)
    if masters is not None:  # else they come from the model's float32 checkpoint
        with torch.no_grad():
            for (_, m), saved in zip(opt._pairs, masters):
                m.copy_(saved)
        copy_masters_to_model_(opt._pairs)


def grad_scaler_values(scaler: LossScaler, state: dict[str, Any], where: str) -> dict:
    """The values a `torch.amp.GradScaler` ``state`` sets in ``scaler``, changing nothing:
    its scale (brought into this config's [min_scale, max_scale]) and growth tracker
    (below this ``growth_interval``), a full hysteresis, no warm start (the run is past
    its start); skip counters stay as they are.
    GradScaler's hyperparameters are checked but not taken, as in its own load."""
    if (c := scaler.config) is None:  # a scale that is not dynamic
        raise ValueError(f"`{where}` is a torch.amp.GradScaler state; it loads into a dynamic "
                         f"loss scale, and this optimizer's scale is {scaler.kind}.")
    missing = [k for k in _GRAD_SCALER_KEYS if k not in state]
    if missing:
        raise ValueError(f"`{where}` (a torch.amp.GradScaler state) is missing keys {missing}.")
    got = {}
    for key in _GRAD_SCALER_KEYS:
        integer = key in ("growth_interval", "_growth_tracker")
        try:
            got[key] = as_python_number(f"{where}[{key!r}]", state[key], integer=integer)
        except TypeError as e:
            raise ValueError(str(e)) from None
    scale = to_float32(got["scale"])  # GradScaler keeps it as a float32 tensor
    if not FLOAT32_MIN_NORMAL <= scale <= FLOAT32_MAX:
        raise ValueError(f"`{where}['scale']` must be a finite scale > 0, got {state['scale']!r}.")
    for key in ("growth_factor", "backoff_factor"):
        if not 0 < got[key] < math.inf:
            raise ValueError(f"`{where}[{key!r}]` must be a finite number > 0, got "
                             f"{state[key]!r}.")
    interval = got["growth_interval"]
    if interval < 1:
        raise ValueError(f"`{where}['growth_interval']` must be an int >= 1, got {interval!r}.")
    if not 0 <= got["_growth_tracker"] < interval:
        raise ValueError(f"`{where}['_growth_tracker']` must be an int in [0, {interval - 1}], "
                         f"got {got['_growth_tracker']!r}.")
    values = scaler.check_state(scaler.state_dict())
    values.update(loss_scale=min(max(scale, c.min_scale), c.max_scale),
                  growth_tracker=min(got["_growth_tracker"], c.growth_interval - 1),
                  hysteresis_left=c.hysteresis, warm_phase=0)  # a run past its start
    return values


def _check_header(state_dict: Any, plan: AmpPlan) -> None:
    if not isinstance(state_dict, dict):
        raise ValueError("`state_dict` must be a dict from AmpOptimizer.state_dict(), got "
                         f"{type(state_dict).__name__}.")
    missing = [k for k in _KEYS if k not in state_dict]
    if missing:
        raise ValueError(f"`state_dict` is missing keys {missing}; was it made by "
                         "AmpOptimizer.state_dict()?")
    if state_dict["format"] != FORMAT:
        raise ValueError(f"`state_dict['format']` must be {FORMAT}, got "
                         f"{state_dict['format']!r}.")
    if (state_dict["mode"], state_dict["opt_level"]) != (plan.mode, plan.opt_level):
        to = repr(plan.mode) + (f", opt_level={plan.opt_level!r}" if plan.opt_level else "")
        raise ValueError(
            f"`state_dict` is from mode {state_dict['mode']!r} (opt_level "
            f"{state_dict['opt_level']!r}); this optimizer runs mode {plan.mode!r} "
            f"(opt_level {plan.opt_level!r}). Convert the checkpoint, model and optimizer "
            "together: `model_sd, optim_sd = mpfunc_torch.convert_checkpoint(model_sd, "
            f"optim_sd, {to})`, then load both."
        )


def _check_inner_state(inner: Any, where: str) -> None:
    """The inner optimizer's state_dict: its shape is torch's to check; here, that no
    floating state tensor holds an inf/NaN (one host read for all of them)."""
    if not isinstance(inner, dict) or "state" not in inner or "param_groups" not in inner:
        raise ValueError(f"`{where}` must be a torch optimizer state_dict (keys 'state' and "
                         "'param_groups').")
    bad = non_finite_names([
        (f"{where}['state'][{pid!r}][{key!r}]", t)
        for pid, st in inner["state"].items() if isinstance(st, dict) for key, t in st.items()
        if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())])
    if bad:
        raise ValueError(f"`{bad[0]}` holds inf/NaN values; optimizer state must be finite.")


def _check_inner_fits(inner: torch.optim.Optimizer, saved: dict[str, Any],
                      where: str) -> dict[str, Any]:
    """The inner state_dict loads into ``inner`` and fits its params, checked without
    changing ``inner``: torch's own ``load_state_dict`` runs on a scratch copy of it
    (the same params, a fresh state, no hooks), so whatever torch or the optimizer's
    ``__setstate__`` refuses is refused here, before anything is written. That costs no
    copy unless the saved tensors need moving to the params' device or dtype. Returns
    ``saved`` with ``inner``'s implementation flags in its groups, to load."""
    groups, live = saved["param_groups"], inner.param_groups
    if not isinstance(groups, list | tuple) or len(groups) != len(live):
        n = len(groups) if isinstance(groups, list | tuple) else type(groups).__name__
        raise ValueError(f"`{where}['param_groups']` must list {len(live)} param groups (this "
                         f"optimizer's), got {n}.")
    for i, (g, lg) in enumerate(zip(groups, live)):
        n = len(g.get("params", ())) if isinstance(g, dict) else None
        if n != len(lg["params"]):
            raise ValueError(f"`{where}['param_groups'][{i}]` must hold {len(lg['params'])} "
                             f"params (this optimizer's group {i}), got {n}.")
        for key, value in g.items():
            if key != "params" and _non_finite(value) and not _non_finite(lg.get(key)):
                raise ValueError(f"`{where}['param_groups'][{i}][{key!r}]` is {value!r}; this "
                                 f"optimizer's is finite ({lg.get(key)!r}).")
    groups = [{**g, **{k: lg[k] for k in _IMPLEMENTATION if k in lg}}
              for g, lg in zip(groups, live)]
    saved = {**saved, "param_groups": groups}
    scratch = object.__new__(type(inner))
    scratch.__dict__.update(inner.__dict__)
    scratch.__dict__.update(state=defaultdict(dict), defaults=dict(inner.defaults),
                            _optimizer_load_state_dict_pre_hooks=OrderedDict(),
                            _optimizer_load_state_dict_post_hooks=OrderedDict())
    try:
        scratch.load_state_dict(saved)
    except Exception as e:  # torch's and the optimizer's own refusals, whatever their type
        lacks = sorted(set(inner.defaults) - {k for g in groups for k in g})
        hint = (f"; its param groups lack {lacks}: was it saved from another optimizer?"
                if lacks else ".")
        raise ValueError(f"`{where}` does not load into {type(inner).__name__} "
                         f"({type(e).__name__}: {e}){hint}") from e
    for i, (g, lg) in enumerate(zip(scratch.param_groups, live)):
        _check_group(g, lg, inner.defaults, f"{where}['param_groups'][{i}]",
                     type(inner).__name__)
    pid_of = {id(q): k for k, q in zip(itertools.chain(*(g["params"] for g in groups)),
                                       itertools.chain(*(g["params"] for g in live)))}
    steps: list = []
    for q, st in scratch.state.items():
        if not isinstance(q, torch.Tensor) or not isinstance(st, dict):
            continue
        have = inner.state.get(q, {})
        for key, t in st.items():
            name = f"{where}['state'][{pid_of[id(q)]!r}][{key!r}]"
            if isinstance(inner, _TORCH_OPTIM):
                if key == "step":
                    _check_step(t, name, steps)
                elif not (t is None or isinstance(t, torch.Tensor) or _is_number(t)):
                    raise ValueError(f"`{name}` must be a tensor, got {type(t).__name__}.")
            if not isinstance(t, torch.Tensor) or t.dim() == 0:
                continue
            want = have.get(key)
            if isinstance(want, torch.Tensor):
                shape, whose = want.shape, "this optimizer's state"
            else:
                shape, whose = _state_shape(inner, q, key), f"{type(inner).__name__}'s"
            if shape is not None and t.shape != shape and not is_scale_key(key):
                raise ValueError(f"`{name}` must have shape {tuple(shape)} ({whose}), got "
                                 f"{tuple(t.shape)}.")
    _check_step_values(steps)
    return saved


def _state_shape(inner: torch.optim.Optimizer, q: torch.Tensor, key: Any) -> Any:
    """The shape torch.optim's optimizer gives ``q``'s state ``key``; None: not known."""
    if isinstance(inner, _PARAM_SHAPED):
        return q.shape
    if _ADAFACTOR is not None and isinstance(inner, _ADAFACTOR):
        factor = {"row_var": -1, "col_var": -2}.get(key)
        if key == "variance" or factor is not None and q.dim() < 2:
            return q.shape
        if factor is not None:
            shape = list(q.shape)
            shape[factor] = 1
            return torch.Size(shape)
    return None


def _check_group(saved: dict[str, Any], live: dict[str, Any], defaults: dict[str, Any],
                 where: str, cls: str) -> None:
    """A loaded param group (after the optimizer's ``__setstate__`` filled in the keys
    older torch versions lack) has every hyperparameter of this optimizer's, numbers
    where it has numbers, booleans where it has booleans and tuples of the same length
    (an SGD group loaded into Adam has no ``betas``: torch loads it and the step fails).
    Other keys (a scheduler's ``initial_lr``) may be missing."""
    for key, want in live.items():
        if key in ("params", "param_names"):
            continue
        if key not in saved:
            if key not in defaults:
                continue
            raise ValueError(f"`{where}` has no {key!r} (a {cls} param group has); was it "
                             "saved from another optimizer?")
        got = saved[key]
        if isinstance(want, bool) and not _is_bool(got):
            raise ValueError(f"`{where}[{key!r}]` must be True or False (this optimizer's is "
                             f"{want!r}), got {got!r}.")
        if _is_number(want) and not _is_number(got):
            raise ValueError(f"`{where}[{key!r}]` must be a number (this optimizer's is "
                             f"{want!r}), got {got!r}.")
        if isinstance(want, tuple | list) and (not isinstance(got, tuple | list)
                                              or len(got) != len(want)):
            raise ValueError(f"`{where}[{key!r}]` must be a sequence of {len(want)} like this "
                             f"optimizer's {want!r}, got {got!r}.")


def _is_number(value: Any) -> bool:
    """A Python, NumPy or 0-dim tensor number, not a boolean."""
    if isinstance(value, torch.Tensor):
        return value.dim() == 0 and value.dtype != torch.bool
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_bool(value: Any) -> bool:
    """A Python, NumPy or 0-dim tensor boolean."""
    return isinstance(value, bool) or (getattr(value, "shape", None) in ((), torch.Size())
                                       and str(getattr(value, "dtype", "")) in ("bool",
                                                                               "torch.bool"))


_STEP = "a step count (a whole number >= 0, as a float32/float64 scalar tensor or a number)"


def _check_step(step: Any, where: str, tensors: list) -> None:
    """torch.optim's step counts: a whole number >= 0, a float32/float64 scalar if a
    tensor (-1 makes Adam's bias correction divide by zero; an int or float16 tensor
    fails foreach's grouping). Tensor values go to ``tensors``, for `_check_step_values`
    (one host read per device, not one per param: fused optimizers keep them on it)."""
    if isinstance(step, torch.Tensor):
        if step.dim() != 0 or step.dtype not in (torch.float32, torch.float64):
            raise ValueError(f"`{where}` must be {_STEP}, got a {step.dtype} tensor of shape "
                             f"{tuple(step.shape)}.")
        tensors.append((where, step))
    elif not (_is_number(step) and math.isfinite(step) and step >= 0 and step == int(step)):
        raise ValueError(f"`{where}` must be {_STEP}, got {step!r}.")


def _check_step_values(tensors: list) -> None:
    by_device: dict[Any, list] = {}
    for where, t in tensors:
        by_device.setdefault(t.device, []).append((where, t))
    for found in by_device.values():
        v = torch.stack([t.detach().double() for _, t in found])
        bad = ~(torch.isfinite(v) & (v >= 0) & (v == v.floor()))
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            raise ValueError(f"`{found[i][0]}` must be {_STEP}, got {float(v[i])!r}.")


def _non_finite(value: Any) -> bool:
    """A hyperparameter holding an inf/NaN float (or float tensor), also in a tuple."""
    if isinstance(value, list | tuple):
        return any(_non_finite(v) for v in value)
    if isinstance(value, torch.Tensor):
        return value.is_floating_point() and not bool(torch.isfinite(value).all())
    return _is_number(value) and not math.isfinite(value)

