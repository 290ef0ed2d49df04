"""Every example runs in its --quick form and shows what it says it shows."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(script, *args, timeout=600):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, str(ROOT / "examples" / script), "--quick", *args],
                         capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-4000:]
    return out.stdout


def test_quickstart_jax():
    out = run("quickstart_jax.py")
    assert "held-out loss" in out and "overflow steps skipped" in out


def test_quickstart_torch():
    out = run("quickstart_torch.py")
    for label in ("torch ", "apex O0", "apex O1", "apex O2", "apex O3", "naive", "bf16"):
        assert label in out
    assert "two optimizers: stepped True and True" in out


def test_flax_policies():
    out = run("flax_policies.py")
    assert "LayerNorm scale float32" in out and "Dense kernel float16" in out
    assert "LayerNorm computes in float32" in out
    assert "Linen: matmuls ['f16 x f16', 'f16 x f16']" in out
    assert "NNX: matmuls ['bf16 x bf16', 'bf16 x bf16'] | output float32" in out


def test_shard_map_parallel():
    out = run("shard_map_parallel.py")
    assert "step 2: shards that stepped 0/8, params changed: False" in out


@pytest.mark.slow
def test_torch_distributed():
    out = run("torch_distributed.py")
    with_group = out.split("process_group=None")[0]
    without = out.split("process_group=None")[1]
    assert "disagree" not in with_group and "disagree" in without


@pytest.mark.slow
def test_compare_modes(tmp_path):
    out = run("compare_modes.py", "--quiet", "--out", str(tmp_path))
    assert (tmp_path / "compare_modes.png").stat().st_size > 10_000
    parity = out.split("Cross-framework parity")[1]
    rows = [ln for ln in parity.splitlines() if ln.startswith("| ") and "---" not in ln][1:]
    assert len(rows) == 6  # fp32 + the five default modes
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[1] == "yes" and cells[2] == "yes", row  # identical scale trajectories
        assert float(cells[3]) < 0.05, row
