"""`Fp8Linear` and `convert_to_fp8`: swap a model's ``nn.Linear`` layers for fp8 ones.

The torch mirror of ``mpfunc.convert_to_fp8`` and the analogue of torchao's
``convert_to_float8_training``: only the matmuls of linear layers change; the layers
keep their ``weight`` and ``bias`` Parameter objects (so an optimizer built before the
swap still steps them), and delayed scaling's amax histories and scales are buffers
that ``state_dict`` saves and restores.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from _mpfunc_common.fp8 import Fp8Recipe, resolve_recipe
from mpfunc_torch._src.distributed import normalize_groups
from mpfunc_torch._src.fp8.matmul import fp8_linear

__all__ = ["Fp8Linear", "convert_to_fp8"]

_ROLES = ("input", "weight", "grad_output")


class Fp8Linear(nn.Linear):
    """An ``nn.Linear`` whose three matmuls (forward, input and weight gradients) are fp8.

    Inputs and weights are quantised to the recipe's forward format, output gradients
    to its backward format, each along its contraction dimension. The output dtype is
    the autocast dtype inside ``torch.autocast`` (bfloat16 in the fp8 mode), else the
    input's. Gradients come back in the dtypes of the input and the (float32) weight.

    With delayed scaling the layer has, per role (``input``, ``weight``,
    ``grad_output``), buffers ``fp8_amax_history_<role>`` (newest first) and
    ``fp8_scale_<role>``, updated in place by each forward / backward and saved by
    ``state_dict``. Activation checkpointing re-runs the forward, which records the
    input and weight amaxes a second time.

    Args:
      in_features, out_features, bias, device, dtype: as ``nn.Linear``.
      recipe: a preset name or an `Fp8Recipe` (default ``"tensorwise"``).
      process_group: group(s) over which per-tensor amaxes are MAX-all-reduced, so all
        ranks use the same scales and histories.
      gemm: ``"auto"`` (``torch._scaled_mm`` on CUDA with compute capability >= 8.9,
        else emulated), ``"emulate"`` or ``"scaled_mm"``.

    Examples:
      >>> import torch, mpfunc_torch
      >>> layer = mpfunc_torch.Fp8Linear(16, 4, recipe="delayed")
      >>> layer(torch.randn(8, 16)).sum().backward()
      >>> sorted(k for k in layer.state_dict() if k.startswith("fp8_scale"))
      ['fp8_scale_grad_output', 'fp8_scale_input', 'fp8_scale_weight']
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 device=None, dtype=None, *, recipe: Any = "tensorwise",
                 process_group: Any = None, gemm: str = "auto"):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._setup(recipe, process_group, gemm)

    def _setup(self, recipe, process_group, gemm) -> None:
        self.recipe: Fp8Recipe = resolve_recipe(recipe)
        self._groups = normalize_groups(process_group)
        if self._groups and self.recipe.block("input") is not None:
            raise ValueError(f"`process_group` applies to per-tensor scales (tensorwise, "
                             f"delayed); {self.recipe.scaling} scales are local to the rows "
                             "they scale.")
        if gemm not in ("auto", "emulate", "scaled_mm"):
            raise ValueError(f"`gemm` must be 'auto', 'emulate' or 'scaled_mm', got {gemm!r}.")
        self.gemm = gemm
        if self.recipe.delayed:
            dev = self.weight.device
            for role in _ROLES:
                self.register_buffer(f"fp8_amax_history_{role}",
                                     torch.zeros(self.recipe.amax_history_len, device=dev))
                self.register_buffer(f"fp8_scale_{role}", torch.ones((), device=dev))

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: Any = "tensorwise", *,
                    process_group: Any = None, gemm: str = "auto") -> Fp8Linear:
        """An `Fp8Linear` sharing ``linear``'s weight and bias Parameters (no copy)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"`linear` must be an nn.Linear, got {type(linear).__name__}.")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = linear.weight
        new.bias = linear.bias
        new.training = linear.training
        new._setup(recipe, process_group, gemm)
        return new

    @classmethod
    def _convert(cls, linear: nn.Linear, recipe: Fp8Recipe, process_group, gemm) -> Fp8Linear:
        """``linear`` as an `Fp8Linear`: a plain ``nn.Linear`` changes class in place (its
        identity, hooks and attributes stay: HuggingFace's, a user's forward hooks), and
        so does one FSDP2's ``fully_shard`` made an ``FSDPLinear`` (it becomes an
        ``FSDPFp8Linear``: FSDP's state is keyed by the module object and unshards into
        its attributes, so a new object would compute on the sharded DTensors); any
        other subclass is replaced by `from_linear`, which takes its hooks along."""
        old = type(linear)
        new_cls = cls if old is nn.Linear else _fsdp_twin(old, cls)
        if new_cls is not None:
            linear.__class__ = new_cls
            fp8 = cast(Fp8Linear, linear)  # the same object, now of an Fp8Linear class
            try:
                fp8._setup(recipe, process_group, gemm)
            except BaseException:
                linear.__class__ = old
                raise
            return fp8
        new = cls.from_linear(linear, recipe, process_group=process_group, gemm=gemm)
        for name, value in vars(linear).items():
            if name.endswith(("_hooks", "_hooks_with_kwargs", "_hooks_always_called")) or (
                    name == "_is_full_backward_hook"):
                setattr(new, name, value)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ weight.T + bias`` with fp8 operands, as the recipe says."""
        return fp8_linear(x, self, gemm=self.gemm)

    def extra_repr(self) -> str:
        """``nn.Linear``'s, and the recipe."""
        return f"{super().extra_repr()}, recipe=({self.recipe.describe()})"


_FSDP_TWINS: dict[type, type] = {}


def _fsdp_twin(wrapped: type, cls: type) -> type | None:
    """For ``FSDPLinear`` (FSDP2's ``type("FSDPLinear", (FSDPModule, nn.Linear), ...)``),
    the same wrapper around ``cls``; None for any other class."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return None
    bases = wrapped.__bases__
    if len(bases) != 2 or bases[1] is not nn.Linear or not issubclass(bases[0], FSDPModule):
        return None
    if wrapped not in _FSDP_TWINS:
        extra = {k: v for k, v in vars(wrapped).items() if k == "__deepcopy__"}
        _FSDP_TWINS[wrapped] = type(f"{wrapped.__name__[:-len('Linear')]}{cls.__name__}",
                                    (bases[0], cls), extra)
    return _FSDP_TWINS[wrapped]


def convert_to_fp8(
    model: nn.Module,
    recipe: Any = "tensorwise",
    *,
    module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
    process_group: Any = None,
    gemm: str = "auto",
) -> nn.Module:
    """Turns every ``nn.Linear`` of ``model`` (in place) into an `Fp8Linear`.

    The analogue of torchao's ``convert_to_float8_training``. A plain ``nn.Linear``
    changes class in place, so it stays the same object with its hooks and attributes;
    a subclass of it is replaced by an `Fp8Linear` that takes its hooks along.
    Parameters are shared, not copied, so convert before or after building the
    optimizer. Norms, attention, softmax, embeddings and the loss are untouched.

    Args:
      model: the model (also an ``nn.Linear`` itself, which is then returned swapped).
      recipe: a preset name (``"tensorwise"``, ``"delayed"``, ``"rowwise"``,
        ``"blockwise"``) or an `Fp8Recipe`.
      module_filter_fn: ``(module, fully_qualified_name) -> bool``; only the linears it
        accepts are converted (torchao's argument of the same name).
      process_group: group(s) for the per-tensor amax reduction (see `Fp8Linear`).
      gemm: ``"auto"``, ``"emulate"`` or ``"scaled_mm"`` (see `Fp8Linear`).

    Returns:
      ``model``, converted.

    Examples:
      >>> import torch, mpfunc_torch
      >>> net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
      >>> w = net[0].weight
      >>> net = mpfunc_torch.convert_to_fp8(net, "rowwise")
      >>> type(net[0]).__name__, net[0].weight is w, type(net[1]).__name__
      ('Fp8Linear', True, 'LayerNorm')
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"`model` must be a torch.nn.Module, got {type(model).__name__}.")
    if module_filter_fn is not None and not callable(module_filter_fn):
        raise TypeError("`module_filter_fn` must be callable (module, fqn) -> bool, got "
                        f"{type(module_filter_fn).__name__}.")
    recipe = resolve_recipe(recipe)

    def convert(mod: nn.Module, fqn: str) -> nn.Module:
        if isinstance(mod, nn.Linear) and not isinstance(mod, Fp8Linear) and (
            module_filter_fn is None or module_filter_fn(mod, fqn)
        ):
            return Fp8Linear._convert(mod, recipe, process_group, gemm)
        return mod

    if isinstance(model, nn.Linear):
        return convert(model, "")
    for fqn, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            new = convert(child, f"{fqn}.{name}" if fqn else name)
            if new is not child:
                setattr(parent, name, new)
    return model
