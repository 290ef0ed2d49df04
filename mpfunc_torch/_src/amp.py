"""`convert_to_amp`: the torch / apex-like / naive / bf16 modes for PyTorch."""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from _mpfunc_common.amp_config import AmpPlan, resolve_amp
from mpfunc_torch._src import fused
from mpfunc_torch._src.autocast import Fp32Functions
from mpfunc_torch._src.distributed import all_reduce_found_inf_, normalize_groups
from mpfunc_torch._src.scaler import LossScaler

__all__ = ["AMP_TYPE", "convert_to_amp", "AmpModel", "AmpCriterion", "AmpOptimizer"]

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_HALF = (torch.float16, torch.bfloat16)


def _norm_types() -> tuple[type, ...]:
    types = [nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm, nn.LayerNorm,
             nn.GroupNorm, nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d,
             nn.LocalResponseNorm]
    if hasattr(nn, "RMSNorm"):
        types.append(nn.RMSNorm)
    return tuple(types)


class AMP_TYPE(str, enum.Enum):  # noqa: N801 - the name users know from Colossal-AI
    """The AMP modes (a string enum: ``AMP_TYPE.NAIVE == "naive"``)."""

    TORCH = "torch"
    APEX = "apex"
    NAIVE = "naive"
    BF16 = "bf16"


def _map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_map_tensors(fn, x) for x in obj))
    if isinstance(obj, list | tuple):
        return type(obj)(_map_tensors(fn, x) for x in obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(fn, v) for k, v in obj.items()}
    return obj


def _caster(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t

    return cast


class AmpModel(nn.Module):
    """A model running in its mode's precision.

    Floating inputs are cast to the model's dtype (half-precision models), the forward
    runs under ``torch.autocast`` (and apex O1's fp32 list) when the mode says so, and
    floating outputs are cast as the mode says. ``state_dict`` and ``load_state_dict``
    use the wrapped module's own keys, so checkpoints load into the unwrapped model.

    Examples:
      >>> import torch, mpfunc_torch
      >>> net = torch.nn.Linear(4, 2)
      >>> opt = torch.optim.SGD(net.parameters(), lr=0.1)
      >>> model, opt, _ = mpfunc_torch.convert_to_amp(net, opt, mode="bf16")
      >>> model(torch.randn(3, 4)).dtype
      torch.bfloat16
    """

    def __init__(self, module: nn.Module, plan: AmpPlan, device_type: str):
        super().__init__()
        self.module = module
        self.plan = plan
        self.device_type = device_type
        half_model = plan.enabled and plan.cast_model_type in ("float16", "bfloat16")
        self._input_cast = _caster(_DTYPES[plan.cast_model_type]) if half_model else None
        out = plan.cast_model_outputs if plan.enabled else None
        self._output_cast = _caster(_DTYPES[out]) if out else None
        self._fp32_functions = Fp32Functions(device_type) if plan.apex_fp32_functions else None

    def forward(self, *args, **kwargs):
        if self._input_cast is not None:
            args, kwargs = _map_tensors(self._input_cast, (args, kwargs))
        with contextlib.ExitStack() as stack:
            if self.plan.enabled and self.plan.autocast_dtype is not None:
                stack.enter_context(
                    torch.autocast(self.device_type, dtype=_DTYPES[self.plan.autocast_dtype])
                )
            if self._fp32_functions is not None:
                stack.enter_context(self._fp32_functions)
            out = self.module(*args, **kwargs)
        if self._output_cast is not None:
            out = _map_tensors(self._output_cast, out)
        return out

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)


class AmpCriterion(nn.Module):
    """A loss computed in float32: half inputs are upcast and autocast is off inside."""

    def __init__(self, criterion: Callable, device_type: str):
        super().__init__()
        if not callable(criterion):
            raise TypeError(f"`criterion` must be callable, got {type(criterion).__name__}.")
        self.criterion = criterion
        self.device_type = device_type
        self._cast = _caster(torch.float32)

    def forward(self, *args, **kwargs):
        args, kwargs = _map_tensors(self._cast, (args, kwargs))
        with torch.autocast(self.device_type, enabled=False):
            return self.criterion(*args, **kwargs)


_READY, _BACKWARD, _UNSCALED = "ready", "backward", "unscaled"


class _SharedScale:
    """One set of loss scalers shared by the optimizers converted together.

    As with one ``torch.amp.GradScaler`` driving several optimizers: each optimizer skips
    or steps on its own gradients, and the scale is updated once per iteration, after
    the last of them has stepped, with the overflow flag of all of them.
    """

    def __init__(self, scalers: list[LossScaler], n_optimizers: int, device):
        self.scalers = scalers
        self.n = n_optimizers
        self.members: list[AmpOptimizer] = []
        self.stepped = 0
        self.found = torch.zeros((), dtype=torch.float32, device=device)

    def record(self, found_inf: torch.Tensor) -> bool:
        """Adds one optimizer's flag; True when the iteration's last optimizer stepped."""
        if self.n == 1:
            return True
        torch.maximum(self.found, found_inf, out=self.found)
        self.stepped += 1
        return self.stepped == self.n

    def take(self, found_inf: torch.Tensor) -> torch.Tensor:
        if self.n == 1:
            return found_inf
        self.stepped = 0
        out = self.found.clone()
        self.found.zero_()
        return out


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
        shared: _SharedScale | None = None,
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
            shared = _SharedScale(
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

    def _copy_grads_to_masters(self) -> None:
        """Model (half) grads -> float32 master grads in one foreach copy; the half grads
        are released right after (nothing reads them again before the next backward)."""
        model_grads, master_grads = [], []
        for p, m in self._pairs:
            if p.grad is None:
                m.grad = None
                continue
            if m.grad is None:
                m.grad = torch.empty_like(m)
            model_grads.append(p.grad)
            master_grads.append(m.grad)
        if model_grads:
            torch._foreach_copy_(master_grads, model_grads)
        for p, _ in self._pairs:
            p.grad = None

    def _release_master_grads(self) -> None:
        # Master grads are dead once the step is taken (or skipped); freeing them keeps
        # them from sitting beside the next forward's activations.
        for _, m in self._pairs:
            m.grad = None

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
                self._copy_grads_to_masters()
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
                if self._pairs:
                    self._copy_masters_to_model()
            else:
                if not found.item():  # the one host read of a non-fused step
                    self.optimizer.step()
                    if self._pairs:
                        self._copy_masters_to_model()
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
        self._release_master_grads()
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

    def _copy_masters_to_model(self) -> None:
        if self._pairs:
            torch._foreach_copy_([p.data for p, _ in self._pairs],
                                 [m.data for _, m in self._pairs])

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
        self._copy_masters_to_model()
        self._stage = _READY


def _device_of(model: nn.Module, requested: str | None) -> torch.device:
    params = list(model.parameters())
    if not params:
        raise ValueError("`model` has no parameters.")
    device = params[0].device
    if requested is not None:
        if requested not in ("cpu", "cuda"):
            raise ValueError(f"`device` must be 'cpu', 'cuda' or None, got {requested!r}.")
        if requested == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("`device='cuda'` was requested but CUDA is not available "
                               "(this torch build or machine has no GPU); use device='cpu'.")
        if device.type != requested:
            raise ValueError(f"`device={requested!r}` but the model's params are on "
                             f"{device}; move the model first (model.to({requested!r})).")
    return device


def _cast_model(model: nn.Module, dtype: torch.dtype, keep_norm_fp32: bool) -> None:
    norms = _norm_types()
    with torch.no_grad():
        for module in model.modules():
            if keep_norm_fp32 and isinstance(module, norms):
                continue
            for p in module.parameters(recurse=False):
                if p.is_floating_point():
                    p.data = p.data.to(dtype)
            for name, b in module.named_buffers(recurse=False):
                if b is not None and b.is_floating_point():
                    module._buffers[name] = b.to(dtype)
    if keep_norm_fp32:
        for module in model.modules():
            if isinstance(module, norms):
                module.register_forward_pre_hook(_norm_pre_hook)
                module.register_forward_hook(_norm_post_hook(dtype))


def _norm_pre_hook(module, args):
    # Normalisation runs in float32: its params are float32 and so is its computation.
    return _map_tensors(_caster(torch.float32), args)


def _norm_post_hook(dtype):
    def hook(module, args, output):
        return _map_tensors(_caster(dtype), output)

    return hook


def _refuse_broken_fused_sgd(optimizers, masters) -> None:
    """torch's fused SGD on CPU leaves float16/bfloat16 params unchanged (seen in torch
    2.13: a 1000-element float16 param moved only in its last elements). A half-precision
    mode would then train nothing, silently, so that combination is refused."""
    masters = masters or {}
    for opt in optimizers:
        if not (isinstance(opt, torch.optim.SGD) and opt.defaults.get("fused")):
            continue
        for g in opt.param_groups:
            for p in g["params"]:
                if id(p) not in masters and p.dtype in _HALF and p.device.type == "cpu":
                    raise ValueError(
                        "`optimizer` is SGD(fused=True) stepping half-precision params on "
                        "CPU, which torch's fused CPU SGD kernel does not update correctly. "
                        "Use fused=False, or a mode with float32 master weights (naive, "
                        "apex O2)."
                    )


def convert_to_amp(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    criterion: Callable | None = None,
    mode: str | AMP_TYPE = "torch",
    *,
    process_group: Any = None,
    device: str | None = None,
    **config: Any,
) -> tuple[AmpModel, AmpOptimizer, AmpCriterion | None]:
    """Converts a model, its optimizer and its loss to mixed precision.

    The modes (the same names, keys and defaults as Colossal-AI's ``convert_to_amp``, and
    the same meaning as ``mpfunc.convert_to_amp`` on the JAX side):

    ======  =========================================================================
    mode    what it does
    ======  =========================================================================
    torch   ``torch.autocast`` (float16, or ``dtype="bfloat16"``), float32 params,
            dynamic scale with the ``"torch"`` preset (GradScaler's rule).
            Keys: init_scale, growth_factor, backoff_factor, growth_interval, enabled,
            dtype.
    apex    apex's O0-O3 natively (no apex needed). O1: autocast + apex's fp32 list;
            O2: float16 params, float32 norms, float32 master weights; O3: pure float16;
            O0: float32. Dynamic levels use the ``"apex"`` preset. Keys: enabled,
            opt_level, cast_model_type, patch_torch_functions, keep_batchnorm_fp32,
            master_weights, loss_scale, cast_model_outputs, num_losses, verbosity,
            min_loss_scale, max_loss_scale.
    naive   every param float16, float32 master weights, dynamic scale with the
            ``"naive"`` preset (hysteresis 2). Keys: log_num_zeros_in_grad,
            initial_scale, min_scale, growth_factor, backoff_factor, growth_interval,
            hysteresis, max_scale, clip_grad, verbose.
    bf16    ``torch.autocast`` to bfloat16, no loss scaling (non-finite steps are still
            skipped).
    ======  =========================================================================

    The loss-scale rule is ``mpfunc.dynamic_scale``'s (see `LossScaler`), so given the
    same config and overflows both frameworks follow the same scale trajectory.

    Args:
      model: the model; float32 params for every mode (the half modes cast it).
      optimizer: a torch optimizer over (some of) the model's params, with no state yet;
        or a list of them, which then share one loss scale (as several optimizers share
        one GradScaler): each skips or steps on its own gradients, and the scale updates
        once, after the last of them has stepped in the iteration.
      criterion: the loss function, wrapped to compute in float32; or None.
      mode: ``"torch"``, ``"apex"``, ``"naive"``, ``"bf16"`` or an `AMP_TYPE`.
      process_group: a ``ProcessGroup`` or a sequence of them (e.g. tensor-parallel and
        pipeline groups): ``found_inf`` is MAX-all-reduced over each, so all their ranks
        skip or step together. None: no reduction (with plain DDP the gradients are
        already identical on every rank).
      device: ``"cpu"`` or ``"cuda"`` to assert where the model runs; None = its params'.
      **config: the mode's keys (above).

    Returns:
      ``(model, optimizer, criterion)``: `AmpModel`, `AmpOptimizer` (a list of them for
      a list of optimizers) and `AmpCriterion` (or None).

    Raises:
      ValueError: unknown mode, opt level or config key (the message lists the valid
        ones), inconsistent config, a half-precision model where float32 is needed, or an
        optimizer that already has state.
      RuntimeError: ``device="cuda"`` without CUDA.

    Examples:
      >>> import torch, mpfunc_torch
      >>> net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
      >>> opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
      >>> model, opt, crit = mpfunc_torch.convert_to_amp(
      ...     net, opt, torch.nn.MSELoss(), mode="naive", growth_interval=100)
      >>> net[0].weight.dtype, opt.param_groups[0]["params"][0].dtype
      (torch.float16, torch.float32)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"`model` must be a torch.nn.Module, got {type(model).__name__}.")
    optimizers = list(optimizer) if isinstance(optimizer, list | tuple) else [optimizer]
    for opt in optimizers:
        if not isinstance(opt, torch.optim.Optimizer) or isinstance(opt, AmpOptimizer):
            raise TypeError("`optimizer` must be a torch.optim.Optimizer (not already "
                            f"converted) or a list of them, got {type(opt).__name__}.")
    if not optimizers:
        raise ValueError("`optimizer` is an empty list.")
    plan = resolve_amp(mode, config)
    if len(optimizers) > 1 and plan.num_losses > 1:
        raise ValueError("`num_losses > 1` with several optimizers is not supported; use "
                         "one optimizer with per-loss scales, or one shared scale.")
    dev = _device_of(model, device)
    groups = normalize_groups(process_group)
    half = [n for n, p in model.named_parameters() if p.dtype in _HALF]
    if half and plan.enabled and plan.cast_model_type in (None, "float32"):
        raise ValueError(
            f"mode {plan.mode!r}{' ' + plan.opt_level if plan.opt_level else ''} needs "
            f"float32 params, but {half[:3]}{'...' if len(half) > 3 else ''} are half "
            "precision. Gradients of half params cannot be unscaled safely; give the model "
            "in float32 and use mode='naive' (or apex O2), which keep float32 master "
            "weights, or call model.float() first."
        )
    if half and plan.enabled and plan.cast_model_type in ("float16", "bfloat16"):
        raise ValueError(
            f"`model` params {half[:3]} are already half precision; give the model in "
            "float32 so the float32 master weights start from the exact values."
        )
    masters: dict[int, torch.Tensor] | None = None
    if plan.enabled and plan.cast_model_type is not None:
        target = _DTYPES[plan.cast_model_type]
        if plan.master_weights:
            if any(len(opt.state) > 0 for opt in optimizers):
                raise ValueError("`optimizer` already has state; convert it to master "
                                 "weights before its first step.")
            # The master aliases the float32 storage the model is about to drop: exact
            # values and no extra copy.
            masters = {id(p): nn.Parameter(p.detach(), requires_grad=p.requires_grad)
                       for opt in optimizers for g in opt.param_groups for p in g["params"]}
        _cast_model(model, target, plan.keep_norm_fp32)
        if masters is not None:
            dtypes = {id(p): p.dtype for opt in optimizers for g in opt.param_groups
                      for p in g["params"]}
            masters = {k: m for k, m in masters.items() if dtypes[k] != torch.float32}
    _refuse_broken_fused_sgd(optimizers, masters)
    if plan.verbose:
        print(f"mpfunc_torch.convert_to_amp: {plan.describe()}")
    amp_model = AmpModel(model, plan, dev.type)
    first = AmpOptimizer(optimizers[0], plan, device=dev, masters=masters,
                         process_groups=groups)
    shared = first._shared
    shared.n = len(optimizers)
    amp_opts = [first] + [
        AmpOptimizer(opt, plan, device=dev, masters=masters, process_groups=groups,
                     shared=shared)
        for opt in optimizers[1:]
    ]
    amp_crit = AmpCriterion(criterion, dev.type) if criterion is not None else None
    out_opt = amp_opts if isinstance(optimizer, list | tuple) else amp_opts[0]
    return amp_model, out_opt, amp_crit

