"""What the trainer integrations share: a mode and its keys, checked when the plugin or
trainer is built, and the one `convert_to_amp` call that converts the model and its
optimizers once, when the trainer has made them.

Used by `mpfunc_torch.lightning.AmpPrecision` (``lightning.py``) and
`mpfunc_torch.transformers.AmpTrainer` (``huggingface.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from _mpfunc_common.amp_config import AmpPlan, check_bool, resolve_amp
from _mpfunc_common.mixed_precision import mode_and_config
from mpfunc_torch._src.modes import convert_to_amp
from mpfunc_torch._src.optimizer import AmpOptimizer

__all__ = ["TrainerAmp"]

# `convert_to_amp`'s keyword arguments that are not mode keys: passed through as given.
CONVERT_KWARGS = ("process_group", "fp8_amax_group", "device", "is_norm", "step_chunks",
                  "record_skip_leaves")


class TrainerAmp:
    """A mode, its keys and `convert_to_amp`'s other keyword arguments, checked now, and
    the conversion they describe, done once per model.

    Args:
      mode: anything `convert_to_amp` takes as ``mode`` ("torch", "apex", "naive",
        "bf16", "fp8", an ``AMP_TYPE``, a Booster name or a config object).
      config: the mode's keys, and any of ``process_group``, ``fp8_amax_group``,
        ``device``, ``is_norm``, ``step_chunks``, ``record_skip_leaves``.
      arg: how the caller spells the mode argument, for error messages.
    """

    def __init__(self, mode: Any, config: Mapping[str, Any], arg: str = "mode"):
        if not isinstance(config, Mapping):
            raise TypeError(f"the mode's keys must be a dict, got {type(config).__name__}: "
                            f"{config!r}.")
        config = dict(config)
        self.kwargs = {k: config.pop(k) for k in CONVERT_KWARGS if k in config}
        if "record_skip_leaves" in self.kwargs:
            check_bool("record_skip_leaves", self.kwargs["record_skip_leaves"])
        if mode is None:
            raise ValueError(f"`{arg}` is None; name the mode: 'torch', 'apex' (with "
                             "opt_level), 'naive', 'bf16' or 'fp8'.")
        # Every key and value is checked here, before the trainer runs anything.
        self.plan: AmpPlan = resolve_amp(*mode_and_config(mode, None, config))
        self.mode, self.config = mode, config
        self.module: torch.nn.Module | None = None  # the converted model
        self.optimizers: list[AmpOptimizer] = []

    def __repr__(self) -> str:
        keys = {**self.config, **self.kwargs}
        return ", ".join([repr(getattr(self.mode, "value", self.mode))]
                         + [f"{k}={v!r}" for k, v in keys.items()])

    @property
    def half_params(self) -> bool:
        """Whether the mode casts the model's params to a half dtype (naive, apex O2/O3)."""
        return self.plan.enabled and self.plan.cast_model_type in ("float16", "bfloat16")

    def is_ours(self, optimizer: Any) -> bool:
        return any(optimizer is o for o in self.optimizers)

    def convert(self, module: torch.nn.Module, optimizers: list) -> list[AmpOptimizer]:
        """Converts ``module`` and ``optimizers`` (torch optimizers over its params) with
        `convert_to_amp`; several optimizers share one loss scale."""
        if any(isinstance(o, AmpOptimizer) for o in optimizers):
            raise ValueError("the optimizer is already an mpfunc_torch AmpOptimizer (converted "
                             "by convert_to_amp); give the trainer the plain torch optimizer "
                             "and let it convert.")
        _, amp_opts, _ = convert_to_amp(module, list(optimizers), mode=self.mode,
                                        **self.config, **self.kwargs)
        self.module, self.optimizers = module, amp_opts
        return amp_opts

    def first(self, what: str) -> AmpOptimizer:
        """The converted optimizer (the first, with several); ``what`` names the caller."""
        if not self.optimizers:
            raise RuntimeError(f"{what}: nothing is converted yet; the model and optimizer "
                               "are converted when training starts (in the trainer's "
                               "fit/train), so read this during or after training.")
        return self.optimizers[0]

    def scale_metrics(self, what: str, as_python: bool = False, loss_id: int = 0, *,
                      skip_leaves: bool = False) -> dict[str, Any]:
        return self.first(what).scale_metrics(as_python, loss_id, skip_leaves=skip_leaves)
