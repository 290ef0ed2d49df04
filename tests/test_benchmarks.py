"""Every benchmark script runs end to end at a tiny size and reports sane numbers.

The numbers in BENCHMARKS.md come from these scripts (and a GPU session runs them with
``--device cuda``), so a script that no longer runs is a broken promise. Each runs as
its own process, as a user would run it; timings are not checked, byte counts are.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_script(name, *args, timeout=300):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env.pop("XLA_FLAGS", None)  # the scripts that need devices set them themselves
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / name), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_jax_scale_cost(tmp_path):
    out = tmp_path / "r.json"
    run_script("jax_scale_cost.py", "--depths", "2", "--batch", "8", "--compile-repeats", "1",
               "--rounds", "1", "--iters", "1", "--json", str(out), "--only",
               "mpfunc.dynamic_scale(adam)", "mpfunc.dynamic_scale(adam), float16 compute",
               "mpfunc.dynamic_scale(chain(clip_by_global_norm(1.0), adam))")
    r = json.loads(out.read_text())
    assert r["compile_isolated"] is True  # each compile timed in a fresh process
    (depth,) = r["depths"]
    rows = depth["rows"]
    assert len(rows) == 6  # three variants and their baselines
    for row in rows.values():
        assert row["peak_bytes"] > 0 and row["compile_s"] > 0 and row["step_ms"] > 0
    # The exact skip copies neither params nor state: at most one gradient buffer more.
    grads = depth["params"] * 4
    base = rows["plain optax.adam"]["peak_bytes"]
    assert base < rows["mpfunc.dynamic_scale(adam)"]["peak_bytes"] <= base + 1.02 * grads
    assert rows["mpfunc.dynamic_scale(chain(clip_by_global_norm(1.0), adam))"][
        "peak_ratio"] <= 1.02


def test_jax_loss_scale(tmp_path):
    out = tmp_path / "r.json"
    run_script("jax_loss_scale.py", "--batch", "8", "--width", "32", "--depth", "1",
               "--rounds", "1", "--iters", "1", "--json", str(out))
    r = json.loads(out.read_text())
    assert "plain" in json.dumps(r) and "mpfunc" in json.dumps(r)


def test_precision_report(tmp_path):
    out = tmp_path / "r.json"
    run_script("precision_report.py", "--batch", "8", "--width", "32", "--rounds", "1",
               "--iters", "1", "--depth", "1", "--torch-width", "32", "--torch-batch", "4",
               "--torch-iters", "1", "--json", str(out))
    r = json.loads(out.read_text())
    assert set(r["jax"]["median_step_ms"]) == {"plain", "mpfunc", "+ report",
                                               "+ report + watch"}
    for mode in ("torch", "bf16"):
        times = r["torch"]["modes"][mode]["median_step_ms"]
        assert set(times) == {"mpfunc", "mpfunc, no skip record", "+ report",
                              "+ report + watch"} and min(times.values()) > 0


def test_torch_memory(tmp_path):
    out = tmp_path / "r.json"
    run_script("torch_memory.py", "--width", "64", "--depth", "3", "--batch", "4",
               "--memory-only", "--json", str(out))
    mem = json.loads(out.read_text())["memory"]
    n = mem["fp32"]["params"]
    small = 64 * 1024 / n  # the batch and a few scalars, per param
    assert 16 <= mem["fp32"]["step_peak_per_param"] <= 16 + small
    assert 20 <= mem["hand-written fp16 + fp32 masters"]["step_peak_per_param"] <= 20 + small
    for name in ("mpfunc naive", "mpfunc apex O2"):
        m = mem[name]
        # 18 bytes/param plus what the whole-tensor copy is predicted to hold above it.
        assert 18 <= m["step_peak_per_param"] <= 18 + m["whole_tensor_term_per_param"] + small
        chunked = mem[f"{name}, step_chunks=4"]  # the default --step-chunks
        assert 16 < chunked["predicted_step_peak_per_param"] < 18
    for m in mem.values():  # the accounting predicts every variant's peak
        p = m["predicted_step_peak_per_param"]
        assert p <= m["step_peak_per_param"] <= p + small


def test_unscale_bandwidth(tmp_path):
    out = tmp_path / "r.json"
    run_script("unscale_bandwidth.py", "--mib", "1", "--reps", "2", "--json", str(out))
    r = json.loads(out.read_text())
    for fw in ("torch", "jax"):
        assert r[fw]["unscale_GBps"] > 0 and r[fw]["copy_GBps"] > 0


@pytest.mark.slow  # a child process per mode: about 30 s
def test_torch_modes(tmp_path):
    out = tmp_path / "r.json"
    run_script("torch_modes.py", "--width", "32", "--depth", "1", "--batch", "8",
               "--rounds", "1", "--iters", "1", "--json", str(out), timeout=600)
    assert json.loads(out.read_text())


def test_jax_sharding():
    r = json.loads(run_script("jax_sharding.py", "--hidden", "64", "--layers", "1",
                              "--json").strip().splitlines()[-1])
    assert r


@pytest.mark.slow
def test_torch_sharding():
    r = json.loads(run_script("torch_sharding.py", "--hidden", "64", "--layers", "1",
                              "--sizes", "1,2", "--json", timeout=600).strip().splitlines()[-1])
    assert r


def test_jax_scale_cost_transformer(tmp_path):
    # The transformer model, through bf16 mode: its attention backward is what XLA:CPU
    # could not run before autocast widened bf16 dots on CPU.
    out = tmp_path / "r.json"
    run_script("jax_scale_cost.py", "--model", "transformer", "--depths", "1", "--batch", "2",
               "--compile-repeats", "1", "--rounds", "1", "--iters", "1", "--json", str(out),
               "--only", "mode bf16", "mpfunc.dynamic_scale(adam), float16 compute",
               "--compile-in-process")
    r = json.loads(out.read_text())
    assert r["model"] == "transformer" and r["compile_isolated"] is False
    (depth,) = r["depths"]
    assert depth["leaves"] == 12  # ten per layer and the final LayerNorm's two
    for name in ("mode bf16", "mpfunc.dynamic_scale(adam), float16 compute"):
        assert depth["rows"][name]["peak_ratio"] <= 1.02
        assert depth["rows"][name]["step_ms"] > 0
