"""Tests for mpfunc_torch._src.distributed: the inf check across real gloo ranks."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mpfunc_torch._src.distributed import normalize_groups

WORKER = Path(__file__).with_name("torch_dist_worker.py")
pytestmark = pytest.mark.slow


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(scenario, world):
    port = str(_free_port())
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]),
               OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(WORKER), scenario, str(r), str(world), port],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    out = {}
    for p in procs:
        stdout, stderr = p.communicate(timeout=240)
        assert p.returncode == 0, stderr[-3000:]
        line = next(ln for ln in stdout.splitlines() if ln.startswith("RESULT "))
        data = json.loads(line[len("RESULT "):])
        out[data["rank"]] = data
    return [out[r] for r in range(world)]


@pytest.mark.parametrize("scenario", ["one_rank_inf", "one_rank_inf_fused"])
def test_inf_on_one_rank_makes_every_rank_skip(scenario):
    r0, r1 = launch(scenario, 2)
    steps0, steps1 = r0["report"], r1["report"]
    assert [s["stepped"] for s in steps0] == [True, False, True, True]
    assert [s["stepped"] for s in steps1] == [True, False, True, True]
    assert [s["scale"] for s in steps0] == [s["scale"] for s in steps1]
    assert steps0[1]["scale"] == 2.0**15
    # Skipped means unchanged on the rank that saw only finite grads, too.
    assert steps0[1]["param_sum"] == steps0[0]["param_sum"]


def test_without_a_group_ranks_diverge():
    # The control: no process_group, no reduction, and the ranks disagree.
    r0, r1 = launch("one_rank_inf_no_group", 2)
    assert r0["report"][1]["stepped"] and not r1["report"][1]["stepped"]
    assert r0["report"][1]["scale"] != r1["report"][1]["scale"]


def test_torch_sharded_grad_scaler_with_a_fused_optimizer_diverges():
    # What the fused path must not do: torch's ShardedGradScaler skips the all-reduce
    # when a fused optimizer unscales in its kernel, so the ranks' scales split.
    r0, r1 = launch("sharded_grad_scaler_fused", 2)
    assert r0["scales"][1] != r1["scales"][1], (r0, r1)


def test_ddp():
    r0, r1 = launch("ddp", 2)
    for a, b in zip(r0["report"], r1["report"]):
        assert a == b  # same decision, same scale, same params on both ranks
    assert [s["stepped"] for s in r0["report"]] == [True, True, False, True]


def test_tensor_parallel_linear_matches_the_unsplit_layer():
    r0, r1 = launch("tensor_parallel", 2)
    assert [s["stepped"] for s in r0["report"]] == [True, False, True, True]
    assert r0["report"] == r1["report"]
    # The same training on the unsplit layer in one process, with the same skip.
    import mpfunc_torch

    torch.manual_seed(42)
    full = torch.nn.Linear(4, 8, bias=False)
    opt = torch.optim.SGD(full.parameters(), lr=0.05)
    model, opt, crit = mpfunc_torch.convert_to_amp(full, opt, torch.nn.MSELoss(), mode="naive",
                                                   initial_scale=2.0**10, hysteresis=1)
    g = torch.Generator().manual_seed(7)
    for i in range(4):
        x = torch.randn(16, 4, generator=g)
        t = torch.randn(16, 8, generator=g)
        if i == 1:
            t[0, 0] = float("inf")
        opt.zero_grad()
        opt.backward(crit(model(x), t))
        opt.step()
    master = opt._pairs[0][1].detach()
    torch.testing.assert_close(torch.tensor(r0["shard"]), master[:4], rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(torch.tensor(r1["shard"]), master[4:], rtol=1e-3, atol=1e-3)


def test_several_groups():
    ranks = launch("several_groups", 4)
    tp_only = [r["tp_only"][1]["stepped"] for r in ranks]
    both = [r["tp_and_dp"][1]["stepped"] for r in ranks]
    assert tp_only == [False, False, True, True]  # rank 0's inf reaches its TP group only
    assert both == [False, False, False, False]  # ...and through DP, everyone


def test_normalize_groups_errors():
    assert normalize_groups(None) == ()
    # The type is checked first: a string is not "not initialized", it is wrong.
    for bad in (object(), "foo", ["foo"]):
        with pytest.raises(TypeError, match="`process_group` must be a torch.distributed"):
            normalize_groups(bad)
    group = torch.distributed.ProcessGroup(torch.distributed.HashStore(), 0, 1)
    with pytest.raises(RuntimeError, match="not initialized"):
        normalize_groups(group)
