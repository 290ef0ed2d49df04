"""`AmpOptimizer`: loss scaling, exact skips, master weights and the inf-check reduction
around a torch optimizer."""

from __future__ import annotations

from typing import Any

import torch

from _mpfunc_common.amp_config import AmpPlan
from mpfunc_torch._src import fused
from mpfunc_torch._src.distributed import all_reduce_found_inf_
from mpfunc_torch._src.loss_scale import LossScaler, SharedScale
from mpfunc_torch._src.master_weights import (
    copy_grads_to_masters_,
    copy_masters_to_model_,
    release_master_grads_,
)

__all__ = ["AmpOptimizer"]

_READY, _BACKWARD, _UNSCALED = "ready", "backward", "unscaled"


def _mark_step_called(optimizer: torch.optim.Optimizer) -> None:
    """A skipped step is still this iteration's optimizer step. torch's LR schedulers
    wrap the inner optimizer's ``step`` to check, at their first ``step()``, that the
    optimizer stepped first; a skipped step never reaches the inner ``step``, so record
    the call as that wrapper does. Otherwise a correctly ordered loop whose first steps
    overflow (naive starts at 2**32) gets a call-order warning (GradScaler users do)."""
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        optimizer._opt_called = True


class AmpOptimizer(torch.optim.Optimizer):
    """The wrapped optimizer: loss scaling, exact skips, master weights, inf-check reduction.

    It keeps the torch optimizer interface (``param_groups``, ``state``, ``zero_grad``,
    ``torch.optim.lr_scheduler`` works on it) and adds `backward`, `scale_loss`,
    `unscale_`, `clip_grad_norm`, `loss_scale`, `skipped_steps` and `scale_metrics`.

    A step whose gradients hold an inf/NaN (on any rank of ``process_group``) is skipped:
    params, master weights and optimizer state stay exactly as they were, and the loss
    scale follows the mode's rule. With a fused optimizer (``Adam``/``AdamW``/``SGD`` with
    ``fused=True``) the skip happens inside the kernel and no step syncs with the host;
    otherwise `step` reads one flag from the device (as ``torch.amp.GradScaler`` does).

    Use `backward` (it scales) and `step`; `step` returns a 0-dim bool tensor that says
    whether the step was taken (reading it syncs). With master weights, the model's
    half-precision ``.grad`` are released once copied into the float32 master grads
    (at `unscale_`), and those are released after `step`: read gradients between
    `unscale_` and `step`, on ``optimizer.param_groups``' params.

    Examples:
      >>> import torch, mpfunc_torch
      >>> net = torch.nn.Linear(4, 1)
      >>> opt = torch.optim.SGD(net.parameters(), lr=0.1)
      >>> model, opt, crit = mpfunc_torch.convert_to_amp(
      ...     net, opt, torch.nn.MSELoss(), mode="torch", init_scale=1024.0)
      >>> loss = crit(model(torch.randn(8, 4)), torch.randn(8, 1))
      >>> opt.backward(loss)
      >>> bool(opt.step())
      True
      >>> opt.scale_metrics(as_python=True)["loss_scale"]
      1024.0
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        plan: AmpPlan,
        *,
        device: torch.device,
        masters: dict[int, torch.Tensor] | None = None,
        process_groups: tuple = (),
        shared: SharedScale | None = None,
    ):
        # Deliberately not calling Optimizer.__init__: param_groups/state/defaults are
        # the inner optimizer's own (see the properties below).
        self.optimizer = optimizer
        self.plan = plan
        self._enabled = plan.enabled
        self._groups = process_groups
        self._device = device
        self._optimizer_step_pre_hooks = {}
        self._optimizer_step_post_hooks = {}
        self._optimizer_state_dict_pre_hooks = {}
        self._optimizer_state_dict_post_hooks = {}
        self._optimizer_load_state_dict_pre_hooks = {}
        self._optimizer_load_state_dict_post_hooks = {}
        n = plan.num_losses if plan.enabled else 1
        if not plan.enabled:
            kinds = ["none"]
        else:
            kinds = [plan.scale_kind] * n
        if shared is None:
            shared = SharedScale(
                [LossScaler(k, plan.scale_config if k == "dynamic" else None,
                            plan.static_scale if k == "static" else 1.0, device)
                 for k in kinds], 1, device)
        self._shared = shared
        shared.members.append(self)
        self._scalers = shared.scalers
        self._fused = bool(getattr(optimizer, "_step_supports_amp_scaling", False))
        self._stage = _READY
        self._found_inf = torch.zeros((), dtype=torch.float32, device=device)
        self._found_inf_per_loss = [torch.zeros((), dtype=torch.float32, device=device)
                                    for _ in range(n)]
        self._grads_unscaled = False  # set once per-loss unscaling happened in backward
        self.num_zeros_in_grad: torch.Tensor | None = None
        self.grad_norm: torch.Tensor | None = None
        # Owned params are what the inner optimizer steps (float32 masters where there
        # are master weights); each has a source, the model param its gradient comes from.
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        if masters:
            for group in optimizer.param_groups:
                new = []
                for p in group["params"]:
                    m = masters.get(id(p), p)
                    if m is not p:
                        self._pairs.append((p, m))
                    new.append(m)
                group["params"] = new
        self._index_params()

    def _index_params(self) -> None:
        source_of = {id(m): p for p, m in self._pairs}
        self._owned = [q for g in self.optimizer.param_groups for q in g["params"]]
        self._sources = [source_of.get(id(q), q) for q in self._owned]

    # -- the torch optimizer interface ---------------------------------------------------
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.optimizer.param_groups = value

    @property
    def state(self):
        return self.optimizer.state

    @property
    def defaults(self):
        return self.optimizer.defaults

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if self._pairs:
            raise RuntimeError("add_param_group is not supported with master weights; "
                               "add the params before convert_to_amp.")
        self.optimizer.add_param_group(param_group)
        self._index_params()

    def __repr__(self) -> str:
        return f"AmpOptimizer({self.plan.describe()}, optimizer={self.optimizer!r})"

    def __getstate__(self):
        raise TypeError("AmpOptimizer is not picklable; save its state_dict() instead.")

    # -- scaling -----------------------------------------------------------------------
    def _scaler(self, loss_id: int) -> LossScaler:
        if isinstance(loss_id, bool) or not isinstance(loss_id, int) or not (
            0 <= loss_id < len(self._scalers)
        ):
            raise ValueError(
                f"`loss_id` must be an int in [0, {len(self._scalers)}) (num_losses="
                f"{len(self._scalers)}), got {loss_id!r}."
            )
        return self._scalers[loss_id]

    @property
    def loss_scale(self) -> torch.Tensor:
        """The current loss scale (loss 0): a float32 0-dim device tensor."""
        return self._scalers[0].scale

    @property
    def skipped_steps(self) -> torch.Tensor:
        """Skipped steps so far: an int32 0-dim device tensor."""
        return self._scalers[0].skipped_steps

    def scale_metrics(self, as_python: bool = False, loss_id: int = 0) -> dict[str, Any]:
        """``loss_scale``, ``skipped_steps``, ``last_finite`` (and ``num_zeros_in_grad``
        when logged): device tensors, or Python numbers with ``as_python=True``."""
        out = self._scaler(loss_id).metrics(as_python)
        if self.num_zeros_in_grad is not None:
            z = self.num_zeros_in_grad
            out["num_zeros_in_grad"] = int(z) if as_python else z
        return out

    def scale_loss(self, loss: torch.Tensor, loss_id: int = 0) -> torch.Tensor:
        """``loss`` in float32 times the current scale (for ``torch.autograd.grad``)."""
        scaler = self._scaler(loss_id)
        if not self._enabled or scaler.kind == "none":
            return loss
        return loss.float() * scaler.scale

    def backward(self, loss: torch.Tensor, loss_id: int = 0, **kwargs) -> None:
        """Scales ``loss`` and back-propagates (``kwargs`` go to ``Tensor.backward``).

        May be called several times before `step` (gradient accumulation, several
        losses). With ``num_losses > 1`` each loss has its own scale: its gradients are
        unscaled right after its backward and accumulated (in float32 for master weights).
        """
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"`loss` must be a tensor, got {type(loss).__name__}.")
        if self._stage == _UNSCALED:
            raise RuntimeError("backward() after unscale_()/clip_grad_norm() and before "
                               "step(): gradients of one step must share one scale.")
        scaled = self.scale_loss(loss, loss_id)
        if len(self._scalers) == 1:
            scaled.backward(**kwargs)
        else:
            self._backward_separate_scale(scaled, loss_id, kwargs)
        for member in self._shared.members:  # one backward feeds every optimizer sharing
            if member._stage == _READY:      # this scale (e.g. two models, two losses)
                member._stage = _BACKWARD

    def _backward_separate_scale(self, scaled, loss_id, kwargs):
        # Gradients of earlier losses are already unscaled: set them aside, back-propagate
        # this loss alone, unscale it with its own scale (in float32 for master weights),
        # then add the two.
        stash = [q.grad for q in self._owned]
        for q, src in zip(self._owned, self._sources):
            q.grad = None
            src.grad = None
        scaled.backward(**kwargs)
        fresh = []
        for q, src in zip(self._owned, self._sources):
            g = src.grad
            fresh.append(None if g is None else g if src is q else g.to(q.dtype))
            if src is not q:
                src.grad = None
        fused.unscale_and_check_([g for g in fresh if g is not None],
                                 self._found_inf_per_loss[loss_id],
                                 self._scalers[loss_id].inv_scale())
        for q, g, old in zip(self._owned, fresh, stash):
            q.grad = old if g is None else g if old is None else g + old
        self._grads_unscaled = True

    # -- unscale / clip / step ---------------------------------------------------------
    def _owned_grads(self) -> list[torch.Tensor]:
        return [q.grad for q in self._owned if q.grad is not None]

    def unscale_(self) -> None:
        """Divides the gradients the optimizer owns by the scale, and checks them.

        Call it before inspecting or clipping gradients; `step` calls it otherwise.
        With master weights the model's half gradients are first copied into the float32
        master gradients (one foreach copy), then unscaled there in one fused pass.

        Raises:
          RuntimeError: before any `backward`, or a second time before `step`.
        """
        if not self._enabled:
            return
        if self._stage == _READY:
            raise RuntimeError("unscale_() called before backward(); there is nothing to "
                               "unscale.")
        if self._stage == _UNSCALED:
            raise RuntimeError("unscale_() has already been called since the last step(); "
                               "calling it twice would unscale twice.")
        found = self._found_inf
        found.zero_()
        if self._grads_unscaled:  # num_losses > 1: each backward already unscaled
            for f in self._found_inf_per_loss:
                all_reduce_found_inf_(f, self._groups)
                torch.maximum(found, f, out=found)
        else:
            if self._pairs:
                copy_grads_to_masters_(self._pairs)
            scaler = self._scalers[0]
            inv = scaler.inv_scale() if scaler.kind != "none" else torch.ones(
                (), device=self._device)
            fused.unscale_and_check_(self._owned_grads(), found, inv)
            all_reduce_found_inf_(found, self._groups)
            self._found_inf_per_loss[0].copy_(found)
        self._stage = _UNSCALED

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Unscales (if not yet done) and clips the gradients' global norm.

        The norm is over the gradients this optimizer owns on this rank (float32 masters
        with master weights). Returns the total norm before clipping, as a device tensor;
        it is inf/NaN on an overflow step, which `step` then skips anyway.
        """
        if self._stage != _UNSCALED:
            self.unscale_()
        params = [q for q in self._owned if q.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type,
                                              foreach=True)

    def step(self, closure=None) -> torch.Tensor:
        """Takes the optimizer step unless a gradient is inf/NaN; updates the loss scale.

        Returns:
          A 0-dim bool device tensor: True if the step was taken.

        Raises:
          RuntimeError: `step` before `backward`.
          ValueError: a closure (not supported with loss scaling, as in GradScaler).
        """
        if closure is not None:
            raise ValueError("`closure` is not supported: loss scaling needs backward() "
                             "through this optimizer before step().")
        if not self._enabled:
            self.optimizer.step()
            self._stage = _READY
            return torch.ones((), dtype=torch.bool, device=self._device)
        if self._stage == _READY:
            raise RuntimeError("step() called before backward(): call "
                               "optimizer.backward(loss) first (it scales the loss).")
        scaler = self._scalers[0]
        fused_scaled_path = (
            self._fused and not self._pairs and self._stage == _BACKWARD
            and not self._grads_unscaled and len(self._scalers) == 1
            and not self.plan.clip_grad and not self.plan.log_num_zeros_in_grad
        )
        found = self._found_inf
        if fused_scaled_path:
            # Pass 1: check only (inv_scale 1). Pass 2: the fused optimizer unscales,
            # skips on found_inf and undoes its step count, all on the device.
            found.zero_()
            fused.unscale_and_check_(self._owned_grads(), found,
                                     torch.ones((), device=self._device))
            all_reduce_found_inf_(found, self._groups)  # the path ShardedGradScaler misses
            self._run_fused_step(scaler.scale if scaler.kind != "none" else None, found)
            stepped = found == 0
        else:
            if self._stage != _UNSCALED:
                self.unscale_()
            if self.plan.clip_grad:
                self.grad_norm = self.clip_grad_norm(self.plan.clip_grad)
            if self.plan.log_num_zeros_in_grad:
                self.num_zeros_in_grad = fused.count_zeros(self._owned_grads())
            if self._fused:
                self._run_fused_step(None, found)
                stepped = found == 0
                copy_masters_to_model_(self._pairs)
            else:
                if not found.item():  # the one host read of a non-fused step
                    self.optimizer.step()
                    copy_masters_to_model_(self._pairs)
                else:
                    _mark_step_called(self.optimizer)
                stepped = found == 0
        if len(self._scalers) == 1:
            if self._shared.record(found):
                scaler.update(self._shared.take(found))
        else:
            for s, f in zip(self._scalers, self._found_inf_per_loss):
                # Each loss's scale follows its own overflows; the step is skipped (and
                # counted on every scaler) if any loss overflowed.
                s.update(f, step_found_inf=found)
        for f in self._found_inf_per_loss:
            f.zero_()
        release_master_grads_(self._pairs)
        self._grads_unscaled = False
        self._stage = _READY
        return stepped

    def _run_fused_step(self, grad_scale, found_inf):
        opt = self.optimizer
        opt.grad_scale = grad_scale
        opt.found_inf = found_inf
        try:
            opt.step()
        finally:
            opt.grad_scale = None
            opt.found_inf = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears model and master gradients and starts a new accumulation."""
        params = {id(t): t for t in self._owned + self._sources}.values()
        for p in params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_()
                p.grad.zero_()
        self._stage = _READY
        self._grads_unscaled = False
        for f in self._found_inf_per_loss:
            f.zero_()

    # -- checkpoints -------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs, loadable with ``weights_only=True``.

        Keys: ``format`` (1), ``mode``, ``opt_level``, ``optimizer`` (the inner optimizer's
        state_dict, over the master weights when there are any), ``scalers`` (one
        `LossScaler.state_dict` per loss: scale, growth and hysteresis trackers, skipped
        steps) and ``master_weights`` (the float32 masters, or None).
        """
        return {
            "format": 1,
            "mode": self.plan.mode,
            "opt_level": self.plan.opt_level,
            "optimizer": self.optimizer.state_dict(),
            "scalers": [s.state_dict() for s in self._scalers],
            "master_weights": [m.detach().clone() for _, m in self._pairs] or None,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores `state_dict`; also writes the masters back into the model's params."""
        required = {"format", "mode", "opt_level", "optimizer", "scalers", "master_weights"}
        missing = sorted(required - set(state_dict))
        if missing:
            raise ValueError(f"`state_dict` is missing keys {missing}; was it made by "
                             "AmpOptimizer.state_dict()?")
        if (state_dict["mode"], state_dict["opt_level"]) != (self.plan.mode, self.plan.opt_level):
            raise ValueError(
                f"`state_dict` is from mode {state_dict['mode']!r} "
                f"(opt_level {state_dict['opt_level']!r}); this optimizer runs mode "
                f"{self.plan.mode!r} (opt_level {self.plan.opt_level!r})."
            )
        if len(state_dict["scalers"]) != len(self._scalers):
            raise ValueError(f"`state_dict` has {len(state_dict['scalers'])} loss scalers, "
                             f"this optimizer {len(self._scalers)}.")
        masters = state_dict["master_weights"] or []
        if len(masters) != len(self._pairs):
            raise ValueError(f"`state_dict` has {len(masters)} master weights, this "
                             f"optimizer {len(self._pairs)}.")
        self.optimizer.load_state_dict(state_dict["optimizer"])
        for s, sd in zip(self._scalers, state_dict["scalers"]):
            s.load_state_dict(sd)
        with torch.no_grad():
            for (_, m), saved in zip(self._pairs, masters):
                m.copy_(saved)
        copy_masters_to_model_(self._pairs)
        self._stage = _READY
