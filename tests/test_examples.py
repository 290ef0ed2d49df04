"""Every example runs in its --quick form and shows what it says it shows."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from own_code import is_project_file

ROOT = Path(__file__).resolve().parents[1]


def recompiled(stderr):
    """Functions of this project that jax traced again for new argument types (jax's
    cache-miss explanations): each is a second compile of the same step."""
    return sorted(set(re.findall(r"for (\S+) defined at (\S+)\n\s+all previously seen "
                                 r"cache keys differ", stderr)))


def run(script, *args, timeout=600):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", OMP_NUM_THREADS="1",
               JAX_EXPLAIN_CACHE_MISSES="1")
    out = subprocess.run([sys.executable, str(ROOT / "examples" / script), "--quick", *args],
                         capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-4000:]
    # Every jitted step of an example compiles once: nothing of ours is traced again
    # (ours by folder: in a clone named `mpfunc`, jax's own files are under it too).
    # `eager_*` functions are the library's eager calls jitted (mpfunc/_src/eager_jit.py):
    # compiled once per argument signature by design, inlined into traced steps.
    ours = [(f, where) for f, where in recompiled(out.stderr)
            if is_project_file(re.sub(r":\d+$", "", where)) and not f.startswith("eager_")]
    assert not ours, ours
    return out.stdout


def test_quickstart_jax():
    out = run("quickstart_jax.py")
    assert "held-out loss" in out and "overflow steps skipped" in out


def test_quickstart_torch():
    out = run("quickstart_torch.py")
    for label in ("torch ", "apex O0", "apex O1", "apex O2", "apex O3", "naive", "bf16"):
        assert label in out
    assert "two optimizers: stepped True and True" in out


@pytest.mark.slow  # Linen and NNX end to end, about 11 s; test_flax_policy and test_flax_transformers check the same dtypes in process
def test_flax_policies():
    out = run("flax_policies.py")
    assert "LayerNorm scale float32" in out and "Dense kernel float16" in out
    assert "LayerNorm computes in float32" in out
    assert "Linen: matmuls ['f16 x f16', 'f16 x f16']" in out
    assert "NNX: matmuls ['bf16 x bf16', 'bf16 x bf16'] | output float32" in out


@pytest.mark.slow  # both frameworks' overflow hunt end to end, about 15 s; find_overflow's functions are tested in process (test_nonfinite_watch*)
def test_find_overflow(tmp_path):
    out = run("find_overflow.py", "--out", str(tmp_path))
    for framework in ("torch", "jax"):
        line = next(ln for ln in out.splitlines() if ln.startswith(f"{framework}: ")
                    and "skipped steps" in ln)
        # The layer with the large weight is named at every outlier batch (steps 5, 13,
        # 21 of 24), and no module at the skips where only gradients overflowed.
        assert "(steps 5, 13, 21) the forward watch names fc2 as the first non-finite " \
               "module: True" in line, line
        assert line.endswith("the forward was finite (only gradients overflowed): True"), line
        assert f"{framework} step   5: skipped; first non-finite module in the forward: " \
               "fc2; non-finite gradients: 8 of 8" in out
    assert "first non-finite module in the forward: fc2" in out.split("precision report:")[1]
    assert (tmp_path / "find_overflow.png").stat().st_size > 10_000


def test_shard_map_parallel():
    out = run("shard_map_parallel.py")
    assert "inf goes into the w1 gradient shard of model column 1 (4 of the 8 devices" in out
    assert "step 2: shards that stepped 0/8, params changed: False" in out
    # The comparison uses the same step, batch and overflow, so the same 4 devices see it.
    assert "optax.apply_if_finite, same step 2 and same overflow: 4/8 shards would step" in out


def test_compare_modes_cuda_without_a_gpu_is_a_clear_error():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env.update(PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "compare_modes.py"),
                          "--quick", "--device", "cuda"],
                         capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "--device cuda needs a CUDA GPU" in out.stderr
    assert "torch 2" in out.stderr and "jax 0" in out.stderr  # names both frameworks' reason
    assert "--device cpu" in out.stderr and out.stdout == ""


@pytest.mark.slow  # two meshes of 8 devices, about 12 s; test_sharding holds FSDP skips and master bytes in process
def test_jax_fsdp():
    out = run("jax_fsdp.py")
    # FSDP under jit: an inf in one device's gradient shard, no axis_name, all 8 skip.
    assert "skipped on 8/8 devices, params and state unchanged: True" in out
    # Each device's float32 masters cover its own float16 shard only: twice its bytes.
    row = next(ln for ln in out.splitlines() if ln.startswith("| naive |"))
    params_kib, masters_kib = (float(c) for c in row.split("|")[2:4])
    assert masters_kib == pytest.approx(2 * params_kib, abs=0.15)  # printed to 0.1 KiB
    # FSDP + TP in shard_map: the injected overflow skipped everywhere, and every device
    # clips by the same global norm.
    assert "devices that stepped 0/8  <- inf in device 7's w1 gradient shard; params and " \
           "state unchanged on every device: True" in out
    assert "(same: True)" in out and "(same: False)" not in out


def test_jax_pipeline():
    out = run("jax_pipeline.py")
    assert "stepped per stage [0, 0] of 4  <- inf in stage 1's gradients only; every stage " \
           "skipped: True, params and optimizer state unchanged: True" in out
    assert out.count("stepped per stage [4, 4] of 4") == 9


@pytest.mark.slow
def test_torch_distributed():
    out = run("torch_distributed.py")
    with_group = out.split("process_group=None")[0]
    without = out.split("process_group=None")[1]
    assert "disagree" not in with_group and "disagree" in without


@pytest.mark.slow  # the demo timed in two modes, about 45 s; every example run in the default suite checks its steps compile once (run's recompile check)
def test_compare_modes_compiles_each_jax_step_once(tmp_path):
    # Counted by XLA's own compile events (jax.monitoring), per jitted function: a second
    # compile of a step (a cache miss, e.g. uncommitted arrays coming back committed)
    # would show here. The timing rounds and the memory figure use the same executable.
    import json

    path, cache = tmp_path / "cm.json", tmp_path / "cache"
    out = run("compare_modes.py", "--framework", "jax", "--modes", "torch,naive", "--steps",
              "6", "--rounds", "2", "--window", "2", "--quiet", "--out", str(tmp_path),
              "--json", str(path), "--compile-cache", str(cache), "--compiler-options",
              "no_triton_gemm")
    section = json.loads(path.read_text())["compare_modes"]
    assert section["config"]["xla_options"] == {"xla_gpu_enable_triton_gemm": False}
    rows = section["rows"]
    assert [r["mode"] for r in rows] == ["fp32", "torch", "naive"]
    for r in rows:
        # The warm compile (from the persistent cache) is a measurement, not a recompile.
        assert r["compiles"] == {"step": 1, "eval": 1}, r
        assert r["compile_s"] > 0 and len(r["rates"]) == 2
        assert r["speed_vs_fp32"]["min"] <= r["speed_vs_fp32"]["median"]
        # Cold (compiled, an entry written to the folder given), then warm (loaded).
        c = r["compile"]
        assert (c["first"]["cache"], c["warm"]["cache"]) == ("miss", "hit"), c
        assert r["compile_cold_s"] == r["compile_s"] and r["compile_warm_s"] > 0
        assert r["eval_compile_s"] > 0
    assert any(f.name.startswith("jit_train_step_naive") for f in cache.iterdir())
    assert f"JAX compilation cache: {cache.resolve()}" in out
    assert "jax naive: train step compiled 1x (" in out
    assert "\x1b[" not in out  # no progress-bar escapes when stdout is not a terminal


def test_compare_modes_names_bad_compiler_options():
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "compare_modes.py"),
                          "--compiler-options", "xla_gpu_autotune_level"],
                         capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert out.returncode == 2
    assert ("--compiler-options: compiler options 'xla_gpu_autotune_level': expected a "
            "preset from ['autotune_0', 'default', 'no_fusion_autotuner', 'no_triton_gemm'] "
            "or xla_name=value pairs") in out.stderr


def test_compare_modes_watchdog_says_where_it_stalled(capfd):
    import time

    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from compare_modes import Watchdog
    finally:
        sys.path.pop(0)
    dog = Watchdog(0.3)
    dog.beat("jax fp32, training step 7")
    time.sleep(1.8)
    dog.stop()
    err = capfd.readouterr().err
    assert "no progress for 0.3 s, in jax fp32, training step 7" in err
    assert "test_compare_modes_watchdog_says_where_it_stalled" in err  # the Python stack


def compare_modes_module():
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import compare_modes
    finally:
        sys.path.pop(0)
    return compare_modes


def test_compare_modes_prints_a_line_per_finished_run_off_a_terminal(capsys, monkeypatch):
    # In a log (stderr not a terminal) a run that finishes says so on one line; --quiet
    # says nothing; on a terminal the bar shows and no extra line is printed.
    cm = compare_modes_module()
    with cm.bar(3, "jax   naive", quiet=False) as pb:
        for _ in range(3):
            pb.update()
    assert re.fullmatch(r"compare_modes\.py: jax naive done, 3/3 in \d+\.\d s\n",
                        capsys.readouterr().err)
    with cm.bar(3, "jax   naive", quiet=True) as pb:
        pb.update()
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    with cm.bar(3, "jax   naive", quiet=False) as pb:
        pb.update()
    err = capsys.readouterr().err
    assert "jax   naive" in err and "done" not in err  # tqdm's bar


def test_compare_modes_help_and_docs_give_the_stall_timeout_default_of_the_code(
        capsys, monkeypatch):
    cm = compare_modes_module()
    said = "default 300 on a GPU, off on CPU; 0 turns it off"
    with pytest.raises(SystemExit):
        cm.main(["--help"])
    assert said in " ".join(capsys.readouterr().out.split())
    docs = " ".join((ROOT / "docs" / "getting-started.md").read_text().split())
    assert f"`--stall-timeout` seconds ({said})" in docs
    # What the code does: the watchdog's timeout per device (stopped before any run).
    timeouts = []

    class Stop(Exception):
        pass

    def watchdog(timeout):
        timeouts.append(timeout)
        raise Stop

    monkeypatch.setattr(cm, "Watchdog", watchdog)
    monkeypatch.setattr(cm, "cuda_problems", lambda frameworks: [])  # as if on a GPU
    for device in ("cuda", "cpu"):
        with pytest.raises(Stop):
            cm.main(["--quick", "--steps", "1", "--device", device, "--framework", "torch"])
    assert timeouts == [300.0, 0.0]


def test_compare_modes_table_flags_a_wide_spread():
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from compare_report import is_unreliable, speed_ratio
    finally:
        sys.path.pop(0)
    # A round where the machine was busy: ratios 0.01-0.14 around 0.07 (the report's case).
    median, lo, hi = speed_ratio([0.1, 1.4, 0.7], [10.0, 10.0, 10.0])
    assert (median, lo, hi) == pytest.approx((0.07, 0.01, 0.14))
    assert is_unreliable(median, lo, hi)
    assert not is_unreliable(*speed_ratio([9.0, 10.0, 11.0], [10.0, 10.0, 10.0]))


@pytest.mark.slow
def test_compare_modes(tmp_path):
    # --quick's model and every mode, at half its steps and a shorter timing: the checks
    # below hold at any length (7 min of the slow suite on 2 cores at --quick's own 60
    # steps and 5 rounds of 5, most of it float16 torch, ~20x slower than float32 on a
    # CPU). The compile cache off: one compile per step (test_compare_modes_compiles_
    # each_jax_step_once checks the cold and warm figures).
    out = run("compare_modes.py", "--quiet", "--out", str(tmp_path), "--steps", "30",
              "--rounds", "3", "--window", "3", "--no-compile-cache")
    assert (tmp_path / "compare_modes.png").stat().st_size > 10_000
    table = out.split("Cross-framework parity")[0]
    rows = [ln for ln in table.splitlines() if ln.startswith("| ") and "---" not in ln]
    # The header and fp32 + the eight default modes (fp8 and the two no-master ones
    # included) in each framework.
    assert "speed vs strict fp32 (min-max)" in rows[0] and len(rows) == 19
    for row in rows[1:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        median, lo, hi = map(float, re.fullmatch(r"(\S+)x \((\S+)-(\S+)\)( unreliable)?",
                                                 cells[9]).groups()[:3])
        assert 0 < lo <= median <= hi, row
        if cells[1] == "fp32":
            assert median == lo == hi == 1.0, row  # each round's own fp32 timing
    assert "median of 3 timing rounds of 3 steps" in out
    parity = out.split("Cross-framework parity")[1]
    rows = [ln for ln in parity.splitlines() if ln.startswith("| ") and "---" not in ln][1:]
    assert len(rows) == 9  # fp32 + the eight default modes
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[1] == "yes" and cells[2] == "yes", row  # identical scale trajectories
        assert float(cells[3]) < 0.05, row


@pytest.mark.slow  # five Booster trainings, about 10 s; test_booster holds every Booster name in process
def test_booster_tutorial():
    """Colossal-AI's Booster tutorial loop (Steps 3-5) runs on mpfunc_torch: every
    Booster name trains, the scheduler's warmup/decay reaches the wrapped optimizer, and
    the tutorial's FP16TorchMixedPrecision object trains exactly as 'fp16' does."""
    import re
    out = run("booster_tutorial.py")
    results = dict(re.findall(r"^result (\S+): (.*)$", out, re.MULTILINE))
    assert sorted(results) == ["bf16", "fp16", "fp16_apex", "fp16_naive", "object"]
    for name, line in results.items():
        first, last, lrs, skipped = re.fullmatch(
            r"loss (\S+) -> (\S+), lrs (\[.*\]), skipped (\d+)", line).groups()
        assert float(last) < float(first) - 0.1, (name, line)   # it learns
        assert lrs == "[0.003333, 0.006667, 0.01, 0.005]", (name, line)  # LinearWarmupLR
        assert (int(skipped) > 0) == (name == "fp16_naive"), (name, line)  # 2**32 backs off
    assert results["object"] == results["fp16"]


@pytest.mark.slow
def test_torch_fsdp_tp():
    out = run("torch_fsdp_tp.py")
    # An inf in one rank's gradient shard: all 4 ranks skip, nothing changes, one scale.
    assert out.count("ranks that stepped 0/4, params, masters and optimizer state unchanged "
                     "on every rank: True") == 2
    # Clipping uses one global norm: the same on every rank.
    assert "(same: True)" in out and "(same: False)" not in out
    assert "ranks that stepped 4/4" in out
    # naive: each rank's float32 masters are twice its float16 params, and a fraction of
    # the unsharded masters.
    naive = out.split("\nnaive:")[1].split("\ntorch:")[0]
    rows = [ln for ln in naive.splitlines() if ln.startswith("  | ") and "---" not in ln][1:]
    assert len(rows) == 4
    whole = float(naive.split(" KiB of float32 masters")[0].rsplit(" ", 1)[-1])
    for row in rows:
        params_kib, masters_kib = (float(c) for c in row.split("|")[2:4])
        assert masters_kib == pytest.approx(2 * params_kib, abs=0.15)
        assert masters_kib < whole / 2


def _rows(out):
    return {r.split("|")[1].strip(): [c.strip() for c in r.split("|")[2:-1]]
            for r in out.splitlines() if r.startswith("| ") and "---" not in r
            and not r.startswith("| mode")}


@pytest.mark.slow  # six Lightning trainings, about 18 s; test_lightning_plugin trains Lightning's own example in every mode
def test_lightning_amp():
    out = run("lightning_amp.py")
    rows = _rows(out)
    assert sorted(rows) == ["apex O1", "apex O2", "bf16", "fp8", "naive", "torch"]
    for name, (first, last, step, skipped, _scale, params, masters) in rows.items():
        assert float(last) < float(first) - 1.0, name  # it learns
        assert step == "skipped, params unchanged" and skipped == "1", name
        # float32 masters of float16 params: twice their bytes (less the fp32 norm)
        assert (float(masters) > 1.9 * float(params)) == (name in ("naive", "apex O2")), name
    assert "resumed after the skip (naive): params as the uninterrupted run: True; " \
           "scale 65536 vs 65536; skipped 1 vs 1" in out


@pytest.mark.slow
def test_hf_trainer_amp():
    out = run("hf_trainer_amp.py")
    rows = _rows(out)
    assert sorted(rows) == ["apex O2", "bf16", "fp8", "naive", "torch"]
    for name, (first, last, step, lrs, skipped, _scale) in rows.items():
        assert float(last) < float(first) - 0.3, name
        assert step == "skipped, params unchanged" and skipped == "1", name
        before, at, after = lrs.split(" -> ")
        assert float(before) > float(at) == float(after), name  # the schedule waits
    assert "params as the uninterrupted run: True; scale 65536 vs 65536; skipped 1 vs 1" in out
