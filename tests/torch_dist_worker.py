"""One rank of the torch.distributed tests (run by tests/test_torch_distributed.py).

Usage: python torch_dist_worker.py SCENARIO RANK WORLD_SIZE PORT
Prints one line "RESULT <json>".
"""

import json
import sys

import torch
import torch.distributed as dist

import mpfunc_torch

scenario, rank, world, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                        world_size=world)
torch.manual_seed(0)


def local_model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def run_steps(model, opt, crit, inf_at, steps=4, seed=1):
    g = torch.Generator().manual_seed(seed + rank)
    report = []
    for i in range(steps):
        x = torch.randn(16, 4, generator=g)
        y = torch.randn(16, 1, generator=g)
        if (i, rank) in inf_at:
            x[0, 0] = float("inf")
        opt.zero_grad()
        loss = crit(model(x), y)
        opt.backward(loss)
        stepped = opt.step()
        report.append({"stepped": bool(stepped), "scale": opt.loss_scale.item(),
                       "param_sum": sum(p.double().sum().item() for p in model.parameters())})
    return report


result = {}
if scenario in ("one_rank_inf", "one_rank_inf_fused", "one_rank_inf_no_group"):
    fused = scenario == "one_rank_inf_fused"
    net = local_model(rank)  # every rank owns different params, as in tensor parallelism
    opt = torch.optim.Adam(net.parameters(), lr=1e-2, fused=fused)
    group = None if scenario == "one_rank_inf_no_group" else dist.group.WORLD
    model, opt, crit = mpfunc_torch.convert_to_amp(net, opt, torch.nn.MSELoss(), mode="torch",
                                                   process_group=group)
    result["report"] = run_steps(model, opt, crit, inf_at={(1, 1)})

elif scenario == "ddp":
    net = local_model(0)
    ddp = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    model, opt, crit = mpfunc_torch.convert_to_amp(ddp, opt, torch.nn.MSELoss(), mode="torch")
    result["report"] = run_steps(model, opt, crit, inf_at={(2, 0)})

elif scenario == "ddp_orders":
    # DDP and convert_to_amp in both orders, per mode: each rank trains on its own data;
    # averaged gradients leave the ranks' params identical. The report has, per order,
    # the params after 3 steps or the error the conversion raised.
    from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

    cases = {
        "torch": ("torch", {"init_scale": 2.0**8}),
        "apex-O1": ("apex", {"opt_level": "O1", "verbosity": 0, "max_loss_scale": 2.0**8}),
        "naive": ("naive", {"initial_scale": 2.0**8}),
        "apex-O2": ("apex", {"opt_level": "O2", "verbosity": 0, "max_loss_scale": 2.0**8}),
    }
    for key, (mode, cfg) in cases.items():
        result[key] = {}
        # "rank_init": each rank starts from its own weights, and DDP's broadcast of
        # rank 0's must reach everything that trains.
        for order in ("convert_then_ddp", "ddp_then_convert", "convert_then_ddp_rank_init"):
            net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8),
                                      torch.nn.Tanh(), torch.nn.Linear(8, 1))
            torch.manual_seed(rank if order.endswith("rank_init") else 0)
            for p in net.parameters():
                torch.nn.init.normal_(p, std=0.5)
            opt = torch.optim.SGD(net.parameters(), lr=0.1)
            try:
                if order.startswith("convert_then_ddp"):
                    model, opt, crit = mpfunc_torch.convert_to_amp(
                        net, opt, torch.nn.MSELoss(), mode=mode, **cfg)
                    model = DDP(model)
                else:
                    model, opt, crit = mpfunc_torch.convert_to_amp(
                        DDP(net), opt, torch.nn.MSELoss(), mode=mode, **cfg)
            except ValueError as e:
                result[key][order] = {"error": str(e)}
                continue
            report = run_steps(model, opt, crit, inf_at=set(), steps=3)
            result[key][order] = {"stepped": [s["stepped"] for s in report],
                                  "params": [p.detach().double().flatten().tolist()
                                             for p in net.parameters()]}

elif scenario == "tensor_parallel":
    # One Linear(4 -> 8) split by output rows: rank r holds rows [4r, 4r+4). Each rank's
    # loss depends only on its rows, so each rank sees a different shard of the grads.
    torch.manual_seed(42)
    full = torch.nn.Linear(4, 8, bias=False)
    shard = torch.nn.Linear(4, 4, bias=False)
    with torch.no_grad():
        shard.weight.copy_(full.weight[4 * rank: 4 * rank + 4])
    opt = torch.optim.SGD(shard.parameters(), lr=0.05)
    model, opt, crit = mpfunc_torch.convert_to_amp(shard, opt, torch.nn.MSELoss(), mode="naive",
                                                   initial_scale=2.0**10, hysteresis=1,
                                                   process_group=dist.group.WORLD)
    g = torch.Generator().manual_seed(7)  # the same data on every rank
    report = []
    for i in range(4):
        x = torch.randn(16, 4, generator=g)
        t = torch.randn(16, 8, generator=g)
        target = t[:, 4 * rank: 4 * rank + 4].clone()
        if i == 1 and rank == 0:
            target[0, 0] = float("inf")  # an overflow in rank 0's shard only
        opt.zero_grad()
        # The full MSE (over 8 outputs) is the mean of the two shards' MSEs.
        opt.backward(crit(model(x), target) / 2)
        report.append({"stepped": bool(opt.step()), "scale": opt.loss_scale.item()})
    result["report"] = report
    result["shard"] = [m.detach().tolist() for _, m in opt._pairs][0]

elif scenario == "several_groups":
    # 4 ranks: tensor-parallel groups {0,1},{2,3}; data-parallel groups {0,2},{1,3}.
    tp = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    my_tp, my_dp = tp[rank // 2], dp[rank % 2]
    for groups, key in (([my_tp], "tp_only"), ([my_tp, my_dp], "tp_and_dp")):
        net = local_model(rank)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        model, opt, crit = mpfunc_torch.convert_to_amp(net, opt, torch.nn.MSELoss(),
                                                       mode="torch", process_group=groups)
        result[key] = run_steps(model, opt, crit, inf_at={(1, 0)}, steps=2)

elif scenario == "sharded_grad_scaler_fused":
    # torch's own ShardedGradScaler with a fused optimizer, for comparison.
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    net = local_model(rank)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2, fused=True)
    scaler = ShardedGradScaler(device="cpu", process_group=dist.group.WORLD)
    g = torch.Generator().manual_seed(1 + rank)
    scales = []
    for i in range(3):
        x = torch.randn(16, 4, generator=g)
        y = torch.randn(16, 1, generator=g)
        if i == 1 and rank == 1:
            x[0, 0] = float("inf")
        opt.zero_grad()
        scaler.scale(torch.nn.functional.mse_loss(net(x), y)).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    result["scales"] = scales

print("RESULT " + json.dumps({"rank": rank, **result}), flush=True)
dist.barrier()
dist.destroy_process_group()
