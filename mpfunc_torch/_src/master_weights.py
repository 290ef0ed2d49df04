"""Float32 master weights for half-precision params (naive mode, apex O2).

The inner optimizer steps float32 masters; each master has a source, the model's half
param its gradient comes from and its value goes back to. Gradients go model -> master
in a few foreach copies, chunk by chunk, each half gradient freed once copied (so the
step peaks at Megatron's 18 bytes/param plus one tensor, not 20); values go master ->
model in one foreach copy. With ``step_chunks > 1`` the inner optimizer steps chunk by
chunk instead (`mpfunc_torch._src.chunked_step`). A ``load_state_dict`` on the
model moves the masters with it (`follow_model_loads`), so loading pretrained weights
after `convert_to_amp` is not undone by stale masters at the next step.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from mpfunc_torch._src.distributed import all_reduce_found_inf_
from mpfunc_torch._src.sharding import is_dtensor, local, mesh_groups

__all__ = [
    "FROM_MODEL",
    "non_finite_names",
    "master_of",
    "make_masters",
    "keep_half_masters",
    "has_stepped",
    "swap_in_masters_",
    "largest_first",
    "sparse_grads_to_masters_",
    "copy_grads_to_masters_",
    "copy_masters_to_model_",
    "release_master_grads_",
    "follow_model_loads",
    "model_versions",
    "follow_model_writes_",
    "check_saved_masters",
    "store_master",
    "stored_in",
    "replace_master_",
]

# What a `convert_checkpoint` result holds in place of masters, or of a storage's params
# and remainders: they come from the float32 params of the model checkpoint converted
# with it (the model's load sets them exactly, before or after the optimizer's).
FROM_MODEL = "from the model's float32 checkpoint"

Pairs = Sequence[tuple[torch.Tensor, torch.Tensor]]  # (model param, its master)


def make_masters(optimizers: Sequence[torch.optim.Optimizer],
                 float32_value: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 ) -> dict[int, nn.Parameter]:
    """One float32 master per optimizer param, keyed by ``id(param)``; call before the
    model is cast. The master aliases the float32 storage the model is about to drop:
    exact values and no extra copy. A tied param is one object, so it gets one master.
    Built from ``p.data``, not ``p.detach()``: the master must not share the param's
    version counter, or every step on the master would look like an outside write to
    the param (`follow_model_writes_`). A model cast already (`cast_ahead`) gives each
    half param's float32 value with ``float32_value(param)``."""
    def value(p: torch.Tensor) -> torch.Tensor:
        return float32_value(p) if float32_value is not None and p.dtype != torch.float32 else p.data

    return {id(p): nn.Parameter(value(p), requires_grad=p.requires_grad)
            for opt in optimizers for g in opt.param_groups for p in g["params"]}


def keep_half_masters(masters: dict[int, nn.Parameter],
                      optimizers: Sequence[torch.optim.Optimizer]) -> dict[int, nn.Parameter]:
    """The masters whose param was cast to half precision (the others need none)."""
    dtypes = {id(p): p.dtype for opt in optimizers for g in opt.param_groups
              for p in g["params"]}
    return {k: m for k, m in masters.items() if dtypes[k] != torch.float32}


def has_stepped(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` has state from a step. The state some optimizers make at
    construction (``Adagrad``'s accumulators, at step 0) does not count."""
    for s in optimizer.state.values():
        if s and not (isinstance(s.get("step"), torch.Tensor | int | float)
                      and float(s["step"]) == 0):
            return True
    return False


# model param -> (a weak reference to) its float32 master, for `master_of`. Keyed by
# identity (tensors compare elementwise) and weak both ways: it keeps neither alive.
_MASTER_OF = WeakIdKeyDictionary()


def master_of(param: torch.Tensor) -> torch.Tensor | None:
    """The float32 master weight that steps in place of model ``param``, or None."""
    ref = _MASTER_OF.get(param)
    return ref() if ref is not None else None


# A master kept below float32 between steps (`mpfunc_torch._src.master_storage`): its
# float32 placeholder -> (a weak reference to) the storage that holds its value. Such a
# master has no values of its own outside the step: the hooks below reach it through
# its storage (``reset_to_param_``, ``load_mask``, ``follow_load_``).
_STORED = WeakIdKeyDictionary()


def store_master(master: torch.Tensor, storage: Any) -> None:
    """Marks ``master`` as a placeholder whose value ``storage`` holds."""
    _STORED[master] = weakref.ref(storage)


def stored_in(master: torch.Tensor | None) -> Any:
    """The storage holding ``master``'s value (`store_master`), or None."""
    ref = _STORED.get(master) if master is not None else None
    return ref() if ref is not None else None


def replace_master_(optimizer: torch.optim.Optimizer, param: torch.Tensor,
                    old: torch.Tensor, new: torch.Tensor) -> None:
    """Puts ``new`` in ``optimizer``'s groups (and state) in place of ``param``'s master
    ``old``, and makes it `master_of` ``param``."""
    for group in optimizer.param_groups:
        group["params"] = [new if q is old else q for q in group["params"]]
    if old in optimizer.state:
        optimizer.state[new] = optimizer.state.pop(old)
    _MASTER_OF[param] = weakref.ref(new)


def swap_in_masters_(optimizer: torch.optim.Optimizer,
                     masters: dict[int, nn.Parameter]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Puts the masters in ``optimizer.param_groups`` in place of their params, moving
    any state made at construction (see `has_stepped`; float32, made before the cast)
    to them; returns the (param, master) pairs, in the optimizer's order."""
    pairs = []
    for group in optimizer.param_groups:
        new = []
        p: torch.Tensor
        for p in group["params"]:
            m = masters.get(id(p), p)
            if m is not p:
                pairs.append((p, m))
                _MASTER_OF[p] = weakref.ref(m)
                if p in optimizer.state:
                    optimizer.state[m] = optimizer.state.pop(p)
            new.append(m)
        group["params"] = new
    return pairs


def largest_first(pairs: Pairs) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``pairs`` ordered by size, largest first: the order `copy_grads_to_masters_`
    wants (computed once, at conversion)."""
    return sorted(pairs, key=lambda pm: pm[1].numel(), reverse=True)


def _chunks(pairs: Pairs, floor_fraction: int = 256) -> list[list]:
    """Splits ``pairs`` (largest first) into chunks, each at most half of what is left
    from its start (and at least one tensor); below ``total // floor_fraction`` elements
    the rest is one chunk. Copying chunk k allocates its float32 grads while the half
    grads of chunks k.. are still alive; a chunk no bigger than what comes after it keeps
    that sum under the float32 grads of everything (see `copy_grads_to_masters_`)."""
    left = sum(m.numel() for _, m in pairs)
    floor = left // floor_fraction
    chunks: list[list] = []
    chunk: list = []
    size = 0
    for pair in pairs:
        n = pair[1].numel()
        if chunk and size + n > max(left // 2, floor):
            chunks.append(chunk)
            left -= size
            chunk, size = [], 0
        chunk.append(pair)
        size += n
    if chunk:
        chunks.append(chunk)
    return chunks


def sparse_grads_to_masters_(pairs: Pairs) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Sets the master grad of every pair whose half grad is None (None) or sparse (a
    coalesced float32 sparse copy; the half grad is dropped). Returns the pairs whose
    half grad is dense, in order, for the caller to copy."""
    dense = []
    for p, m in pairs:
        g = p.grad
        if g is None:
            m.grad = None
        elif g.is_sparse:
            m.grad = g.to(m.dtype).coalesce()
            p.grad = None
        else:
            dense.append((p, m))
    return dense


def copy_grads_to_masters_(pairs: Pairs) -> None:
    """Model (half) grads -> float32 master grads, releasing each half grad as soon as
    it is copied; pass ``pairs`` largest first (`largest_first`).

    The copy goes chunk by chunk (one foreach copy each, a few chunks in all), so that
    the half grads and the new float32 grads are never all alive together. Copying one
    copy of everything holds 6 bytes per float16 element (2 half + 4 float32); chunk by
    chunk the grads peak at 4 bytes per element plus 2 per element of the largest
    tensor that is copied when fewer elements than its own are left (10 equal layers:
    +0.2). That brings the optimizer step of naive/O2 with Adam from 20 bytes/param to
    Megatron's 18 (2 half param + 4 master + 4 master grad + 8 Adam) plus that one
    tensor (BENCHMARKS.md). A half grad someone else still holds is not freed, only
    dropped from ``.grad``. Nothing reads the half grads after the copy: a skipped step
    loses nothing that the one-copy version kept.

    A sparse grad becomes a coalesced float32 sparse master grad (duplicates summed in
    float32), which optimizers with sparse support (SGD, SparseAdam, Adagrad) step.
    """
    for chunk in _chunks(sparse_grads_to_masters_(pairs)):
        for _, m in chunk:
            if m.grad is None or m.grad.is_sparse:
                m.grad = torch.empty_like(m)
        # DTensors (FSDP2, TP): each rank copies its own shard
        torch._foreach_copy_([local(m.grad) for _, m in chunk],  # pyright: ignore[reportPrivateImportUsage]  # torch's foreach kernel, as torch.optim uses it; not re-exported
                             [local(p.grad) for p, _ in chunk])
        for p, _ in chunk:
            p.grad = None


def copy_masters_to_model_(pairs: Pairs) -> None:
    """Master values -> model params (rounded to the params' dtype), one foreach copy."""
    if pairs:
        torch._foreach_copy_([local(p).data for p, _ in pairs],  # pyright: ignore[reportPrivateImportUsage]  # torch's foreach kernel, as torch.optim uses it; not re-exported
                             [local(m).data for _, m in pairs])


def release_master_grads_(pairs: Pairs) -> None:
    """Master grads are dead once the step is taken (or skipped); freeing them keeps
    them from sitting beside the next forward's activations."""
    for _, m in pairs:
        m.grad = None


def model_versions(pairs: Pairs) -> dict[int, int]:
    """The version counters of the model params, by ``id``. Every in-place write bumps
    them except ours: `copy_masters_to_model_` writes through ``.data``, which does not."""
    return {id(p): p._version for p, _ in pairs}


@torch.no_grad()
def follow_model_writes_(pairs: Pairs, versions: dict[int, int]) -> None:
    """Re-seeds, exactly from the param, the master of every param written in place
    since ``versions`` was taken, and updates ``versions``.

    The written half value is the truth: on every DDP rank the master becomes exactly
    the broadcast value, so the ranks' masters agree bit for bit (a master's extra
    float32 bits cannot travel with a half-precision broadcast). Loads through
    ``load_state_dict`` are handled more finely by `follow_model_loads`. Cost when
    nothing was written: one integer comparison per param, no device work.
    """
    for p, m in pairs:
        v = p._version
        if v != versions.get(id(p)):
            stored = stored_in(m)
            if stored is None:
                m.copy_(p)
            else:
                stored.reset_to_param_(m)
            versions[id(p)] = v


def follow_model_loads(model: nn.Module, pairs: Pairs,
                       versions: dict[int, dict[int, int]]) -> list[Any]:
    """Makes every ``load_state_dict`` on ``model`` (or any submodule) move the masters.

    For each loaded param that has a master: a value of higher precision than the param
    (the usual float32 pretrained checkpoint) becomes the master exactly; a value in the
    param's own half dtype (a checkpoint of the converted model) replaces the master
    only where the master does not already round to it, so loading a converted model's
    checkpoint next to its optimizer checkpoint keeps the masters' extra bits, whatever
    the order of the two loads. ``assign=True`` is turned into a copy, so the optimizer
    keeps stepping the model's params. ``versions`` maps ``id(param)`` to the version
    table (`model_versions`) of the optimizer that steps it; a load marks the param as
    followed there, so `follow_model_writes_` leaves the loaded master alone. Returns the
    hook handles.
    """
    with_master = {id(p) for p, _ in pairs}
    handles = []
    for module in model.modules():
        names = [n for n, p in module._parameters.items()
                 if p is not None and id(p) in with_master]
        if not names:
            continue
        tables = {n: versions[id(module._parameters[n])] for n in names}
        follower = _LoadFollower(names, tables)
        handles.append(module.register_load_state_dict_pre_hook(follower.pre))
        handles.append(module.register_load_state_dict_post_hook(follower.post))
    return handles


class _LoadFollower:
    """The load hooks of one module: a module-level class (not closures), so a converted
    model still pickles whole (``torch.save(model)``). The masters are looked up when a
    load happens (`master_of`), so a master replaced after conversion is followed."""

    def __init__(self, names: list[str], versions: dict[str, dict[int, int]]):
        self.names = names  # the names of the params with a master
        self.versions = versions  # param name -> its optimizer's version table
        self.seen: dict[str, tuple] = {}

    def __getstate__(self):
        return {"names": self.names, "versions": self.versions, "seen": {}}

    def pre(self, mod, state_dict, prefix, *_):
        self.seen.clear()
        for n in self.names:
            value = state_dict.get(prefix + n)
            if isinstance(value, torch.Tensor):
                param = mod._parameters[n]
                master = master_of(param)
                stored = stored_in(master)
                # Where a master kept below float32 already rounds to the loaded half
                # value: decided before the load overwrites the param it is built on.
                keep = (stored.load_mask(master, value) if stored is not None
                        and value.dtype == param.dtype else None)
                self.seen[n] = (param, value, master, keep)

    def post(self, mod, _incompatible):
        for n, (param, value, master, keep) in self.seen.items():
            _follow(mod, n, param, value, master, keep)
            self.versions[n][id(param)] = param._version
        self.seen.clear()


@torch.no_grad()
def _follow(module: nn.Module, name: str, param: nn.Parameter, value: torch.Tensor,
            master: torch.Tensor | None, keep: torch.Tensor | None) -> None:
    current = module._parameters[name]
    if current is not param:  # load_state_dict(assign=True) swapped the param object
        if current is not None and current.shape == param.shape:
            param.copy_(current)
        module._parameters[name] = param
    if master is None or value.shape != master.shape:
        return  # torch reports the size mismatch and raises
    stored = stored_in(master)
    if stored is not None:
        stored.follow_load_(master, value, keep)
    elif value.dtype == param.dtype:
        keep = master.to(param.dtype) == param
        master.copy_(torch.where(keep, master, param.to(master.dtype)))
    else:
        master.copy_(value)


def check_saved_masters(saved: Any, pairs: Pairs, where: str) -> list[torch.Tensor]:
    """Validates checkpointed masters against ``pairs`` (count, float32 dtype, shape,
    finite values) without changing anything; returns them as a list."""
    saved = list(saved) if saved else []
    if len(saved) != len(pairs):
        raise ValueError(f"`{where}` has {len(saved)} master weights, this optimizer "
                         f"{len(pairs)}.")
    for i, (t, (_, m)) in enumerate(zip(saved, pairs)):
        name = f"{where}[{i}]"
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"`{name}` must be a tensor, got {type(t).__name__}.")
        if t.dtype != m.dtype or t.shape != m.shape:
            raise ValueError(f"`{name}` must be {m.dtype} with shape {tuple(m.shape)} (a "
                             f"master weight), got {t.dtype} with shape {tuple(t.shape)}.")
    bad = non_finite_names([(f"{where}[{i}]", t) for i, t in enumerate(saved)])
    if bad:
        raise ValueError(f"`{bad[0]}` holds inf/NaN values; a master weight must be finite.")
    return saved


def non_finite_names(named: Sequence[tuple[str, torch.Tensor]]) -> list[str]:
    """The names of the tensors in ``named`` holding an inf/NaN, for checkpoint checks:
    one host read per device for all of them (sparse tensors through their values).

    A DTensor (FSDP2, tensor parallelism) is checked on this rank's shard and its flag
    MAX-reduced over its mesh, so every rank finds the same names (call it on every
    rank, with the same names in the same order)."""
    flags: dict[Any, list] = {}
    for name, t in named:
        mesh = t.device_mesh if is_dtensor(t) else None
        shard = local(t)
        if shard.is_sparse:  # e.g. SGD's momentum for nn.Embedding(sparse=True)
            shard = shard.coalesce().values()
        if shard.element_size() == 1 and shard.is_floating_point():
            shard = shard.float()  # 8-bit state codes: torch has no isfinite for fp8
        flags.setdefault((shard.device, mesh), []).append((name, t, torch.isfinite(shard).all()))
    bad = []
    for (_, mesh), found in flags.items():
        non_finite = (~torch.stack([f for _, _, f in found])).float()
        if mesh is not None:
            all_reduce_found_inf_(non_finite, mesh_groups([found[0][1]]))
        bad += [n for (n, _, _), f in zip(found, non_finite.cpu().tolist()) if f]
    return bad
