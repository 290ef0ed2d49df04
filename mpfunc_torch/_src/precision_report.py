"""Which gradient overflowed, and how close each one is to overflow or underflow.

The torch twin of ``mpfunc/_src/precision_report.py``: the same per-leaf rule
(`_mpfunc_common.precision_report.LEAF_RULE`), reduced on the device (small gradients
together by segment reductions, large ones one at a time) into one tensor, read with one
transfer when asked. Which params made the last step skip: ``skip_record.py``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from _mpfunc_common.precision_report import (
    FloatFormat,
    check_loss_scale,
    check_report_dtype,
    format_table,
    leaf_rows,
    nonfinite_names,
)
from mpfunc_torch._src import fused
from mpfunc_torch._src.cancelled_updates import match_tensors, update_counts
from mpfunc_torch._src.distributed import host_values, normalize_groups
from mpfunc_torch._src.nonfinite_watch import watch_of
from mpfunc_torch._src.sharding import is_dtensor, local

__all__ = ["PrecisionReport", "precision_report"]


class PrecisionReport:
    """What `precision_report` returns: per-param statistics on the device, read once.

    Nothing is copied to the host until `rows`, `nonfinite_names`,
    `first_nonfinite_module` or ``str(report)`` is called; the first of them reads the
    whole report (one transfer) and the others reuse it. ``names`` are the params'
    names; ``stats`` is the packed int64 device tensor: nonfinite, amax (float32 bits),
    zeros, underflows, sizes, and with ``updates`` updated and cancelled
    (`CANCEL_RULE`), a row of ``len(names)`` each, the scale's float32 bits, then the
    watched forward's flags.
    """

    def __init__(self, names: Sequence[str], stats: torch.Tensor, fmt: FloatFormat,
                 forward_names: Sequence[str] | None = None, updates: bool = False):
        self.names = tuple(names)
        self.dtype = fmt.name
        self.stats = stats
        self._fmt = fmt
        self._forward_names = None if forward_names is None else tuple(forward_names)
        self._rows = 7 if updates else 5
        self._host: tuple | None = None

    def __repr__(self) -> str:  # reads nothing from the device
        return f"PrecisionReport({len(self.names)} params, dtype={self.dtype})"

    def _read(self) -> tuple:
        if self._host is None:
            n, k = len(self.names), self._rows
            host = self.stats.cpu()  # the one transfer
            f32 = host[:k * n + 1].to(torch.int32).view(torch.float32)
            ints = host[:k * n].view(k, n).tolist()
            rows = leaf_rows(self.names, ints[0], f32[n:2 * n].tolist(), ints[2], ints[3],
                             ints[4], float(f32[k * n]), self._fmt,
                             (ints[5], ints[6]) if k == 7 else None)
            fwd = None if self._forward_names is None else host[k * n + 1:].tolist()
            self._host = rows, float(f32[k * n]), fwd
        return self._host

    def rows(self) -> list[dict[str, Any]]:
        """One dict per param, in ``named_parameters()`` order: ``name``, ``nonfinite``,
        ``amax``, ``zero_fraction``, ``underflow_fraction``, ``headroom_bits`` (and
        ``update_cancelled`` when made with ``updates``)."""
        return [dict(r) for r in self._read()[0]]

    def nonfinite_names(self) -> list[str]:
        """The names of the params whose gradient holds an inf or NaN, in order."""
        return nonfinite_names(self._read()[0])

    @property
    def first_nonfinite_module(self) -> str | None:
        """The first module, in the order its forward returned, whose output held an
        inf or NaN in the last forward of a model watched with `watch_nonfinite`; None
        if none did, or if the model is not watched."""
        fwd = self._read()[2]
        if fwd is None:
            return None
        return next((n for n, f in zip(self._forward_names or (), fwd) if f), None)

    def __str__(self) -> str:
        rows, scale, fwd = self._read()
        return format_table(rows, scale, self._fmt, self.first_nonfinite_module,
                            watched=fwd is not None)


def _format(dtype: Any) -> FloatFormat:
    if isinstance(dtype, torch.dtype):
        return check_report_dtype(str(dtype).removeprefix("torch."), dtype)
    if isinstance(dtype, str):
        return check_report_dtype(dtype.removeprefix("torch."), dtype)
    return check_report_dtype(None, dtype)


def _scale_tensor(loss_scale: Any, device: torch.device) -> torch.Tensor:
    """The scale as a float32 0-dim tensor on ``device``; numbers are checked, tensors
    are not read (a host sync)."""
    scale = getattr(loss_scale, "loss_scale", getattr(loss_scale, "scale", loss_scale))
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1 or not scale.is_floating_point():
            raise TypeError("`loss_scale` must be a floating 0-dim tensor, got "
                            f"{scale.dtype} with shape {tuple(scale.shape)}.")
        return scale.detach().reshape(()).to(device, torch.float32)
    value = 1.0 if loss_scale is None else check_loss_scale(loss_scale)
    return torch.full((), value, dtype=torch.float32, device=device)


def _dense(g: torch.Tensor) -> torch.Tensor:
    g = local(g.detach())
    if g.is_sparse:
        g = g.coalesce().values()
    return g


# Real gradients of at most this many elements are reduced together (`_flat_stats`): a
# few kernels for all of them instead of about eight per tensor, which on a GPU are
# launches that a model's many biases and norm weights would be bound by. Each segment
# sum is a float32 count of at most this many ones: exact.
_FLAT_MAX = 1 << 16
# Elements per flat pass: bounds its float32 copy and temporaries (about 16 MiB each).
_FLAT_CHUNK = 1 << 22


def _stats(grads: Sequence[torch.Tensor], threshold: torch.Tensor,
           amax_factor: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per tensor: ``(nonfinite, amax)`` float32 and ``(zeros, underflows, size)`` int64,
    stacked into ``[n, 2]`` and ``[n, 3]`` (`LEAF_RULE`; ``threshold`` is
    ``tiny(dtype) / 2 / scale``, or ``tiny(dtype) / 2`` for gradients that carry the
    scale already, whose amax ``amax_factor`` then unscales).

    Small real gradients together (`_flat_stats`); the others one tensor at a time, in
    one float32 buffer for ``|g|`` (the largest gradient's size), with the ops measured
    fastest on CPU: ``isfinite`` and a masked max took 4x longer than the check kernel
    (`fused.nonfinite_flags_`) and ``nan_to_num`` then ``amax``.
    """
    dev, n = threshold.device, len(grads)
    flags = torch.zeros(n, dtype=torch.float32, device=dev)
    amax = torch.zeros(n, dtype=torch.float32, device=dev)
    counts = torch.zeros((n, 3), dtype=torch.int64, device=dev)
    small = [i for i, g in enumerate(grads)
             if g.numel() <= _FLAT_MAX and not g.is_complex() and g.device == dev]
    _flat_stats(grads, small, threshold, flags, amax, counts)
    large = sorted(set(range(n)) - set(small))
    # Buffers for |g| and |g| <= threshold, the largest gradient's size: allocating
    # them per tensor cost as much as the ops themselves on CPU (page faults).
    size = max((grads[i].numel() for i in large), default=0)
    buffer = torch.empty(size, dtype=torch.float32, device=dev)
    below = torch.empty(size, dtype=torch.bool, device=dev)
    for i in large:
        g = grads[i]
        a = buffer[:g.numel()].view(g.shape)
        if g.dtype == torch.float32:
            a = torch.abs(g, out=a)
        else:  # half precision, or a complex gradient's magnitude
            a = a.copy_(g.abs() if g.is_complex() else g).abs_()
        zeros = a.numel() - torch.count_nonzero(a)  # as a == 0: torch keeps subnormals
        le = torch.le(a, threshold, out=below[:g.numel()].view(g.shape))
        counts[i] = torch.stack([zeros, torch.count_nonzero(le) - zeros,
                                 zeros.new_full((), a.numel())])
        fused.nonfinite_flags_([a], flags[i:i + 1])
        if a.numel():
            amax[i] = torch.nan_to_num_(a, nan=0.0, posinf=0.0).amax()
    if amax_factor is not None:
        amax = amax * amax_factor
    return torch.stack([flags, amax], dim=1), counts


def _flat_stats(grads: Sequence[torch.Tensor], index: list[int], threshold: torch.Tensor,
                flags: torch.Tensor, amax: torch.Tensor, counts: torch.Tensor) -> None:
    """`_stats` of ``grads[i]`` for ``i`` in ``index`` (real, small), into rows ``i`` of
    ``flags``, ``amax`` and ``counts``: per chunk, one float32 copy of ``|g|`` for all of
    them (a ``cat`` per dtype) and segment reductions over it, a fixed number of
    kernels whatever the number of tensors. The same values as the per-tensor path."""
    dev = threshold.device
    chunks: list[list[int]] = []
    total = 0
    for i in sorted(index, key=lambda i: str(grads[i].dtype)):
        size = grads[i].numel()
        if not chunks or total + size > _FLAT_CHUNK or grads[i].dtype != grads[chunks[-1][0]].dtype:
            chunks.append([])
            total = 0
        chunks[-1].append(i)
        total += size
    for chunk in chunks:
        a = torch.cat([grads[i].reshape(-1) for i in chunk]).to(torch.float32).abs_()
        # Copied from the host without a sync (`host_values`). unsafe: the lengths are
        # right by construction, and checking them would read the device.
        lengths = host_values([grads[i].numel() for i in chunk], torch.int64, dev)
        rows = host_values(chunk, torch.int64, dev)
        finite = torch.isfinite(a)
        f32 = torch.float32

        def total_of(x, how="sum", lengths=lengths):
            return torch.segment_reduce(x, how, lengths=lengths, unsafe=True, initial=0)

        flags[rows] = total_of(finite.logical_not().to(f32), "max")
        amax[rows] = total_of(torch.where(finite, a, 0.0), "max")
        zeros = total_of((a == 0).to(f32))  # as count_nonzero: subnormals are not 0
        below = total_of((a <= threshold).to(f32))
        counts[rows] = torch.stack([zeros, below - zeros, lengths.to(f32)], dim=1).to(
            torch.int64)


def _reduce_(fl: torch.Tensor, counts: torch.Tensor, tensors: Sequence[torch.Tensor],
             groups: tuple) -> None:
    """MAX-reduces the flags and amaxes and sums the counts over ``groups`` (every rank
    holding the same params) and over the meshes of DTensor params: MAX over every mesh
    dimension, as the inf check does, and the counts over the dimensions a param is
    sharded over. Each reduction covers the whole vector, so every rank passes the same
    params in the same order (true within a mesh and for the groups named)."""
    if not groups and not any(is_dtensor(t) for t in tensors):
        return
    op = torch.distributed.ReduceOp
    for g in groups:
        torch.distributed.all_reduce(fl, op=op.MAX, group=g)
        torch.distributed.all_reduce(counts, op=op.SUM, group=g)
    done: list = []
    for t in tensors:
        if not is_dtensor(t) or any(t.device_mesh == m for m in done):
            continue
        mesh = t.device_mesh
        done.append(mesh)
        for dim in range(mesh.ndim):
            group = mesh.get_group(dim)
            torch.distributed.all_reduce(fl, op=op.MAX, group=group)
            sharded = host_values([is_dtensor(u) and u.device_mesh == mesh
                                   and u.placements[dim].is_shard() for u in tensors],
                                  torch.bool, fl.device)
            summed = counts.clone()
            torch.distributed.all_reduce(summed, op=op.SUM, group=group)
            counts.copy_(torch.where(sharded[:, None], summed, counts))


def _pack(fl, counts, scale, forward) -> torch.Tensor:
    bits = [fl[:, 1].contiguous().view(torch.int32), scale.reshape(1).view(torch.int32)]
    parts = [fl[:, 0].to(torch.int64), bits[0].to(torch.int64), *counts.t(),
             bits[1].to(torch.int64)]
    return torch.cat(parts + ([] if forward is None else [forward.to(torch.int64)]))


def _report(names, grads, tensors, scale, fmt, groups, prescaled, model,
            updates=None) -> PrecisionReport:
    """``updates``: None, or a ``(param, update or None)`` pair per gradient."""
    dev = scale.device
    threshold = torch.full((), fmt.threshold, dtype=torch.float32, device=dev)
    if not prescaled:
        threshold = threshold / scale
    fl, counts = _stats(grads, threshold, torch.reciprocal(scale) if prescaled else None)
    if updates is not None:
        counts = torch.cat([counts, update_counts(updates, dev)], dim=1)
    _reduce_(fl, counts, tensors, groups)
    watch = watch_of(model) if model is not None else None
    fwd_names, fwd = (None, None) if watch is None else watch.snapshot(dev)
    return PrecisionReport(names, _pack(fl, counts, scale, fwd), fmt, fwd_names,
                           updates is not None)


def _unwrap(model: nn.Module) -> nn.Module:
    inner = model.__dict__.get("_modules", {}).get("module")
    return inner if type(model).__name__ == "AmpModel" and inner is not None else model


def precision_report(
    model: nn.Module,
    *,
    loss_scale: Any = None,
    dtype: Any = torch.float16,
    grads: Sequence[torch.Tensor | None] | Mapping[str, torch.Tensor] | None = None,
    process_group: Any = None,
    updates: Sequence[torch.Tensor | None] | Mapping[str, torch.Tensor] | None = None,
) -> PrecisionReport:
    """Per-param overflow and underflow statistics of ``model``'s gradients, on the device.

    For the ``.grad`` of each of ``model.named_parameters()`` that has one, in order:

    .. code-block:: python

        # per gradient leaf g (its local shard, then reduced over the shards)
        a = abs(float32(g))                                  # elementwise, in float32
        nonfinite = any(not isfinite(a))                     # MAX over shards
        amax = max(a where isfinite(a), initial=0)           # float32; MAX over shards
        zeros = count(a == 0)                                # these three: SUM over shards
        underflows = count(a != 0 and a <= float32(tiny(dtype) / 2) / loss_scale)
        size = count(a)
        # on the host, from those numbers (shared code, so both frameworks agree bit for bit)
        zero_fraction = zeros / size                         # 0.0 for an empty leaf
        underflow_fraction = underflows / (size - zeros)     # 0.0 when nothing is non-zero
        headroom_bits = log2(max(dtype) / (amax * loss_scale))   # inf when amax == 0

        tiny(dtype) is dtype's smallest subnormal: a scaled value at or below half of it
        rounds to 0 in dtype (round to nearest, ties to even); the threshold is divided by
        the scale once, in float32. A negative headroom means the scaled gradient no longer
        fits in dtype: it would overflow to inf. Zeros are counted by their bits: XLA on
        CPU reads a float32 subnormal as 0 in arithmetic, torch does not, so such a value
        is an underflow (not a zero) in both.

    Given ``updates``, each row also has ``update_cancelled``:

    .. code-block:: python

        # per leaf given an update u and its stored param p (local shards, then SUM-reduced)
        new = round_to(p.dtype, float32(p) + float32(u))   # to nearest even: p + u as applied
        updated = count(u != 0)
        cancelled = count(u != 0 and new == p)              # p does not move: u rounded away
        update_cancelled = cancelled / updated              # 0.0 when u is all zero

        An update below half an ulp of its param (2**-8 at 1.0 in bfloat16, 2**-11 in
        float16) is always cancelled. XLA on CPU flushes float32 subnormals (in p or u) to
        zero, which torch does not.

    For half params stepped directly (``p.add_(u)``) it is the share of the step lost
    for good (training stalls as it nears 1). Masters (float32, remainders, Kahan) keep
    what the param cancels and stochastic rounding keeps it in expectation: there it
    says how much of the step only they carry.

    The gradients are taken as they are: give the scale they are trained at when they are
    unscaled (after ``optimizer.unscale_()`` / ``step()``), or None when they still carry
    it (after a scaled ``backward``); `AmpOptimizer.precision_report` knows which. DTensor
    gradients (FSDP2, tensor parallelism) are reduced over their device meshes, plain
    ones over ``process_group`` if given (the ranks must hold the same params: data or
    tensor parallel, not pipeline stages). A watched model's report (`watch_nonfinite`)
    also names the first module whose output was non-finite in its last forward.

    Args:
      model: the model (an ``AmpModel`` is looked through).
      loss_scale: None (1), a number > 0, a float32 0-dim tensor, an ``AmpOptimizer`` or
        a ``LossScaler`` (their current scale). Only numbers are checked: a tensor is
        not read.
      dtype: ``torch.float16`` (default), ``torch.bfloat16``, ``torch.float32``,
        ``torch.float8_e4m3fn`` or ``torch.float8_e5m2`` (or their names).
      grads: instead of the ``.grad``: one tensor (or None) per param in
        ``named_parameters()`` order, or a dict from param name to tensor.
      process_group: a ``ProcessGroup`` or a sequence of them to reduce over.
      updates: the float32 update of each param (added to the param as it is stored),
        as ``grads`` are given: adds ``update_cancelled`` (above); None for a param
        without one.

    Returns:
      A `PrecisionReport`.

    Raises:
      TypeError: ``model`` is not a module, a non-floating ``dtype``, a bad ``loss_scale``.
      ValueError: a scale that is not finite or not > 0; ``grads`` or ``updates`` that
        do not match the model's params (count, names or shapes).

    Examples:
      >>> import torch, mpfunc_torch
      >>> net = torch.nn.Linear(2, 1)
      >>> net.weight.grad = torch.tensor([[1e-12, 0.5]])
      >>> net.bias.grad = torch.tensor([float("inf")])
      >>> report = mpfunc_torch.precision_report(net, loss_scale=1024.0)
      >>> report.nonfinite_names()
      ['bias']
      >>> row = report.rows()[0]
      >>> row["underflow_fraction"], row["zero_fraction"], round(row["headroom_bits"], 2)
      (0.5, 0.0, 7.0)
      >>> net = torch.nn.Linear(2, 1).to(torch.bfloat16)
      >>> _ = torch.nn.init.ones_(net.weight)
      >>> report = mpfunc_torch.precision_report(net, grads=[torch.ones(1, 2), None],
      ...     updates=[torch.tensor([[1e-4, 1e-2]]), None])   # 1e-4 < 2**-8: rounds away
      >>> report.rows()[0]["update_cancelled"]
      0.5
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"`model` must be a torch.nn.Module, got {type(model).__name__}.")
    fmt = _format(dtype)
    groups = normalize_groups(process_group)
    model = _unwrap(model)
    named = list(model.named_parameters())
    if not named:
        raise ValueError("`model` has no parameters.")
    chosen = [p.grad for _, p in named] if grads is None else \
        match_tensors(named, grads, "grads")
    keep = [i for i, g in enumerate(chosen) if g is not None]
    tensors = [g for g in chosen if g is not None]
    pairs = None
    if updates is not None:
        given = match_tensors(named, updates, "updates")
        pairs = [(named[i][1], given[i]) for i in keep]
    scale = _scale_tensor(loss_scale, named[0][1].device)
    return _report([named[i][0] for i in keep], [_dense(g) for g in tensors], tensors,
                   scale, fmt, groups, False, model, pairs)
