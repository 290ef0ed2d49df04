"""A "did you mean ...?" for a misspelt name, shared by both frameworks' errors."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["closest", "did_you_mean"]


def closest(name: object, choices: Iterable[str]) -> str | None:
    """The choice closest to ``name`` (ignoring case), as the choice is spelt, or None.

    Examples:
      >>> closest("inital_scale", ["initial_scale", "max_scale", "hysteresis"])
      'initial_scale'
      >>> closest("APEX-o2", ["apex-O1", "apex-O2"]), closest("zzz", ["apex"])
      ('apex-O2', None)
    """
    if not isinstance(name, str):
        return None
    by_lower = {c.lower(): c for c in choices}
    close = difflib.get_close_matches(name.lower(), list(by_lower), n=1)
    return by_lower[close[0]] if close else None


def did_you_mean(names: Iterable[object], choices: Iterable[str]) -> str:
    """`` (did you mean `x`?)`` for the misspelt ``names`` that have a close choice, with
    ``for `name``` after each suggestion when several names were misspelt; else ``""``.

    Examples:
      >>> did_you_mean(["inital_scale"], ["initial_scale", "max_scale"])
      ' (did you mean `initial_scale`?)'
      >>> did_you_mean(["inital_scale", "max_scal", "xyz"], ["initial_scale", "max_scale"])
      ' (did you mean `initial_scale` for `inital_scale`, `max_scale` for `max_scal`?)'
    """
    names, choices = list(names), list(choices)
    pairs = [(n, c) for n in names if (c := closest(n, choices)) is not None]
    if not pairs:
        return ""
    if len(names) == 1:
        return f" (did you mean `{pairs[0][1]}`?)"
    return " (did you mean " + ", ".join(f"`{c}` for `{n}`" for n, c in pairs) + "?)"
