"""The precision report's definitions, shared word for word by `mpfunc` and `mpfunc_torch`.

Both frameworks reduce each gradient leaf on the device to the same five exact numbers
(`LEAF_RULE`): a non-finite flag, the float32 amax of the finite elements, and three
integer counts. Everything else, the fractions, the headroom in bits, the rows, the
order and the table, is computed here on the host from those numbers, so the same
gradients give the same rows, bit for bit, in both frameworks.

No framework is imported here.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence
from typing import Any, Protocol

__all__ = [
    "CANCEL_RULE",
    "FIELDS",
    "FORMATS",
    "LEAF_RULE",
    "FloatFormat",
    "check_loss_scale",
    "check_report_dtype",
    "format_table",
    "leaf_rows",
    "nonfinite_names",
    "worst_first",
]

# The per-leaf fields of a row, after its ``name``; ``update_cancelled`` follows them
# when the report is given the updates.
FIELDS = ("nonfinite", "amax", "zero_fraction", "underflow_fraction", "headroom_bits")

# The rule, shared word for word by the JAX and torch docstrings.
LEAF_RULE = """\
    # per gradient leaf g (its local shard, then reduced over the shards)
    a = abs(float32(g))                                  # elementwise, in float32
    nonfinite = any(not isfinite(a))                     # MAX over shards
    amax = max(a where isfinite(a), initial=0)           # float32; MAX over shards
    zeros = count(a == 0)                                # these three: SUM over shards
    underflows = count(a != 0 and a <= float32(tiny(dtype) / 2) / loss_scale)
    size = count(a)
    # on the host, from those numbers (shared code, so both frameworks agree bit for bit)
    zero_fraction = zeros / size                         # 0.0 for an empty leaf
    underflow_fraction = underflows / (size - zeros)     # 0.0 when nothing is non-zero
    headroom_bits = log2(max(dtype) / (amax * loss_scale))   # inf when amax == 0

    tiny(dtype) is dtype's smallest subnormal: a scaled value at or below half of it
    rounds to 0 in dtype (round to nearest, ties to even); the threshold is divided by
    the scale once, in float32. A negative headroom means the scaled gradient no longer
    fits in dtype: it would overflow to inf. Zeros are counted by their bits: XLA on
    CPU reads a float32 subnormal as 0 in arithmetic, torch does not, so such a value
    is an underflow (not a zero) in both.
"""

# The update column's rule, shared word for word by the JAX and torch docstrings.
CANCEL_RULE = """\
    # per leaf given an update u and its stored param p (local shards, then SUM-reduced)
    new = round_to(p.dtype, float32(p) + float32(u))   # to nearest even: p + u as applied
    updated = count(u != 0)
    cancelled = count(u != 0 and new == p)              # p does not move: u rounded away
    update_cancelled = cancelled / updated              # 0.0 when u is all zero

    An update below half an ulp of its param (2**-8 at 1.0 in bfloat16, 2**-11 in
    float16) is always cancelled. XLA on CPU flushes float32 subnormals (in p or u) to
    zero, which torch does not.
"""


@dataclasses.dataclass(frozen=True)
class FloatFormat:
    """A floating format's range, for the report.

    Attributes:
      name: the dtype's name (``"float16"``).
      max: its largest finite value.
      tiny: its smallest positive (subnormal) value.
    """

    name: str
    max: float
    tiny: float

    @property
    def threshold(self) -> float:
        """``tiny / 2``: a scaled value at or below it rounds to 0 in this format."""
        return self.tiny / 2


FORMATS = {
    f.name: f for f in (
        FloatFormat("float16", 65504.0, 2.0**-24),
        FloatFormat("bfloat16", 3.3895313892515355e38, 2.0**-133),
        FloatFormat("float32", 3.4028234663852886e38, 2.0**-149),
        FloatFormat("float8_e4m3fn", 448.0, 2.0**-9),
        FloatFormat("float8_e5m2", 57344.0, 2.0**-16),
    )
}


def check_report_dtype(name: str | None, given: Any) -> FloatFormat:
    """The `FloatFormat` of a dtype, given by its framework-free ``name``.

    Args:
      name: the dtype's name as its framework spells it without a prefix
        (``"float16"``; ``torch.float16`` is ``"float16"`` too), or None where ``given``
        is not a dtype at all.
      given: what the user passed, for the message.

    Raises:
      TypeError: ``dtype`` is not a floating dtype.
      ValueError: a floating dtype the report has no range for (float64, complex).
    """
    if name in FORMATS:
        return FORMATS[name]
    choices = ", ".join(FORMATS)
    if name is None or not (name.startswith(("float", "bfloat"))):
        raise TypeError(f"`dtype` must be a floating dtype ({choices}), got "
                        f"{type(given).__name__}: {given!r}.")
    raise ValueError(f"`dtype` must be one of {choices} (the formats a gradient is cast to "
                     f"in mixed precision), got {name}.")


def check_loss_scale(value: Any) -> float:
    """A Python (or NumPy) number given as ``loss_scale``, as a float: finite and > 0.

    Device arrays are not read here (that would be a host sync); the caller passes them
    through unchecked.

    Raises:
      TypeError: a bool, a string or another non-number.
      ValueError: a scale that is not finite or not > 0.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"`loss_scale` must be None, a number > 0 or the loss-scale state, "
                        f"got {type(value).__name__}: {value!r}.")
    v = float(value)
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"`loss_scale` must be a finite number > 0, got {value!r}.")
    return v


def _headroom(amax: float, scale: float, fmt: FloatFormat) -> float:
    scaled = amax * scale  # two float32 values: exact in float64
    if scaled == 0:
        return math.inf
    if math.isinf(scaled):
        return -math.inf
    return math.log2(fmt.max / scaled)


class _HostNumbers(Protocol):
    """Numbers indexed by leaf: a list, or a NumPy array (not a `Sequence`)."""

    def __getitem__(self, i: int, /) -> Any: ...


def _cancelled(updated: int, cancelled: int) -> float | None:
    if updated < 0:  # no update given for this leaf
        return None
    return cancelled / updated if updated else 0.0


def leaf_rows(names: Sequence[str], nonfinite: _HostNumbers, amax: _HostNumbers,
              zeros: _HostNumbers, underflows: _HostNumbers, sizes: _HostNumbers,
              scale: float, fmt: FloatFormat,
              updates: tuple[_HostNumbers, _HostNumbers] | None = None
              ) -> list[dict[str, Any]]:
    """One dict per leaf, in the order given: ``name`` and the `FIELDS` (`LEAF_RULE`),
    then ``update_cancelled`` (`CANCEL_RULE`) when ``updates`` are given.

    The inputs are host numbers (lists or NumPy arrays), one per leaf; ``scale`` is the
    loss scale as a float (a float32 value); ``updates`` is ``(updated, cancelled)``,
    the counts of `CANCEL_RULE` (``updated < 0``: no update for that leaf, None).
    """
    rows = []
    for i, name in enumerate(names):
        size, z, u, a = int(sizes[i]), int(zeros[i]), int(underflows[i]), float(amax[i])
        nonzero = size - z
        rows.append({
            "name": name,
            "nonfinite": bool(nonfinite[i]),
            "amax": a,
            "zero_fraction": z / size if size else 0.0,
            "underflow_fraction": u / nonzero if nonzero > 0 else 0.0,
            "headroom_bits": _headroom(a, float(scale), fmt),
        })
        if updates is not None:
            rows[-1]["update_cancelled"] = _cancelled(int(updates[0][i]), int(updates[1][i]))
    return rows


def worst_first(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` sorted worst first: non-finite leaves, then the least headroom, then the
    largest underflow fraction (ties keep their order)."""
    return sorted(rows, key=lambda r: (not r["nonfinite"], r["headroom_bits"],
                                       -r["underflow_fraction"]))


def nonfinite_names(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The names of the non-finite rows, in the order given."""
    return [r["name"] for r in rows if r["nonfinite"]]


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def format_table(rows: Sequence[dict[str, Any]], scale: float, fmt: FloatFormat,
                 first_module: str | None = None, watched: bool = False) -> str:
    """The report as a text table, worst leaves first (see `worst_first`)."""
    bad = nonfinite_names(rows)
    head = (f"precision report: {len(rows)} leaves, dtype {fmt.name}, loss scale {scale:g}, "
            f"non-finite: {len(bad)}")
    if watched:
        head += f", first non-finite module in the forward: {first_module}"
    cancel = any("update_cancelled" in r for r in rows)
    cells = [("leaf", "non-finite", "amax", "headroom bits", "underflow", "zeros")
             + (("update cancelled",) if cancel else ())]
    for r in worst_first(rows):
        cells.append((r["name"], "yes" if r["nonfinite"] else "no", f"{r['amax']:.4g}",
                      f"{r['headroom_bits']:.2f}", _pct(r["underflow_fraction"]),
                      _pct(r["zero_fraction"]))
                     + ((_pct(r.get("update_cancelled")),) if cancel else ()))
    widths = [max(len(c[i]) for c in cells) for i in range(len(cells[0]))]
    lines = [head] + ["  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                                for i, (c, w) in enumerate(zip(row, widths))).rstrip()
                      for row in cells]
    return "\n".join(lines)
