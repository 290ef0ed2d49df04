"""An `AmpOptimizer`'s params and optimizer state below float32: the step and checkpoints.

`use_low_precision` switches a freshly converted `AmpOptimizer` (bfloat16 params with
float32 masters, before its first step) to a `MasterStorage` (``"remainder"``,
``"kahan"``, ``"stochastic"``) and/or a `StateDtype`. `LowPrecision` is what it keeps:

* **The step.** `wrap` turns the inner optimizer's step into: build the float32 masters
  and state of the params that have a gradient (one chunk's, with ``step_chunks > 1``),
  step, write them back (rounded as configured, random bits of step number `step`),
  free them. A step that fails inside puts the stored state back and writes nothing.
  With ``torch.optim.Adam``/``AdamW(fused=True)`` the same step runs chunk by chunk
  through torch's fused kernel instead (`mpfunc_torch._src.storage_kernels`), bit for
  bit, with a few chunks of float32 temporaries.
* **Exact skips.** The skip is decided on the host before any of that (one read of the
  overflow flag, as for any non-fused optimizer), so a skipped step touches no param,
  remainder, compensation, state or counter; `advance` counts taken steps only.
* **Checkpoints.** `state_dict` holds the storage, seed and step count, the bfloat16
  params (so that the optimizer checkpoint rebuilds the masters whichever of the model
  and optimizer checkpoints loads first, as float32 masters do) and the remainders or
  compensations; the state's stored tensors are in the inner optimizer's state_dict.
  `check` validates all of it before `load` writes anything. A `convert_checkpoint`
  result holds `FROM_MODEL` in place of the params and remainders: the float32 model
  checkpoint converted with it sets them (`MasterStorage.follow_load_`); one from the
  ``torch.distributed.checkpoint`` helpers holds it in place of the params only (the
  model part holds them) and the remainders or compensations beside.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from _mpfunc_common.storage import STATE_BLOCK
from mpfunc_torch._src.master_storage import MasterStorage, check_storage, raw
from mpfunc_torch._src.master_weights import FROM_MODEL, has_stepped, non_finite_names
from mpfunc_torch._src.optimizer_parts import AmpOptimizerParts
from mpfunc_torch._src.sharding import local
from mpfunc_torch._src.state_dtype import StateDtype
from mpfunc_torch._src.storage_kernels import StorageKernels

__all__ = ["LowPrecision", "use_low_precision", "low_precision_of", "persistent_bytes"]

_KEYS = ("storage", "seed", "step", "params", "extra")


def low_precision_of(opt: Any) -> LowPrecision | None:
    """The `LowPrecision` of an `AmpOptimizer`, or None (float32 masters and state)."""
    return getattr(opt, "_lowp", None)


def _check_seed(seed: Any) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
        raise ValueError(f"`seed` must be an int in [0, 2**32), got {seed!r}.")
    return seed


class LowPrecision:
    """The storage and state dtype of one `AmpOptimizer`, with the seed and step count."""

    def __init__(self, optimizer: torch.optim.Optimizer, storage: MasterStorage | None,
                 state: StateDtype | None, seed: int):
        self.optimizer, self.storage, self.state = optimizer, storage, state
        self.seed, self.step = seed, 0
        # The fused Adam path (mpfunc_torch._src.storage_kernels), where it applies; None
        # always takes the generic one. `kernel_path`: whether the last step took it.
        self.kernels: StorageKernels | None = StorageKernels(optimizer, storage, state)
        self.kernel_path = False

    @property
    def kind(self) -> str:
        return self.storage.kind if self.storage is not None else "float32"

    def wrap(self, inner: Callable[[], Any]) -> Callable[[], None]:
        """``inner`` (the inner optimizer's step, or a chunk of it) between building and
        writing back the float32 masters and state of the params that have a grad."""
        return lambda: self._around(inner, write_back=True)

    def make_state_(self, inner: Callable[[], Any]) -> None:
        """Runs ``inner`` (a step of the inner optimizer with lr 0, to create its state)
        on the float32 masters and state, then stores the state and frees the masters
        without writing them back: no param, remainder or compensation changes (a Kahan
        write-back of a zero update may move a param by an ulp and its compensation the
        other way)."""
        self._around(inner, write_back=False)

    def _around(self, inner: Callable[[], Any], write_back: bool) -> None:
        qs = [q for g in self.optimizer.param_groups for q in g["params"]
              if q.grad is not None]
        self.kernel_path = bool(write_back and self.kernels is not None
                                and self.kernels.ready(qs))
        if self.kernel_path and self.kernels is not None:
            self.kernels.step_(inner, qs, self.step)
            return
        idx = self.storage.positions(qs) if self.storage is not None else []
        if self.storage is not None:
            self.storage.begin_(idx)
        saved = self.state.begin_(qs) if self.state is not None else []
        try:
            inner()
        except BaseException:
            if self.storage is not None:
                self.storage.abort_(idx)
            StateDtype.abort_(saved)
            raise
        if self.state is not None:
            self.state.end_(qs, self.step, saved)
        if self.storage is not None:
            if write_back:
                self.storage.end_(idx, self.step)
            else:
                self.storage.abort_(idx)

    def advance(self) -> None:
        """One more step taken (the next one draws the random bits of the next step)."""
        self.step += 1

    # -- checkpoints ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        s = self.storage
        return {
            "storage": self.kind, "seed": self.seed, "step": self.step,
            "params": None if s is None else [p.detach().clone() for p, _ in s.pairs],
            "extra": None if s is None else [None if e is None else e.detach().clone()
                                             for e in s.extra],
        }

    def check(self, saved: Any, where: str) -> dict[str, Any]:
        """Every check of `load`, changing nothing; returns what to load."""
        if not isinstance(saved, dict) or any(k not in saved for k in _KEYS):
            raise ValueError(f"`{where}` must be a dict with keys {list(_KEYS)} (this "
                             f"optimizer stores its masters as {self.kind!r}), got "
                             f"{saved if not isinstance(saved, dict) else sorted(saved)!r}.")
        if saved["storage"] != self.kind:
            raise ValueError(f"`{where}['storage']` is {saved['storage']!r}; this optimizer "
                             f"stores its masters as {self.kind!r}. Convert the checkpoint "
                             "(convert_checkpoint) or resume with the same master_weights.")
        try:
            _check_seed(saved["seed"])
        except ValueError:
            raise ValueError(f"`{where}['seed']` must be an int in [0, 2**32), got "
                             f"{saved['seed']!r}.") from None
        step = saved["step"]
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"`{where}['step']` must be an int >= 0, got {step!r}.")
        s = self.storage
        from_model = _from_model(saved["params"])
        if s is None or (from_model and saved["extra"] is None):
            return dict(saved)  # (a converted checkpoint's: the model's load sets them)
        params, extra = saved["params"], saved["extra"]
        for key, got, want in (("params", params, [p for p, _ in s.pairs]),
                               ("extra", extra, s.extra)):
            if key == "params" and from_model:
                continue  # (torch.distributed.checkpoint's: the model part holds them)
            if not isinstance(got, list | tuple) or len(got) != len(want):
                n = len(got) if isinstance(got, list | tuple) else type(got).__name__
                raise ValueError(f"`{where}[{key!r}]` must list {len(want)} tensors, got {n}.")
            for i, (t, w) in enumerate(zip(got, want)):
                if w is None and t is None:
                    continue
                if not isinstance(t, torch.Tensor) or w is None or (t.dtype, t.shape) != (
                        w.dtype, w.shape):
                    what = "None" if w is None else f"{w.dtype} of shape {tuple(w.shape)}"
                    found = (f"{t.dtype} of shape {tuple(t.shape)}"
                             if isinstance(t, torch.Tensor) else type(t).__name__)
                    raise ValueError(f"`{where}[{key!r}][{i}]` must be {what}, got {found}.")
        floats = [] if from_model else [(f"{where}['params'][{i}]", t)
                                         for i, t in enumerate(params)]
        if s.kind == "kahan":
            floats += [(f"{where}['extra'][{i}]", t) for i, t in enumerate(extra)]
        bad = non_finite_names(floats)
        if bad:
            raise ValueError(f"`{bad[0]}` holds inf/NaN values; a param and its "
                             "compensation must be finite.")
        return dict(saved)

    @torch.no_grad()
    def load(self, checked: dict[str, Any]) -> None:
        """Writes what `check` returned: params, remainders/compensation, seed, step."""
        self.seed, self.step = checked["seed"], checked["step"]
        for part in (self.storage, self.state):  # the run's seed is the checkpoint's
            if part is not None:
                part.seed = self.seed
        s = self.storage
        from_model = _from_model(checked["params"])
        if s is None or (from_model and checked["extra"] is None):
            return
        params = [None] * len(s.pairs) if from_model else checked["params"]
        for (p, _), e, sp, se in zip(s.pairs, s.extra, params, checked["extra"]):
            if sp is not None:
                raw(p).copy_(local(sp))
            if e is not None:
                raw(e).copy_(local(se))

    def after_inner_load_(self) -> None:
        """After the inner optimizer's ``load_state_dict``: its state back in the stored
        dtypes (`StateDtype.after_load_`)."""
        if self.state is not None:
            self.state.after_load_([q for g in self.optimizer.param_groups
                                    for q in g["params"]])


def _from_model(params: Any) -> bool:
    return isinstance(params, str) and params == FROM_MODEL


def persistent_bytes(opt: AmpOptimizerParts, model: torch.nn.Module | None = None) -> int:
    """Bytes held between steps by ``opt`` and the params it trains, counted from the
    buffers themselves (each storage once, this rank's shards): the model's params (all
    of ``model``'s if given), masters or placeholders, remainders or compensations,
    every tensor in the optimizer state (moments, step counts, block scales), and the
    seed and step counter (8 bytes each, kept on the host)."""
    tensors: list[torch.Tensor] = list(model.parameters()) if model is not None else []
    tensors += [t for pair in opt._pairs for t in pair] + list(opt._owned)
    lowp = low_precision_of(opt)
    if lowp is not None and lowp.storage is not None:
        tensors += [e for e in lowp.storage.extra if e is not None]
    for st in opt.optimizer.state.values():
        tensors += [v for v in st.values() if isinstance(v, torch.Tensor)]
    seen: dict[tuple, int] = {}
    for t in tensors:
        s = raw(t).untyped_storage()
        seen[(s.device.type, s.data_ptr(), s.nbytes())] = s.nbytes()
    return sum(v for (_, ptr, _), v in seen.items() if ptr) + (16 if lowp else 0)


def use_low_precision(opt: AmpOptimizerParts, master_weights: str = "remainder",
                      state_dtype: Any = None, rounding: str = "nearest", *,
                      seed: int = 0, block: int = STATE_BLOCK) -> LowPrecision:
    """Switches ``opt`` (an `AmpOptimizer` with bfloat16 params and float32 masters, or
    any `AmpOptimizer` for ``master_weights="float32"``, before its first step) to
    storing its masters as ``master_weights`` and its optimizer state in
    ``state_dtype`` (None: as the inner optimizer makes it).

    Args:
      opt: the converted optimizer.
      master_weights: ``"float32"`` (keep the masters), ``"remainder"``, ``"kahan"`` or
        ``"stochastic"`` (see `mpfunc_torch._src.master_storage`).
      state_dtype: None, a dtype name for every floating state tensor, or a mapping
        from state key to dtype name (see `StateDtype`).
      rounding: how the state is rounded to its dtype: ``"nearest"`` or
        ``"stochastic"`` (bfloat16 and 8-bit state).
      seed: the seed of every random bit (params: stream 0; state: 1, 2, ...).
      block: elements per scale of 8-bit state (`STATE_BLOCK`, 128, as JAX and
        `convert_checkpoint` use).

    Returns:
      The `LowPrecision` now in ``opt``.
    """
    check_storage(master_weights)
    _check_seed(seed)
    if low_precision_of(opt) is not None:
        raise ValueError("`opt` already stores its masters below float32 (use_low_precision "
                         "was called on it before).")
    if has_stepped(opt.optimizer):
        raise ValueError("`opt` has already stepped: switch the storage of a fresh "
                         "optimizer (its float32 state would otherwise be rounded).")
    state = None  # validated (and nothing changed) before the storage moves anything
    if state_dtype is not None:
        state = StateDtype(opt.optimizer, state_dtype, rounding, seed=seed, block=block)
    storage = None
    if master_weights != "float32":
        if not opt._pairs:
            raise ValueError(f"master_weights={master_weights!r} stores bfloat16 params "
                             "without float32 masters, but this optimizer has no half "
                             f"params with masters ({opt.plan.describe()}).")
        storage = MasterStorage(master_weights, opt._pairs, seed=seed)
        storage.swap_into_(opt.optimizer)
        opt._pairs = storage.pairs
        opt._index_params()
    opt._lowp = LowPrecision(opt.optimizer, storage, state, seed)
    opt._kernel_unscales = False  # the kernel may not skip: the write-back must too
    return opt._lowp
