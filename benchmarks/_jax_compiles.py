"""Counting XLA compiles of a benchmark's steps, so that each is compiled exactly once.

A benchmark puts its params, state and inputs on one device (committed), compiles each
step ahead of time (``jax.jit(f).lower(...).compile()``) and uses that one executable for
warm-up, timing and ``memory_analysis()``. :class:`CompileCounter` counts XLA backend
compiles by function name through ``jax.monitoring`` (the event that jax logs as
"Finished XLA compilation of jit(<name>)"), and :func:`named` gives each step a name of
its own, so that a second compile of a step (an uncommitted input that comes back
committed, a changed dtype or sharding) shows up in the script's JSON as a count of 2.

JAX's persistent compilation cache, which the demo and every JAX benchmark turn on by
default (`add_cache_args`, `cache_from_args`): compiled executables are kept in a local
folder, ``$MPFUNC_JAX_CACHE`` or else ``~/.cache/mpfunc/jax``, with no minimum compile
time or entry size, so a second run of the same step loads it instead of compiling it.
`compile_cold_warm` times a step's compile twice in one process: as it comes (cold when
the cache held no entry for it, which the cache's own ``jax.monitoring`` events say), then
after ``jax.clear_caches()`` (jax's in-memory caches), when it must come from the folder
(warm). ``--no-compile-cache`` turns the cache off (no warm figure then).
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import time
from pathlib import Path

# jax is imported where it is used: the command-line helpers (`add_cache_args`,
# `compiler_options`) run before a script has set up jax's environment.

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
CACHE_MISS_EVENT = "/jax/compilation_cache/cache_misses"  # recorded as the entry is written
CACHE_ENV = "MPFUNC_JAX_CACHE"


class CompileCounter:
    """Counts backend compiles per jitted function name from its creation on."""

    def __init__(self):
        import jax

        self.counts: collections.Counter[str] = collections.Counter()
        self._paused = False
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event, duration, **kwargs):
        del duration
        if event == BACKEND_COMPILE_EVENT and not self._paused:
            self.counts[str(kwargs.get("fun_name", "?"))] += 1

    @contextlib.contextmanager
    def paused(self):
        """Compiles inside are not counted (a measurement's extra compile, not the run's)."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

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


# ------------------------------------------------------------ persistent compilation cache
class _CacheEvents:
    """Hits and misses of the persistent cache, counted from jax.monitoring events."""

    def __init__(self):
        import jax

        self.hits = self.misses = self.backend = 0
        jax.monitoring.register_event_listener(self._on_event)
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)

    def _on_event(self, event, **kwargs):
        del kwargs
        if event == CACHE_HIT_EVENT:
            self.hits += 1
        elif event == CACHE_MISS_EVENT:
            self.misses += 1

    def _on_duration(self, event, duration, **kwargs):
        del duration, kwargs
        if event == BACKEND_COMPILE_EVENT:
            self.backend += 1


_EVENTS = None


def _events() -> _CacheEvents:
    global _EVENTS
    if _EVENTS is None:
        _EVENTS = _CacheEvents()
    return _EVENTS


def default_cache_dir() -> str:
    """``$MPFUNC_JAX_CACHE``, else ``~/.cache/mpfunc/jax``."""
    return os.environ.get(CACHE_ENV) or str(Path.home() / ".cache" / "mpfunc" / "jax")


def add_cache_args(ap) -> None:
    """``--compile-cache DIR`` and ``--no-compile-cache`` on an argparse parser."""
    ap.add_argument("--compile-cache", metavar="DIR", default=None,
                    help="JAX's persistent compilation cache folder (default: "
                    f"${CACHE_ENV}, else ~/.cache/mpfunc/jax)")
    ap.add_argument("--no-compile-cache", action="store_true",
                    help="turn JAX's persistent compilation cache off (no warm compile figure)")


def cache_from_args(args) -> str | None:
    """Turns the cache on as ``args`` say (before the first compile); its folder, or None."""
    if args.no_compile_cache:
        return use_compile_cache(None)
    return use_compile_cache(args.compile_cache or default_cache_dir())


def _reset_cache() -> None:
    # jax reads the cache settings once, at its first compile: make it read them again.
    from jax.experimental.compilation_cache import compilation_cache

    compilation_cache.reset_cache()


def use_compile_cache(path: str | os.PathLike | None) -> str | None:
    """Turns JAX's persistent compilation cache on in folder ``path`` (created), every
    compile cached (no minimum compile time or entry size); ``None`` turns it off."""
    import jax

    _events()
    if path is None:
        jax.config.update("jax_enable_compilation_cache", False)
        _reset_cache()
        return None
    path = Path(path).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    _reset_cache()
    return str(path)


def cache_on() -> bool:
    import jax

    return bool(jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir)


@contextlib.contextmanager
def cache_paused():
    """The persistent cache off inside (compiles timed cold whatever the folder holds)."""
    import jax

    was_on = cache_on()
    if was_on:
        jax.config.update("jax_enable_compilation_cache", False)
        _reset_cache()
    try:
        yield
    finally:
        if was_on:
            jax.config.update("jax_enable_compilation_cache", True)
            _reset_cache()


def timed_compile(lower, compiler_options=None):
    """``lower()`` then ``.compile()``: the executable and ``{"lower_s", "compile_s",
    "total_s", "cache"}``, cache "hit" (loaded from the folder), "miss" (compiled and
    written), "off" (compiled, the cache off) or "memory" (jax's in-memory cache: no
    XLA compile at all)."""
    ev = _events()
    t0 = time.perf_counter()
    lowered = lower()
    t1 = time.perf_counter()
    hits, misses, backend = ev.hits, ev.misses, ev.backend
    compiled = (lowered.compile() if compiler_options is None
                else lowered.compile(compiler_options=compiler_options))
    t2 = time.perf_counter()
    cache = ("hit" if ev.hits > hits else "miss" if ev.misses > misses
             else "off" if ev.backend > backend else "memory")
    return compiled, {"lower_s": t1 - t0, "compile_s": t2 - t1, "total_s": t2 - t0,
                      "cache": cache}


def compile_cold_warm(lower, counter=None, compiler_options=None, warm=True):
    """Compiles ``lower()`` as it comes, then (cache on, ``warm``) once more after
    ``jax.clear_caches()``, which must load it from the cache folder.

    Returns the first executable and ``{"first", "warm", "cold_s", "warm_s"}``: the two
    `timed_compile` records (``warm`` None when not measured), ``cold_s`` the first
    compile's seconds when it compiled (a miss, or the cache off; None when it was
    loaded from an earlier run's entry or jax's memory) and ``warm_s`` the second's when
    it was a hit.
    ``counter``'s counts leave the second compile out.
    """
    import jax

    compiled, first = timed_compile(lower, compiler_options)
    second = None
    if warm and cache_on():
        jax.clear_caches()
        with counter.paused() if counter is not None else contextlib.nullcontext():
            _, second = timed_compile(lower, compiler_options)
    return compiled, {
        "first": first, "warm": second,
        "cold_s": first["total_s"] if first["cache"] in ("miss", "off") else None,
        "warm_s": second["total_s"] if second and second["cache"] == "hit" else None,
    }


def warm_compile(lower, counter=None, compiler_options=None):
    """A warm compile's record (None, cache off): compiles until the cache has an entry,
    then once more after ``jax.clear_caches()``; for steps whose cold compiles were timed
    under `cache_paused`. ``counter``'s counts leave these compiles out."""
    import jax

    if not cache_on():
        return None
    with counter.paused() if counter is not None else contextlib.nullcontext():
        jax.clear_caches()
        _, rec = timed_compile(lower, compiler_options)
        if rec["cache"] != "hit":
            jax.clear_caches()
            _, rec = timed_compile(lower, compiler_options)
    return rec


def compile_cell(rec: dict) -> str:
    """``"12.31 s / 0.42 s"``: a `compile_cold_warm` record's first and warm compile, each
    with its cache outcome in brackets where it is not the expected one (first: a miss or
    the cache off; warm: a hit)."""
    first, warm = rec["first"], rec["warm"]
    out = f"{first['total_s']:.2f} s" + (
        "" if first["cache"] in ("miss", "off") else f" ({first['cache']})")
    if warm is not None:
        out += f" / {warm['total_s']:.2f} s" + ("" if warm["cache"] == "hit"
                                                 else f" ({warm['cache']})")
    return out


def compile_summary(records: dict, cache_dir: str | None) -> str:
    """One line: each step's first (cold) and warm compile seconds."""
    head = ("Compile seconds, cold (cache off): " if cache_dir is None else
            f"Compile seconds, cold / warm (persistent cache in {cache_dir}): ")
    return head + "; ".join(f"{name} {compile_cell(rec)}" for name, rec in records.items())


# ------------------------------------------------------------------ XLA compiler options
# Passed per compile (``.compile(compiler_options=...)``), so that one process can compare
# them; XLA:CPU accepts and ignores the GPU ones. benchmarks/jax_gpu_compile.py times the
# demo's step under each, and the demo takes one (``--compiler-options``, default: XLA's
# defaults). The fusion autotuner chooses between XLA's native and Triton emitters per
# fusion; autotune level 0 turns all autotuning off (GEMM tilings and algorithms too).
XLA_OPTION_SETS = {
    "default": {},
    "no_triton_gemm": {"xla_gpu_enable_triton_gemm": False},
    "no_fusion_autotuner": {"xla_gpu_experimental_enable_fusion_autotuner": False},
    "autotune_0": {"xla_gpu_autotune_level": 0},
}


def compiler_options(text: str) -> dict:
    """XLA compiler options from a preset name of `XLA_OPTION_SETS` or from
    ``name=value`` pairs separated by commas (values: true/false, integers, or text)."""
    if text in XLA_OPTION_SETS:
        return dict(XLA_OPTION_SETS[text])
    options = {}
    for pair in filter(None, (p.strip() for p in text.split(","))):
        name, eq, value = pair.partition("=")
        if not eq or not name.startswith("xla_"):
            raise ValueError(
                f"compiler options {text!r}: expected a preset from "
                f"{sorted(XLA_OPTION_SETS)} or xla_name=value pairs separated by commas, "
                f"found {pair!r}")
        low = value.strip().lower()
        options[name.strip()] = (low == "true" if low in ("true", "false")
                                 else int(low) if low.lstrip("-").isdigit() else value.strip())
    return options
