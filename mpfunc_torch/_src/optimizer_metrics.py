"""`AmpOptimizer`'s reading side: its loss scale, skip metrics and precision report
(`optimizer_report`, on ``precision_report``'s rows).

A mixin of `AmpOptimizer` (``optimizer``), kept apart so the step's state machine reads
on its own; the attributes below are set by `AmpOptimizer.__init__`.
"""

from __future__ import annotations

from typing import Any

import torch

from _mpfunc_common.amp_config import check_bool
from mpfunc_torch._src import fused
from mpfunc_torch._src.cancelled_updates import match_tensors
from mpfunc_torch._src.distributed import normalize_groups
from mpfunc_torch._src.loss_scale import LossScaler
from mpfunc_torch._src.precision_report import PrecisionReport, _dense, _format, _report
from mpfunc_torch._src.skip_record import current_grads, param_names, skip_names

__all__ = ["OptimizerMetrics", "optimizer_report"]


class OptimizerMetrics:
    """`loss_scale`, `skipped_steps`, `scale_metrics`, `record_skip_leaves` and
    `precision_report` of `AmpOptimizer`."""

    _scalers: list[LossScaler]
    _fused: bool
    _record_skips_every_step: bool
    num_zeros_in_grad: torch.Tensor | None

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

    def scale_metrics(self, as_python: bool = False, loss_id: int = 0, *,
                      skip_leaves: bool = False) -> dict[str, Any]:
        """``loss_scale``, ``skipped_steps``, ``consecutive_skips``, ``last_finite`` (and
        ``num_zeros_in_grad`` when logged): device tensors, or Python numbers with
        ``as_python=True``. With ``skip_leaves=True``, also ``skip_leaves``: the names of
        the params whose gradient held an inf or NaN at the last skipped step (``[]``
        before any skip), read from the device then."""
        out = self._scaler(loss_id).metrics(as_python)
        if self.num_zeros_in_grad is not None:
            z = self.num_zeros_in_grad
            out["num_zeros_in_grad"] = int(z) if as_python else z
        if skip_leaves:
            if self._fused and not self._record_skips_every_step:
                raise ValueError(
                    "`skip_leaves=True` with a fused optimizer needs "
                    "`optimizer.record_skip_leaves()` before the steps: its kernel decides a "
                    "skip on the device, so the record costs one check launch per gradient "
                    "every step, and is off by default. `optimizer.precision_report()` "
                    "names the non-finite params of the current step at any time.")
            out["skip_leaves"] = skip_names(self)
        return out

    def record_skip_leaves(self, enabled: bool = True) -> None:
        """Records which params make a step skip, for ``scale_metrics(skip_leaves=True)``,
        with a fused optimizer (``fused=True``).

        A non-fused optimizer's step already reads the overflow flag on the host, so
        its record is taken on a skipped step only, for free, and is always on. A fused
        optimizer decides the skip inside its kernel with no host read; recording there
        runs the check once per gradient (one launch each, the same bytes) instead of
        one multi-tensor launch, every step, so it is off until this is called.

        Args:
          enabled: True to record from the next step on; False to stop.
        """
        self._record_skips_every_step = check_bool("enabled", enabled)

    @fused.eager
    def precision_report(self, dtype: Any = None, *, process_group: Any = None,
                         updates: Any = None):
        """`mpfunc_torch.precision_report` of the gradients this step will use, at the
        current scale, named as in the model; call it between `backward` and `step`
        (see `optimizer_report`). ``dtype`` defaults to the mode's half dtype; ``updates``
        adds ``update_cancelled`` against the params as the model stores them."""
        return optimizer_report(self, dtype, process_group, updates)


def optimizer_report(opt, dtype: Any = None, process_group: Any = None,
                     updates: Any = None) -> PrecisionReport:
    """`AmpOptimizer.precision_report`: the report of the gradients the step will use.

    Before `unscale_` it reads the model's gradients, which still carry the scale; after
    it, the unscaled ones (naive and apex O2's float32 master gradients); either way the
    rows are those of the unscaled gradients at the current loss scale. Params are named
    as in the converted model's ``named_parameters()``; a watched model adds
    ``first_nonfinite_module``. ``dtype`` defaults to the mode's half dtype (float32
    where nothing is cast); ``process_group`` as in `precision_report`. ``updates`` (one
    float32 tensor or None per param in that order, or a dict by name) adds
    ``update_cancelled``, read against each param as the model stores it (the bfloat16
    param of a remainder, Kahan or stochastic run, the half param of naive or apex O2):
    the same rows as ``precision_report(model, updates=...)``.

    Raises:
      RuntimeError: before any ``backward``, or after ``step`` (the gradients were used,
        and with master weights released).
    """
    if opt._stage == "ready":
        raise RuntimeError("precision_report() reads the gradients of the current step: call "
                           "it after backward() and before step() (after step() they were "
                           "used, and with master weights released).")
    plan = opt.plan
    if dtype is None:
        dtype = "float32" if not plan.enabled else "bfloat16" if plan.fp8_recipe is not None \
            else (plan.cast_model_type or plan.autocast_dtype or "float32")
    fmt = _format(dtype)
    groups = normalize_groups(process_group)
    opt._finish_pending()
    grads = current_grads(opt)
    keep = [i for i, g in enumerate(grads) if g is not None]
    names = param_names(opt)
    scaler = opt._scalers[0]
    scale = scaler.scale if plan.enabled and scaler.kind != "none" else \
        torch.ones((), dtype=torch.float32, device=opt._device)
    prescaled = opt._stage == "backward" and not opt._grads_unscaled and \
        plan.enabled and scaler.kind != "none"
    model = opt._model_ref() if getattr(opt, "_model_ref", None) is not None else None
    tensors = [grads[i] for i in keep]
    pairs = None
    if updates is not None:
        given = match_tensors(list(zip(names, opt._sources)), updates, "updates",
                              "the optimizer's model")
        pairs = [(opt._sources[i], given[i]) for i in keep]
    return _report([names[i] for i in keep], [_dense(g) for g in tensors], tensors, scale,
                   fmt, groups, prescaled, model, pairs)
