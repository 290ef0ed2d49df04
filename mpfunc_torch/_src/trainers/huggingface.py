"""`AmpTrainer`: HuggingFace's ``Trainer`` training in any mode of `convert_to_amp`.

The Trainer is met at its seams, nothing of its loop is copied:

* ``create_optimizer``: the Trainer's optimizer (``args.optim``, weight-decay groups, or
  the one passed in ``optimizers=``) and ``self.model`` are converted once; the converted
  optimizer is handed to accelerate already wrapped (`_StepAwareOptimizer`), so that
  ``accelerator.optimizer_step_was_skipped`` tells the Trainer about a skipped step and
  it does not step the LR scheduler then, as with its own ``fp16=True``;
* ``accelerator.scaler`` (`_AmpScaler`): ``accelerator.backward`` scales every loss
  through it, and the Trainer saves and restores it (``scaler.pt``) as it does its
  GradScaler;
* ``compute_loss_context_manager``: the loss runs in the converted forward's precision;
* ``_clip_grad_norm`` / ``_get_grad_norm``: clipping and the logged norm use the
  unscaled gradients (float32 master gradients with master weights), global norm;
* ``log``: ``loss_scale`` and ``skipped_steps`` join each training log.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

from _mpfunc_common.extras import missing_extra_error
from mpfunc_torch._src.autocast import step_context
from mpfunc_torch._src.optimizer import AmpOptimizer
from mpfunc_torch._src.trainers.trainer_amp import TrainerAmp

try:
    import transformers
    from accelerate.optimizer import AcceleratedOptimizer
except ModuleNotFoundError as _error:
    raise missing_extra_error("mpfunc_torch.transformers (AmpTrainer)", "hf", _error) from _error

__all__ = ["AmpTrainer"]

# The Trainer's own precision options, each of which clashes with `amp_mode`.
_CLASHES = {
    "fp16": "it turns on the Trainer's own float16 autocast and GradScaler",
    "bf16": "it turns on the Trainer's own bfloat16 autocast",
    "fp16_full_eval": "it casts the whole model to float16 for evaluation",
    "bf16_full_eval": "it casts the whole model to bfloat16 for evaluation",
}


class _StepAwareOptimizer(AcceleratedOptimizer):
    """accelerate's optimizer wrapper around an `AmpOptimizer`, whose
    ``step_was_skipped`` is True after a skipped step (accelerate's own says so only for
    its GradScaler). It reads one flag from the device per step, as GradScaler's step
    does; the Trainer reads the loss for NaN every step already."""

    def __init__(self, optimizer: AmpOptimizer):
        super().__init__(optimizer, device_placement=False, scaler=None)
        self._skipped = False
        self._is_accelerate_prepared = True  # accelerate.prepare returns it as it is

    def step(self, closure: Any = None) -> None:
        super().step(closure)
        if self.gradient_state.sync_gradients:
            self._skipped = not bool(self.optimizer.scale_metrics()["last_finite"])

    @property
    def step_was_skipped(self) -> bool:
        return self._skipped


class _AmpScaler:
    """What accelerate and the Trainer call on ``accelerator.scaler``, for an
    `AmpOptimizer`: ``scale`` (in ``accelerator.backward``), ``state_dict`` /
    ``load_state_dict`` (the Trainer's ``scaler.pt``), ``get_scale``, ``is_enabled``."""

    def __init__(self, optimizer: AmpOptimizer):
        self.optimizer = optimizer

    def scale(self, loss):
        return self.optimizer.scale_loss(loss)

    def unscale_(self, optimizer: Any = None) -> None:
        if self.optimizer._stage != "unscaled":
            self.optimizer.unscale_()

    def update(self, new_scale: Any = None) -> None:
        """Nothing: the loss scale is updated in the optimizer's step."""

    def get_scale(self) -> float:
        return float(self.optimizer.loss_scale)

    def is_enabled(self) -> bool:
        return True

    def state_dict(self) -> dict[str, Any]:
        """The loss scalers' states (they are in ``optimizer.pt`` too, with the masters)."""
        return {"format": "mpfunc_torch.AmpTrainer",
                "scalers": [s.state_dict() for s in self.optimizer._scalers]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Our own ``scaler.pt``, or a ``torch.amp.GradScaler`` state from a run with the
        Trainer's ``fp16=True`` (its scale and growth tracker continue)."""
        if not (isinstance(state, dict) and state.get("format") == "mpfunc_torch.AmpTrainer"):
            self.optimizer.load_state_dict(state)  # a GradScaler state, or a clear error
            return
        scalers, mine = state.get("scalers"), self.optimizer._scalers
        if not isinstance(scalers, list) or len(scalers) != len(mine):
            raise ValueError(f"`scaler.pt` holds {scalers!r:.80}, not {len(mine)} loss-scaler "
                             "states (one per loss) of this mode.")
        values = [s.check_state(sd, f"scaler.pt['scalers'][{i}]")
                  for i, (s, sd) in enumerate(zip(mine, scalers))]
        for s, v in zip(mine, values):  # all checked first: all or nothing
            s._apply(v)


class AmpTrainer(transformers.Trainer):
    """``transformers.Trainer`` training in a mode of `convert_to_amp`.

    Takes every ``Trainer`` argument, plus ``amp_mode`` and ``amp_config``. At the start
    of ``train()`` the model and the Trainer's optimizer are converted (once; later
    ``train()`` calls reuse them). Then:

    * every backward is scaled, and the gradients are unscaled once per optimizer step,
      also with ``gradient_accumulation_steps``;
    * ``max_grad_norm`` clips the unscaled gradients by their global norm (the float32
      master gradients with master weights), and the logged ``grad_norm`` is theirs;
    * a step whose loss or gradients are not finite is skipped with params, master
      weights and optimizer state unchanged, and the LR scheduler does not step, as
      with the Trainer's ``fp16=True`` (this reads one flag from the device per step);
    * ``loss_scale`` and ``skipped_steps`` join each training log (``state.log_history``);
    * checkpoints carry the loss scale, the skip counters and, for naive / apex O2, the
      float32 master weights (in ``optimizer.pt``; the scale also in ``scaler.pt``), and
      ``train(resume_from_checkpoint=...)`` resumes exactly. A checkpoint of a
      ``fp16=True`` run resumes too: its GradScaler's scale carries over.

    The Trainer's ``fp16``, ``bf16``, ``fp16_full_eval`` and ``bf16_full_eval`` clash
    with ``amp_mode`` and are refused, as are DeepSpeed and FSDP (they keep their own
    precision and optimizer wrappers).

    Args:
      *args: the ``Trainer``'s arguments.
      amp_mode: ``"torch"``, ``"apex"``, ``"naive"``, ``"bf16"``, ``"fp8"``, an
        ``AMP_TYPE``, a Booster name or config object (as `convert_to_amp` takes it).
      amp_config: the mode's keys (``opt_level``, ``initial_scale``, ...) and
        `convert_to_amp`'s ``process_group``, ``fp8_amax_group``, ``is_norm``,
        ``step_chunks``, ``record_skip_leaves``. Checked here, before anything runs.
      **kwargs: the ``Trainer``'s keyword arguments.

    Raises:
      ValueError: an unknown mode or key, a bad value, or a clashing Trainer option
        (the message says which to drop).
      TypeError: ``amp_config`` that is not a dict, or a value of the wrong type.
    """

    def __init__(self, *args: Any, amp_mode: Any, amp_config: dict[str, Any] | None = None,
                 **kwargs: Any):
        self._amp = TrainerAmp(amp_mode, {} if amp_config is None else amp_config,
                               arg="amp_mode")
        super().__init__(*args, **kwargs)
        for option, why in _CLASHES.items():
            if getattr(self.args, option, False):
                raise ValueError(
                    f"`{option}=True` (TrainingArguments) and `amp_mode={self._amp!r:.40}` "
                    f"both set the precision: {why}. Drop `{option}=True`; AmpTrainer's "
                    "amp_mode does the mixed precision, loss scaling included.")
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise ValueError(
                f"AmpTrainer does not combine with {'DeepSpeed' if self.is_deepspeed_enabled else 'FSDP'} "
                "(it keeps its own precision and optimizer wrapper): drop "
                f"`{'deepspeed' if self.is_deepspeed_enabled else 'fsdp'}=` from "
                "TrainingArguments, or use the Trainer with its own precision options.")

    @property
    def amp_optimizer(self) -> AmpOptimizer:
        """The converted optimizer (after ``train()`` has started)."""
        return self._amp.first("AmpTrainer.amp_optimizer")

    def scale_metrics(self, as_python: bool = False, loss_id: int = 0, *,
                      skip_leaves: bool = False) -> dict[str, Any]:
        """`AmpOptimizer.scale_metrics` of the converted optimizer: device tensors, or
        Python numbers with ``as_python=True`` (which reads them from the device)."""
        return self._amp.scale_metrics("AmpTrainer.scale_metrics", as_python, loss_id,
                                       skip_leaves=skip_leaves)

    def create_optimizer(self, model: Any = None):
        """The Trainer's optimizer, converted to the mode once (an `AmpOptimizer`, behind
        accelerate's scaler interface).

        Raises:
          ValueError: the Trainer asks for an optimizer over a prepared model (FSDP,
            SageMaker model parallel), which AmpTrainer does not support.
        """
        if self._amp.module is not None and self._amp.module is self.model:
            return self.optimizer  # converted in an earlier train()
        if model is not None and model is not self.model:
            raise ValueError("AmpTrainer converts `self.model`; the Trainer asked for an "
                             f"optimizer over a prepared {type(model).__name__} instead "
                             "(FSDP, SageMaker model parallel), which it does not support.")
        optimizer = super().create_optimizer()
        while isinstance(optimizer, AcceleratedOptimizer):
            optimizer = optimizer.optimizer
        if self.model is None:  # HF sets it from `model` or `model_init` before this
            raise ValueError("AmpTrainer needs a model: give the Trainer `model=` or "
                             "`model_init=`.")
        (amp_optimizer,) = self._amp.convert(self.model, [optimizer])
        self.optimizer = _StepAwareOptimizer(amp_optimizer)
        self.accelerator.scaler = _AmpScaler(amp_optimizer)
        return self.optimizer

    def compute_loss_context_manager(self) -> contextlib.ExitStack:
        """The Trainer's context around ``compute_loss`` (training and evaluation), with
        the precision of the converted forward: the mode's autocast and function mode,
        so a loss computed outside the model (``compute_loss_func``, label smoothing, an
        overridden ``compute_loss``) runs as it would inside its ``forward``."""
        stack = super().compute_loss_context_manager()
        stack.enter_context(step_context(self._amp.plan, self.args.device.type))
        return stack

    def _clip_grad_norm(self, model: Any):
        """Clips the unscaled gradients to ``max_grad_norm``; returns the norm before."""
        return self.amp_optimizer.clip_grad_norm(self.args.max_grad_norm)

    def _get_grad_norm(self, model: Any, grad_norm: Any = None):
        if grad_norm is None:  # max_grad_norm=0: the norm is still logged
            grad_norm = self.amp_optimizer.clip_grad_norm(math.inf)
        return super()._get_grad_norm(model, grad_norm=grad_norm)

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """The Trainer's log, with ``loss_scale`` and ``skipped_steps`` beside the loss."""
        if "loss" in logs and self._amp.optimizers:
            metrics = self.amp_optimizer.scale_metrics(as_python=True)
            logs.update(loss_scale=metrics["loss_scale"],
                        skipped_steps=metrics["skipped_steps"])
        super().log(logs, *args, **kwargs)
