"""Tests for tests/compile_profile.py, the plugin behind `make test-compiles`."""

import sys

import jax
import jax.numpy as jnp
from compile_profile import ROOT, STAGES, CompileProfile, call_site, summarize


def test_jax_emits_the_three_stages_it_books_with_the_function_name():
    seen = []

    def listener(event, seconds, **kwargs):
        if event in STAGES:
            seen.append((STAGES[event], kwargs.get("fun_name"), seconds))

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        def profiled_fn(x):
            return x * 3 + 1

        jax.jit(profiled_fn)(jnp.arange(7.0))  # a shape no other test compiles this for
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    stages = {stage for stage, name, _ in seen if "profiled_fn" in str(name)}
    assert stages == {"trace", "lower", "compile"}, seen
    assert all(s >= 0 for *_, s in seen)


def test_an_event_is_booked_to_the_running_test_and_the_line_that_asked():
    profile = CompileProfile()
    profile.test = "tests/test_x.py"
    profile.on_event("/jax/core/compile/backend_compile_duration", 0.25, fun_name="jit(f)")
    line = sys._getframe().f_lineno - 1
    profile.on_event("/jax/core/compile/backend_compile_duration", 0.5, fun_name="jit(f)")
    profile.on_event("/jax/some/other_event", 9.0, fun_name="jit(f)")  # not a stage
    rows = profile.dump()
    site = f"tests/test_compile_profile.py:{line}"
    assert ["compile", "tests/test_x.py", site, "jit(f)", 1, 0.25] in rows
    assert len(rows) == 2 and all(r[0] == "compile" for r in rows)


def test_the_call_site_skips_frames_outside_the_repository_and_in_the_skipped_files():
    here = sys._getframe()
    assert call_site(here).startswith("tests/test_compile_profile.py:")
    assert call_site(here, skip=(__file__,)) != call_site(here)  # the caller's frame
    assert call_site(here, root="/nonexistent") == "?"
    assert str(ROOT) not in call_site(here)


def test_the_summary_adds_up_processes_and_ranks_by_compile_seconds():
    rows = [
        ["compile", "tests/a.py", "tests/a.py:1", "jit(step)", 2, 3.0],
        ["compile", "tests/b.py", "mpfunc/x.py:9", "jit(add)", 5, 0.5],
        ["trace", "tests/b.py", "mpfunc/x.py:9", "add", 5, 0.25],
        ["compile", "tests/a.py", "tests/a.py:1", "jit(step)", 1, 1.0],  # another worker
    ]
    text = summarize(rows)
    lines = text.splitlines()
    assert "  compile       8 x       4.5 s" in lines
    assert "  trace         5 x       0.2 s" in lines
    files = lines[lines.index(next(x for x in lines if x.startswith("files"))) + 1:][:2]
    assert files[0].split() == ["3", "4.0", "0.0", "tests/a.py"]
    assert files[1].split() == ["5", "0.5", "0.2", "tests/b.py"]
    funcs = lines[lines.index(next(x for x in lines if x.startswith("functions"))) + 1:]
    assert funcs[0].split()[-1] == "jit(add)"  # most often: 5 compiles against 3
