"""Where a test run's JAX compile time goes: ``make test-compiles``.

A pytest plugin (registered by tests/conftest.py when ``$MPFUNC_COMPILE_PROFILE`` names
a folder) that listens to jax's own compile events (``jax.monitoring``: tracing to a
jaxpr, lowering to StableHLO, and XLA's backend compile, each with the jitted
function's name) and books each one to the running test's file and to the call site
that asked for it: the innermost frame in this repository outside this plugin (a line
of a test, or of the library where it runs an op eagerly). Each process (each xdist
worker) writes its totals to ``<folder>/<worker>.json`` at its end; the process that
prints the summary (the xdist controller, or the only process) adds up every file there
and prints the stages' totals, the test files and call sites that compiled the most,
and the functions compiled most often.

Run it with the compilation cache off (``make test-compiles`` does): with the cache
warm, the backend stage is a load from disk, not a compile.
"""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict
from pathlib import Path

STAGES = {
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    "/jax/core/compile/backend_compile_duration": "compile",
}
ROOT = Path(__file__).resolve().parents[1]
_SKIP = (str(ROOT / ".venv"), str(Path(__file__).resolve()))


def call_site(frame, root: str = str(ROOT), skip: tuple[str, ...] = _SKIP) -> str:
    """``path:line`` (relative to ``root``) of the innermost frame from ``frame`` outwards
    whose file is under ``root`` and not under any of ``skip``; ``"?"`` if none is."""
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(root) and not name.startswith(skip):
            return f"{os.path.relpath(name, root)}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


class CompileProfile:
    """Seconds and counts of jax's compile stages, by test file, call site and function.

    ``on_event`` is a ``jax.monitoring`` duration listener; ``test`` is the file of the
    test running (set by the plugin hooks)."""

    def __init__(self):
        self.test = "(collection)"
        # (stage, test file, call site, function) -> [count, seconds]
        self.rows: dict[tuple[str, str, str, str], list[float]] = defaultdict(lambda: [0, 0.0])

    def on_event(self, event: str, seconds: float, **kwargs) -> None:
        stage = STAGES.get(event)
        if stage is None:
            return
        key = (stage, self.test, call_site(sys._getframe(1)), str(kwargs.get("fun_name", "?")))
        row = self.rows[key]
        row[0] += 1
        row[1] += seconds

    def dump(self) -> list:
        return [[*k, *v] for k, v in self.rows.items()]


def summarize(rows: list, top: int = 15) -> str:
    """The report of ``rows`` (`CompileProfile.dump` lists, from any number of
    processes): each stage's count and seconds, then the ``top`` test files and call
    sites by backend-compile seconds, and the functions compiled most often."""
    stages: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    by: dict[str, dict[str, list[float]]] = {k: defaultdict(lambda: [0, 0.0, 0.0])
                                             for k in ("file", "site", "function")}
    for stage, test, site, fun, count, seconds in rows:
        stages[stage][0] += count
        stages[stage][1] += seconds
        for kind, name in (("file", test), ("site", site), ("function", fun)):
            row = by[kind][name]
            if stage == "compile":
                row[0] += count
                row[1] += seconds
            else:  # tracing and lowering: paid again on a warm cache
                row[2] += seconds
    lines = ["JAX compiles (every process together):"]
    for stage in ("trace", "lower", "compile"):
        count, seconds = stages[stage]
        lines.append(f"  {stage:8s} {int(count):6d} x  {seconds:8.1f} s")
    for kind, order in (("file", 1), ("site", 1), ("function", 0)):
        label = "most often" if order == 0 else "by compile seconds"
        lines.append(f"{kind}s, {label}: compiles, compile s, trace + lower s")
        ranked = sorted(by[kind].items(), key=lambda kv: -kv[1][order])[:top]
        for name, (count, seconds, front) in ranked:
            lines.append(f"  {int(count):6d} {seconds:8.1f} {front:8.1f}  {name}")
    return "\n".join(lines)


class Plugin:
    """The pytest side: books events to the running test, writes and reads the files."""

    def __init__(self, folder: str | os.PathLike):
        import jax

        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        if "PYTEST_XDIST_WORKER" not in os.environ:  # the run's first process: a new run
            for f in self.folder.glob("*.json"):
                f.unlink()
        self.profile = CompileProfile()
        jax.monitoring.register_event_duration_secs_listener(self.profile.on_event)

    def pytest_runtest_setup(self, item):
        self.profile.test = item.nodeid.split("::")[0]

    def pytest_sessionfinish(self, session):
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        rows = self.profile.dump()
        if rows or worker != "main":
            (self.folder / f"{worker}.json").write_text(json.dumps(rows))

    def pytest_terminal_summary(self, terminalreporter):
        rows = []
        for f in sorted(self.folder.glob("*.json")):
            rows += json.loads(f.read_text())
        terminalreporter.write_line(summarize(rows))
