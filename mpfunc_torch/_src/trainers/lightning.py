"""`AmpPrecision`: `convert_to_amp`'s modes as a Lightning precision plugin.

One class for both Lightning packages: it derives from the ``Precision`` plugin class of
``pytorch_lightning`` and of ``lightning`` (``lightning.pytorch``), whichever are
installed, so either package's ``Trainer(plugins=[...])`` takes it. Where a base method
calls into its own package (the hooks around backward and the optimizer step, and
Lightning's gradient-clipping hook), the method of the package the model belongs to runs.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from _mpfunc_common.amp_config import check_bool
from _mpfunc_common.extras import missing_extra_error
from mpfunc_torch._src.autocast import step_context
from mpfunc_torch._src.cast_ahead import cast_ahead, cast_ahead_of, sync_cast_ahead_
from mpfunc_torch._src.model import DTYPES, cast_floats
from mpfunc_torch._src.optimizer import AmpOptimizer
from mpfunc_torch._src.trainers.trainer_amp import TrainerAmp

__all__ = ["AmpPrecision"]


def _packages() -> tuple[list[type], list[type]]:
    """The ``Precision`` plugin classes and ``LightningModule`` classes of the installed
    Lightning packages (``pytorch_lightning`` first)."""
    bases, modules, error = [], [], None
    for name in ("pytorch_lightning", "lightning.pytorch"):
        try:
            package = importlib.import_module(name)
        except ModuleNotFoundError as e:
            error = error or e
            continue
        bases.append(package.plugins.precision.Precision)
        modules.append(package.LightningModule)
    if not bases and error is not None:  # neither package imports
        raise missing_extra_error("mpfunc_torch.lightning (the Lightning precision plugin)",
                                  "lightning", error)
    return bases, modules


_BASES, _MODULES = _packages()


def _lightning_name(plan) -> str:
    """What ``Trainer.precision`` reports: Lightning's name for the same precision."""
    if not plan.enabled:
        return "32-true"
    if plan.cast_model_type in ("float16", "bfloat16"):
        return "16-true" if plan.cast_model_type == "float16" else "bf16-true"
    if plan.autocast_dtype is not None:
        return "16-mixed" if plan.autocast_dtype == "float16" else "bf16-mixed"
    return "32-true"


class AmpPrecision(*_BASES):
    """`convert_to_amp`'s modes in Lightning: ``Trainer(plugins=[AmpPrecision(...)])``.

    The plugin converts the ``LightningModule`` and the optimizers that
    ``configure_optimizers`` returns with `convert_to_amp` when the ``Trainer`` connects
    it (once: a validation, test or predict run after the fit finds them converted).
    Then, inside Lightning's own loop:

    * each step (``training_step``, ``validation_step``, ``test_step``,
      ``predict_step``) runs in the precision of the converted forward: the mode's
      autocast and function mode, so a loss computed in the step from a submodule's
      output is float32 (naive, apex O2) and float32 tensors made there meet the half
      layers in their dtype; with half-precision params (naive, apex O2/O3) floating
      tensors of each batch arrive in that dtype, as with Lightning's
      ``precision="16-true"``;
    * each backward is scaled (several with ``accumulate_grad_batches``: the gradients
      are unscaled once, at the step) and unscaled before ``on_before_optimizer_step``;
    * ``gradient_clip_val`` clips the unscaled gradients by their global norm (over the
      process groups and device meshes the mode reduces over; float32 master gradients
      with master weights), or by value with ``gradient_clip_algorithm="value"``;
    * a step whose loss or gradients are not finite is skipped, params, master weights
      and optimizer state unchanged; the LR scheduler still steps, as with Lightning's
      ``precision="16-mixed"``;
    * ``loss_scale`` and ``skipped_steps`` are logged with ``LightningModule.log`` after
      each optimizer step, as device tensors: nothing is read from the device unless a
      logger or the progress bar reads them;
    * checkpoints carry the optimizers' `AmpOptimizer.state_dict` (loss scale, skip
      counters and, for naive / apex O2, the float32 master weights), so
      ``fit(ckpt_path=...)`` resumes exactly.

    ``precision=`` given to the ``Trainer`` as well is refused by Lightning itself
    ("Received both `precision=...` and `plugins=...`"): drop ``precision``. With
    several optimizers (manual optimization) they share one loss scale, each stepped
    once per iteration. Under DDP (``strategy="ddp"`` / ``"ddp_spawn"``), which wraps the
    model before the plugin gets the optimizers, the half modes' params are cast in
    `convert_module`, before the wrap, and the masters start from their float32 values
    (rank 0's).

    Args:
      mode: ``"torch"``, ``"apex"``, ``"naive"``, ``"bf16"``, ``"fp8"``, an ``AMP_TYPE``,
        a Booster name or config object (as `convert_to_amp` takes it).
      log_metrics: log ``loss_scale`` and ``skipped_steps`` after each step (default True).
      **config: the mode's keys (``opt_level``, ``initial_scale``, ``hysteresis``, ...) and
        `convert_to_amp`'s ``process_group``, ``fp8_amax_group``, ``is_norm``,
        ``step_chunks``, ``record_skip_leaves``. Checked here: a bad key fails now.

    Raises:
      ValueError: an unknown mode or key, or a bad value (named as you spelled it).
      TypeError: a value of the wrong type.

    Examples:
      >>> from mpfunc_torch.lightning import AmpPrecision
      >>> plugin = AmpPrecision("naive", hysteresis=1)  # any key of the mode
      >>> plugin, plugin.precision
      (AmpPrecision('naive', hysteresis=1), '16-true')
    """

    def __init__(self, mode: Any, *, log_metrics: bool = True, **config: Any):
        self._amp = TrainerAmp(mode, config)
        self._log_metrics = check_bool("log_metrics", log_metrics)
        self.precision = _lightning_name(self._amp.plan)
        self._device_type = "cuda" if torch.cuda.is_available() else "cpu"

    def __repr__(self) -> str:
        return f"AmpPrecision({self._amp!r})"

    # -- what the plugin converted --------------------------------------------------------
    @property
    def optimizers(self) -> list[AmpOptimizer]:
        """The converted optimizers (empty before the fit starts)."""
        return list(self._amp.optimizers)

    def scale_metrics(self, as_python: bool = False, loss_id: int = 0, *,
                      skip_leaves: bool = False) -> dict[str, Any]:
        """`AmpOptimizer.scale_metrics` of the (first) converted optimizer: device tensors,
        or Python numbers with ``as_python=True`` (which reads them from the device)."""
        return self._amp.scale_metrics("AmpPrecision.scale_metrics", as_python, loss_id,
                                       skip_leaves=skip_leaves)

    def _base(self, module: Any) -> type:
        """The ``Precision`` class of the Lightning package ``module`` belongs to."""
        for base, module_type in zip(_BASES, _MODULES):
            if isinstance(module, module_type):
                return base
        return _BASES[0]

    def _amp_optimizer(self, optimizer: Any) -> AmpOptimizer:
        inner = optimizer
        while not self._amp.is_ours(inner) and hasattr(inner, "_optimizer"):
            inner = inner._optimizer  # a LightningOptimizer
        if not self._amp.is_ours(inner):
            raise TypeError(
                f"`optimizer` ({type(optimizer).__name__}) is not one AmpPrecision converted; "
                "the plugin steps, unscales and clips only the optimizers of the fit it "
                "connected to (trainer.optimizers).")
        return inner

    # -- conversion ---------------------------------------------------------------------
    def connect(self, model: nn.Module, optimizers: list, lr_schedulers: list) -> tuple:
        """Converts the ``LightningModule`` under ``model`` and ``optimizers`` (once)."""
        module = model
        while not isinstance(module, tuple(_MODULES)) and isinstance(
                inner := getattr(module, "module", None), nn.Module):
            module = inner  # a strategy's wrapper (DistributedDataParallel)
        params = list(module.parameters())
        if params:
            self._device_type = params[0].device.type
        if module is self._amp.module:
            if all(self._amp.is_ours(o) for o in optimizers):
                return model, optimizers, lr_schedulers  # validate/test after the fit
            raise ValueError(
                "AmpPrecision already converted this model in an earlier fit, and "
                "configure_optimizers made new optimizers for this one; a model is "
                "converted once. Resume in a new Trainer with a new model and plugin: "
                "`Trainer(plugins=[AmpPrecision(...)]).fit(model, ckpt_path=...)`.")
        if not optimizers:
            return model, optimizers, lr_schedulers  # evaluation only: runs as it is
        if model is not module and self._amp.half_params:
            if cast_ahead_of(module, self._amp.plan) is None:
                raise ValueError(
                    f"AmpPrecision({self._amp!r}) casts the params to "
                    f"{self._amp.plan.cast_model_type}, but the strategy wrapped the model "
                    f"in {type(model).__name__} (which holds hooks on the float32 params) "
                    "without calling the plugin's convert_module first, which casts them "
                    "before the wrap. Use a mode that keeps float32 params (torch, bf16, "
                    "apex O1, fp8) with this strategy, or one that calls convert_module.")
            group = getattr(model, "process_group", None)
            if group is not None:  # DDP broadcast rank 0's params: the masters follow
                sync_cast_ahead_(module, group)
        return model, self._amp.convert(module, optimizers), lr_schedulers

    def convert_module(self, module: nn.Module) -> nn.Module:
        """With half params (naive, apex O2/O3): casts them in place when a fit starts,
        before a strategy wraps the model (DDP holds hooks on the params it sees), keeping
        their float32 values for the master weights made when the optimizers arrive
        (`connect`). A validation, test or predict run alone leaves the model as it is."""
        trainer = getattr(module, "_trainer", None)
        fitting = trainer is not None and trainer.state.fn == "fit"
        if fitting and module is not self._amp.module:
            cast_ahead(module, self._amp.plan, self._amp.kwargs.get("is_norm"))
        return module

    def forward_context(self) -> contextlib.AbstractContextManager:
        """The precision of the converted forward around each step (``training_step``,
        ``validation_step``, ``test_step``, ``predict_step``): the mode's autocast and
        its function mode (apex O1's float32 list; naive's and apex O2's float32
        functions; the one-dtype rule of every half-param mode), so a loss computed in
        the step runs as it would inside the model's ``forward``."""
        return step_context(self._amp.plan, self._device_type)

    def convert_input(self, data: Any) -> Any:
        """Floating tensors of a batch in the params' half dtype (naive, apex O2/O3)."""
        half = self._amp.plan.cast_model_type  # set where half_params
        if self._amp.half_params and self._amp.module is not None and half is not None:
            return cast_floats(data, DTYPES[half])
        return data

    # -- backward and step --------------------------------------------------------------
    def pre_backward(self, tensor: torch.Tensor, module: Any) -> torch.Tensor:
        """The loss, multiplied by the current loss scale (Lightning's hook)."""
        if self._amp.optimizers:
            tensor = self._amp.optimizers[0].scale_loss(tensor)
        return self._base(module).pre_backward(self, tensor, module)

    def post_backward(self, tensor: torch.Tensor, module: Any) -> Any:
        """Lightning's own hook (nothing of the scale to undo: gradients are unscaled at
        the step)."""
        return self._base(module).post_backward(self, tensor, module)

    def _after_closure(self, model: Any, optimizer: Any) -> None:
        self._base(model)._after_closure(self, model, optimizer)

    def _clip_gradients(self, model: Any, optimizer: Any, clip_val: Any = None,
                        gradient_clip_algorithm: Any = None) -> None:
        self._base(model)._clip_gradients(self, model, optimizer, clip_val,
                                          gradient_clip_algorithm)

    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any],
                       **kwargs: Any) -> Any:
        """Runs ``closure`` (training step and scaled backward), unscales, runs Lightning's
        ``on_before_optimizer_step`` hooks and gradient clipping, then steps or skips."""
        opt = self._amp_optimizer(optimizer)
        closure_result = closure()
        # training_step returned None: no backward, no step (as with 16-mixed).
        skipped_backward = closure_result is None and model.automatic_optimization
        if not skipped_backward and self._unscale_before_hooks(model):
            self.unscale_gradients(opt)
        self._after_closure(model, opt)
        if skipped_backward:
            return closure_result
        opt.step(**kwargs)
        self._log(model)
        return closure_result

    def _unscale_before_hooks(self, model: Any) -> bool:
        """The hooks get unscaled gradients, except with ``step_chunks > 1`` and no
        clipping, where unscaling all gradients at once would undo the chunked step's
        memory saving (the hooks then see the scaled half gradients)."""
        if self._amp.kwargs.get("step_chunks", 1) == 1:
            return True
        return bool(getattr(model.trainer, "gradient_clip_val", None))

    def _log(self, model: Any) -> None:
        trainer = getattr(model, "_trainer", None)
        if not self._log_metrics or trainer is None or getattr(trainer, "barebones", False):
            return
        opt = self._amp.optimizers[0]
        # Tensors, not numbers: Lightning keeps them on the device until a logger reads.
        model.log("loss_scale", opt.loss_scale, on_step=True, on_epoch=False)
        model.log("skipped_steps", opt.skipped_steps.float(), on_step=True, on_epoch=False)

    # -- clipping -----------------------------------------------------------------------
    def clip_gradients(self, optimizer: Any, clip_val: float = 0.0,
                       gradient_clip_algorithm: Any = "norm") -> None:
        """Clips the unscaled gradients: ``"norm"`` by their global norm
        (`AmpOptimizer.clip_grad_norm`), ``"value"`` elementwise."""
        if not clip_val or clip_val <= 0:
            return
        algorithm = str(getattr(gradient_clip_algorithm, "value", gradient_clip_algorithm))
        if algorithm.lower() == "value":
            self.clip_grad_by_value(optimizer, clip_val)
        elif algorithm.lower() == "norm":
            self.clip_grad_by_norm(optimizer, clip_val)
        else:
            raise ValueError("`gradient_clip_algorithm` must be 'norm' or 'value', got "
                             f"{gradient_clip_algorithm!r}.")

    def clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        """Clips the unscaled gradients to a global norm (`AmpOptimizer.clip_grad_norm`:
        over the masters with master weights, reduced over the process groups)."""
        self._amp_optimizer(optimizer).clip_grad_norm(clip_val)

    def clip_grad_by_value(self, optimizer: Any, clip_val: float) -> None:
        """Unscales, then clips each gradient element to ``[-clip_val, clip_val]``."""
        self.unscale_gradients(optimizer)
        torch.nn.utils.clip_grad_value_(list(self.main_params(optimizer)), clip_val)

    def unscale_gradients(self, optimizer: Any) -> None:
        """Unscales the gradients of ``optimizer`` (if not yet done this step)."""
        opt = self._amp_optimizer(optimizer)
        if opt._stage != "unscaled":
            opt.unscale_()

    def main_params(self, optimizer: Any):
        """The params the optimizer steps: the float32 masters with master weights."""
        for group in self._amp_optimizer(optimizer).param_groups:
            yield from group["params"]

    # -- checkpoints --------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The mode, for the check on load; the loss scale, skip counters and master
        weights are in the optimizers' states, which Lightning saves too."""
        plan = self._amp.plan
        return {"mode": plan.mode, "opt_level": plan.opt_level}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Checks that the checkpoint was trained in this mode.

        Raises:
          ValueError: the checkpoint's mode (or opt level) is another.
        """
        plan = self._amp.plan
        saved = (state_dict.get("mode"), state_dict.get("opt_level"))
        if saved != (plan.mode, plan.opt_level):
            def name(mode, level):
                return f"{mode!r}" + (f" {level}" if level else "")

            raise ValueError(
                f"the checkpoint was trained with AmpPrecision mode {name(*saved)}, and this "
                f"plugin's mode is {name(plan.mode, plan.opt_level)}; resume with the same "
                "mode (its loss scale and master weights are in the checkpoint).")
