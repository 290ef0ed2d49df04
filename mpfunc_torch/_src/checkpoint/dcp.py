"""``torch.distributed.checkpoint`` for a converted model and its `AmpOptimizer`.

torch's ``get_state_dict`` / ``set_state_dict`` key optimizer state by the model's
parameter names, found through ``optimizer.param_groups``. An `AmpOptimizer` with master
weights steps float32 masters that are not model params, and it has state of its own
(the loss scale and its trackers). These two functions present it to torch's as a
plain optimizer over the model's params whose per-param state also holds the float32
master (``"master_weight"``, a DTensor shard under FSDP2), and add the loss-scale state
under ``"mpfunc"``. torch then does the rest: parameter names, DTensor shards,
``StateDictOptions`` (full or sharded, CPU offload), and ``dcp.save`` / ``dcp.load``
reshard on load, e.g. from 2 ranks to 4.

Masters kept below float32 (mode ``"bf16"`` with ``master_weights`` ``"remainder"``,
``"kahan"``, ``"stochastic"``) have no float32 tensor to save: each param's state holds
its remainder or compensation instead (``"master_extra"``, sharded like the param), the
model part the bfloat16 params, and ``"mpfunc"`` the storage, seed and step count.
Optimizer state stored in bfloat16 is saved as it is stored; 8-bit state (per-block
scales of each rank's shard) is refused here.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
import torch.utils._pytree
from torch import nn

from mpfunc_torch._src.checkpoint import optimizer_state
from mpfunc_torch._src.master_weights import FROM_MODEL

__all__ = ["get_state_dict", "set_state_dict", "MASTER_KEY", "EXTRA_KEY", "MPFUNC_KEY"]

MASTER_KEY = "master_weight"
EXTRA_KEY = "master_extra"  # a stored master's remainder or Kahan compensation
MPFUNC_KEY = "mpfunc"


def _checkpoint_api():
    try:
        from torch.distributed.checkpoint import state_dict as api
    except ImportError as e:  # pragma: no cover - builds without distributed
        raise RuntimeError("torch.distributed.checkpoint is not available in this torch "
                           "build.") from e
    return api


def _amp_optimizers(optimizers: Any) -> list:
    from mpfunc_torch._src.optimizer import AmpOptimizer

    opts = list(optimizers) if isinstance(optimizers, list | tuple) else [optimizers]
    if not opts:
        raise ValueError("`optimizers` is empty; pass the AmpOptimizer from convert_to_amp.")
    for o in opts:
        if not isinstance(o, AmpOptimizer):
            raise TypeError("`optimizers` must be the AmpOptimizer(s) from convert_to_amp (for "
                            "a plain torch optimizer use torch.distributed.checkpoint."
                            f"state_dict directly), got {type(o).__name__}.")
    for o in opts:  # 8-bit state's scales are per local shard: no tensor DCP can reshard
        lp = getattr(o, "_lowp", None)  # mpfunc_torch._src.low_precision
        names = set() if lp is None or lp.state is None else (
            set(lp.state.dtypes.values()) | {lp.state.default})
        if names & {"float8_e4m3fn", "float8_e5m2"}:
            raise ValueError(
                "`optimizers` store their state in 8 bits, with one scale per block of each "
                "rank's shard, which torch.distributed.checkpoint cannot reshard; save "
                "AmpOptimizer.state_dict() with the model's state_dict instead (bfloat16 "
                "state, remainders, compensation and stochastic rounding go through these "
                "functions).")
    shared = opts[0]._shared
    if any(o._shared is not shared for o in opts):
        raise ValueError("`optimizers` must come from one convert_to_amp call (one shared "
                         "loss scale).")
    return opts


def _inner_module(model: nn.Module) -> nn.Module:
    from mpfunc_torch._src.model import AmpModel

    while isinstance(model, AmpModel):
        model = model.module
    if not isinstance(model, nn.Module):
        raise TypeError(f"`model` must be a torch.nn.Module, got {type(model).__name__}.")
    return model


def _init_inner_state(amp: Any) -> None:
    """Creates the inner optimizer's state without changing anything else: a step with
    zero gradients and lr 0 (what torch's checkpoint does for a fresh optimizer). With
    masters or state kept below float32, the step runs on their float32 values and
    writes only the new state back (`LowPrecision.make_state_`); the step count of the
    random bits does not move."""
    inner = amp.optimizer
    lowp = getattr(amp, "_lowp", None)
    owned = [q for g in inner.param_groups for q in g["params"]]
    if inner.state or any(q.grad is not None for q in owned):
        return
    for q in owned:
        if q.requires_grad:
            q.grad = torch.zeros_like(q)
    lrs = [g.get("lr") for g in inner.param_groups]
    for g in inner.param_groups:
        if "lr" in g:
            g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
    try:
        inner.step() if lowp is None else lowp.make_state_(inner.step)
    finally:
        for g, lr in zip(inner.param_groups, lrs):
            if lr is not None:
                g["lr"] = lr
        for q in owned:
            q.grad = None


class _View(torch.optim.Optimizer):
    """What torch's checkpoint functions see: the inner optimizer over the model's params,
    with each master weight in its param's state. Never steps (see `step`)."""

    state: dict[Any, Any]  # a plain dict here (torch's own is a defaultdict)

    def __init__(self, amp: Any):  # not Optimizer.__init__: nothing of its own to set up
        self.amp = amp
        self.inner = amp.optimizer
        self._optimizer_step_pre_hooks = {}
        self._optimizer_step_post_hooks = {}
        self._optimizer_state_dict_pre_hooks = OrderedDict()  # as torch's own
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        storage = amp._lowp.storage if getattr(amp, "_lowp", None) is not None else None
        master_of = {id(m): m for _, m in amp._pairs} if storage is None else {}
        self.masters = [master_of.get(id(q)) for q in amp._owned]  # None: no master
        extra_of = {} if storage is None else {
            id(w): e for (_, w), e in zip(storage.pairs, storage.extra)}
        self.extras = [extra_of.get(id(q)) for q in amp._owned]  # remainders, compensation
        self.param_groups = [
            {**{k: v for k, v in g.items() if k != "params"},
             "params": [amp._sources[i] for i in _indices(self.inner, gi)]}
            for gi, g in enumerate(self.inner.param_groups)
        ]
        self.defaults = self.inner.defaults
        self.state = {}
        for q, src, m, e in zip(amp._owned, amp._sources, self.masters, self.extras):
            st = dict(self.inner.state.get(q, {}))
            if m is not None:
                st[MASTER_KEY] = m
            if e is not None:
                st[EXTRA_KEY] = e
            if st:
                self.state[src] = st
        self.loaded: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        sd = self.inner.state_dict()
        # torch's state_dict hands out the live per-param dicts: add to copies of them
        sd["state"] = {pid: dict(st) for pid, st in sd["state"].items()}
        for pid, (m, e) in enumerate(zip(self.masters, self.extras)):
            if m is not None:
                sd["state"].setdefault(pid, {})[MASTER_KEY] = m.detach()
            if e is not None:
                sd["state"].setdefault(pid, {})[EXTRA_KEY] = e.detach()
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loaded = state_dict

    def step(self, closure=None):  # torch's checkpoint calls it to create missing state
        _init_inner_state(self.amp)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for g in self.param_groups:
            for p in g["params"]:
                p.grad = None


def _indices(inner: torch.optim.Optimizer, group_index: int) -> range:
    start = sum(len(g["params"]) for g in inner.param_groups[:group_index])
    return range(start, start + len(inner.param_groups[group_index]["params"]))


def _snapshot(tree: Any) -> Any:
    return torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.detach().clone(), tree)


def get_state_dict(model: nn.Module, optimizers: Any, *,
                   options: Any = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """torch's ``get_state_dict`` for a converted model and its `AmpOptimizer`.

    Returns ``(model_state_dict, optim_state_dict)`` for ``torch.distributed.checkpoint``
    ``save`` / ``load``. The optimizer part is torch's layout, keyed by parameter name,
    with a ``"master_weight"`` entry in each param's state (mode naive, apex O2), or its
    remainder or compensation (``"master_extra"``: mode bf16 without float32 masters),
    and the loss-scale state under ``"mpfunc"`` (with the storage, seed and step count). Both parts are snapshots (copies, one more copy
    of this rank's shards while they live): ``dcp.load`` into them changes nothing in
    the model or the optimizers until `set_state_dict` has checked it all (torch's own
    ``get_model_state_dict`` hands out the live params, so ``dcp.load`` would write the
    model before any check). Call it on every rank.

    Args:
      model: the model (the module given to `convert_to_amp`, or the `AmpModel`).
      optimizers: the `AmpOptimizer`, or the list of them from one `convert_to_amp`.
      options: a ``torch.distributed.checkpoint.state_dict.StateDictOptions``.

    Examples:
      >>> import torch, mpfunc_torch
      >>> net = torch.nn.Linear(4, 2)
      >>> model, opt, _ = mpfunc_torch.convert_to_amp(
      ...     net, torch.optim.Adam(net.parameters()), mode="naive")
      >>> msd, osd = mpfunc_torch.get_state_dict(net, opt)
      >>> sorted(osd["state"]["weight"]), osd["mpfunc"]["mode"]
      (['exp_avg', 'exp_avg_sq', 'master_weight', 'step'], 'naive')
    """
    api = _checkpoint_api()
    opts = _amp_optimizers(optimizers)
    module = _inner_module(model)
    for o in opts:
        _init_inner_state(o)
    views = [_View(o) for o in opts]
    model_sd = _snapshot(api.get_model_state_dict(module, options=options))
    optim_sd = _snapshot(api.get_optimizer_state_dict(module, views, options=options))
    own = opts[0].state_dict()
    optim_sd[MPFUNC_KEY] = {"format": own["format"], "mode": own["mode"],
                            "opt_level": own["opt_level"], "scalers": own["scalers"]}
    if "low_precision" in own:  # the storage, seed and step (the same in every optimizer)
        optim_sd[MPFUNC_KEY]["low_precision"] = {
            k: own["low_precision"][k] for k in ("storage", "seed", "step")}
    return model_sd, optim_sd


def set_state_dict(model: nn.Module, optimizers: Any, *, model_state_dict: dict[str, Any],
                   optim_state_dict: dict[str, Any], options: Any = None) -> None:
    """torch's ``set_state_dict`` for what `get_state_dict` made (after ``dcp.load``).

    Everything is checked first: the model's keys and shapes (unless ``options`` says
    ``strict=False``), and the optimizer part with every check of
    `AmpOptimizer.load_state_dict` (mode, loss-scale state, master weights, inner
    state). Only then are the model and the optimizers written, so a bad checkpoint
    changes nothing. The masters are written into the model's params, so training
    continues exactly where the checkpoint was taken.

    Raises:
      ValueError: ``optim_state_dict`` lacks the ``"mpfunc"`` entry (it was not made by
        `get_state_dict`), the model state does not fit the model, any check of
        `AmpOptimizer.load_state_dict` fails, or the optimizers keep 8-bit state.
    """
    api = _checkpoint_api()
    opts = _amp_optimizers(optimizers)
    module = _inner_module(model)
    if not isinstance(optim_state_dict, dict) or MPFUNC_KEY not in optim_state_dict:
        raise ValueError(f"`optim_state_dict` has no {MPFUNC_KEY!r} entry; make it with "
                         "mpfunc_torch.get_state_dict (then dcp.load into it).")
    own = optim_state_dict[MPFUNC_KEY]
    rest = {k: v for k, v in optim_state_dict.items() if k != MPFUNC_KEY}
    views = [_View(o) for o in opts]
    # torch maps names back to positions and hands each view its part.
    api.set_optimizer_state_dict(module, views, rest, options=options)
    converted = [_to_amp_state_dict(v, own) for v in views]
    for o, sd in zip(opts, converted):
        try:
            optimizer_state.check(o, sd)
        except ValueError as e:
            raise ValueError(f"`optim_state_dict`, checked as the AmpOptimizer.state_dict it "
                             f"converts to (params numbered in the optimizer's order): {e}"
                             ) from e
    if getattr(options, "strict", True):
        _check_model_state(module, model_state_dict)
    api.set_model_state_dict(module, model_state_dict, options=options)
    for o, sd in zip(opts, converted):
        o.load_state_dict(sd)


def _check_model_state(module: nn.Module, state: dict[str, Any]) -> None:
    expected = module.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"`model_state_dict` does not fit the model: missing keys "
                         f"{missing[:5]}, unexpected keys {unexpected[:5]}.")
    for k, v in expected.items():
        got = state[k]
        if isinstance(v, torch.Tensor) and (not isinstance(got, torch.Tensor)
                                            or got.shape != v.shape):
            found = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            raise ValueError(f"`model_state_dict[{k!r}]` must have shape {tuple(v.shape)}, "
                             f"got {found}.")


def _to_amp_state_dict(view: _View, own: dict[str, Any]) -> dict[str, Any]:
    """A view's loaded part (names in its params' order) as an `AmpOptimizer.state_dict`."""
    loaded = view.loaded
    if loaded is None:
        raise ValueError("`optim_state_dict` holds nothing for one of the optimizers.")
    names: list[str] = [n for g in loaded["param_groups"] for n in g["params"]]
    pid_of = {n: i for i, n in enumerate(names)}
    state: dict[int, dict[str, Any]] = {}
    masters: list[torch.Tensor] = []
    master_pids = [i for i, m in enumerate(view.masters) if m is not None]
    for name, st in loaded["state"].items():
        st = dict(st)
        st.pop(MASTER_KEY, None)
        st.pop(EXTRA_KEY, None)
        if st:
            state[pid_of[name]] = st
    by_pid = {pid_of[n]: st for n, st in loaded["state"].items()}
    low = own.get("low_precision")
    if low is not None:  # the bfloat16 params come from the model part, loaded first
        pids = {id(q): i for i, q in enumerate(view.amp._owned)}
        storage = view.amp._lowp.storage
        extra = None if storage is None else [
            None if e is None else by_pid.get(pids[id(w)], {}).get(EXTRA_KEY)
            for (_, w), e in zip(storage.pairs, storage.extra)]
        low = {**low, "params": None if storage is None else FROM_MODEL, "extra": extra}
    for pid in master_pids:
        st = by_pid.get(pid, {})
        if MASTER_KEY not in st:
            raise ValueError(f"`optim_state_dict['state'][{names[pid]!r}]` has no "
                             f"{MASTER_KEY!r}; was the checkpoint made in a mode without "
                             "master weights?")
        masters.append(st[MASTER_KEY])
    groups = []
    for g in loaded["param_groups"]:
        groups.append({**{k: v for k, v in g.items() if k != "params"},
                       "params": [pid_of[n] for n in g["params"]]})
    _check_sequence(masters, view)
    out = {"format": own["format"], "mode": own["mode"], "opt_level": own["opt_level"],
           "optimizer": {"state": state, "param_groups": groups},
           "scalers": own["scalers"], "master_weights": masters or None}
    return out if low is None else {**out, "low_precision": low}


def _check_sequence(masters: Sequence[torch.Tensor], view: _View) -> None:
    # The masters come in the view's param order, which is the AmpOptimizer's pair order.
    order = [id(m) for m in view.masters if m is not None]
    stored = getattr(view.amp, "_lowp", None) is not None and view.amp._lowp.storage is not None
    pairs = [] if stored else [id(m) for _, m in view.amp._pairs]  # (stored: no masters)
    if order != pairs:  # pragma: no cover - an internal invariant
        raise RuntimeError("master weights are not in pair order; please report this.")
