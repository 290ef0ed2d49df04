"""`convert_checkpoint`: a run's checkpoint moved to another mode.

A checkpoint is a pair: the model's ``state_dict`` and the optimizer's. Moving between
modes moves values between them: from a mode with float32 master weights (naive, apex
O2) to one without, the masters become the model's params; the other way, the
model's float32 params become the masters (the converted model's ``load_state_dict``
sets them exactly). The inner optimizer's state (Adam's moments, step counts) is
float32 and keyed by the optimizer's param order in every mode, so it carries over as
it is. The JAX twin is ``mpfunc.convert_checkpoint``.

Mode ``"bf16"`` without float32 masters (``master_weights`` ``"remainder"``,
``"kahan"``, ``"stochastic"``; a ``state_dtype``) goes through the float32 values: a
source's are rebuilt from its ``"low_precision"`` part (a remainder's master exactly,
Kahan's ``param + compensation``, a stochastic param as it is; `_mpfunc_common.rounding`)
and its stored state widened to float32. A target's storage is derived when the
converted model loads the float32 values (`MasterStorage.follow_load_`: the remainder
split, Kahan's residual, rounding to nearest), and its state is rounded to nearest when
the optimizer loads the float32 state, so the two loads may come in either order.

Also here: the errors for a resume in the wrong order (`guard_inner_load`,
`refuse_optimizer_state`); `AmpOptimizer.load_state_dict` says when a checkpoint is of
another mode.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch

from _mpfunc_common.amp_config import resolve_amp
from _mpfunc_common.mixed_precision import mode_and_config
from mpfunc_torch._src.checkpoint.optimizer_state import FORMAT
from mpfunc_torch._src.checkpoint.storage import applied_steps, stored_masters, widen_state
from mpfunc_torch._src.master_weights import FROM_MODEL, has_stepped, non_finite_names

__all__ = ["convert_checkpoint", "guard_inner_load", "refuse_optimizer_state"]

_PLAIN = ("state", "param_groups")
_AMP = ("format", "mode", "opt_level", "optimizer", "scalers", "master_weights")


def convert_checkpoint(
    model_state_dict: Mapping[str, Any],
    optimizer_state_dict: Mapping[str, Any],
    mode: Any = None,
    *,
    mixed_precision: Any = None,
    **config: Any,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A checkpoint of one mode, converted for another (nothing passed in is changed).

    The result owns its tensors and containers: where a value would be the input's
    tensor (or a view of it) it is a copy, so loading the result into a second model and
    optimizer while the first run goes on training (from its live ``state_dict()``)
    shares no step count, moment or param between the two.

    From naive or apex O2 (float32 master weights) to a mode without masters (torch,
    bf16, apex O0/O1/O3, plain float32 training), the float32 masters become the
    model's params. The other way, the model's float32 params become the masters: the
    optimizer's ``master_weights`` then say so, and the converted model's
    ``load_state_dict`` sets its masters from the float32 values exactly (the two loads
    may come in either order). The inner optimizer's state (Adam's moments and steps)
    carries over as it is. A dynamic loss scale carries over into a mode with a dynamic
    scale (brought into that mode's range at load); anywhere else the new mode starts
    from its own initial scale, and a mode without scaling has none.

    Mode ``"bf16"`` without float32 masters, to and from any of these (between two
    such modes too), goes through the float32 values, as ``mpfunc.convert_checkpoint``
    does, bit for bit:

    * ``master_weights="remainder"``: the converted model's load splits each float32
      value into the bfloat16 param and int16 remainder that rebuild it bit for bit
      (ties away from zero), so training goes on float32 masters' trajectory; back,
      the model checkpoint gets that master.
    * ``"kahan"``: the param is the value rounded to nearest, the compensation its
      residual rounded to bfloat16; back, ``param + compensation``.
    * ``"stochastic"``: the param is the value rounded to nearest; the seed is the
      target's (``seed=``), and the step count the random bits go on from is the
      source's count of applied steps (its ``low_precision`` step, else the largest
      ``"step"`` in the inner state, else 0). Back, the param's value.
    * ``state_dtype``: the float32 state is rounded to nearest (8-bit: quantised to
      nearest) when the converted optimizer loads it; back, widened (8-bit codes
      dequantised); 8-bit codes already in the target's format stay as they are.

    The optimizer part then holds `FROM_MODEL` in place of the params and remainders:
    load the model part too (in either order).

    Args:
      model_state_dict: the model's ``state_dict()`` saved with the optimizer's (the
        converted model's, whose keys are the module's; a ``DistributedDataParallel``
        one with keys under ``module.`` works too).
      optimizer_state_dict: ``AmpOptimizer.state_dict()``, or a plain torch optimizer's
        ``state_dict()`` (a float32 run without mpfunc_torch).
      mode: the mode to convert to, as ``convert_to_amp`` takes it (``"naive"``,
        ``"torch"``, ``"apex"`` with ``opt_level=``, an `AMP_TYPE`, a config object), or
        ``"fp32"`` for plain float32 torch training (the optimizer part is then a plain
        torch optimizer's ``state_dict``).
      mixed_precision: Colossal-AI's spelling of ``mode`` (``"fp16_naive"``, ...).
      **config: the target mode's keys (they decide, e.g., whether it scales the loss).

    Returns:
      ``(model_state_dict, optimizer_state_dict)`` for the new mode: load the first
      into the converted model and the second into the converted optimizer.

    Raises:
      ValueError: an optimizer state_dict that is neither kind, a mode's name or keys
        that ``convert_to_amp`` would refuse, master weights whose params are not in
        ``model_state_dict`` (or of another shape), a checkpoint saved before its
        masters were named (load it in its own mode and save it again), a
        ``"low_precision"`` part that does not hold what its storage keeps, or several
        loss scales (``num_losses``) where the new mode has another number.

    Examples:
      >>> import torch, mpfunc_torch
      >>> net = torch.nn.Linear(4, 2)
      >>> model, opt, _ = mpfunc_torch.convert_to_amp(
      ...     net, torch.optim.AdamW(net.parameters()), mode="naive")
      >>> msd, osd = mpfunc_torch.convert_checkpoint(
      ...     model.state_dict(), opt.state_dict(), "bf16")
      >>> msd["weight"].dtype, osd["mode"], osd["optimizer"]["param_groups"][0]["lr"]
      (torch.float32, 'bf16', 0.001)
      >>> msd, osd = mpfunc_torch.convert_checkpoint(
      ...     model.state_dict(), opt.state_dict(), "bf16", master_weights="remainder")
      >>> osd["low_precision"]["storage"], osd["low_precision"]["step"]
      ('remainder', 0)
    """
    plan = _target(mode, mixed_precision, config)
    keep = plan.state_dtype if plan is not None and plan.enabled else None
    source = _source(optimizer_state_dict, keep)
    model_out = _model_part(model_state_dict, source)
    if plan is None:
        return _owned((model_out, source["inner"]), (model_state_dict, optimizer_state_dict))
    scalers = None  # None: the loading optimizer keeps its own initial scale
    if source["dynamic"] and plan.enabled and plan.scale_kind == "dynamic":
        scalers = source["scalers"]
        if len(scalers) != plan.num_losses:
            raise ValueError(
                f"`optimizer_state_dict` has {len(scalers)} loss scales (num_losses="
                f"{len(scalers)}); the mode converted to has {plan.num_losses}. Convert to a "
                f"mode with num_losses={len(scalers)}, or load the scales yourself.")
    masters = FROM_MODEL if plan.enabled and plan.master_weights else None
    out = {
        "format": FORMAT, "mode": plan.mode, "opt_level": plan.opt_level,
        "optimizer": source["inner"], "scalers": scalers, "master_weights": masters,
        "master_names": None,
    }
    if plan.enabled and (plan.master_storage not in (None, "float32")
                         or plan.state_dtype not in (None, "float32")):
        stored = plan.master_storage not in (None, "float32")
        out["low_precision"] = {  # the params and remainders: from the model's load
            "storage": plan.master_storage or "float32", "seed": plan.seed,
            "step": source["step"], "params": FROM_MODEL if stored else None,
            "extra": None}
    return _owned((model_out, out), (model_state_dict, optimizer_state_dict))


def _tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor in nested mappings, lists and tuples."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, Mapping):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, list | tuple):
        return [t for v in obj for t in _tensors(v)]
    return []


def _storage(t: torch.Tensor) -> Any:
    """The memory a tensor's values live in (shared by its views), or None where it has
    none to read (a tensor subclass without storage, no elements)."""
    try:
        s = t.untyped_storage()
        return (s.device, s.data_ptr()) if s.nbytes() else None
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def _owned(result: tuple, inputs: tuple) -> Any:
    """``result`` with its own containers and, where a tensor is (or views) one of
    ``inputs``' tensors, a copy of it; tensors made here are kept as they are."""
    ids = {id(t) for t in _tensors(inputs)}
    shared = {k for k in map(_storage, _tensors(inputs)) if k is not None}
    memo: dict[int, Any] = {}
    for t in _tensors(result):
        if id(t) not in ids and _storage(t) not in shared:
            memo[id(t)] = t  # deepcopy keeps it (its memo says it is copied already)
    return copy.deepcopy(result, memo)


def _target(mode: Any, mixed_precision: Any, config: dict[str, Any]):
    """The target's `AmpPlan`, or None for plain float32 torch."""
    if mode is None and mixed_precision is None:
        raise TypeError("`mode` is required: the mode to convert the checkpoint to (as "
                        "convert_to_amp takes it), or 'fp32' for plain torch.")
    if isinstance(mode, str) and mode.lower() == "fp32" and mixed_precision is None:
        if config:
            raise ValueError(f"mode='fp32' (plain torch) takes no keys, got {sorted(config)}.")
        return None
    plan = resolve_amp(*mode_and_config(mode, mixed_precision, config))
    return plan


def _source(sd: Any, keep: str | None = None) -> dict[str, Any]:
    """What the optimizer checkpoint holds: inner state (widened to float32, but for
    8-bit state already in ``keep``), masters (with their params' names; rebuilt from a
    storage), whether its scale is dynamic (with the scaler states), and its count of
    applied steps (`applied_steps`)."""
    if not isinstance(sd, Mapping):
        raise ValueError("`optimizer_state_dict` must be an AmpOptimizer or torch optimizer "
                         f"state_dict, got {type(sd).__name__}.")
    if set(sd) == set(_PLAIN):
        return {"inner": dict(sd), "masters": [], "names": [], "dynamic": False,
                "scalers": None, "step": applied_steps(sd, None)}
    missing = [k for k in _AMP if k not in sd]
    if missing:
        raise ValueError(
            f"`optimizer_state_dict` is missing keys {missing}: it must be an "
            "AmpOptimizer's state_dict() (keys format, mode, opt_level, optimizer, scalers, "
            "master_weights) or a plain torch optimizer's (keys state, param_groups), "
            f"got keys {sorted(sd)[:8]}.")
    if sd["format"] != FORMAT:
        raise ValueError(f"`optimizer_state_dict['format']` must be {FORMAT}, got "
                         f"{sd['format']!r}.")
    inner = sd["optimizer"]
    if not isinstance(inner, Mapping) or not set(_PLAIN) <= set(inner):
        raise ValueError("`optimizer_state_dict['optimizer']` must be a torch optimizer "
                         "state_dict (keys 'state' and 'param_groups').")
    masters = sd["master_weights"]
    if isinstance(masters, str) and masters == FROM_MODEL:
        masters = None  # itself converted: its masters are the model's params already
    masters = list(masters or ())
    low = sd.get("low_precision")
    if low is not None:
        stored = stored_masters(low)  # (validated whether or not it holds masters)
        masters = masters or stored
        inner = widen_state(inner, keep)
    names = sd.get("master_names")
    if masters and names is None:
        raise ValueError(
            "`optimizer_state_dict` holds master weights but not the names of their params "
            "(`master_names`; saved before mpfunc_torch recorded them), so they cannot be "
            "matched to `model_state_dict`. Load it into an optimizer of its own mode "
            f"({sd['mode']!r}) and save its state_dict() again, then convert that.")
    if masters and (not isinstance(names, list | tuple) or len(names) != len(masters)):
        raise ValueError(f"`optimizer_state_dict['master_names']` must list {len(masters)} "
                         f"name lists (one per master weight), got {names!r:.80}.")
    scalers = sd["scalers"]
    dynamic = isinstance(scalers, list | tuple) and bool(scalers) and all(
        isinstance(s, Mapping) and s.get("kind") == "dynamic" for s in scalers)
    return {"inner": dict(inner), "masters": masters, "names": list(names or ()),
            "dynamic": dynamic, "scalers": list(scalers) if dynamic else None,
            "step": applied_steps(inner, None if low is None else low["step"])}


def _model_part(model_sd: Any, source: dict[str, Any]) -> dict[str, Any]:
    """``model_sd`` in float32 (a shallow copy: its ``_metadata`` kept), each master in
    place of its param, under every name of a tied one. Half values become float32 (what
    they are exactly), so a model with masters takes them as its masters exactly."""
    if not isinstance(model_sd, Mapping):
        raise ValueError("`model_state_dict` must be the model's state_dict(), got "
                         f"{type(model_sd).__name__}.")
    out = copy.copy(model_sd) if isinstance(model_sd, dict) else dict(model_sd)
    for k, v in model_sd.items():
        if isinstance(v, torch.Tensor) and v.dtype in (torch.float16, torch.bfloat16):
            out[k] = v.float()
    if not source["masters"]:
        return out
    for i, names in enumerate(source["names"]):
        if not (isinstance(names, list | tuple) and names
                and all(isinstance(n, str) for n in names)):
            raise ValueError(f"`optimizer_state_dict['master_names'][{i}]` must list the "
                             f"model's names of that master's param, got {names!r}.")
    prefix = _prefix(model_sd, source["names"][0][0])
    checked = []
    for i, (master, names) in enumerate(zip(source["masters"], source["names"])):
        where = f"optimizer_state_dict['master_weights'][{i}]"
        if not isinstance(master, torch.Tensor) or master.dtype != torch.float32:
            raise ValueError(f"`{where}` must be a float32 tensor (a master weight), got "
                             f"{getattr(master, 'dtype', type(master).__name__)}.")
        for name in names:
            key = prefix + name
            value = model_sd.get(key)
            if not isinstance(value, torch.Tensor):
                raise ValueError(f"`model_state_dict` has no tensor {key!r}, the param of "
                                 f"`{where}`; was it saved from the same model?")
            if value.shape != master.shape:
                raise ValueError(f"`model_state_dict[{key!r}]` has shape {tuple(value.shape)}"
                                 f", its master `{where}` {tuple(master.shape)}.")
            out[key] = master
        checked.append((where, master))
    bad = non_finite_names(checked)
    if bad:
        raise ValueError(f"`{bad[0]}` holds inf/NaN values; a master weight must be finite.")
    return out


def _prefix(model_sd: Mapping[str, Any], first: str) -> str:
    """The prefix the model's keys carry in ``model_sd``: none, or a wrapper's
    (``module.`` for DistributedDataParallel), found from the first master's name."""
    if first in model_sd:
        return ""
    found = sorted({k[:-len(first)] for k in model_sd
                    if isinstance(k, str) and k.endswith("." + first)}, key=len)
    return found[0] if found else ""


def guard_inner_load(optimizers: list[torch.optim.Optimizer]) -> None:
    """Makes the torch optimizers inside `AmpOptimizer` refuse the wrapper's format,
    which torch's own load would fail on with a bare ``KeyError: 'param_groups'`` (the
    usual slip: loading into the optimizer object passed to ``convert_to_amp``)."""
    for opt in optimizers:
        opt.register_load_state_dict_pre_hook(_refuse_amp_format)


def refuse_optimizer_state(optimizers: list[torch.optim.Optimizer]) -> None:
    """Master weights start from the params: an optimizer with state from a step or a
    load cannot be converted to them; say which order resumes."""
    if any(has_stepped(opt) for opt in optimizers):
        raise ValueError(
            "`optimizer` already has state (from a step, or a load_state_dict before "
            "convert_to_amp), and its float32 master weights must start from the params. "
            "To resume, convert first, then load into what convert_to_amp returned: "
            "`model, optimizer, _ = convert_to_amp(net, torch_optimizer, ...)`, then "
            "`optimizer.load_state_dict(ck_optimizer)` (a plain torch optimizer's "
            "state_dict loads there too).")


def _refuse_amp_format(optimizer: torch.optim.Optimizer, state_dict: Any) -> None:
    if isinstance(state_dict, dict) and "scalers" in state_dict and \
            "param_groups" not in state_dict:
        raise ValueError(
            f"`state_dict` is an AmpOptimizer.state_dict() (mode "
            f"{state_dict.get('mode')!r}), and this is the {type(optimizer).__name__} that "
            "convert_to_amp wrapped: load it with the optimizer convert_to_amp returned "
            "(`model, optimizer, criterion = convert_to_amp(...)`, then "
            "`optimizer.load_state_dict(state_dict)`).")
