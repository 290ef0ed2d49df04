"""`AmpOptimizer`: loss scaling, exact skips, master weights and the inf-check reduction
around a torch optimizer."""

from __future__ import annotations

from typing import Any

import torch

from _mpfunc_common.amp_config import AmpPlan
from mpfunc_torch._src import fused, fused_sgd
from mpfunc_torch._src.checkpoint import optimizer_state
from mpfunc_torch._src.clipping import (
    clip_grads_with_norm_,
    global_grad_norm,
)
from mpfunc_torch._src.exact_skip import exact_step_
from mpfunc_torch._src.grads import (
    add_back_unscaled_,
    recheck_unscaled_,
    set_aside_,
    unscale_owned_,
    zero_grads_,
)
from mpfunc_torch._src.loss_scale import LossScaler
from mpfunc_torch._src.master_weights import (
    copy_grads_to_masters_,
    follow_model_writes_,
    largest_first,
    model_versions,
    release_master_grads_,
    swap_in_masters_,
)
from mpfunc_torch._src.optimizer_metrics import OptimizerMetrics
from mpfunc_torch._src.sharding import mesh_groups
from mpfunc_torch._src.shared_scale import SharedScale
from mpfunc_torch._src.skip_record import new_step_flags
from mpfunc_torch._src.wrapped_optimizer import WrappedOptimizer

__all__ = ["AmpOptimizer"]

_READY, _BACKWARD, _UNSCALED = "ready", "backward", "unscaled"
_profile_hook_step = torch.optim.Optimizer.profile_hook_step
# The step state machine runs outside dynamo (see `fused.eager`).
_eager = fused.eager


class AmpOptimizer(OptimizerMetrics, WrappedOptimizer):
    """The wrapped optimizer: loss scaling, exact skips, master weights, inf-check reduction.

    It keeps the torch optimizer interface (``param_groups``, ``state``, ``zero_grad``,
    ``torch.optim.lr_scheduler`` and optimizer hooks work on it) and adds `backward`,
    `scale_loss`, `unscale_`, `clip_grad_norm`, `loss_scale`, `skipped_steps`,
    `scale_metrics` and `precision_report`.

    A step whose gradients hold an inf/NaN (on any rank of ``process_group``) is skipped:
    params, master weights and optimizer state stay exactly as they were, and the loss
    scale follows the mode's rule. With a fused optimizer (``Adam``/``AdamW``/``SGD`` with
    ``fused=True``) the skip happens inside the kernel and no step syncs with the host;
    otherwise `step` reads one flag from the device (as ``torch.amp.GradScaler`` does).

    Use `backward` (it scales) and `step`, or, as with GradScaler,
    ``opt.scale_loss(loss).backward()`` then `step`. `step` returns a 0-dim bool tensor
    that says whether the step was taken (reading it syncs). Step hooks registered on
    this optimizer (``register_step_pre_hook``/``register_step_post_hook``, and the
    global ones) fire around every `step` call, taken or skipped: telling which would
    cost a host sync; read the returned flag or ``scale_metrics()["last_finite"]``.
    With master weights, the model's half-precision ``.grad`` are released once copied
    into the float32 master grads (at `unscale_`), and those are released after `step`:
    read gradients between `unscale_` and `step`, on ``optimizer.param_groups``' params.
    With ``step_chunks > 1`` (see `convert_to_amp`) and no `unscale_` before it, `step`
    checks the half grads, then makes, steps and frees the master grads chunk by chunk.

    Examples:
      >>> import torch, mpfunc_torch
      >>> net = torch.nn.Linear(4, 1)
      >>> opt = torch.optim.SGD(net.parameters(), lr=0.1)
      >>> model, opt, crit = mpfunc_torch.convert_to_amp(
      ...     net, opt, torch.nn.MSELoss(), mode="torch", init_scale=1024.0)
      >>> loss = crit(model(torch.randn(8, 4)), torch.randn(8, 1))
      >>> opt.scale_loss(loss).backward()  # or opt.backward(loss)
      >>> bool(opt.step())
      True
      >>> opt.scale_metrics(as_python=True)["loss_scale"]
      1024.0
    """

    _lowp: Any  # a LowPrecision where set (mpfunc_torch._src.low_precision)

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        plan: AmpPlan,
        *,
        device: torch.device,
        masters: dict[int, torch.nn.Parameter] | None = None,
        process_groups: tuple = (),
        shared: SharedScale | None = None,
        step_chunks: int = 1,
    ):
        super().__init__(optimizer)  # the inner optimizer's groups and state, own hooks
        self.plan = plan
        self._enabled = plan.enabled
        self._groups = process_groups
        self._device = device
        n = plan.num_losses if plan.enabled else 1
        kinds = [plan.scale_kind] * n if plan.enabled else ["none"]
        if shared is None:
            shared = SharedScale(
                [LossScaler(k, plan.scale_config if k == "dynamic" else None,
                            plan.static_scale if k == "static" else 1.0, device)
                 for k in kinds], 1, device)
        self._shared = shared
        shared.members.append(self)
        self._scalers = shared.scalers
        self._fused = bool(getattr(optimizer, "_step_supports_amp_scaling", False))
        # With a fused optimizer the skip is decided on the device: recording which params
        # skipped then costs a check launch per gradient every step (record_skip_leaves).
        self._record_skips_every_step = False
        self._step_chunks = step_chunks  # validated by convert_to_amp
        self._stage = _READY
        self._last = "init"  # the last call that ended a step: for error messages
        self._found_inf = torch.zeros((), dtype=torch.float32, device=device)
        self._found_inf_per_loss = [torch.zeros((), dtype=torch.float32, device=device)
                                    for _ in range(n)]
        self._grads_unscaled = False  # set once per-loss unscaling happened (num_losses > 1)
        self._pending: tuple[int, list] | None = None  # (loss_id, grads set aside)
        self.num_zeros_in_grad: torch.Tensor | None = None
        self.grad_norm: torch.Tensor | None = None
        # Owned params are what the inner optimizer steps (float32 masters where there
        # are master weights); each has a source, the model param its gradient comes from.
        self._pairs = swap_in_masters_(optimizer, masters or {})
        self._versions = model_versions(self._pairs)  # see follow_model_writes_
        # The fused optimizer may unscale inside its kernel: one scale, no master weights,
        # nothing to do between unscaling and the step, and a scale that cannot go below
        # 1 (the kernel would not see an overflow created by unscaling).
        self._kernel_unscales = (
            self._fused and not self._pairs and n == 1 and not plan.clip_grad
            and not plan.log_num_zeros_in_grad and not self._scalers[0].may_go_below_one)
        self._index_params()
        # The inf check is reduced over the groups named and over every dimension of the
        # device meshes of DTensor params (FSDP2, tensor parallelism); clipping sums plain
        # gradients over the named groups and DTensor ones over their meshes.
        self._clip_groups = tuple(process_groups)
        self._groups = self._clip_groups + tuple(
            g for g in mesh_groups(self._owned + self._sources)
            if all(g is not h for h in self._clip_groups))

    def _index_params(self) -> None:
        source_of = {id(m): p for p, m in self._pairs}
        self._copy_order = largest_first(self._pairs)
        self._owned: list[torch.Tensor] = [
            q for g in self.optimizer.param_groups for q in g["params"]]
        self._sources = [source_of.get(id(q), q) for q in self._owned]
        self._sgd_first = self._sgd_late = fused_sgd.is_fused_sgd_with_momentum(self.optimizer)

    # -- the torch optimizer interface (the rest is WrappedOptimizer's) --------------------
    @_eager
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """``torch.optim.Optimizer.add_param_group`` on the wrapped optimizer.

        Raises:
          RuntimeError: in a mode with master weights (give every param before
            `convert_to_amp`).
        """
        if self._pairs:
            raise RuntimeError("add_param_group is not supported with master weights; "
                               "give the optimizer every param before convert_to_amp (a "
                               "frozen one, requires_grad=False, trains once unfrozen).")
        self.optimizer.add_param_group(param_group)
        self._index_params()

    def __repr__(self) -> str:
        return f"AmpOptimizer({self.plan.describe()}, optimizer={self.optimizer!r})"

    # -- scaling -----------------------------------------------------------------------
    @_eager
    def scale_loss(self, loss: torch.Tensor, loss_id: int = 0) -> torch.Tensor:
        """``loss`` in float32 times the current scale.

        As with ``GradScaler.scale``: the gradients that follow (``.backward()`` on the
        result, or ``torch.autograd.grad``) are scaled, and `step` unscales them. With
        ``num_losses > 1`` the gradients accumulated so far are set aside until the next
        `backward`, `scale_loss`, `unscale_` or `step`, which unscales this loss's
        gradients with its own scale and adds them back.
        """
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"`loss` must be a tensor, got {type(loss).__name__}.")
        scaler = self._scaler(loss_id)
        self._shared.check_none_unscaled(self)
        if len(self._scalers) > 1:
            self._finish_pending()
            self._pending = (loss_id, set_aside_(self._owned, self._sources))
        self._shared.mark_backward()
        if not self._enabled or scaler.kind == "none":
            return loss
        return loss.float() * scaler.scale

    @_eager
    def backward(self, loss: torch.Tensor, loss_id: int = 0, **kwargs) -> None:
        """Scales ``loss`` and back-propagates (``kwargs`` go to ``Tensor.backward``).

        May be called several times before `step` (gradient accumulation, several
        losses). With ``num_losses > 1`` each loss has its own scale: its gradients are
        unscaled right after its backward and accumulated (in float32 for master weights).
        """
        if isinstance(loss, torch.Tensor) and loss.numel() != 1 and "gradient" not in kwargs:
            raise ValueError(f"`loss` must be a scalar (one element), got shape "
                             f"{tuple(loss.shape)}; reduce it (e.g. .mean()) or pass "
                             "`gradient=`.")
        stages = [m._stage for m in self._shared.members]
        scaled = self.scale_loss(loss, loss_id)
        try:
            scaled.backward(**kwargs)
        except BaseException:
            # A failed backward leaves no step behind it: step() then says so.
            for m, stage in zip(self._shared.members, stages):
                m._stage = stage
            raise
        self._finish_pending()

    def _finish_pending(self) -> None:
        if self._pending is not None:
            loss_id, stash = self._pending
            self._pending = None
            add_back_unscaled_(self._owned, self._sources, stash, self._scalers[loss_id],
                               self._found_inf_per_loss[loss_id])
            self._grads_unscaled = True

    # -- unscale / clip / step ---------------------------------------------------------
    def _not_after_backward(self, call: str) -> RuntimeError:
        if self._last == "step":
            return RuntimeError(
                f"{call} called again after step() with no backward() in between: the "
                "gradients of that step were already used (and released). Call "
                "optimizer.backward(loss) (or scale_loss(loss).backward()) for each step.")
        return RuntimeError(f"{call} called before backward(): call optimizer.backward(loss) "
                            "(or optimizer.scale_loss(loss).backward()) first.")

    @_eager
    def unscale_(self) -> None:
        """Divides the gradients the optimizer owns by the scale, and checks them.

        Call it before inspecting or clipping gradients; `step` calls it otherwise.
        With master weights the model's half gradients are first copied into the float32
        master gradients (chunk by chunk, each half gradient freed once copied), then
        unscaled there in one fused pass. Where
        the scale can be below 1 they are checked again after unscaling (one more pass).

        Raises:
          RuntimeError: before any `backward`, or a second time before `step`.
        """
        if not self._enabled:
            return
        if self._stage == _READY:
            raise self._not_after_backward("unscale_()")
        if self._stage == _UNSCALED:
            raise RuntimeError("unscale_() has already been called since the last step(); "
                               "calling it twice would unscale twice.")
        self._finish_pending()
        found = self._found_inf
        found.zero_()
        if self._grads_unscaled:  # num_losses > 1: each backward already unscaled
            recheck_unscaled_(self._owned, found, self._found_inf_per_loss, self._groups,
                              new_step_flags(self))
        else:
            copy_grads_to_masters_(self._copy_order)
            unscale_owned_(self._owned, found, self._scalers[0], self._groups,
                           new_step_flags(self))
            self._found_inf_per_loss[0].copy_(found)
        self._stage = _UNSCALED

    @_eager
    def backward_done(self) -> None:
        """Says that the scaled backward of this step ran outside this optimizer.

        For a pipeline schedule (``torch.distributed.pipelining``) whose ``loss_fn``
        returns ``optimizer.scale_loss(loss)``: the last stage scales its losses, and the
        gradients reaching the other stages are scaled with them; those stages call
        this before `clip_grad_norm` / `step`.
        """
        if self._stage == _UNSCALED:
            raise RuntimeError("backward_done() after unscale_()/clip_grad_norm() and before "
                               "step(): gradients of one step must share one scale.")
        self._finish_pending()
        if self._stage == _READY:
            self._stage = _BACKWARD

    @_eager
    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Unscales (if not yet done) and clips the gradients' global norm.

        The norm is over the gradients this optimizer owns (float32 masters with master
        weights; sparse ones through their values) on every rank that holds a part of
        them: DTensor gradients (FSDP2, tensor parallelism) over their device meshes,
        plain ones summed over the ``process_group`` given to `convert_to_amp`, with
        params marked by `mark_replicated` counted once (see `clip_grad_norm_`). Every
        rank clips by the same factor. Returns the total norm before clipping, as a
        device tensor; it is inf/NaN on an overflow step, which `step` then skips anyway.
        """
        if self._stage != _UNSCALED:
            self.unscale_()
        if isinstance(max_norm, bool) or not isinstance(max_norm, int | float) or \
                not max_norm > 0:
            raise ValueError(f"`max_norm` must be a number > 0, got {max_norm!r}.")
        total = global_grad_norm(self._owned, norm_type, process_group=self._clip_groups,
                                 mark_sources=self._sources)
        clip_grads_with_norm_(self._owned, float(max_norm), total)
        return total

    @_eager
    @_profile_hook_step
    def step(self, closure=None) -> torch.Tensor:
        """Takes the optimizer step unless a gradient is inf/NaN; updates the loss scale.

        Returns:
          A 0-dim bool device tensor: True if the step was taken.

        Raises:
          RuntimeError: `step` before `backward`, or twice for one backward.
          ValueError: a closure (not supported with loss scaling, as in GradScaler).
        """
        if closure is not None:
            raise ValueError("`closure` is not supported: loss scaling needs backward() "
                             "through this optimizer before step().")
        if not self._enabled:
            self.optimizer.step()
            self._stage, self._last = _READY, "step"
            return torch.ones((), dtype=torch.bool, device=self._device)
        if self._stage == _READY:
            raise self._not_after_backward("step()")
        self._finish_pending()
        follow_model_writes_(self._pairs, self._versions)
        found = exact_step_(self, self._stage == _BACKWARD)
        stepped = found == 0
        self._shared.update_after_step(found, self._found_inf_per_loss)
        for f in self._found_inf_per_loss:
            f.zero_()
        release_master_grads_(self._pairs)
        self._grads_unscaled = False
        self._stage, self._last = _READY, "step"
        return stepped

    @_eager
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears model and master gradients and starts a new accumulation."""
        self._pending = None
        zero_grads_(self._owned + self._sources, set_to_none)
        self._stage = _READY
        self._last = "zero_grad"
        self._grads_unscaled = False
        for f in self._found_inf_per_loss:
            f.zero_()

    # -- checkpoints -------------------------------------------------------------------
    @_eager
    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs, loadable with ``weights_only=True``.

        Keys: ``format`` (1), ``mode``, ``opt_level``, ``optimizer`` (the inner optimizer's
        state_dict, over the master weights when there are any), ``scalers`` (one
        `LossScaler.state_dict` per loss: scale, growth and hysteresis trackers, skip
        counters, and the config they were saved with), ``master_weights`` (the float32
        masters, or None) and ``master_names`` (their params' names in the model, for
        `convert_checkpoint`). Loading keeps this optimizer's loss-scale hyperparameters
        (a run may resume with another ``init_scale``, as with GradScaler). The
        ``register_state_dict_pre_hook``/``post_hook`` hooks run around it.
        """
        def save():
            follow_model_writes_(self._pairs, self._versions)
            return optimizer_state.save(self)

        return self._state_dict_with_hooks(save)

    @_eager
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores `state_dict`, all or nothing; also writes the masters into the model.

        Everything is checked before anything is written: a checkpoint of another mode
        (convert it: `convert_checkpoint`), a missing key, a corrupt value (a bad scale
        or counter, a non-float32 or non-finite master, a non-finite optimizer state, a
        state of the wrong shape, a step count below 0, a param group without this
        optimizer's hyperparameters, whatever torch's own load refuses) raises
        ``ValueError`` naming the key and leaves this optimizer as it was. The
        loss-scale hyperparameters and the inner optimizer's ``foreach`` / ``fused`` /
        ``capturable`` / ``differentiable`` flags stay this optimizer's own. A plain torch
        optimizer's ``state_dict()`` (a run moving to mpfunc_torch), or a converted one,
        loads with the same checks; its masters come from loading the model's float32
        checkpoint. A ``torch.amp.GradScaler.state_dict()``, loaded the same way, sets
        the loss scale and growth tracker (brought into this config's range).
        """
        def load(state_dict):
            optimizer_state.load(self, state_dict)
            # in place: the model's load hooks hold this dict
            self._versions.update(model_versions(self._pairs))
            self._pending = None
            self._stage, self._last = _READY, "load_state_dict"
            self._grads_unscaled = False
            self._index_params()

        self._load_state_dict_with_hooks(state_dict, load)
