"""Every benchmark script runs end to end at a tiny size and reports sane numbers.

The numbers in BENCHMARKS.md come from these scripts (and a GPU session runs them with
``--device cuda``), so a script that no longer runs is a broken promise. Each runs as
its own process, as a user would run it; timings are not checked, byte counts are.
"""

import argparse
import gc
import json
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"


def run_script(name, *args, timeout=300):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env.pop("XLA_FLAGS", None)  # the scripts that need devices set them themselves
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / name), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow  # several compiles per row: about 20 s
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
    # One compile of each step in this process, used for memory_analysis and timing.
    assert {row["compiles"] for row in rows.values()} == {1}
    assert r["compile_problems"] == [] and r["skipped"] == {}
    # The cold compiles bypass the persistent cache (on: $MPFUNC_JAX_CACHE, conftest);
    # each step's warm compile loads it from there.
    assert r["compile_cache"] == os.environ["MPFUNC_JAX_CACHE"]
    assert {row["warm_cache"] for row in rows.values()} == {"hit"}
    assert all(row["warm_compile_s"] > 0 for row in rows.values())


def test_jax_no_master_cost(tmp_path):
    out = tmp_path / "r.json"
    run_script("jax_no_master_cost.py", "--width", "128", "--layers", "1", "--rounds", "1",
               "--iters", "1", "--only", "remainder,stochastic_8bit", "--json", str(out))
    r = json.loads(out.read_text())
    assert set(r["median_update_ms"]) == {"adam_bf16", "remainder", "stochastic_8bit"}
    # Byte counts are exact: 2 (bf16 param) + 2 + 2 (bf16 moments) + 2 (remainder); 8-bit
    # moments add a float32 scale per 128 elements of each, plus a few scalars.
    n = r["params"]
    assert n == 128 * 128 + 128
    assert r["bytes_per_param"]["adam_bf16"] == pytest.approx(6 + 4 / n)
    assert r["bytes_per_param"]["remainder"] == pytest.approx(8 + 12 / n)
    assert 4.0625 < r["bytes_per_param"]["stochastic_8bit"] < 4.1
    assert r["ratio_vs_adam_bf16"]["adam_bf16"] == 1.0


# Every method and every state dtype once (each combination's optimizer is tested in
# tests/test_master_weights.py and test_param_storage.py; what this adds is the script):
# 6 short trainings, a compile each (the 15 of the whole grid took 4.5 min on 2 cores).
NO_MASTER_RUNS = ("remainder/bfloat16", "kahan/float8_e4m3fn", "stochastic/float8_e4m3fn",
                  "plain/float32", "float32/bfloat16")


@pytest.mark.slow  # 6 short trainings: about 100 s on 2 busy cores
def test_jax_no_master_loss(tmp_path):
    out = tmp_path / "r.json"
    run_script("jax_no_master_loss.py", "--steps", "3", "--width", "32", "--layers", "1",
               "--context", "16", "--batch", "4", "--eval-batches", "1", "--runs",
               ",".join(NO_MASTER_RUNS), "--json", str(out))
    r = json.loads(out.read_text())
    assert sorted(r["runs"]) == sorted(["float32/float32", *NO_MASTER_RUNS])
    assert r["runs"]["float32/float32"]["gap_vs_float32_masters"] == 0
    assert all(abs(row["gap_vs_float32_masters"]) < 0.05 for row in r["runs"].values())
    sizes = {k: row["bytes_per_param"] for k, row in r["runs"].items()}
    assert 14 <= sizes["float32/float32"] < 14.01 and sizes["remainder/bfloat16"] < 8.01
    assert sizes["stochastic/float8_e4m3fn"] < 4.1


def test_jax_no_master_loss_one_method(tmp_path):
    out = tmp_path / "r.json"
    run_script("jax_no_master_loss.py", "--steps", "2", "--width", "32", "--layers", "1",
               "--context", "16", "--batch", "4", "--eval-batches", "1", "--methods",
               "kahan", "--states", "bfloat16", "--json", str(out))
    r = json.loads(out.read_text())
    assert set(r["runs"]) == {"float32/float32", "kahan/bfloat16"}


def test_jax_no_master_loss_noise_floor_moves_one_weight_one_bfloat16_ulp():
    import jax
    import jax.numpy as jnp
    import numpy as np

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from jax_no_master_loss import one_ulp_off
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    # The largest leaf's first element: a zero bias's next value would be subnormal,
    # which XLA:CPU flushes to zero (the first version moved one, and changed nothing).
    p = {"a": jnp.zeros((1, 3)), "w": jnp.asarray([[1.0, 0.5], [0.25, -2.0]])}
    leaves = jax.tree.leaves(one_ulp_off(p))
    bf = [np.asarray(x).astype(jnp.bfloat16) for x in leaves]
    assert (bf[0] == 0).all()
    assert float(bf[1][0, 0]) == 1.0 + 2.0**-7 and (bf[1].reshape(-1)[1:] == [0.5, 0.25, -2.0]).all()
    with pytest.raises(ValueError, match="not a normal number"):
        one_ulp_off({"w": jnp.zeros((2, 2))})


@pytest.mark.slow  # about 8 s
def test_jax_loss_scale(tmp_path):
    out, cache = tmp_path / "r.json", tmp_path / "cache"
    run_script("jax_loss_scale.py", "--batch", "8", "--width", "32", "--depth", "1",
               "--rounds", "1", "--iters", "1", "--json", str(out), "--compile-cache",
               str(cache))
    r = json.loads(out.read_text())
    assert {"plain", "mpfunc"} <= set(r["median_step_ms"])
    # Each variant's step compiled exactly once (warm-up and timing reuse it).
    variants = ["plain", "mpfunc", "mpfunc_select", "mpfunc_cond", "manual"]
    assert r["compiles"] == dict.fromkeys(variants, 1)
    assert r["compile_problems"] == []
    # JAX's persistent cache, in the folder given: each step compiled cold (an entry
    # written), then, after jax.clear_caches(), loaded from the folder (warm).
    assert r["compile_cache"] == str(cache.resolve())
    assert any(f.name.startswith("jit_bench_step") for f in cache.iterdir())
    for name in variants:
        c = r["compile"][name]
        assert (c["first"]["cache"], c["warm"]["cache"]) == ("miss", "hit"), name
        assert c["cold_s"] == c["first"]["total_s"] > 0 and c["warm_s"] > 0


@pytest.mark.slow  # both frameworks' report cost: about 10 s
def test_precision_report(tmp_path):
    out = tmp_path / "r.json"
    run_script("precision_report.py", "--batch", "8", "--width", "32", "--rounds", "1",
               "--iters", "1", "--depth", "1", "--torch-width", "32", "--torch-batch", "4",
               "--torch-iters", "1", "--json", str(out))
    r = json.loads(out.read_text())
    assert set(r["jax"]["median_step_ms"]) == {"plain", "mpfunc", "+ skip record",
                                               "+ report", "+ report + watch"}
    for mode in ("torch", "bf16"):
        times = r["torch"]["modes"][mode]["median_step_ms"]
        assert set(times) == {"mpfunc", "+ skip record", "+ report",
                              "+ report + watch"} and min(times.values()) > 0


@pytest.mark.slow  # a child per mode, about 8 s; test_low_precision measures the same buffers
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
        assert r[fw]["device_copy_GBps"] > 0 and r[fw]["fraction_of_device_copy"] > 0
    assert r["jax"]["device_copy_is_real_copy"] is True  # not aliased away by XLA


def test_low_precision(tmp_path):
    out = tmp_path / "r.json"
    run_script("low_precision.py", "--params", "3000", "--rounds", "1", "--steps-per-round",
               "1", "--steps", "2", "--layers", "1", "--width", "16", "--heads", "2",
               "--context", "8", "--batch", "2", "--json", str(out))
    r = json.loads(out.read_text())
    per_param = r["bytes"]["bytes_per_param"]  # counted from the buffers: exact here
    assert per_param["float32 masters"] == pytest.approx(14, abs=0.05)
    assert per_param["remainder + bf16 state"] == pytest.approx(8, abs=0.05)
    assert per_param["stochastic + bf16 state"] == pytest.approx(6, abs=0.05)
    assert 4 < per_param["stochastic + 8-bit state"] < 4.1
    assert 4 < per_param["stochastic + 8-bit state (stochastic)"] < 4.1
    peak = r["peak"]["step_peak_bytes_per_param"]  # counted at the allocator: exact
    assert 4 <= peak["float32 masters, fused AdamW"] < 4.5  # the float32 master grads
    assert peak["remainder + bf16 state, fused AdamW, generic path"] >= 16
    # One chunk holds this model whole: the fused path's workspace is the same 12 bytes.
    assert peak["remainder + bf16 state, fused AdamW"] <= peak[
        "remainder + bf16 state, fused AdamW, generic path"]
    runs = r["overhead"]["runs"]
    assert runs["AdamW(foreach) on bf16 params"]["paired_median_ratio"] == 1
    assert "AdamW(fused) on bf16 params" in runs
    assert all(v["median_ms"] > 0 for v in runs.values())
    losses = r["loss"]["runs"]
    assert losses["float32 masters"]["gap_vs_float32_masters"] == 0
    assert all(0 < v["eval_loss"] < 10 for v in losses.values())


@pytest.mark.slow  # a child process per mode: about 30 s
def test_torch_modes(tmp_path):
    out = tmp_path / "r.json"
    run_script("torch_modes.py", "--width", "32", "--depth", "1", "--batch", "8",
               "--rounds", "1", "--iters", "1", "--json", str(out), timeout=600)
    r = json.loads(out.read_text())
    assert r["peak_method"] == "child"  # CPU: RSS, a fresh process per variant
    assert len(r["peak_mib"]) == len(r["memory_vs_fp32"]) == 9


def test_torch_modes_without_peaks(tmp_path):
    out = tmp_path / "r.json"
    run_script("torch_modes.py", "--width", "16", "--depth", "1", "--batch", "4",
               "--rounds", "1", "--iters", "1", "--peak", "none", "--json", str(out))
    r = json.loads(out.read_text())
    assert r["peak_method"] == "none" and r["peak_mib"] == {}
    assert len(r["median_step_ms"]) == 9


def test_torch_function_mode(tmp_path):
    out = tmp_path / "r.json"
    run_script("torch_function_mode.py", "--d", "16", "--layers", "1", "--batch", "2",
               "--seq", "8", "--rounds", "1", "--iters", "1", "--json", str(out))
    r = json.loads(out.read_text())
    assert set(r["ms"]) == {"naive", "naive, function mode off",
                            "naive, without the one-dtype rule", "apex O3",
                            "apex O3, function mode off"}
    assert r["torch_calls_per_forward"] > 20  # every torch call in forward goes through it
    assert all(v > 0 for m in r["ms"].values() for v in m.values())
    assert set(r["one_dtype_rule_forward_ratio"]) == {"naive", "apex O3"}


@pytest.mark.slow  # every torch mode in one process, about 16 s; test_torch_modes_without_peaks stays
def test_torch_modes_in_process_peaks_free_each_variant_first(monkeypatch):
    # The CUDA path (one process, peak stats reset per variant), run on CPU with a meter
    # that checks, at each reset, that no model built before it is still alive.
    sys.path.insert(0, str(BENCH))
    try:
        import torch_modes as tm
    finally:
        sys.path.remove(str(BENCH))
    built = []

    class Meter:
        starts = 0

        def start(self):
            gc.collect()
            alive = [name for name, ref in built if ref() is not None]
            assert not alive, f"still alive when variant {self.starts} starts: {alive}"
            self.starts += 1
            return 1000

        def peak(self):
            return 1000 + 2**20 * self.starts

    make_step = tm.make_step

    def tracked(name, *args):
        step = make_step(name, *args)
        built.append((name, weakref.ref(step)))
        return step

    monkeypatch.setattr(tm, "make_step", tracked)
    meter = Meter()
    args = argparse.Namespace(device="cpu", width=16, depth=1, batch=4, rounds=1, iters=1,
                              peak="in-process")
    r = tm.measure(args, meter=meter)
    assert meter.starts == len(tm.VARIANTS) == 9
    assert len(built) == 18  # nine timed, then nine measured one at a time
    assert r["peak_method"] == "in-process"
    assert list(r["peak_mib"].values()) == [float(i) for i in range(1, 10)]
    assert r["memory_vs_fp32"]["mpfunc bf16"] == 9.0
    assert tm.peak_method("auto", "cuda") == "in-process"
    assert tm.peak_method("auto", "cpu") == "child"


def test_torch_modes_in_process_peaks_need_cuda():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(BENCH / "torch_modes.py"), "--peak",
                           "in-process"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert "--peak in-process needs --device cuda" in proc.stderr


@pytest.mark.slow  # compiles the demo at two depths, unrolled and scanned: about 15 s
def test_jax_compile_depth(tmp_path):
    out = tmp_path / "r.json"
    stdout = run_script("jax_compile_depth.py", "--depths", "1", "2", "--repeats", "1",
                        "--modes", "fp32", "--width", "16", "--heads", "2", "--context", "8",
                        "--batch", "2", "--json", str(out))
    rows = {r["layout"]: r for r in json.loads(out.read_text())["jax_compile_depth"]["rows"]}
    assert set(rows) == {"scan", "unrolled"}
    for r in rows.values():
        assert r["1"]["compile_s"] > 0 and r["2"]["lower_s"] > 0 and r["ratio"] > 0
    # The scanned step's program is the same size at any depth; the unrolled one grows.
    assert rows["scan"]["1"]["dots"] == rows["scan"]["2"]["dots"]
    assert rows["unrolled"]["2"]["dots"] > rows["unrolled"]["1"]["dots"]
    assert "| fp32 | scan |" in stdout


@pytest.mark.slow  # a child compiling every mesh, about 8 s
def test_jax_sharding_with_the_compile_cache_off(tmp_path):
    env_cache = Path(os.environ["MPFUNC_JAX_CACHE"])
    before = set(env_cache.iterdir()) if env_cache.exists() else set()
    r = json.loads(run_script("jax_sharding.py", "--hidden", "64", "--layers", "1",
                              "--json", "--no-compile-cache").strip().splitlines()[-1])
    assert [row["devices"] for row in r["rows"]] == [1, 2, 4, 8]
    assert [row["step_compiles"] for row in r["rows"]] == [1, 1, 1, 1]
    # Off: compiled, nothing written to the cache folder, no warm figure.
    assert r["compile_cache"] is None
    for row in r["rows"]:
        c = row["compile"]
        assert c["first"]["cache"] == "off" and c["warm"] is None and c["warm_s"] is None
    after = set(env_cache.iterdir()) if env_cache.exists() else set()
    assert after == before


def test_compile_counter_counts_a_recompile():
    # What the benchmarks' counts rest on: a step called with an uncommitted input and
    # then with a committed one is compiled twice, and the counter sees both.
    import jax
    import jax.numpy as jnp

    sys.path.insert(0, str(BENCH))
    try:
        from _jax_compiles import CompileCounter, named, step_name
    finally:
        sys.path.remove(str(BENCH))
    counter = CompileCounter()
    name = step_name("test: a step (recompiled)", 7)
    assert name == "bench_step7_test_a_step_recompiled"
    f = jax.jit(named(lambda a: a * 2, name))
    x = jnp.ones(3)
    f(x)
    f(x)
    assert counter.of(name) == 1
    f(jax.device_put(x, jax.devices()[0]))
    assert counter.of(name) == 2
    compiled = jax.jit(named(lambda a: a * 2, name)).lower(x).compile()
    compiled(x)
    compiled(x)
    assert counter.of(name) == 3
    assert counter.of("bench_step7") == 0  # names are matched whole


@pytest.mark.slow
def test_torch_sharding():
    r = json.loads(run_script("torch_sharding.py", "--hidden", "64", "--layers", "1",
                              "--sizes", "1,2", "--json", timeout=600).strip().splitlines()[-1])
    assert r


@pytest.mark.slow  # a transformer's compiles: about 20 s
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
    assert {row["compiles"] for row in depth["rows"].values()} == {1}


@pytest.mark.slow  # a jax_scale_cost run, about 11 s; test_jax_scale_cost_names_an_unknown_variant stays
def test_jax_scale_cost_without_jmp_skips_its_row(tmp_path):
    # The CUDA image has no jmp: its row is left out with a note, the rest still runs.
    out = tmp_path / "r.json"
    argv = [str(BENCH / "jax_scale_cost.py"), "--depths", "1", "--batch", "2",
            "--compile-repeats", "1", "--rounds", "0", "--compile-in-process", "--json",
            str(out), "--only", "jmp DynamicLossScale + select_tree", "mode naive"]
    code = ("import runpy, sys; sys.modules['jmp'] = None; "
            f"sys.argv = {argv!r}; runpy.run_path(sys.argv[0], run_name='__main__')")
    env = dict(os.environ, PYTHONPATH=f"{BENCH}{os.pathsep}{ROOT}", OMP_NUM_THREADS="1")
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["skipped"] == {"jmp DynamicLossScale + select_tree": "jmp is not installed"}
    assert set(r["depths"][0]["rows"]) == {"mode naive", "mode naive, no loss scaling"}
    assert "Not measured: jmp DynamicLossScale + select_tree" in proc.stdout


def test_jax_scale_cost_names_an_unknown_variant():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(BENCH / "jax_scale_cost.py"), "--only", "nope"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "`only` names unknown variants ['nope']" in proc.stderr


@pytest.mark.slow  # every recipe in both frameworks: about 20 s
def test_fp8(tmp_path):
    # The --quick CPU setting (d=32): every variant runs and reports a finite, positive
    # throughput and ratio under the keys fp8.<framework>.<recipe>.<d>.speed_vs_bf16.
    # Two recipes here (each compiled variant is a few seconds of tracing); the others
    # go through the same code (tests/test_fp8_*.py run them all).
    import math

    out = tmp_path / "r.json"
    run_script("fp8.py", "--quick", "--recipes", "tensorwise,delayed", "--out", str(out))
    r = json.loads(out.read_text())
    assert r["skipped"] == []
    want = {"torch": ["bf16", "tensorwise", "delayed", "bf16_compiled", "tensorwise_compiled",
                      "delayed_compiled"],
            "jax": ["bf16", "tensorwise", "delayed"]}
    assert {fw: list(rows) for fw, rows in r["fp8"].items()} == want
    for fw, rows in r["fp8"].items():
        for key, by_d in rows.items():
            assert list(by_d) == ["32"]
            row = by_d["32"]
            for field in ("speed_vs_bf16", "tflops", "step_ms"):
                assert math.isfinite(row[field]) and row[field] > 0, (fw, key, field)
            if key.startswith("bf16"):
                assert row["speed_vs_bf16"] == 1.0
    assert "| torch | tensorwise_compiled | 32 |" in r["markdown"]


def test_fp8_time_budget_skips_and_records(tmp_path):
    out = tmp_path / "r.json"
    run_script("fp8.py", "--quick", "--frameworks", "torch", "--recipes", "tensorwise",
               "--no-compile", "--time-budget", "0", "--out", str(out))
    r = json.loads(out.read_text())
    assert r["fp8"] == {}
    assert [s["variant"] for s in r["skipped"]] == ["torch/bf16/32", "torch/tensorwise/32"]
    assert {s["reason"] for s in r["skipped"]} == {"time budget"}


@pytest.mark.slow  # GPT and dot models in both frameworks: about 30 s
def test_fp8_gpt_and_dot_models(tmp_path):
    # The demo's GPT decoder at a tiny size in both frameworks (one init, the same
    # batches), and JAX's single dot: every row measured, the GPT losses at the same
    # step close to bf16's.
    import math

    out = tmp_path / "r.json"
    run_script("fp8.py", "--quick", "--model", "gpt,dot", "--recipes", "tensorwise,rowwise",
               "--no-compile", "--out", str(out))
    r = json.loads(out.read_text())
    assert r["skipped"] == []
    g = "gpt32x2x16"
    keys = ("bf16", "tensorwise", "rowwise")
    assert {fw: {k: list(v) for k, v in rows.items()} for fw, rows in r["fp8"].items()} == {
        "torch": {k: [g] for k in keys}, "jax": {k: [g, "dot32"] for k in keys}}
    for fw, rows in r["fp8"].items():
        for key, by_size in rows.items():
            for size, row in by_size.items():
                for field in ("step_ms", "tflops", "speed_vs_bf16", "first_step_s"):
                    assert math.isfinite(row[field]) and row[field] > 0, (fw, key, field)
                assert (row.get("compile_s", 0) > 0) == (fw == "jax")
                if size == g:
                    assert math.isfinite(row["loss"]) and abs(row["loss_vs_bf16"]) < 0.02
                    assert key != "bf16" or row["loss_vs_bf16"] == 0
    assert (r["gpt"]["width"], r["gpt"]["layers"], r["gpt"]["context"]) == (32, 2, 16)
    assert f"| jax | tensorwise | {g} |" in r["markdown"]


@pytest.mark.slow  # about 9 s; test_fp8_budget_skips_a_variant_that_would_not_fit stays
def test_fp8_time_limit_stops_the_running_variant_and_keeps_the_json(tmp_path):
    out = tmp_path / "r.json"
    run_script("fp8.py", "--quick", "--model", "gpt", "--frameworks", "torch", "--recipes",
               "tensorwise", "--no-compile", "--time-limit", "0.001", "--out", str(out))
    r = json.loads(out.read_text())
    assert r["fp8"] == {}
    assert r["skipped"] == [
        {"variant": "torch/bf16/gpt32x2x16", "reason": "time limit (stopped in it)"},
        {"variant": "torch/tensorwise/gpt32x2x16", "reason": "time limit"}]


def test_fp8_budget_skips_a_variant_that_would_not_fit(monkeypatch, capsys):
    # No variant starts where less time is left than the last of its kind took.
    import time

    monkeypatch.syspath_prepend(str(BENCH))
    import fp8

    def fake(model, size, fw, recipe, compiled, args):
        time.sleep(0.4)
        return {"step_s": 0.001, "first_step_s": 0.0}

    monkeypatch.setattr(fp8, "run_variant", fake)
    r = fp8.main(["--quick", "--frameworks", "torch", "--recipes", "tensorwise,delayed",
                  "--no-compile", "--time-budget", "0.6"])
    assert list(r["fp8"]["torch"]) == ["bf16"]
    assert r["skipped"] == [{"variant": f"torch/{k}/32", "reason": "time budget"}
                            for k in ("tensorwise", "delayed")]


def test_fp8_dot_baseline_keeps_the_cotangent_in_bfloat16(monkeypatch):
    # The dot model's bf16 baseline: every GEMM, the backward two included, reads
    # bfloat16 operands (the cotangent too), as fp8's read fp8 ones; with
    # preferred_element_type=float32 the backward GEMMs would read a float32 cotangent.
    import jax
    import jax.numpy as jnp

    monkeypatch.syspath_prepend(str(BENCH))
    import _fp8_models

    x = jnp.ones((32, 32), jnp.bfloat16)
    jaxpr = jax.make_jaxpr(jax.grad(_fp8_models.dot_loss(None), argnums=(0, 1)))(x, x, None)
    dots = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 3
    assert all(v.aval.dtype == jnp.bfloat16 for e in dots for v in e.invars)

    def unfair(x, w, s):
        return jnp.dot(x, w, preferred_element_type=jnp.float32).sum()

    jaxpr = jax.make_jaxpr(jax.grad(unfair, argnums=(0, 1)))(x, x, None)
    assert any(v.aval.dtype == jnp.float32 for e in jaxpr.eqns
               if e.primitive.name == "dot_general" for v in e.invars)


@pytest.mark.slow  # every recipe timed, about 10 s; test_fp8_time_budget_skips_and_records stays
def test_fp8_eager(tmp_path):
    # Ops counts are exact (dispatch-mode counts); times only have to be there.
    out = tmp_path / "r.json"
    run_script("fp8_eager.py", "--shape", "64,128", "--rounds", "1", "--iters", "1",
               "--json", str(out))
    r = json.loads(out.read_text())
    assert list(r["fp8_eager"]) == ["tensorwise", "delayed", "rowwise", "blockwise"]
    for recipe, row in r["fp8_eager"].items():
        assert row["ops_per_operand_fused"] == {"tensorwise": 2, "delayed": 3}.get(recipe, 1)
        assert row["ops_per_operand_torch_ops"] > 10
        assert row["ops_per_linear_fused"] < row["ops_per_linear_torch_ops"] - 50
        for key in ("quantize_us_fused", "quantize_us_torch_ops", "linear_ms_fused",
                    "linear_ms_torch_ops"):
            assert row[key] > 0
    assert "| delayed | 3 (" in r["markdown"] and r["triton_compile"] is None


def test_fp8_variant_order_and_selection(monkeypatch, capsys):
    # Eager torch variants of every model first (the cheap ones, for a time budget),
    # then compiled, then JAX; --gpt-recipes and --compiled-only select.
    monkeypatch.syspath_prepend(str(BENCH))
    import fp8

    ran = []

    def fake(model, size, fw, recipe, compiled, args):
        ran.append((fw, model, recipe or "bf16", compiled))
        return {"step_s": 0.001, "first_step_s": 0.0}

    monkeypatch.setattr(fp8, "run_variant", fake)
    fp8.main(["--quick", "--model", "linear,gpt", "--recipes", "tensorwise",
              "--gpt-recipes", "delayed"])
    eager = [("linear", "bf16"), ("linear", "tensorwise"), ("gpt", "bf16"), ("gpt", "delayed")]
    assert ran == ([("torch", m, r, False) for m, r in eager]
                   + [("torch", m, r, True) for m, r in eager]
                   + [("jax", m, r, False) for m, r in eager])
    ran.clear()
    fp8.main(["--quick", "--frameworks", "torch", "--recipes", "rowwise", "--compiled-only"])
    assert ran == [("torch", "linear", "bf16", True), ("torch", "linear", "rowwise", True)]
    with pytest.raises(SystemExit):
        fp8.main(["--quick", "--no-compile", "--compiled-only"])
    assert "leave no torch variant" in capsys.readouterr().err


def test_compiler_options_presets_and_pairs():
    sys.path.insert(0, str(BENCH))
    try:
        from _jax_compiles import XLA_OPTION_SETS, compiler_options
    finally:
        sys.path.remove(str(BENCH))
    assert compiler_options("default") == {} and set(XLA_OPTION_SETS) == {
        "default", "no_triton_gemm", "no_fusion_autotuner", "autotune_0"}
    assert compiler_options("autotune_0") == {"xla_gpu_autotune_level": 0}
    assert compiler_options("xla_gpu_autotune_level=1, xla_gpu_enable_triton_gemm=false,"
                            "xla_dump_to=/tmp/x") == {
        "xla_gpu_autotune_level": 1, "xla_gpu_enable_triton_gemm": False,
        "xla_dump_to": "/tmp/x"}
    with pytest.raises(ValueError, match=r"compiler options 'fast': expected a preset from "
                       r"\['autotune_0', .*or xla_name=value pairs .*found 'fast'"):
        compiler_options("fast")


@pytest.mark.slow  # several child processes compiling the demo, about 30 s
def test_jax_gpu_compile_tiny_on_cpu(tmp_path):
    # The GPU benchmark's pipeline at a tiny size: each option set in its own child, the
    # demo's step (through compare_modes.run_jax) and the fp8 / bf16 dots cold and warm, an
    # option set this jaxlib does not know reported for its rows, not fatal.
    out, logs = tmp_path / "r.json", tmp_path / "logs"
    run_script("jax_gpu_compile.py", "--modes", "fp32", "--forms", "scanned", "--options",
               "default", "--extra-options", "bogus:xla_no_such_option=1", "--window", "1",
               "--logs", str(logs), "--json", str(out), timeout=900)
    r = json.loads(out.read_text())
    assert r["size"]["layers"] == 2 and r["size"]["dot"] == 64  # the CPU sizes
    assert r["option_sets"] == {"default": {}, "bogus": {"xla_no_such_option": 1}}
    rows = {(x["options"], x["item"]): x for x in r["rows"]}
    for item in ("dot/bf16", "dot/fp8"):
        x = rows["default", item]
        assert x["status"] == "ok", x
        assert (x["first"]["cache"], x["warm"]["cache"]) == ("miss", "hit")
        assert x["cold_s"] > 0 and x["warm_s"] > 0 and x["step_ms"] > 0
        assert rows["bogus", item]["status"] == "unknown option"
    assert "No such compile option: 'xla_no_such_option'" in rows["bogus", "dot/bf16"][
        "reason"]
    step = rows["default", "scanned/fp32"]
    if step["status"] == "not run":  # a compare_modes without the scanned model
        assert step["reason"] == "examples/compare_modes.py has no scanned model"
    else:
        assert step["status"] == "ok" and step["warm"]["cache"] == "hit", step
        assert step["eval_compile_s"] > 0 and step["step_ms"] > 0
    assert [c["options"] for c in r["children"]] == ["default", "bogus"]
    assert sorted(f.name for f in logs.iterdir()) == [
        "jax_gpu_compile-1-bogus.log", "jax_gpu_compile-1-default.log"]
    assert "| dot/fp8 |" in r["markdown"] and r["choice"]["best"] == "default"


def test_jax_gpu_compile_names_bad_arguments(capsys):
    sys.path.insert(0, str(BENCH))
    try:
        import jax_gpu_compile
    finally:
        sys.path.remove(str(BENCH))
    for argv, msg in ((["--options", "fast"], "--options: unknown set 'fast'; choose from "
                       "['default', 'no_triton_gemm', 'no_fusion_autotuner', 'autotune_0']"),
                      (["--modes", "fp16"], "--modes from ['fp32',"),
                      (["--extra-options", "x:fast"], "--extra-options 'x:fast': compiler "
                       "options 'fast': expected a preset")):
        with pytest.raises(SystemExit) as e:
            jax_gpu_compile.main(argv)
        assert e.value.code == 2 and msg in capsys.readouterr().err


def test_import_time(tmp_path):
    # `import mpfunc_torch` loads no torch._dynamo / torch.onnx / inductor.
    out = tmp_path / "r.json"
    run_script("import_time.py", "--rounds", "1", "--modules", "torch,mpfunc_torch",
               "--json", str(out))
    r = json.loads(out.read_text())
    assert set(r["seconds"]) == set(r["cpu_seconds"]) == {"torch", "mpfunc_torch"}
    assert r["rounds"] == 1 and r["cpu_seconds"]["torch"]["median"] > 0
    assert r["loaded"] == {"torch": [], "mpfunc_torch": []}
    assert r["mpfunc_torch_vs_torch"]["cpu_seconds"]["median"] > 0
    assert "mpfunc_vs_jax" not in r  # only the pairs measured
    proc = subprocess.run([sys.executable, str(BENCH / "import_time.py"), "--modules",
                           "tensorflow"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "--modules: unknown ['tensorflow']; choose from ['torch'," in proc.stderr


@pytest.mark.slow  # four HF trainings, about 11 s
def test_hf_trainer(tmp_path):
    # The Trainer's own fp16=True against AmpTrainer, tiny GPT-2 on CPU (the GPU run is
    # GPT-2 small at batch 8 x 1024): every variant trains and is timed.
    out = tmp_path / "r.json"
    printed = run_script("hf_trainer.py", "--device", "cpu", "--tiny", "--steps", "3",
                         "--warmup", "1", "--batch", "2", "--time-budget", "120",
                         "--json", str(out))
    r = json.loads(out.read_text())
    names = [row["variant"] for row in r["rows"]]
    assert names == ["Trainer fp16=True", "AmpTrainer naive", "AmpTrainer torch",
                     "AmpTrainer bf16"]
    for row in r["rows"]:
        assert row["median_step_ms"] > 0 and row["timed_steps"] == 2
        assert row["peak_bytes"] is None  # no peak counter on CPU
        assert (row["skipped_steps"] is None) == (row["variant"] == "Trainer fp16=True")
    assert r["rows"][0]["step_time_vs_fp16"] == 1.0
    assert "| AmpTrainer naive | n/a | n/a |" in printed
