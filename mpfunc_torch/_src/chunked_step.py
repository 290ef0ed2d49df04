"""The master-weight step taken chunk by chunk (``convert_to_amp(..., step_chunks=k)``).

`AmpOptimizer.step` with ``step_chunks > 1`` and no `unscale_` before it:

1. `split_for_chunked_step_`: the pairs whose half grad is dense, and the owned params
   whose grads exist already (no half source; sparse grads made float32 at once).
2. `check_half_grads_`: the skip is decided from the half grads, before any float32
   master grad exists, exactly as the check of the float32 grads would decide it.
3. With ``clip_grad``, `norms_in_chunks`: the per-tensor norms of the unscaled float32
   master grads, made and freed chunk by chunk; the global norm is combined from them as
   `global_grad_norm` combines its own.
4. `step_in_chunks_`: for each chunk, half grads -> float32 master grads (each half grad
   freed once copied), unscaled, clipped, stepped by the inner optimizer, freed.

Only one chunk's float32 grads exist at a time: with Adam the step peaks at 16 + 4 / k
bytes/param instead of 18, and the result is bit for bit that of one step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from mpfunc_torch._src import fused
from mpfunc_torch._src.clipping import (
    Norms,
    ZeroCounts,
    clip_grads_with_norm_,
    global_grad_norm,
    grad_norms,
    grad_zero_counts,
)
from mpfunc_torch._src.distributed import all_reduce_found_inf_
from mpfunc_torch._src.grads import (
    check_,
    coalesce_sparse_,
    grads_of,
    inv_scale_or_none,
    unscale_checked_,
)
from mpfunc_torch._src.master_weights import sparse_grads_to_masters_
from mpfunc_torch._src.sharding import local

__all__ = [
    "PER_PARAM_OPTIMIZERS",
    "check_step_chunks",
    "chunks_of_size",
    "check_half_grads_",
    "split_for_chunked_step_",
    "norms_in_chunks",
    "check_for_chunks_",
    "clip_in_chunks_",
    "step_in_chunks_",
    "ChunkedStep",
    "prepare_chunked_step_",
    "visit_chunks_",
    "finish_chunked_step_",
]

Pairs = Sequence[tuple[torch.Tensor, torch.Tensor]]  # (model param, its master)


class ChunkedStep(NamedTuple):
    """What `prepare_chunked_step_` decided, for `step_in_chunks_`."""

    dense: list          # (model param, master) pairs whose half grad is dense
    ready: list          # owned params whose grads exist and are unscaled already
    chunks: list         # the dense pairs in about ``step_chunks`` chunks
    inv_scale: torch.Tensor | None
    clip: tuple[float, torch.Tensor] | None  # (max_norm, total norm) with clip_grad
    zeros: ZeroCounts | None  # with log_num_zeros_in_grad: filled by ``visit``
    visit: Callable[[list], None] | None  # counts the zeros of the grads it is shown


# torch.optim classes whose step updates each param from its own grad and state only, so
# that stepping disjoint subsets of the params (the others' grads set to None, which
# every one of them skips) gives bit for bit the result of one step over all of them.
PER_PARAM_OPTIMIZERS: tuple[type, ...] = tuple(
    getattr(torch.optim, name) for name in (
        "SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Rprop", "Adagrad",
        "Adadelta", "ASGD", "Adafactor", "Muon")
    if hasattr(torch.optim, name))


def chunks_of_size(pairs: Pairs, n_chunks: int) -> list[list]:
    """Packs ``pairs`` (largest first) into chunks of at most ``total / n_chunks``
    elements each (a larger tensor is a chunk of its own), first fit: about
    ``n_chunks`` chunks, a few more where the sizes do not pack."""
    total = sum(m.numel() for _, m in pairs)
    cap = -(-total // n_chunks)
    chunks: list[list] = []
    room: list[int] = []
    for pair in pairs:
        n = pair[1].numel()
        for i, r in enumerate(room):
            if n <= r:
                chunks[i].append(pair)
                room[i] -= n
                break
        else:
            chunks.append([pair])
            room.append(cap - n)
    return chunks


def check_half_grads_(grads: Sequence[torch.Tensor], found_inf: torch.Tensor,
                      inv_scale: torch.Tensor | None, smallest_scale: float) -> None:
    """Raises ``found_inf`` if any half gradient, copied to float32 and multiplied by
    ``inv_scale`` (None: 1), would be inf/NaN: exactly the check `step` makes on the
    float32 master grads, without making them.

    One fused check pass over the half grads finds their infs/NaNs. Unscaling can only
    overflow where ``1 / smallest_scale`` (the smallest scale the scaler can reach, a
    host number) times the dtype's largest value passes float32's: float16 grads never
    do unless the scale can fall below ~2e-34, bfloat16 ones whenever it can fall below
    1. Only then is the largest magnitude of each such grad read too (``aminmax``;
    rounding is monotonic, so it overflows when any element does).
    """
    dense = [local(g) for g in grads]
    dense = [torch.view_as_real(g) if g.is_complex() else g for g in dense]
    check_(dense, found_inf)
    if inv_scale is None:
        return
    top = torch.finfo(torch.float32).max
    risky = [g for g in dense if g.numel() and (
        smallest_scale <= 0 or torch.finfo(g.dtype).max / smallest_scale >= top / 2)]
    for g in risky:
        lo, hi = torch.aminmax(g)
        peak = torch.maximum(-lo, hi).float() * inv_scale.to(g.device)
        bad = (~torch.isfinite(peak)).float().to(found_inf.device)
        torch.maximum(found_inf, bad, out=found_inf)


def split_for_chunked_step_(pairs: Pairs, owned: Sequence[torch.Tensor]
                            ) -> tuple[list, list[torch.Tensor]]:
    """Before `step_in_chunks_`: returns the pairs whose half grad is dense (to copy
    chunk by chunk) and the owned params that have a grad already (params without a
    half source, and masters of sparse half grads, `sparse_grads_to_masters_`)."""
    dense = sparse_grads_to_masters_(pairs)
    for _, m in dense:
        m.grad = None
    return dense, [q for q in owned if q.grad is not None]


def _make_master_grads_(chunk: Pairs, inv_scale: torch.Tensor | None,
                        found_inf: torch.Tensor) -> None:
    """The chunk's half grads -> float32 master grads, unscaled (the same kernel as the
    unchunked step's); the half grads stay."""
    for _, m in chunk:
        m.grad = torch.empty_like(m)
    if chunk:
        # (every pair here has a dense half grad: `sparse_grads_to_masters_`)
        torch._foreach_copy_(grads_of([m for _, m in chunk]),  # pyright: ignore[reportPrivateImportUsage]  # torch's foreach kernel, as torch.optim uses it; not re-exported
                             grads_of([p for p, _ in chunk]))
    if inv_scale is not None and chunk:
        fused.unscale_and_check_(grads_of([m for _, m in chunk]), found_inf, inv_scale)


def visit_chunks_(chunks: Sequence[Pairs], inv_scale: torch.Tensor | None,
                  visit: Callable[[list], None],
                  clip: tuple[float, torch.Tensor] | None = None) -> None:
    """For each chunk: makes its float32 master grads (unscaled by ``inv_scale``, then
    clipped with ``clip``'s ``(max_norm, total_norm)``), calls ``visit(masters)``, and
    frees them. The half grads stay; nothing steps."""
    scratch = torch.zeros((), dtype=torch.float32,
                          device=inv_scale.device if inv_scale is not None else None)
    for chunk in chunks:
        _make_master_grads_(chunk, inv_scale, scratch)
        masters = [m for _, m in chunk]
        if clip is not None:
            clip_grads_with_norm_(masters, *clip)
        visit(masters)
        for m in masters:
            m.grad = None


def norms_in_chunks(chunks: Sequence[Pairs], index_of: dict[int, int],
                    inv_scale: torch.Tensor | None, norm_type: float) -> Norms:
    """The `grad_norms` of the unscaled float32 master grads, keyed by ``index_of[id(
    master)]``, each chunk's grads made and freed in turn (the half grads stay)."""
    out: Norms = {}
    visit_chunks_(chunks, inv_scale, lambda masters: out.update(
        grad_norms(masters, norm_type, [index_of[id(m)] for m in masters])))
    return out


def check_for_chunks_(pairs: Pairs, owned: Sequence[torch.Tensor], scaler: Any,
                      inv_scale: torch.Tensor | None,
                      found_inf: torch.Tensor) -> tuple[list, list]:
    """`AmpOptimizer.unscale_`'s check for the chunked step, made on the half grads
    without copying them (`check_half_grads_`); the grads that exist already (no half
    source) are unscaled by ``inv_scale`` (``scaler``'s; None: not scaled) and checked
    here. ``found_inf`` is raised, not reduced across ranks. Returns `split_for_chunked_step_`'s (dense pairs, ready params)."""
    dense, ready = split_for_chunked_step_(pairs, owned)
    coalesce_sparse_(ready)
    unscale_checked_(grads_of(ready), found_inf, inv_scale, scaler.may_go_below_one)
    check_half_grads_([p.grad for p, _ in dense], found_inf, inv_scale,
                      scaler.smallest_scale)
    return dense, ready


def clip_in_chunks_(chunks: Sequence[Pairs], ready: Sequence[torch.Tensor],
                    owned: Sequence[torch.Tensor], sources: Sequence[torch.Tensor],
                    groups: tuple, inv_scale: torch.Tensor | None,
                    max_norm: float) -> torch.Tensor:
    """``clip_grad`` for the chunked step: the global 2-norm of the unscaled float32
    grads of ``owned``, from per-tensor norms taken chunk by chunk (`norms_in_chunks`)
    and combined as `global_grad_norm` combines its own (over ``groups`` and the DTensor
    meshes; ``sources`` carry the `mark_replicated` marks). Clips the ``ready`` grads
    now; `step_in_chunks_` clips each chunk. Returns the total norm."""
    index_of = {id(q): i for i, q in enumerate(owned)}
    norms = grad_norms(ready, 2.0, [index_of[id(q)] for q in ready])
    norms.update(norms_in_chunks(chunks, index_of, inv_scale, 2.0))
    total = global_grad_norm(owned, 2.0, process_group=groups, mark_sources=sources,
                             norms=norms)
    clip_grads_with_norm_(ready, max_norm, total)
    return total


def step_in_chunks_(chunks: Sequence[Pairs], ready: Sequence[torch.Tensor],
                    inv_scale: torch.Tensor | None, found_inf: torch.Tensor,
                    step: Any, clip: tuple[float, torch.Tensor] | None = None,
                    visit: Callable[[list], None] | None = None) -> None:
    """Steps the masters chunk by chunk: for each chunk, its half grads -> float32 master
    grads (each half grad freed once copied), unscaled by ``inv_scale`` (None: not
    scaled); then ``step()`` (the inner optimizer, which skips every param whose grad is
    None); then those master grads are freed. ``ready`` (owned params whose grads exist
    and are unscaled already, see `split_for_chunked_step_`) step with the first chunk.

    ``visit(masters)``, if given, sees each chunk's grads once clipped, before the step.
    Only one chunk's float32 grads exist at a time. The caller has checked every grad
    (`check_half_grads_`) before: the step must not start unless all are finite, or
    ``step`` must skip on ``found_inf`` itself (a fused optimizer, on the device).
    """
    held = [q.grad for q in ready]
    for q in ready:
        q.grad = None
    for i, chunk in enumerate(chunks or [[]]):
        _make_master_grads_(chunk, inv_scale, found_inf)
        for p, _ in chunk:
            p.grad = None
        if clip is not None:
            clip_grads_with_norm_([m for _, m in chunk], *clip)
        if visit is not None:
            visit([m for _, m in chunk])
        for q, g in zip(ready, held):
            q.grad = g if i == 0 else None
        step()
        for _, m in chunk:
            m.grad = None
    for q, g in zip(ready, held):
        q.grad = g


def prepare_chunked_step_(pairs: Pairs, owned: Sequence[torch.Tensor],
                          sources: Sequence[torch.Tensor], scaler: Any,
                          found_inf: torch.Tensor, groups: tuple, clip_groups: tuple,
                          step_chunks: int, clip_grad: float | None,
                          count_zeros: bool = False) -> ChunkedStep:
    """Everything the chunked step settles before any chunk steps: the check
    (`check_for_chunks_`, ``found_inf`` zeroed first and reduced over ``groups``), the
    chunks, and with ``clip_grad`` the global norm (`clip_in_chunks_`, over
    ``clip_groups``). The scale's reciprocal is taken once, for the whole step. With
    ``count_zeros`` the ``ready`` grads' zeros are counted now and ``visit`` counts
    each chunk's (after clipping, as the unchunked step counts them)."""
    found_inf.zero_()
    inv = inv_scale_or_none(scaler)
    dense, ready = check_for_chunks_(pairs, owned, scaler, inv, found_inf)
    all_reduce_found_inf_(found_inf, groups)
    chunks = chunks_of_size(dense, step_chunks)
    clip = None
    if clip_grad:
        clip = float(clip_grad), clip_in_chunks_(chunks, ready, owned, sources, clip_groups,
                                                 inv, float(clip_grad))
    zeros, visit = None, None
    if count_zeros:
        zeros, index_of = {}, {id(q): i for i, q in enumerate(owned)}

        def count(tensors: list) -> None:
            zeros.update(grad_zero_counts(tensors, [index_of[id(t)] for t in tensors]))

        visit = count
        visit(ready)
    return ChunkedStep(dense, ready, chunks, inv, clip, zeros, visit)


def finish_chunked_step_(cs: ChunkedStep, found_inf: torch.Tensor, step: Any,
                         take: bool) -> None:
    """After `prepare_chunked_step_`: steps chunk by chunk (`step_in_chunks_`) if
    ``take``, else (a skip decided on the host) frees the half grads, counting their
    zeros first where ``cs.visit`` asks, as a skipped unchunked step counts them."""
    if take:
        step_in_chunks_(cs.chunks, cs.ready, cs.inv_scale, found_inf, step, cs.clip, cs.visit)
        return
    if cs.visit is not None:
        visit_chunks_(cs.chunks, cs.inv_scale, cs.visit, cs.clip)
    for p, _ in cs.dense:
        p.grad = None


def check_step_chunks(step_chunks: Any, plan: Any, optimizers: list, masters: Any) -> None:
    """``convert_to_amp``'s check of ``step_chunks`` against the mode and optimizers."""
    if isinstance(step_chunks, bool) or not isinstance(step_chunks, int):
        raise TypeError(f"`step_chunks` must be an int >= 1, got "
                        f"{type(step_chunks).__name__} {step_chunks!r}.")
    if step_chunks < 1:
        raise ValueError(f"`step_chunks` must be >= 1, got {step_chunks}.")
    if step_chunks == 1:
        return
    where = f"`step_chunks={step_chunks}`"
    if not masters:
        raise ValueError(f"{where} chunks the float32 master grads, but {plan.describe()} "
                         "keeps no master weights; it applies to mode='naive' and apex O2.")
    if plan.num_losses > 1:
        raise ValueError(f"{where} cannot be combined with `num_losses`, which needs every "
                         "unscaled float32 master grad at once; leave one of them out.")
    for opt in optimizers:
        if type(opt) not in PER_PARAM_OPTIMIZERS:
            names = ", ".join(c.__name__ for c in PER_PARAM_OPTIMIZERS)
            raise ValueError(f"{where} steps the optimizer once per chunk, which gives "
                             "one step's result only for an optimizer that updates each "
                             f"param from its own state ({names}); got "
                             f"{type(opt).__module__}.{type(opt).__name__}.")
