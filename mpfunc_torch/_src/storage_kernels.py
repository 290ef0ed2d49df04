"""torch's fused Adam kernel stepping stored params and state, one chunk at a time.

The fast path of `LowPrecision`'s step (`mpfunc_torch._src.low_precision`) for an inner
``torch.optim.Adam`` or ``AdamW`` with ``fused=True``. The generic path builds the
float32 master and state of every param that has a gradient (16 bytes per param of
float32 temporaries with Adam, each made, read and written a few times over, and on CPU
page-faulted in again every step), runs the inner step on them and writes them back.
This path runs the inner optimizer's own ``step`` (its step counts, learning rate,
checks and LR-scheduler bookkeeping) and takes over its one kernel call
(torch's fused Adam kernel, `fused.ADAM_KERNELS`, seen through a dispatch mode): for each
param it builds the float32 master and state of one chunk of `chunk_elements` elements
in a small workspace, calls that same kernel with the same arguments on the chunk, and
writes the chunk back, rounded as the generic path rounds it, while it is still in
cache. Float32 params and state (float32 masters, float32 moments) are stepped in
place. The float32 temporaries are then a few chunks, whatever the model's
size.

The result is the generic path's bit for bit: the kernel is elementwise, a chunk
boundary falls at a multiple of `ALIGN` (2**16) elements, where the kernel's own
vector and thread blocks start (CPU) and its multi-tensor blocks do (CUDA), and a
chunk's random bits are those of its elements' positions in the whole tensor (tested
against the generic path: tests/test_torch_storage_kernels.py).

It applies (`takes_over`) when the inner optimizer is exactly ``torch.optim.Adam`` or
``AdamW``, every group has ``fused=True`` and neither ``capturable`` nor
``differentiable``, no step hook is registered (a hook may read the params, which here
have no float32 value), its ``step`` is its own (or an LR scheduler's wrapper of it),
and each param to step has a dense float32 gradient, its state made (the first step,
which makes it from the param, takes the generic path) and in float32, bfloat16 or
float16 (8-bit state takes the generic path), and a contiguous run of the whole tensor's
positions (a DTensor sharded along its first dimension, or none). Where the installed
torch refuses state of another dtype than its params before the kernel (2.11 does:
`fused.fused_adam_takes_state_of_another_dtype`), 16-bit state tensors are float32
stand-ins during the step, and a DTensor's 16-bit state takes the generic path.
`LowPrecision.kernel_path` says which path the last step took.

An exception inside the kernel call (none is expected once the checks pass: they all
run before the first chunk is written) leaves the chunks before it stepped, as
``step_chunks`` leaves the chunks of params before it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mpfunc_torch._src import fused
from mpfunc_torch._src.master_storage import MasterStorage, raw
from mpfunc_torch._src.rounding import (
    element_index,
    foreach_join_remainder_,
    foreach_kahan_step_,
    foreach_split_remainder_,
    random_bits,
    stochastic_round_,
)
from mpfunc_torch._src.sharding import is_dtensor, local
from mpfunc_torch._src.state_dtype import StateDtype

__all__ = ["ALIGN", "StorageKernels", "chunk_elements", "takes_over"]

ALIGN = 1 << 16
_STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")  # the kernel's lists, in order
_F32 = torch.float32
_SMALL = (torch.bfloat16, torch.float16)  # stored state widened chunk by chunk


def chunk_elements(device: torch.device) -> int:
    """Elements per chunk (a multiple of `ALIGN`): a CPU chunk's float32 buffers (1 MiB
    each) stay in cache; a GPU's are larger, to keep its kernels few."""
    return 1 << 18 if device.type == "cpu" else 1 << 22


def takes_over(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `StorageKernels` can step ``optimizer`` (the checks that do not depend on
    the params: see the module)."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return False
    if fused.has_step_hooks(optimizer):
        return False
    own = vars(optimizer).get("step")  # an instance attribute: a wrapper of step
    if own is not None and not getattr(own, "_wrapped_by_lr_sched", False):
        return False
    return all(g.get("fused") and not g.get("capturable") and not g.get("differentiable")
               for g in optimizer.param_groups)


def _run_start(t: torch.Tensor) -> int | None:
    """The position in the whole tensor of the first element of this rank's shard of
    ``t`` where its elements are one run of positions in order, else None."""
    index = element_index(t) if is_dtensor(t) else 0
    return index if isinstance(index, int) else None


class StorageKernels:
    """The kernel path of one `LowPrecision` (see the module).

    Args:
      optimizer: the inner ``torch.optim.Adam``/``AdamW``.
      storage: the params' `MasterStorage`, or None (float32 masters).
      state: the optimizer state's `StateDtype`, or None (as the optimizer makes it).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, storage: MasterStorage | None,
                 state: StateDtype | None):
        self.optimizer, self.storage, self.state = optimizer, storage, state
        self._stand_ins: dict[int, torch.Tensor] = {}  # during a step, see step_
        self._at = {} if storage is None else {id(w): i for i, (_, w) in
                                               enumerate(storage.pairs)}

    def ready(self, params: Sequence[torch.Tensor]) -> bool:
        """Whether this step of ``params`` (those with a gradient) can take the path."""
        if not takes_over(self.optimizer):
            return False
        for q in params:
            g = q.grad
            if g is None or g.layout != torch.strided or g.dtype != _F32 or q.dtype != _F32:
                return False
            if not local(g).is_contiguous() or local(g).numel() != local(q).numel():
                return False
            if _run_start(q) is None:
                return False
            if id(q) not in self._at and not local(q).is_contiguous():
                return False
            st = self.optimizer.state.get(q)
            if not st or not isinstance(st.get("step"), torch.Tensor):
                return False  # a first step makes the state (from the param): generic
            for key, value in st.items():
                if key == "step":
                    continue
                if key not in _STATE_KEYS or not isinstance(value, torch.Tensor):
                    return False
                if value.dtype not in (_F32, *_SMALL) or not local(value).is_contiguous():
                    return False
                if (value.dtype != _F32 and is_dtensor(value)
                        and not fused.fused_adam_takes_state_of_another_dtype()):
                    return False  # (no float32 stand-in is made for a DTensor: see step_)
                if _run_start(value) is None:
                    return False
        return True

    def step_(self, inner: Any, params: Sequence[torch.Tensor], step: int) -> None:
        """Runs ``inner`` (the inner optimizer's step) with its fused kernel taken over
        for ``params``; ``step``: the step number of the random bits."""
        # Where torch refuses state of another dtype than its params before the kernel
        # (2.11), the 16-bit state tensors are float32 stand-ins for the step (4 bytes
        # each, like the params' placeholders); the kernel call maps them back.
        swapped: list[tuple[dict, str, torch.Tensor]] = []
        self._stand_ins = {}
        if not fused.fused_adam_takes_state_of_another_dtype():
            for q in params:
                st = self.optimizer.state[q]
                for key in _STATE_KEYS:
                    t = st.get(key)
                    if isinstance(t, torch.Tensor) and t.dtype != _F32:
                        stand_in = torch.full((1,), float("nan"), device=t.device).expand(t.shape)
                        self._stand_ins[id(stand_in)] = t
                        swapped.append((st, key, t))
                        st[key] = stand_in
        mode = _TakeOver(self, {id(q) for q in params} | set(self._stand_ins), step)
        try:
            with mode:
                inner()
        finally:
            for st, key, t in swapped:
                st[key] = t
            self._stand_ins = {}
        if mode.done != len(params):
            raise RuntimeError(f"the fused Adam step reached {mode.done} of {len(params)} "
                               "params with a gradient, so the others' stored values were "
                               "not stepped: the inner optimizer did not call torch's fused "
                               "Adam kernel for them. Please report this as a bug.")

    # -- one param ----------------------------------------------------------------------
    def _plan(self, q: torch.Tensor, grad: torch.Tensor, states: Sequence[torch.Tensor],
              step: int) -> dict[str, Any]:
        """Everything the chunk loop of ``q`` needs, checked before anything is written."""
        n = local(q).numel()
        plan: dict[str, Any] = {"n": n, "grad": local(grad).reshape(-1), "step": step}
        i = self._at.get(id(q))
        if i is not None and self.storage is not None:  # (q: a placeholder, no storage)
            p, extra = self.storage.pairs[i][0], self.storage.extra[i]
            plan.update(kind=self.storage.kind, param=raw(p).reshape(-1),
                        extra=None if extra is None else raw(extra).reshape(-1),
                        start=_run_start(p), seed=self.storage.seed)
        else:
            plan.update(kind="float32", param=raw(q).view(-1))
        st = self.optimizer.state[q]
        streams = dict(self.state._keys(st)) if self.state is not None else {}
        plan["states"] = []
        for key, t in zip(_STATE_KEYS, states):
            flat = raw(t).reshape(-1)
            if flat.numel() != n:
                raise RuntimeError(f"state {key!r} has {flat.numel()} elements, its param {n}.")
            small = t.dtype in _SMALL
            stochastic = (small and self.state is not None and key in streams
                          and self.state.rounding == "stochastic")
            plan["states"].append((flat, small, stochastic, streams.get(key), _run_start(t)))
        return plan

    def kernel_(self, kernel: Any, args: tuple, kwargs: dict[str, Any],
                owned: set[int], step: int) -> int:
        """One call of torch's fused Adam kernel (one param group's), made chunk by chunk
        for the params in ``owned`` (the others: the call as it was). Returns how many
        were in ``owned``."""
        lists = [list(a) for a in args[:6]]
        params, grads, avgs, sqs, maxs, counts = lists
        amsgrad = bool(kwargs.get("amsgrad"))
        plans, rest = [], []
        for j, q in enumerate(params):
            if id(q) not in owned:
                rest.append(j)
                continue
            given: list[torch.Tensor] = [avgs[j], sqs[j]] + ([maxs[j]] if amsgrad else [])
            states = [self._stand_ins.get(id(t), t) for t in given]
            plans.append((self._plan(q, grads[j], states, step), counts[j]))
        if rest:  # params outside this step's set: stepped as torch would
            kernel(*[[a[j] for j in rest] if a else [] for a in lists], **kwargs)
        by_device: dict[torch.device, list] = {}
        for plan, count in plans:
            by_device.setdefault(plan["param"].device, []).append((plan, count))
        for device, group in by_device.items():
            # A workspace per device: a chunk's elements (a param smaller than a chunk
            # is one of its own) for the masters built and each 16-bit state widened.
            size = max(1, min(chunk_elements(device), max(plan["n"] for plan, _ in group)))
            need = {0} if any(plan["kind"] != "float32" for plan, _ in group) else set()
            if any(plan["kind"] == "remainder" for plan, _ in group):
                need.add(-1)  # the remainders widened to int32
            need |= {1 + k for plan, _ in group
                     for k, (_, small, *_) in enumerate(plan["states"]) if small}
            bufs = {k: torch.empty(size, dtype=torch.int32 if k < 0 else _F32, device=device)
                    for k in need if k >= 0 or 1 not in need}
            if -1 in need and 1 in need:  # used (for the join) before any state is widened
                bufs[-1] = bufs[1].view(torch.int32)
            for chunk in _packed(group, size):
                self._chunk_(kernel, chunk, kwargs, bufs)
        return len(plans)

    def _chunk_(self, kernel: Any, chunk: list, kwargs: dict[str, Any],
                bufs: dict[int, torch.Tensor]) -> None:
        """The kernel over one chunk: ``(plan, count, start, end)`` segments of params
        that fit a workspace buffer together; their float32 masters are built in
        ``bufs[0]`` (remainders widened in ``bufs[-1]``, int32) and their ``k``-th
        16-bit states widened in ``bufs[1 + k]``."""
        works, states, joins, stored = [], [[] for _ in _STATE_KEYS], [], []
        offset = 0
        for plan, _, s, e in chunk:
            p = plan["param"]
            if plan["kind"] == "float32":
                works.append(p[s:e])
            else:
                works.append(bufs[0][offset:offset + e - s])
                joins.append((plan, s, e, works[-1]))
            for k, (flat, small, stochastic, stream, start) in enumerate(plan["states"]):
                if small:
                    states[k].append(bufs[1 + k][offset:offset + e - s])
                    stored.append((flat[s:e], states[k][-1], stochastic, stream,
                                   start + s, plan["step"]))
                else:
                    states[k].append(flat[s:e])
            offset += e - s
        kind = self.storage.kind if self.storage is not None else "float32"
        his = [plan["param"][s:e] for plan, s, e, _ in joins]
        extras = [plan["extra"][s:e] for plan, s, e, _ in joins if plan.get("extra") is not None]
        ws = [w for *_, w in joins]
        if kind == "remainder":
            foreach_join_remainder_(ws, his, extras, bufs[-1])
        elif ws:  # kahan and stochastic step the param itself
            torch._foreach_copy_(ws, his)  # pyright: ignore[reportPrivateImportUsage]  # torch's foreach kernel, as torch.optim uses it; not re-exported
        if stored:  # 16-bit state widened, exactly
            torch._foreach_copy_([v for _, v, *_ in stored], [x for x, *_ in stored])  # pyright: ignore[reportPrivateImportUsage]  # as above
        kernel(works, [plan["grad"][s:e] for plan, _, s, e in chunk], states[0], states[1],
               states[2], [count for _, count, _, _ in chunk], **kwargs)
        near = [(x, v) for x, v, stochastic, *_ in stored if not stochastic]
        if near:  # rounded to nearest: torch's cast, as StateDtype.end_ rounds
            torch._foreach_copy_([x for x, _ in near], [v for _, v in near])  # pyright: ignore[reportPrivateImportUsage]  # as above
        seed = self.state.seed if self.state is not None else 0
        for x, v, stochastic, stream, start, step in stored:
            if stochastic:
                stochastic_round_(x, v, random_bits(seed, stream, step, start, v.numel(),
                                                    v.device))
        if kind == "remainder":
            foreach_split_remainder_(ws, his, extras)
        elif kind == "kahan":
            foreach_kahan_step_(his, extras, ws)
        elif kind == "stochastic":
            for (plan, s, _, w), hi in zip(joins, his):
                stochastic_round_(hi, w, random_bits(plan["seed"], 0, plan["step"],
                                                     plan["start"] + s, w.numel(), w.device))


def _packed(group: list, size: int) -> list[list]:
    """``(plan, count)`` pairs cut into segments of at most ``size`` elements (at
    multiples of ``size`` in each param) and packed, in order, into chunks of at most
    ``size`` elements together: ``[(plan, count, start, end), ...]`` each."""
    chunks: list[list] = [[]]
    room = size
    for plan, count in group:
        for s in range(0, plan["n"], size):
            e = min(plan["n"], s + size)
            if e - s > room:
                chunks.append([])
                room = size
            chunks[-1].append((plan, count, s, e))
            room -= e - s
    return [c for c in chunks if c]


class _TakeOver(fused.DispatchMode):
    """While entered: torch's fused Adam kernel runs through `StorageKernels.kernel_`,
    and any other op on a param being stepped is an error (it has no float32 value)."""

    def __init__(self, kernels: StorageKernels, owned: set[int], step: int):
        super().__init__()
        self.kernels, self.owned, self.step, self.done = kernels, owned, step, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in fused.ADAM_KERNELS:
            self.done += self.kernels.kernel_(func, args, kwargs, self.owned, self.step)
            return None
        for a in args:
            items = a if isinstance(a, list | tuple) else (a,)
            if any(isinstance(t, torch.Tensor) and id(t) in self.owned for t in items):
                raise RuntimeError(
                    f"{func} was called inside the optimizer's step on a param whose "
                    "float32 value is built a chunk at a time inside torch's fused Adam "
                    "kernel only (a bfloat16 param stored without float32 masters); "
                    "please report this as a bug.")
        return func(*args, **kwargs)
