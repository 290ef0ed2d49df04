"""One rank of the distributed precision-report tests (run by
tests/test_torch_precision_report.py).

Usage: python torch_report_worker.py SCENARIO RANK WORLD_SIZE PORT
SCENARIO is ``ddp-MODE`` or ``fsdp-MODE`` (MODE: torch, naive). Rank 1 plants an inf in
its gradient (its local shard with FSDP2) of ``2.weight`` after the backward. Prints one
line "RESULT <json>".
"""

import json
import sys

import torch
import torch.distributed as dist

import mpfunc_torch

scenario, rank, world, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                        world_size=world)
kind, mode = scenario.split("-")
cfg = {"torch": {"init_scale": 1024.0}, "naive": {"initial_scale": 1024.0}}[mode]

torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
if kind == "fsdp":
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    fully_shard(net, mesh=init_device_mesh("cpu", (world,)))
opt = torch.optim.Adam(net.parameters(), lr=1e-3)
group = dist.group.WORLD if kind == "ddp" else None
model, opt, crit = mpfunc_torch.convert_to_amp(net, opt, torch.nn.MSELoss(), mode=mode,
                                               process_group=group, **cfg)
if kind == "ddp":
    model = torch.nn.parallel.DistributedDataParallel(model)  # convert first, then wrap

g = torch.Generator().manual_seed(1 + rank)
x, y = torch.randn(8, 4, generator=g), torch.randn(8, 4, generator=g)
opt.zero_grad()
opt.backward(crit(model(x), y))
if rank == 1:
    grad = net[2].weight.grad
    with torch.no_grad():
        (grad.to_local() if kind == "fsdp" else grad).view(-1)[0] = float("inf")
report = opt.precision_report(process_group=group)
local = opt.precision_report()
rows = report.rows()
stepped = bool(opt.step())
print("RESULT " + json.dumps({
    "rank": rank,
    "report": report.nonfinite_names(),
    "local": local.nonfinite_names(),
    # Elements per param, from the packed statistics (row 4 of 5).
    "sizes": dict(zip(report.names, report.stats[4 * len(rows):5 * len(rows)].tolist())),
    "stepped": stepped,
    "skip_leaves": opt.scale_metrics(skip_leaves=True)["skip_leaves"],
}))
dist.destroy_process_group()
