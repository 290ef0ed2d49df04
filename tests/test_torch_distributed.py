"""Tests for mpfunc_torch._src.distributed: the inf check across real gloo ranks."""


import pytest
import torch
from torch_scaleout_models import launch_results

from mpfunc_torch._src.distributed import normalize_groups

WORKER = "torch_dist_worker.py"
pytestmark = pytest.mark.slow


def launch(scenario, world):
    return launch_results(WORKER, scenario, world, timeout=240)


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


DDP_CASES = {
    "torch": ("torch", {"init_scale": 2.0**8}),
    "apex-O1": ("apex", {"opt_level": "O1", "verbosity": 0, "max_loss_scale": 2.0**8}),
    "naive": ("naive", {"initial_scale": 2.0**8}),
    "apex-O2": ("apex", {"opt_level": "O2", "verbosity": 0, "max_loss_scale": 2.0**8}),
}


def _reference_params(mode, cfg):
    """One process, both ranks' batches together: what averaged gradients must give."""
    import mpfunc_torch

    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Tanh(),
                              torch.nn.Linear(8, 1))
    torch.manual_seed(0)  # the ranks' common init
    for p in net.parameters():
        torch.nn.init.normal_(p, std=0.5)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model, opt, crit = mpfunc_torch.convert_to_amp(net, opt, torch.nn.MSELoss(), mode=mode,
                                                   **cfg)
    gens = [torch.Generator().manual_seed(1 + r) for r in range(2)]  # run_steps' seeds
    for _ in range(3):
        xs, ys = zip(*[(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g))
                       for g in gens])
        opt.zero_grad()
        opt.backward(crit(model(torch.cat(xs)), torch.cat(ys)))
        opt.step()
    return [p.detach().double().flatten() for p in net.parameters()]


@pytest.fixture(scope="module")
def ddp_orders():
    return launch("ddp_orders", 2)


def test_ddp_in_either_order_averages_gradients_or_says_the_right_order(ddp_orders):
    r0, r1 = ddp_orders
    for key, (mode, cfg) in DDP_CASES.items():
        good = r0[key]["convert_then_ddp"]
        assert "params" in good, good
        assert good["stepped"] == [True] * 3, (key, good["stepped"])  # no step skipped
        # Averaged gradients: identical ranks, equal to one process on both batches.
        assert good == r1[key]["convert_then_ddp"], key
        ref = _reference_params(mode, cfg)
        for got, want in zip(good["params"], ref):  # half rounding differs by batch split
            torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), want,
                                       rtol=1e-2, atol=2e-3)
        other = r0[key]["ddp_then_convert"]
        if key in ("naive", "apex-O2"):  # these cast params: DDP must come second
            assert "error" in other, (key, other)
            assert "Convert first, then wrap" in other["error"], other
            assert "DistributedDataParallel" in other["error"], other
        else:  # autocast modes leave params alone: both orders train identically
            assert other == good, key


@pytest.mark.parametrize("key", list(DDP_CASES))
def test_ddp_broadcast_after_conversion_reaches_what_trains(ddp_orders, key):
    r0, r1 = ddp_orders
    assert r0[key]["convert_then_ddp_rank_init"] == r1[key]["convert_then_ddp_rank_init"]



def test_random_combinations_under_ddp_skip_exactly_and_stay_in_step(tmp_path):
    # 24 seeded draws: every mode (O3 too), fused or foreach AdamW and SGD with momentum,
    # naive's step_chunks and clip_grad, user clipping, gradient accumulation with
    # no_sync, and a branch used on some steps only (find_unused_parameters); an inf
    # loss on one rank spreads through DDP's all-reduce on ~half of the steps. Every rank
    # must take the same decision, skip every fault, leave params, masters and state bit
    # for bit on a skip, hold nothing non-finite, and keep the same params as the other.
    import torch_scaleout_models as tm

    tm.check_combinations("ddp", tmp_path, same_params=True)
