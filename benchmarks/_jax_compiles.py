"""Counting XLA compiles of a benchmark's steps, so that each is compiled exactly once.

A benchmark puts its params, state and inputs on one device (committed), compiles each
step ahead of time (``jax.jit(f).lower(...).compile()``) and uses that one executable for
warm-up, timing and ``memory_analysis()``. :class:`CompileCounter` counts XLA backend
compiles by function name through ``jax.monitoring`` (the event that jax logs as
"Finished XLA compilation of jit(<name>)"), and :func:`named` gives each step a name of
its own, so that a second compile of a step (an uncommitted input that comes back
committed, a changed dtype or sharding) shows up in the script's JSON as a count of 2.
"""

from __future__ import annotations

import collections
import re

import jax

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileCounter:
    """Counts backend compiles per jitted function name from its creation on."""

    def __init__(self):
        self.counts: collections.Counter[str] = collections.Counter()
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event, duration, **kwargs):
        del duration
        if event == BACKEND_COMPILE_EVENT:
            self.counts[str(kwargs.get("fun_name", "?"))] += 1

    def of(self, name: str) -> int:
        """Compiles of the function named ``name`` (jax reports it as ``jit(name)``)."""
        return sum(n for k, n in self.counts.items() if k == name or k.endswith(f"({name})"))


def step_name(label: str, index: int) -> str:
    """A unique, identifier-like function name for the step of variant ``label``."""
    return f"bench_step{index}_" + re.sub(r"\W+", "_", label).strip("_")[:48]


def named(fn, name: str):
    """``fn`` under the function name ``name`` (what jit's compile events report)."""

    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)

    wrapper.__name__ = wrapper.__qualname__ = name
    return wrapper


def check_once(compiles: dict[str, int]) -> list[str]:
    """The variants that did not compile exactly once (empty when all did)."""
    return [f"{k}: {n} compiles" for k, n in compiles.items() if n != 1]
