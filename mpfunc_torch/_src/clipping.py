"""Global gradient-norm clipping across ranks, with replicated params counted once.

``torch.nn.utils.clip_grad_norm_`` sees the gradients of one rank. When a model is split
over ranks (tensor parallelism by hand, pipeline stages, FSDP2 or DTensor meshes), each
rank would clip by a different factor and the split model would no longer train like the
unsplit one. Here the norm is global:

* DTensor gradients (FSDP2, ``parallelize_module``): each rank adds ``|g|^p`` of its
  local shard, counting a shard only on the first rank of every mesh dimension the
  tensor is replicated over, then the sums are all-reduced over that mesh's dimensions.
* Plain gradients: summed over the ``process_group`` groups (tensor- or pipeline-
  parallel groups), except params marked with `mark_replicated`, which count on the
  first rank of the group they are replicated over (Megatron's
  ``param_is_not_tensor_parallel_duplicate``).

This mirrors ``mpfunc.clip_by_global_norm(..., axis_name=...)`` on the JAX side.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from mpfunc_torch._src.distributed import normalize_groups
from mpfunc_torch._src.master_weights import master_of
from mpfunc_torch._src.sharding import is_dtensor, local

__all__ = ["mark_replicated", "replicated_over", "clip_grad_norm_", "global_grad_norm",
           "grad_norms", "clip_grads_with_norm_", "global_zero_count", "grad_zero_counts"]

_ATTR = "_mpfunc_replicated_over"


def mark_replicated(params: torch.Tensor | Iterable[torch.Tensor], process_group: Any) -> None:
    """Declares that ``params`` are replicated over ``process_group``: every rank of it
    holds the same values and gradients (a norm weight, the bias after a row-parallel
    layer, an embedding that is not split). Global norms then count them once.

    The mark is an attribute on the tensor, as Megatron's ``tensor_model_parallel`` is;
    mark the model's params (before or after `convert_to_amp`; master weights find it
    through their param). Marking again over another group adds to the marks.

    Args:
      params: a tensor or an iterable of tensors (e.g. ``norm.parameters()``).
      process_group: a ``ProcessGroup`` or a sequence of them.

    Examples:
      >>> import torch, mpfunc_torch
      >>> norm = torch.nn.LayerNorm(4)
      >>> # with torch.distributed initialised and `tp` the tensor-parallel group:
      >>> # mpfunc_torch.mark_replicated(norm.parameters(), tp)
    """
    groups = normalize_groups(process_group)
    if not groups:
        raise ValueError("`process_group` must be a ProcessGroup or a non-empty sequence of "
                         f"them, got {process_group!r}.")
    if isinstance(params, torch.nn.Module):
        raise TypeError(f"`params` must be tensors, got a {type(params).__name__} module; "
                        "pass its .parameters().")
    items = [params] if isinstance(params, torch.Tensor) else list(params)
    for i, p in enumerate(items):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"`params` must be tensors, got {type(p).__name__} at index {i}.")
    for p in items:
        old = getattr(p, _ATTR, ())
        setattr(p, _ATTR, old + tuple(g for g in groups if all(g is not h for h in old)))


def replicated_over(*tensors: torch.Tensor) -> tuple[Any, ...]:
    """The groups any of ``tensors`` was marked replicated over (see `mark_replicated`)."""
    out: list[Any] = []
    for t in tensors:
        for g in getattr(t, _ATTR, ()):
            if all(g is not h for h in out):
                out.append(g)
    return tuple(out)


def _check_norm_type(norm_type: Any) -> float:
    if isinstance(norm_type, bool) or not isinstance(norm_type, int | float):
        raise TypeError(f"`norm_type` must be a float (> 0, or inf), got "
                        f"{type(norm_type).__name__}.")
    norm_type = float(norm_type)
    if not norm_type > 0:
        raise ValueError(f"`norm_type` must be > 0 or inf, got {norm_type!r}.")
    return norm_type


def _values(g: torch.Tensor) -> torch.Tensor:
    """This rank's part of a gradient as a dense tensor that aliases it: a DTensor's local
    shard, a sparse gradient's values (it must be coalesced: an uncoalesced tensor's
    values are a temporary copy, and clipping them would not reach the gradient)."""
    g = local(g)
    if g.is_sparse:
        if not g.is_coalesced():
            raise ValueError("a sparse gradient is not coalesced; coalesce it into "
                             "`param.grad` first (param.grad = param.grad.coalesce()).")
        g = g._values()
    return g


def _first_on_replicas(grad: torch.Tensor, marks: Sequence[Any]) -> bool:
    """Whether this rank is the one that counts ``grad`` (see the module docstring)."""
    for g in marks:
        if torch.distributed.get_rank(g) != 0:
            return False
    if is_dtensor(grad):
        mesh = grad.device_mesh
        for dim, placement in enumerate(grad.placements):
            if placement.is_replicate() and mesh.get_local_rank(dim) != 0:
                return False
    return True


Norms = dict[int, tuple[tuple, torch.Tensor]]  # param index -> ((device, dtype), norm)


def grad_norms(params: Sequence[torch.Tensor], norm_type: float,
               index: Sequence[int] | None = None) -> Norms:
    """The float32 ``norm_type``-norm of each param's local gradient values, one
    ``_foreach_norm`` per (device, dtype), keyed by ``index[i]`` (default ``i``). Each
    norm depends only on its own tensor, so norms computed in parts (as the chunked
    master-weight step does) are the ones computed all at once."""
    index = list(range(len(params))) if index is None else list(index)
    groups: dict[tuple, list] = {}
    for i, p in zip(index, params):
        if p.grad is not None:
            v = _values(p.grad)
            groups.setdefault((v.device, v.dtype), []).append((i, v))
    out: Norms = {}
    for key, items in groups.items():
        norms = torch._foreach_norm([v for _, v in items], norm_type, dtype=torch.float32)  # pyright: ignore[reportPrivateImportUsage]  # torch's foreach kernel, as torch.optim uses it; not re-exported
        out.update((i, (key, n)) for (i, _), n in zip(items, norms))
    return out


def _by_key(indices: Sequence[int], norms: Norms, device: torch.device) -> list[torch.Tensor]:
    """The norms of ``indices`` grouped by (device, dtype) in first-seen order, each group
    stacked on ``device``: the order one ``_foreach_norm`` per group gives."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for i in indices:
        key, n = norms[i]
        groups.setdefault(key, []).append(n)
    return [torch.stack(g).to(device) for g in groups.values()]


def _power_sum(indices: Sequence[int], norms: Norms, norm_type: float,
               device: torch.device) -> torch.Tensor:
    """sum |g|^p over the grads of ``indices`` (max |g| for p = inf), float32."""
    acc = torch.zeros((), dtype=torch.float32, device=device)
    for stacked in _by_key(indices, norms, device):
        if math.isinf(norm_type):
            acc = torch.maximum(acc, stacked.max())
        else:
            acc = acc + stacked.pow(norm_type).sum()
    return acc


def _all_reduce(t: torch.Tensor, groups: Sequence[Any], norm_type: float) -> None:
    op = torch.distributed.ReduceOp.MAX if math.isinf(norm_type) else torch.distributed.ReduceOp.SUM
    for g in groups:
        torch.distributed.all_reduce(t, op=op, group=g)


def _distributed_parts(params: list[torch.Tensor], sources: list[torch.Tensor],
                       counted: Any = None) -> tuple[list[int], list[tuple[Any, list[int]]]]:
    """The indices of this rank's gradients that count, split into plain ones and one
    list per DTensor mesh; a gradient replicated over a mesh dimension or a marked group
    counts on the first rank of it only (see the module docstring). ``counted`` (a set
    of indices) stands for "has a gradient" where the gradients no longer exist (their
    norms were taken earlier); their placements are then the params'."""
    plain: list[int] = []
    meshes: list[tuple[Any, list[int]]] = []
    for i, (p, src) in enumerate(zip(params, sources)):
        g = p.grad
        bucket = plain
        if is_dtensor(p):
            for mesh, items in meshes:
                if mesh is p.device_mesh or mesh == p.device_mesh:
                    bucket = items
                    break
            else:
                bucket = []
                meshes.append((p.device_mesh, bucket))
        if (i not in counted) if counted is not None else g is None:
            continue
        if g is not None and is_dtensor(g) and any(pl.is_partial() for pl in g.placements):
            raise ValueError(
                "a gradient is a DTensor with a Partial placement (not yet reduced over its "
                f"mesh: {g.placements}); clip after the backward's reductions have run.")
        if _first_on_replicas(g if g is not None else p, replicated_over(p, src)):
            bucket.append(i)
    return plain, meshes


def _arguments(params: Iterable[torch.Tensor], process_group: Any, mark_sources: Any
               ) -> tuple[tuple, list[torch.Tensor], list[torch.Tensor], Any]:
    """``(groups, params, sources, device)``, checked; ``device`` is None without params."""
    groups = normalize_groups(process_group)
    params = list(params)
    sources = list(mark_sources) if mark_sources is not None else params
    if len(sources) != len(params):
        raise ValueError(f"`mark_sources` must have one tensor per param ({len(params)}), "
                         f"got {len(sources)}.")
    return groups, params, sources, (local(params[0]).device if params else None)


def global_grad_norm(params: Iterable[torch.Tensor], norm_type: float = 2.0, *,
                     process_group: Any = None,
                     mark_sources: Sequence[torch.Tensor] | None = None,
                     norms: Norms | None = None) -> torch.Tensor:
    """The norm of the gradients of ``params`` over every rank that holds a part of them.

    Every rank of the meshes and groups involved must call it with its params in the
    same order (it runs collectives). See the module docstring for what is summed where.

    Args:
      params: tensors whose ``.grad`` is measured (None grads count as zero).
      norm_type: p of the p-norm (``inf`` for the max norm).
      process_group: groups over which plain gradients are split (tensor- or pipeline-
        parallel groups); None for none. Do not name a DTensor mesh's own groups here:
        those are found from the gradients.
      mark_sources: for each param, another tensor whose `mark_replicated` marks apply
        too (the model param behind a master weight).
      norms: the per-param norms (`grad_norms`, keyed by index in ``params``), taken
        earlier, for gradients that no longer exist (the chunked master-weight step);
        None: taken here from the ``.grad`` of ``params``.

    Returns:
      The total norm, a float32 0-dim tensor on the params' device, equal on every rank.
    """
    norm_type = _check_norm_type(norm_type)
    groups, params, sources, device = _arguments(params, process_group, mark_sources)
    if not params:
        return torch.zeros((), dtype=torch.float32)
    counted = None if norms is None else set(norms)
    if norms is None:
        norms = grad_norms(params, norm_type)
    if not groups and not any(is_dtensor(p) or replicated_over(p, s)
                              for p, s in zip(params, sources)):
        # One rank holds everything: torch's get_total_norm, computed in float32 (the
        # same bits for float32 gradients; no float16 overflow for half ones).
        stacked = _by_key(sorted(norms), norms, device)
        if not stacked:
            return torch.zeros((), dtype=torch.float32, device=device)
        return torch.linalg.vector_norm(torch.cat(stacked), norm_type)
    plain, meshes = _distributed_parts(params, sources, counted)
    total = _power_sum(plain, norms, norm_type, device)
    for mesh, items in meshes:
        part = _power_sum(items, norms, norm_type, device)
        _all_reduce(part, [mesh.get_group(d) for d in range(mesh.ndim)], norm_type)
        total = torch.maximum(total, part) if math.isinf(norm_type) else total + part
    _all_reduce(total, groups, norm_type)
    return total if math.isinf(norm_type) else total.pow(1.0 / norm_type)


ZeroCounts = dict[int, tuple[int, torch.Tensor]]  # param index -> (numel, its non-zeros)


def grad_zero_counts(params: Sequence[torch.Tensor],
                     index: Sequence[int] | None = None) -> ZeroCounts:
    """What the zero count of each param's local gradient needs (this rank's part): its
    element count and its non-zero count (float64, exact; a sparse gradient's dense size
    and its non-zero values), one ``_foreach_norm(..., 0)`` per (device, dtype), keyed by
    ``index[i]`` (default ``i``). Counts taken in parts (the chunked step) are those
    taken at once."""
    index = list(range(len(params))) if index is None else list(index)
    groups: dict[tuple, list] = {}
    for i, p in zip(index, params):
        if p.grad is not None:
            v = _values(p.grad)
            groups.setdefault((v.device, v.dtype), []).append((i, v, local(p.grad).numel()))
    out: ZeroCounts = {}
    for items in groups.values():
        nonzero = torch._foreach_norm([v for _, v, _ in items], 0, dtype=torch.float64)  # pyright: ignore[reportPrivateImportUsage]  # torch's foreach kernel, as torch.optim uses it; not re-exported
        out.update((i, (n, nz)) for (i, _, n), nz in zip(items, nonzero))
    return out


def _sum_counts(indices: Sequence[int], counts: ZeroCounts, device: Any) -> torch.Tensor:
    """The zeros of the gradients of ``indices``: their element count less one stacked
    sum of their non-zero counts (float64)."""
    if not indices:
        return torch.zeros((), dtype=torch.float64, device=device)
    numel = sum(counts[i][0] for i in indices)
    return numel - torch.stack([counts[i][1].to(device) for i in indices]).sum()


def global_zero_count(params: Iterable[torch.Tensor], *, process_group: Any = None,
                      mark_sources: Sequence[torch.Tensor] | None = None,
                      counts: ZeroCounts | None = None) -> torch.Tensor:
    """Exactly-zero gradient elements of ``params`` over every rank that holds a part of
    them, each element counted once: Megatron's ``num_zeros_in_grad``, reduced like
    `global_grad_norm` (DTensor meshes, ``process_group``, `mark_replicated`).
    ``counts`` (`grad_zero_counts`, keyed by index in ``params``) are used for gradients
    that no longer exist (the chunked master-weight step).

    Returns:
      An int64 0-dim tensor on the params' device, equal on every rank (no host sync).
    """
    groups, params, sources, device = _arguments(params, process_group, mark_sources)
    if not params:
        return torch.zeros((), dtype=torch.int64)
    counted = None if counts is None else set(counts)
    if counts is None:
        counts = grad_zero_counts(params)
    plain, meshes = _distributed_parts(params, sources, counted)
    total = _sum_counts(plain, counts, device)
    sum_op = torch.distributed.ReduceOp.SUM
    for mesh, items in meshes:
        part = _sum_counts(items, counts, device)
        for d in range(mesh.ndim):
            torch.distributed.all_reduce(part, op=sum_op, group=mesh.get_group(d))
        total = total + part
    for g in groups:
        torch.distributed.all_reduce(total, op=sum_op, group=g)
    return total.to(torch.int64)


def clip_grads_with_norm_(params: Iterable[torch.Tensor], max_norm: float,
                          total_norm: torch.Tensor) -> None:
    """Scales every gradient (each rank's shard) by ``min(1, max_norm / (total_norm +
    1e-6))``, as ``torch.nn.utils.clip_grads_with_norm_`` does; no host sync."""
    grads = [_values(p.grad) for p in params if p.grad is not None]
    if not grads:
        return
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(g)
    for dev, group in by_device.items():
        torch._foreach_mul_(group, coef.to(dev))  # pyright: ignore[reportPrivateImportUsage]  # torch's foreach kernel, as torch.optim uses it; not re-exported


def clip_grad_norm_(parameters: torch.Tensor | Iterable[torch.Tensor], max_norm: float,
                    norm_type: float = 2.0, *, process_group: Any = None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` with the norm taken over every rank.

    FSDP2 and DTensor tensor-parallel gradients are handled from their placements; for
    hand-split models name the groups the gradients are split over in ``process_group``
    (tensor- and pipeline-parallel groups, not a data-parallel group whose gradients are
    already averaged) and `mark_replicated` the params that every rank of a group holds
    whole. All ranks then clip by the same factor, so the split model trains like the
    unsplit one. `AmpOptimizer.clip_grad_norm` calls this with the optimizer's groups.
    A converted model's params with float32 master weights (naive, apex O2) are followed
    to their masters, where their gradients are after ``optimizer.unscale_()``
    (``torch.nn.utils.clip_grad_norm_`` sees no gradients on them there).

    Returns:
      The total norm before clipping (a float32 0-dim tensor, the same on every rank).

    Examples:
      >>> import torch, mpfunc_torch
      >>> w = torch.nn.Parameter(torch.ones(4))
      >>> w.grad = torch.full((4,), 3.0)
      >>> float(mpfunc_torch.clip_grad_norm_([w], max_norm=1.0))
      6.0
      >>> round(float(w.grad.norm()), 4)
      1.0
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    if isinstance(max_norm, bool) or not isinstance(max_norm, int | float) or not max_norm > 0:
        raise ValueError(f"`max_norm` must be a number > 0, got {max_norm!r}.")
    # A converted model's param with a float32 master (naive, apex O2): its gradient
    # moves into the master at `unscale_()`, and the master's is what steps.
    owned = []
    for p in params:
        m = master_of(p)
        if m is not None and m.grad is None and p.grad is not None:
            raise RuntimeError(
                "clip_grad_norm_ on a converted model's params before optimizer.unscale_(): "
                "their gradients are still scaled, and move into the float32 master weights "
                "at unscale_(). Call optimizer.unscale_() first, or optimizer.clip_grad_norm("
                "max_norm), which does both.")
        owned.append(p if m is None else m)
    total = global_grad_norm(owned, norm_type, process_group=process_group,
                             mark_sources=params)
    clip_grads_with_norm_(owned, float(max_norm), total)
    return total
