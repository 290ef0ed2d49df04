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


def test_jax_loss_scale(tmp_path):
    out = tmp_path / "r.json"
    run_script("jax_loss_scale.py", "--batch", "8", "--width", "32", "--depth", "1",
               "--rounds", "1", "--iters", "1", "--json", str(out))
    r = json.loads(out.read_text())
    assert "plain" in json.dumps(r) and "mpfunc" in json.dumps(r)
    # Each variant's step compiled exactly once (warm-up and timing reuse it).
    assert r["compiles"] == dict.fromkeys(
        ["plain", "mpfunc", "mpfunc_select", "mpfunc_cond", "manual"], 1)
    assert r["compile_problems"] == []


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


def test_jax_sharding():
    r = json.loads(run_script("jax_sharding.py", "--hidden", "64", "--layers", "1",
                              "--json").strip().splitlines()[-1])
    assert [row["devices"] for row in r["rows"]] == [1, 2, 4, 8]
    assert [row["step_compiles"] for row in r["rows"]] == [1, 1, 1, 1]


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


# ------------------------------------------------------------------ benchmarks/gpu.sh
def _gpu_report():
    sys.path.insert(0, str(BENCH))
    try:
        import gpu_report
    finally:
        sys.path.remove(str(BENCH))
    return gpu_report


def test_gpu_sh_parses_and_its_time_boxes_fit_eight_minutes():
    assert subprocess.run(["bash", "-n", str(BENCH / "gpu.sh")]).returncode == 0
    plan = subprocess.run(["bash", str(BENCH / "gpu.sh"), "--plan"], capture_output=True,
                          text=True, timeout=60, check=True).stdout
    rows = dict(line.split() for line in plan.strip().splitlines())
    rows = {k: int(v) for k, v in rows.items()}
    budget, kill_after, overhead = rows.pop("budget"), rows.pop("kill_after"), rows.pop("overhead")
    assert budget == 480
    # The same parts as the report knows, in the same order (the CPU suite aside).
    report = _gpu_report()
    assert [n for n, _ in report.PARTS if n not in report.BACKGROUND] == [
        n for n in rows if n not in report.BACKGROUND]
    assert set(rows) == {n for n, _ in report.PARTS}
    suite = rows.pop("cpu_suite")
    # GPU parts one after another, each possibly KILLed kill_after s after its signal.
    assert sum(rows.values()) + kill_after * len(rows) + overhead <= budget
    assert suite + kill_after + overhead <= budget  # beside them
    proc = subprocess.run(["bash", str(BENCH / "gpu.sh"), "--parts", "nope"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "unknown part 'nope'" in proc.stderr


def test_gpu_report_statuses_and_sections(tmp_path):
    # Every way a part can end, through the same record/assemble steps gpu.sh uses.
    report = _gpu_report()
    run = tmp_path / "gpu-logs"
    run.mkdir()
    env = report.collect_env(dry_run=True)
    (run / "env.json").write_text(json.dumps(env))

    def record(name, rc, result=None, missing=None, log="", data=None):
        (run / f"{name}.log").write_text(log)
        if data is not None:
            (run / f"{name}.json").write_text(json.dumps(data))
        argv = ["record", "--run", str(run), "--name", name, "--rc", str(rc), "--started",
                "0", "--timeout", "30", "--", "python", f"{name}.py"]
        if result:
            argv[1:1] = ["--result", result]
        if missing:
            argv[1:1] = ["--missing", missing]
        assert report.main(argv) == 0

    record("compare_modes", 0, "compare_modes.json",
           data={"compare_modes": {"rows": [1]}, "markdown": "| cm |"})
    record("fp8", 127, "fp8.json", missing="benchmarks/fp8.py")
    record("jax_loss_scale", 124, "jax_loss_scale.json",
           log="Fatal Python error: Aborted\n\nCurrent thread (most recent call first):")
    record("unscale_bandwidth", 0, "unscale_bandwidth.json")  # exit 0, no JSON
    record("torch_modes", 1, "torch_modes.json", log="Traceback ...\nValueError: x")
    record("gpu_tests", 1, log="1 failed, 2 passed in 3.0s")
    (run / "gpu_tests.xml").write_text(
        '<testsuites><testsuite><testcase classname="t" name="a"/>'
        '<testcase classname="t" name="b"><failure message="boom&#10;more"/></testcase>'
        '<testcase classname="t" name="c"><skipped message="needs CUDA"/></testcase>'
        '</testsuite></testsuites>')
    json_path, md_path, r = report.assemble(run, tmp_path, budget_s=480)
    assert json_path == tmp_path / "gpu-cpu-dry-run.json" and json_path.exists()
    assert json.loads(json_path.read_text())["parts"].keys() == r["parts"].keys()
    status = {n: p["status"] for n, p in r["parts"].items()}
    assert status == {"gpu_tests": "failed", "cpu_suite": "not run", "compare_modes": "ok",
                      "jax_scale_cost": "not run", "jax_loss_scale": "timeout",
                      "unscale_bandwidth": "failed", "torch_modes": "failed", "fp8": "failed",
                      "precision_report": "not run"}
    assert r["parts"]["fp8"]["reason"] == "benchmarks/fp8.py is missing"
    assert "Fatal Python error" in r["parts"]["jax_loss_scale"]["log_tail"]
    assert "wrote no JSON" in r["parts"]["unscale_bandwidth"]["reason"]
    assert r["compare_modes"] == {"rows": [1]}  # the inner section, unwrapped
    assert r["fp8"] == {"status": "failed", "reason": "benchmarks/fp8.py is missing"}
    t = r["tests"]["gpu_tests"]
    assert (t["passed"], t["failed"], t["skipped"]) == (1, 1, 1)
    assert t["failures"] == [{"test": "t::b", "kind": "failure", "message": "boom"}]
    assert t["skip_reasons"] == {"needs CUDA": 1}
    assert t["summary_line"] == {"failed": 1, "passed": 2}
    md = md_path.read_text()
    assert "| cm |" in md and "CPU dry run" in md and "`t::b`: boom" in md


@pytest.mark.slow  # the whole pipeline at tiny sizes on CPU: about a minute on 2 cores
def test_gpu_sh_cpu_dry_run(tmp_path):
    out, results = tmp_path / "out", tmp_path / "results"
    out.mkdir()
    env = dict(os.environ, PYTHON=sys.executable, OUT=str(out), OMP_NUM_THREADS="1",
               GPU_SH_BOX_JAX_LOSS_SCALE="2")  # one part runs past its box
    for k in ("XLA_FLAGS", "JAX_PLATFORMS", "PYTHONPATH"):
        env.pop(k, None)
    proc = subprocess.run(["bash", str(BENCH / "gpu.sh"), "--cpu-dry-run", "--results",
                           str(results)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]  # the timeout
    r = json.loads((results / "gpu-cpu-dry-run.json").read_text())
    assert r["dry_run"] is True and r["device"]["slug"] == "cpu-dry-run"
    assert r["versions"]["python"] and r["versions"]["jax"] and r["versions"]["torch"]
    assert r["date"] and "commit" in r["git"]
    report = _gpu_report()
    assert list(r["parts"]) == [n for n, _ in report.PARTS]
    for name, p in r["parts"].items():
        assert p["status"] in ("ok", "failed", "timeout"), (name, p)
        assert p["command"] and p["timeout_s"] > 0 and p["wall_s"] >= 0
    p = r["parts"]["jax_loss_scale"]
    assert p["status"] == "timeout" and p["rc"] in (124, 137)
    assert "Fatal Python error: Aborted" in p["log_tail"]  # faulthandler says where it hung
    for name in ("jax_scale_cost", "unscale_bandwidth", "torch_modes", "gpu_tests",
                 "cpu_suite"):
        assert r["parts"][name]["status"] == "ok", r["parts"][name]
    assert r["jax_scale_cost"]["compile_problems"] == []
    assert r["unscale_bandwidth"]["jax"]["device_copy_is_real_copy"] is True
    assert r["tests"]["gpu_tests"]["skipped"] > 0 and r["tests"]["gpu_tests"]["failed"] == 0
    assert r["tests"]["cpu_suite"]["passed"] > 0 and r["tests"]["cpu_suite"]["failed"] == 0
    # The two sections other sessions fill: present, or recorded as failed.
    for name in ("compare_modes", "fp8"):
        section, status = r[name], r["parts"][name]["status"]
        assert (status == "ok" and section and "status" not in section) or (
            status != "ok" and section["status"] == status), (name, section, status)
    assert sorted(os.listdir(out)) == ["gpu-cpu-dry-run.json", "gpu-cpu-dry-run.md",
                                       "gpu-logs.tar.gz"]
    md = (out / "gpu-cpu-dry-run.md").read_text()
    assert "| part | status |" in md and "jax_loss_scale | timeout" in md


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
