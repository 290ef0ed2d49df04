"""torch.distributed (gloo, 2 ranks on this machine) with a tensor-parallel inf check.

One Linear layer is split by output rows across 2 ranks, so each rank sees a different
shard of the gradients. At step 2 rank 1's shard overflows. With
``process_group=dist.group.WORLD`` the found-inf flag is MAX-reduced, and both ranks skip
and keep the same loss scale; the run without it shows the ranks diverging.

    python examples/torch_distributed.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import mpfunc_torch


def worker(rank, world, port, steps, reduce, queue):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    torch.manual_seed(0)
    full = torch.nn.Linear(16, 8, bias=False)
    shard = torch.nn.Linear(16, 4, bias=False)
    with torch.no_grad():
        shard.weight.copy_(full.weight[4 * rank: 4 * rank + 4])
    opt = torch.optim.Adam(shard.parameters(), lr=1e-2, fused=True)
    model, opt, crit = mpfunc_torch.convert_to_amp(
        shard, opt, torch.nn.MSELoss(), mode="torch", init_scale=2.0**10,
        process_group=dist.group.WORLD if reduce else None)
    g = torch.Generator().manual_seed(1)
    log = []
    for i in range(steps):
        x, t = torch.randn(32, 16, generator=g), torch.randn(32, 8, generator=g)
        target = t[:, 4 * rank: 4 * rank + 4].clone()
        if i == 2 and rank == 1:
            target[0, 0] = float("inf")
        opt.zero_grad()
        opt.backward(crit(model(x), target))
        stepped = opt.step()
        log.append((bool(stepped), opt.loss_scale.item()))
    queue.put((rank, log))
    dist.destroy_process_group()


def run(steps, reduce):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, 2, port, steps, reduce, queue)) for r in range(2)]
    for p in procs:
        p.start()
    logs = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        if p.exitcode != 0:
            raise SystemExit(f"rank process failed with exit code {p.exitcode}")
    return logs


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    steps = 4 if args.quick else args.steps
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for reduce in (True, False):
        logs = run(steps, reduce)
        print(f"process_group={'WORLD' if reduce else 'None'}:")
        for i in range(steps):
            (s0, sc0), (s1, sc1) = logs[0][i], logs[1][i]
            note = "" if (s0, sc0) == (s1, sc1) else "   <- ranks disagree"
            print(f"  step {i}: rank0 stepped={s0} scale={sc0:g} | rank1 stepped={s1} "
                  f"scale={sc1:g}{note}")


if __name__ == "__main__":
    main()
