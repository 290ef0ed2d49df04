"""`make gpu` (benchmarks/gpu.sh and gpu_report.py): the plan, the budget, the report.

The parts run one at a time, the GPU parts first and the CPU suite last; each part's time
box is cut to what is left of a 540 s budget, and a part that no longer fits is recorded
as not run. These tests run the pipeline on CPU (``--cpu-dry-run``) and the report's
steps directly; the GPU figures themselves come from a GPU run.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"


def _gpu_report():
    sys.path.insert(0, str(BENCH))
    try:
        import gpu_report
    finally:
        sys.path.remove(str(BENCH))
    return gpu_report


def plan():
    out = subprocess.run(["bash", str(BENCH / "gpu.sh"), "--plan"], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    head, parts = {}, {}
    for line in out.strip().splitlines():
        words = line.split()
        if words[0] == "part":
            parts[words[1]] = (int(words[2]), int(words[3]))
        else:
            head[words[0]] = int(words[1])
    return head, parts


def gpu_sh(tmp_path, *args, env_extra=(), timeout=900):
    out, results = tmp_path / "out", tmp_path / "results"
    out.mkdir(exist_ok=True)
    env = dict(os.environ, PYTHON=sys.executable, OUT=str(out), OMP_NUM_THREADS="1",
               **dict(env_extra))
    for k in ("XLA_FLAGS", "JAX_PLATFORMS", "PYTHONPATH"):
        env.pop(k, None)
    proc = subprocess.run(["bash", str(BENCH / "gpu.sh"), "--cpu-dry-run", "--results",
                           str(results), *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=timeout)
    report = results / "gpu-cpu-dry-run.json"
    return proc, (json.loads(report.read_text()) if report.exists() else None), out


def test_plan_runs_the_gpu_parts_first_then_the_suite_within_nine_minutes():
    assert subprocess.run(["bash", "-n", str(BENCH / "gpu.sh")]).returncode == 0
    head, parts = plan()
    assert head["budget"] == 540  # 9 minutes, whatever the parts do (boxes are cut to it)
    assert head["reserve"] > 0 and head["kill_after"] > 0
    report = _gpu_report()
    # The same parts as the report knows, in the same order: the CPU suite last.
    assert list(parts) == [n for n, _ in report.PARTS]
    assert list(parts)[-1] == "cpu_suite" and {"cpu_suite"} == report.CPU_PARTS
    assert parts["cpu_suite"][0] == 0  # its box: what the budget has left
    for name, (box, least) in parts.items():
        assert least > 0 and (name == "cpu_suite" or box >= least), name
    assert parts["jax_gpu_compile"][0] <= 240  # at most 4 minutes
    # Imports are timed first, then the GPU tests, then the compiles.
    assert list(parts)[:4] == ["import_time", "gpu_tests", "jax_gpu_compile", "compare_modes"]
    # Every GPU part's least box fits the budget on its own.
    assert all(least <= head["budget"] - head["reserve"] - head["kill_after"]
               for least in (p[1] for p in parts.values()))
    proc = subprocess.run(["bash", str(BENCH / "gpu.sh"), "--parts", "nope"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "unknown part 'nope'" in proc.stderr


def test_a_part_that_does_not_fit_the_budget_is_recorded_not_run(tmp_path):
    # Of a 90 s budget, less the 35 s reserved and the environment's seconds, less than
    # the suite's least box (60 s) is left: not run, said so, the report still written,
    # and the exit status says the run was not complete.
    proc, r, out = gpu_sh(tmp_path, "--parts", "cpu_suite", env_extra={"GPU_SH_BUDGET": "90"},
                          timeout=300)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    suite = r["parts"]["cpu_suite"]
    assert suite["status"] == "not run" and suite["reason"].startswith("time budget:")
    assert "it needs at least 60 s" in suite["reason"]
    assert r["budget"]["not_run_for_budget"] == ["cpu_suite"]
    assert r["budget"]["total_s"] == 90 and r["budget"]["wall_s"] < 90
    assert r["parts"]["import_time"] == {"status": "not run", "reason": "not selected, or "
                                         "gpu.sh stopped before it"}
    md = (out / "gpu-cpu-dry-run.md").read_text()
    assert "Not run, for the time budget: cpu_suite." in md


def test_gpu_report_statuses_and_sections(tmp_path):
    # Every way a part can end, through the same record/assemble steps gpu.sh uses.
    report = _gpu_report()
    run = tmp_path / "gpu-logs"
    run.mkdir()
    env = report.collect_env(dry_run=True)
    env["started_unix"] = 1000.0
    (run / "env.json").write_text(json.dumps(env))

    def record(name, rc, result=None, missing=None, log="", data=None, skipped=None,
               started=1000.0):
        (run / f"{name}.log").write_text(log)
        if data is not None:
            (run / f"{name}.json").write_text(json.dumps(data))
        argv = ["record", "--run", str(run), "--name", name, "--rc", str(rc), "--started",
                str(started), "--timeout", "30", "--", "python", f"{name}.py"]
        for flag, value in (("--result", result), ("--missing", missing),
                            ("--skipped", skipped)):
            if value:
                argv[1:1] = [flag, value]
        assert report.main(argv) == 0

    record("compare_modes", 0, "compare_modes.json",
           data={"compare_modes": {"rows": [1]}, "markdown": "| cm |"})
    record("jax_gpu_compile", 0, "jax_gpu_compile.json",
           data={"rows": [], "markdown": "| gc |"})
    record("fp8", 127, "fp8.json", missing="benchmarks/fp8.py")
    record("jax_loss_scale", 124, "jax_loss_scale.json",  # timed out after writing a row
           log="Fatal Python error: Aborted\n\nCurrent thread (most recent call first):",
           data={"median_step_ms": {"plain": 1.5}})
    record("unscale_bandwidth", 0, "unscale_bandwidth.json")  # exit 0, no JSON
    record("torch_modes", 1, "torch_modes.json", log="Traceback ...\nValueError: x")
    record("precision_report", 0, "precision_report.json", skipped="time budget: 3 s left")
    record("gpu_tests", 1, log="1 failed, 2 passed in 3.0s")
    record("cpu_suite", 124)
    (run / "gpu_tests.xml").write_text(
        '<testsuites><testsuite><testcase classname="t" name="a"/>'
        '<testcase classname="t" name="b"><failure message="boom&#10;more"/></testcase>'
        '<testcase classname="t" name="c"><skipped message="needs CUDA"/></testcase>'
        '</testsuite></testsuites>')
    json_path, md_path, r = report.assemble(run, tmp_path, budget_s=540)
    assert json_path == tmp_path / "gpu-cpu-dry-run.json" and json_path.exists()
    assert json.loads(json_path.read_text())["parts"].keys() == r["parts"].keys()
    status = {n: p["status"] for n, p in r["parts"].items()}
    assert status == {"import_time": "not run", "gpu_tests": "failed",
                      "jax_gpu_compile": "ok", "compare_modes": "ok", "fp8": "failed",
                      "trainers": "not run", "torch_modes": "failed",
                      "jax_scale_cost": "not run", "jax_loss_scale": "timeout",
                      "unscale_bandwidth": "failed", "precision_report": "not run",
                      "cpu_suite": "timeout"}
    assert r["parts"]["fp8"]["reason"] == "benchmarks/fp8.py is missing"
    assert r["parts"]["precision_report"]["reason"] == "time budget: 3 s left"
    assert r["budget"]["not_run_for_budget"] == ["precision_report"]
    assert "cut by the budget" in r["parts"]["cpu_suite"]["reason"]
    assert "cut by the budget" not in r["parts"]["jax_loss_scale"]["reason"]
    assert "Fatal Python error" in r["parts"]["jax_loss_scale"]["log_tail"]
    assert "wrote no JSON" in r["parts"]["unscale_bandwidth"]["reason"]
    assert r["compare_modes"] == {"rows": [1]}  # the inner section, unwrapped
    assert r["fp8"] == {"status": "failed", "reason": "benchmarks/fp8.py is missing"}
    # What a part wrote before it timed out stays, marked as incomplete.
    assert r["jax_loss_scale"] == {"median_step_ms": {"plain": 1.5}, "status": "timeout",
                                   "reason": r["parts"]["jax_loss_scale"]["reason"]}
    t = r["tests"]["gpu_tests"]
    assert (t["passed"], t["failed"], t["skipped"]) == (1, 1, 1)
    assert t["failures"] == [{"test": "t::b", "kind": "failure", "message": "boom"}]
    assert t["skip_reasons"] == {"needs CUDA": 1}
    assert t["summary_line"] == {"failed": 1, "passed": 2}
    # Every record here started at the same time: each run overlaps the next.
    assert r["overlaps"] and all(len(pair) == 2 for pair in r["overlaps"])
    md = md_path.read_text()
    assert "| cm |" in md and "| gc |" in md and "CPU dry run" in md and "`t::b`: boom" in md


def test_the_commit_is_mpfunc_commit_or_this_checkouts_own(tmp_path, monkeypatch):
    # The 2026-11-27 run copied the checkout, without its .git, into another repository:
    # the report took that repository's commit over MPFUNC_COMMIT.
    report = _gpu_report()
    outer = tmp_path / "outer"
    copy = outer / "mpfunc"
    copy.mkdir(parents=True)
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t", "-C", str(outer)]
    subprocess.run([*git, "init", "-q"], check=True)
    (outer / "f").write_text("x")
    subprocess.run([*git, "add", "f"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "outer"], check=True)
    outer_commit = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True,
                                  text=True, check=True).stdout.strip()
    monkeypatch.delenv("MPFUNC_COMMIT", raising=False)
    got = report.git_commit(copy)
    assert got["commit"] is None and got["commit"] != outer_commit
    assert "not its own git repository" in got["source"]
    assert report.git_commit(outer)["commit"] == outer_commit  # its own: git's
    monkeypatch.setenv("MPFUNC_COMMIT", "955b1ba")
    assert report.git_commit(copy) == {"commit": "955b1ba", "dirty": None,
                                       "source": "MPFUNC_COMMIT"}
    assert report.git_commit(outer)["commit"] == "955b1ba"  # set: it wins


@pytest.mark.slow  # the whole pipeline at tiny sizes on CPU: a few minutes on 2 cores
def test_gpu_sh_cpu_dry_run(tmp_path):
    proc, r, out = gpu_sh(tmp_path, env_extra={
        "GPU_SH_BOX_JAX_LOSS_SCALE": "2",  # one part runs past its box
        "GPU_SH_BUDGET": "1500"})  # a loaded 2-core machine: every part gets its box
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]  # the timeout
    assert r["dry_run"] is True and r["device"]["slug"] == "cpu-dry-run"
    assert r["versions"]["python"] and r["versions"]["jax"] and r["versions"]["torch"]
    assert r["date"] and "commit" in r["git"]
    report = _gpu_report()
    assert list(r["parts"]) == [n for n, _ in report.PARTS]
    for name, p in r["parts"].items():
        assert p["status"] in ("ok", "failed", "timeout"), (name, p)
        assert p["command"] and p["timeout_s"] > 0 and p["wall_s"] >= 0
    # One part at a time: no GPU part ran beside another or beside the CPU suite, which
    # started after the last GPU part had ended.
    assert r["overlaps"] == []
    parts = r["parts"]
    suite = parts.pop("cpu_suite")
    assert suite["started_unix"] >= max(p["ended_unix"] for p in parts.values())
    order = [p["started_unix"] for p in parts.values()]
    assert order == sorted(order)
    p = parts["jax_loss_scale"]
    assert p["status"] == "timeout" and p["rc"] in (124, 137)
    assert "Fatal Python error: Aborted" in p["log_tail"]  # faulthandler says where it hung
    for name in ("import_time", "jax_gpu_compile", "jax_scale_cost", "unscale_bandwidth",
                 "torch_modes", "trainers", "gpu_tests"):
        assert parts[name]["status"] == "ok", parts[name]
    assert suite["status"] == "ok", suite
    assert r["jax_scale_cost"]["compile_problems"] == []
    assert r["unscale_bandwidth"]["jax"]["device_copy_is_real_copy"] is True
    assert r["import_time"]["loaded"]["mpfunc_torch"] == []
    assert {row["status"] for row in r["jax_gpu_compile"]["rows"]} <= {"ok", "not run"}
    assert r["tests"]["gpu_tests"]["skipped"] > 0 and r["tests"]["gpu_tests"]["failed"] == 0
    assert r["tests"]["cpu_suite"]["passed"] > 0 and r["tests"]["cpu_suite"]["failed"] == 0
    # The sections other work fills: present, or recorded as failed.
    for name in ("compare_modes", "fp8"):
        section, status = r[name], r["parts"][name]["status"]
        assert (status == "ok" and section and "status" not in section) or (
            status != "ok" and section["status"] == status), (name, section, status)
    assert sorted(os.listdir(out)) == ["gpu-cpu-dry-run.json", "gpu-cpu-dry-run.md",
                                       "gpu-logs.tar.gz"]
    md = (out / "gpu-cpu-dry-run.md").read_text()
    assert "| part | status |" in md and "jax_loss_scale | timeout" in md


def test_log_tail_keeps_the_fatal_error_line_of_a_long_faulthandler_dump(tmp_path):
    # CI on 2026-11-28: a hung part's dump (a deep stack, then the extension-module list) ran
    # past the 40-line tail, and the report lost the line that says the part was aborted.
    report = _gpu_report()
    log = tmp_path / "p.log"
    frames = [f'  File "/x/mod{i}.py", line {i} in f{i}' for i in range(80)]
    log.write_text("\n".join(["starting", "Fatal Python error: Aborted", "",
                              "Current thread 0x1 (most recent call first):", *frames,
                              "Extension modules: numpy.core (total: 12)"]) + "\n")
    tail = report.log_tail(log)
    assert tail.startswith("Fatal Python error: Aborted\n[...]\n")
    assert tail.endswith("(total: 12)") and "mod79.py" in tail and "mod0.py" not in tail
    short = tmp_path / "s.log"
    short.write_text("a\nFatal Python error: Aborted\nb\n")
    assert report.log_tail(short) == "a\nFatal Python error: Aborted\nb"  # already in it
    assert report.log_tail(tmp_path / "none.log") == ""
