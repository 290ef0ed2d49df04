"""fp8 training recipes: one table, one validation, one quantisation rule for both sides.

`mpfunc` (JAX) and `mpfunc_torch` (PyTorch) quantise with exactly the rule written in
`QUANTIZE_RULE`, so for the same input they produce bit-identical fp8 tensors and
scales. No framework is imported here: formats are names (``"float8_e4m3fn"``,
``"float8_e5m2"``) that each side maps to its own dtype.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

from _mpfunc_common.scale_config import FLOAT32_MAX, FLOAT32_MIN_NORMAL
from _mpfunc_common.suggest import did_you_mean

__all__ = [
    "FP8_MAX",
    "MIN_SCALE",
    "MAX_SCALE",
    "FORMATS",
    "SCALINGS",
    "ROLES",
    "RECIPES",
    "QUANTIZE_RULE",
    "Fp8Recipe",
    "resolve_recipe",
    "scale_shape",
    "FLOAT32_MAX",
    "FLOAT32_MIN_NORMAL",
]

# The largest finite value of each fp8 format (OCP 8-bit floating point spec).
FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}
# The smallest scale, and the largest: 2**125 times the format's smallest subnormal
# (2**-9, 2**-16), so that a float32 subnormal times any scale rounds to zero in fp8.
MIN_SCALE = 2.0**-126
MAX_SCALE = {"float8_e4m3fn": 2.0**116, "float8_e5m2": 2.0**109}

# format -> (forward dtype: activations and weights, backward dtype: output gradients).
# The names are TransformerEngine's `recipe.Format` members.
FORMATS = {
    "hybrid": ("float8_e4m3fn", "float8_e5m2"),
    "e4m3": ("float8_e4m3fn", "float8_e4m3fn"),
    "e5m2": ("float8_e5m2", "float8_e5m2"),
}

SCALINGS = ("tensorwise", "delayed", "rowwise", "blockwise")
ROLES = ("input", "weight", "grad_output")
AMAX_REDUCTIONS = ("max", "most_recent")

QUANTIZE_RULE = """\
    Each operand of each matmul is quantised with its contraction dimension last, as a
    2-D array (leading dimensions flattened); a *block* is the set of elements that
    share one scale: the whole tensor (tensorwise, delayed), one row (rowwise), 1x128
    tiles of inputs and output gradients and 128x128 tiles of weights (blockwise). All
    arithmetic is float32 (a bfloat16/float16 input is upcast exactly first). Nothing
    is flushed: the scale range below makes every result the same whether or not the
    hardware flushes float32 subnormals (XLA on CPU does, torch does not). Step by
    step::

        amax  = max(|x|) over the block          # a NaN counts as +inf
        if amax is finite and amax >= 2**-126:   # a subnormal amax counts as zero
            scale = (fp8_max / amax) / 2**margin # correctly rounded float32 divisions
            scale = min(max(scale, 2**-126), max_scale)
            if power_of_2_scales:
                scale = 2**floor(log2(scale))    # mantissa bits cleared: exact
        else:                                    # all zeros, or inf/NaN in the block
            scale = fallback                     # 1.0 (current scaling), or the
                                                 # previous scale (delayed scaling)
        q = x * scale                            # float32 multiply, rounded
        q = clamp(q, -fp8_max, fp8_max) if q is finite else q   # saturate finite values
        q = fp8(q)                               # round to nearest, ties to even
        dequantised = float32(q) * (1 / scale)   # the reciprocal rounded to float32

    max_scale is 2**125 times the smallest fp8 subnormal (2**116 for e4m3fn, 2**109
    for e5m2): a float32 subnormal (below 2**-126) times the scale is then below half
    the smallest fp8 subnormal, so it becomes a zero of its sign whether it was flushed
    first or not, and every nonzero dequantised value is at least 2**-125, a normal
    float32.

    Finite values beyond the range saturate to +-fp8_max, written out because the
    frameworks' own casts disagree (torch's e4m3fn cast saturates, even inf; XLA's
    gives NaN; both overflow to inf in e5m2). Non-finite values are never hidden, so an
    overflow upstream still makes the step non-finite and the loss scale skips it: any
    NaN becomes the positive NaN (0x7F in e4m3fn, 0x7E in e5m2); +-inf becomes +-inf in
    e5m2 (0x7C, 0xFC) and a NaN in e4m3fn, which has no inf (0x7F, 0xFF).

    A GEMM of two per-tensor or rowwise quantised operands multiplies the fp8 values
    (exact in float32), accumulates in float32 and scales the result once:
    out = dot(q_a, q_b) * (1/scale_a * 1/scale_b); its accumulation order is the
    backend's, so GEMM results agree to float32 rounding, not bit for bit.

    Delayed scaling (per tensor) keeps an amax history (newest first, length
    ``amax_history_len``) and the last scale; this step's scale comes from them alone
    (as in TransformerEngine and flax), so the cast never waits for this step's amax::

        amax_used = max(history)  (or history[0] with amax_reduction="most_recent")
        scale = rule above with amax_used, fallback = the previous scale
                (1.0 if it is not a finite scale > 0: a fresh state, or a JAX state
                zeroed because its matmul's output did not reach the loss)
        history = [amax of this step's tensor] + history[:-1]   # only if finite

    So the first step (an all-zero history) uses the previous scale, 1.0 when fresh.

    A per-tensor amax (tensorwise, delayed) is MAX-reduced over the data-parallel group
    (``axis_name`` in JAX, ``process_group`` in torch) before it is used or recorded,
    so every rank has the same scales and histories. Row and tile scales are local.
"""


def _int(value: Any, name: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"`{name}` must be an int, got {type(value).__name__}: {value!r}.")
    value = int(value)
    if not low <= value <= high:
        raise ValueError(f"`{name}` must be an int in [{low}, {high}], got {value}.")
    return value


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
    """How the matmuls of linear/dense layers are quantised to fp8 (both frameworks).

    Frozen and hashable: a valid static ``jit`` argument and a dict key.

    Attributes:
      scaling: ``"tensorwise"`` (current scaling: one scale per tensor from its own
        amax, each step; torchao's default), ``"delayed"`` (one scale per tensor from an
        amax history kept in state; TransformerEngine's ``DelayedScaling``, flax's
        ``fp8_ops``), ``"rowwise"`` (one scale per row along the contraction dimension;
        torchao's rowwise recipe) or ``"blockwise"`` (1 x ``block_size`` tiles of inputs
        and output gradients, ``block_size`` x ``block_size`` tiles of weights; the
        DeepSeek-V3 recipe).
      format: ``"hybrid"`` (default: e4m3 forward, e5m2 for output gradients),
        ``"e4m3"`` or ``"e5m2"`` (one format everywhere), as TransformerEngine's
        ``recipe.Format``.
      amax_history_len: delayed scaling's history length (default 1024, as flax and
        TransformerEngine use).
      amax_reduction: delayed scaling's reduction of the history, ``"max"`` (default)
        or ``"most_recent"``.
      margin: scales are divided by ``2**margin`` (TransformerEngine's margin).
      power_of_2_scales: round every scale down to a power of two, so quantising and
        dequantising multiply exactly (default for rowwise, as torchao does).
      block_size: the tile edge of the blockwise recipe (default 128).

    Examples:
      >>> from _mpfunc_common.fp8 import Fp8Recipe
      >>> r = Fp8Recipe("blockwise")
      >>> r.dtype("grad_output"), r.block("input"), r.block("weight")
      ('float8_e5m2', (1, 128), (128, 128))
    """

    scaling: str = "tensorwise"
    format: str = "hybrid"
    amax_history_len: int = 1024
    amax_reduction: str = "max"
    margin: int = 0
    power_of_2_scales: bool = False
    block_size: int = 128

    def __post_init__(self):
        if self.scaling not in SCALINGS:
            raise ValueError(f"`scaling` must be one of {list(SCALINGS)}, got {self.scaling!r}.")
        if self.format not in FORMATS:
            raise ValueError(f"`format` must be one of {list(FORMATS)}, got {self.format!r}.")
        object.__setattr__(self, "amax_history_len",
                           _int(self.amax_history_len, "amax_history_len", 1, 2**20))
        if self.amax_reduction not in AMAX_REDUCTIONS:
            raise ValueError(f"`amax_reduction` must be one of {list(AMAX_REDUCTIONS)}, got "
                             f"{self.amax_reduction!r}.")
        object.__setattr__(self, "margin", _int(self.margin, "margin", 0, 64))
        if not isinstance(self.power_of_2_scales, bool):
            raise TypeError("`power_of_2_scales` must be a bool, got "
                            f"{type(self.power_of_2_scales).__name__}.")
        size = _int(self.block_size, "block_size", 1, 2**16)
        if size & (size - 1):
            raise ValueError(f"`block_size` must be a power of two, got {size}.")
        object.__setattr__(self, "block_size", size)

    # -- derived ---------------------------------------------------------------------
    @property
    def delayed(self) -> bool:
        """True if the recipe keeps state (amax histories and scales)."""
        return self.scaling == "delayed"

    @property
    def forward_dtype(self) -> str:
        """fp8 format of inputs and weights."""
        return FORMATS[self.format][0]

    @property
    def backward_dtype(self) -> str:
        """fp8 format of output gradients."""
        return FORMATS[self.format][1]

    def dtype(self, role: str) -> str:
        """fp8 format of ``role`` (``"input"``, ``"weight"`` or ``"grad_output"``)."""
        _check_role(role)
        return self.backward_dtype if role == "grad_output" else self.forward_dtype

    def block(self, role: str) -> tuple[int | None, int | None] | None:
        """Elements sharing one scale, on the operand with its contraction dim last.

        None: the whole tensor. ``(rows, cols)``: a tile, None meaning the whole
        dimension; e.g. ``(1, None)`` is one scale per row.
        """
        _check_role(role)
        if self.scaling in ("tensorwise", "delayed"):
            return None
        if self.scaling == "rowwise":
            return (1, None)
        b = self.block_size
        return (b, b) if role == "weight" else (1, b)

    def describe(self) -> str:
        """The recipe in one line, as `Fp8Linear` and the mode plans print it."""
        parts = [f"scaling={self.scaling}", f"format={self.format} "
                 f"({self.forward_dtype} forward, {self.backward_dtype} backward)"]
        if self.delayed:
            parts.append(f"amax_history_len={self.amax_history_len}, "
                         f"amax_reduction={self.amax_reduction}")
        if self.scaling == "blockwise":
            parts.append(f"block_size={self.block_size}")
        if self.margin:
            parts.append(f"margin={self.margin}")
        if self.power_of_2_scales:
            parts.append("power-of-2 scales")
        return ", ".join(parts)


def _check_role(role: str) -> None:
    if role not in ROLES:
        raise ValueError(f"`role` must be one of {list(ROLES)}, got {role!r}.")


# The presets: each anchor's defaults.
RECIPES: dict[str, Fp8Recipe] = {
    "tensorwise": Fp8Recipe("tensorwise"),                       # torchao tensorwise
    "delayed": Fp8Recipe("delayed"),                             # TE DelayedScaling, flax
    "rowwise": Fp8Recipe("rowwise", power_of_2_scales=True),     # torchao rowwise
    "blockwise": Fp8Recipe("blockwise"),                         # DeepSeek-V3
}


def check_block(block: Any, name: str = "block") -> tuple[int | None, int | None] | None:
    """``block`` as None or a ``(rows, cols)`` pair of ints >= 1 or None, or an error
    naming it (shared by `quantize_fp8` / `dequantize_fp8` on both sides)."""
    if block is None:
        return None
    if not isinstance(block, tuple | list) or len(block) != 2 or not all(
            b is None or (isinstance(b, int) and not isinstance(b, bool) and b >= 1)
            for b in block):
        raise ValueError(f"`{name}` must be None or (rows, cols), each an int >= 1 or None "
                         f"(the whole dim), got {block!r}.")
    return tuple(block)


def scale_shape(shape: tuple[int, ...], block) -> tuple[int, ...]:
    """Shape of the scales of an array of ``shape`` quantised in ``block`` tiles.

    ``()`` for one scale per tensor; else ``(row tiles, col tiles)`` of the array seen
    as 2-D (leading dims flattened, the last dim the contraction dim).
    """
    if block is None:
        return ()
    cols = shape[-1] if shape else 1
    rows = 1
    for d in shape[:-1]:
        rows *= d
    br = rows if block[0] is None else block[0]
    bc = cols if block[1] is None else block[1]
    return (-(-rows // max(br, 1)), -(-cols // max(bc, 1)))


def resolve_recipe(recipe: Any = None, **overrides: Any) -> Fp8Recipe:
    """A preset name, an `Fp8Recipe` or None (``"tensorwise"``), with field overrides.

    Raises:
      ValueError: an unknown preset, an unknown field, or an invalid value.
      TypeError: a recipe of the wrong type, or a field value of the wrong type.

    Examples:
      >>> from _mpfunc_common.fp8 import resolve_recipe
      >>> resolve_recipe("delayed", amax_history_len=16).describe()
      'scaling=delayed, format=hybrid (float8_e4m3fn forward, float8_e5m2 backward), amax_history_len=16, amax_reduction=max'
    """
    if recipe is None:
        recipe = "tensorwise"
    if isinstance(recipe, str):
        if recipe not in RECIPES:
            raise ValueError(f"`recipe` must be one of {list(RECIPES)} or an Fp8Recipe, got "
                             f"{recipe!r}{did_you_mean([recipe], RECIPES)}.")
        recipe = RECIPES[recipe]
    elif not isinstance(recipe, Fp8Recipe):
        raise TypeError(f"`recipe` must be a preset name ({list(RECIPES)}) or an Fp8Recipe, "
                        f"got {type(recipe).__name__}.")
    if overrides:
        fields = {f.name for f in dataclasses.fields(Fp8Recipe)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise ValueError(f"unknown fp8 recipe field(s) {unknown}"
                             f"{did_you_mean(unknown, fields)}; valid fields: "
                             f"{sorted(fields)}.")
        recipe = dataclasses.replace(recipe, **overrides)
    return recipe
