"""One rank of the random combinations under FSDP2 or DDP (2 gloo ranks).

Usage: python torch_combos_worker.py {fsdp,ddp} RANK WORLD_SIZE PORT OUTDIR
Writes OUTDIR/SCENARIO-RANK.pt: one record per seed, {"cfg", "error", "steps": [{"took",
"fault", "exact", "finite", "params"}]}, and prints "RESULT ok". The checks are the
tests' (test_torch_fsdp.py, test_torch_distributed.py).
"""

import contextlib
import random
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import mpfunc_torch
from mpfunc_torch._src.sharding import local

SEEDS, STEPS = range(24), 10
scenario, rank, world, port, outdir = (sys.argv[1], int(sys.argv[2]), int(sys.argv[3]),
                                       sys.argv[4], Path(sys.argv[5]))
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                        world_size=world)
torch.set_num_threads(1)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.fc = nn.LayerNorm(16), nn.Linear(16, 16)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.ln(x)))


class Net(nn.Module):
    """Blocks, and a side branch (its own FSDP unit) used on some steps only."""

    def __init__(self):
        super().__init__()
        self.inp, self.side, self.out = nn.Linear(6, 16), nn.Linear(6, 16), nn.Linear(16, 3)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.use_side = False

    def forward(self, x):
        h = self.inp(x) + (self.side(x) if self.use_side else 0)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


MODES = {"torch": ("torch", {}), "bf16": ("bf16", {}),
         "O1": ("apex", {"opt_level": "O1", "verbosity": 0}),
         "O2": ("apex", {"opt_level": "O2", "verbosity": 0}), "naive": ("naive", {}),
         "O3": ("apex", {"opt_level": "O3", "verbosity": 0, "loss_scale": "dynamic"})}


def combination(rng):
    labels = sorted(MODES) if scenario == "ddp" else sorted(set(MODES) - {"O3"})
    label = rng.choice(labels)
    opts = ["adamw-fused", "adamw-foreach", "sgd-foreach"]
    if scenario == "ddp" and label != "O3":  # no DTensor rule for fused SGD (FSDP2), and
        opts.append("sgd-fused")             # torch's fused CPU SGD breaks half params
    kw = {}
    if label == "naive":
        kw = {"initial_scale": 2.0 ** rng.choice([6, 12]), "step_chunks": rng.choice([1, 2]),
              "clip_grad": rng.choice([0, 1.0])}
    return {"label": label, "opt": rng.choice(opts), "kw": kw, "side": rng.random() < 0.5,
            "clip": rng.random() < 0.3 and not kw.get("clip_grad"),
            "accum": rng.choice([1, 2]) if scenario == "ddp" else 1}


def make_optimizer(cfg, params):
    name, impl = cfg["opt"].split("-")
    kw = {impl: True}
    return (torch.optim.AdamW(params, lr=1e-2, eps=1e-3, **kw) if name == "adamw"
            else torch.optim.SGD(params, lr=1e-2, momentum=0.9, **kw))


def build_ddp(cfg, seed):
    """convert_to_amp, then DistributedDataParallel (the order the README gives)."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(seed)
    net = Net()
    mode, mode_kw = MODES[cfg["label"]]
    model, opt, crit = mpfunc_torch.convert_to_amp(net, make_optimizer(cfg, net.parameters()),
                                                   nn.MSELoss(), mode=mode, **mode_kw,
                                                   **cfg["kw"])
    model = DistributedDataParallel(model, find_unused_parameters=True)  # the side branch
    opt.state_dict()  # re-seeds the masters from DDP's broadcast now, not in the first step
    return net, model, opt, crit


def build(cfg, seed):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(seed)
    net = Net()
    param_dtype = {"torch": torch.float16, "O1": torch.float16, "bf16": torch.bfloat16}
    policy = MixedPrecisionPolicy(param_dtype=param_dtype.get(cfg["label"]),
                                  reduce_dtype=torch.float32)
    for block in net.blocks:
        if cfg["label"] == "O2":  # its float32 norms in units of their own
            fully_shard(block.ln, mesh=mesh,
                        mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32))
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(net.side, mesh=mesh, mp_policy=policy)
    fully_shard(net, mesh=mesh, mp_policy=policy)
    mode, mode_kw = MODES[cfg["label"]]
    return (net, *mpfunc_torch.convert_to_amp(net, make_optimizer(cfg, net.parameters()),
                                               nn.MSELoss(), mode=mode, **mode_kw,
                                               **cfg["kw"]))


def shards(net, opt):
    tensors = [*net.parameters(), *(m for _, m in opt._pairs)]
    state = {(id(q), k): v for q, st in opt.optimizer.state.items() for k, v in st.items()
             if isinstance(v, torch.Tensor)}
    return ([local(t).detach().clone() for t in tensors],
            {k: local(v).detach().clone() for k, v in state.items()})


def run(seed):
    rng = random.Random(seed)
    cfg = combination(rng)
    record = {"cfg": cfg, "error": None, "steps": []}
    try:
        net, model, opt, crit = (build_ddp if scenario == "ddp" else build)(cfg, seed)
        for step in range(STEPS):
            net.use_side = cfg["side"] and step % 3 == 1
            fault_rank = rng.choice([None, None, 0, world - 1])
            opt.zero_grad()
            for micro in range(cfg["accum"]):
                g = torch.Generator().manual_seed(seed * 100 + step * 10 + micro)
                x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
                rows = slice(rank * 8 // world, (rank + 1) * 8 // world)
                last = micro == cfg["accum"] - 1
                with contextlib.nullcontext() if last else model.no_sync():
                    loss = crit(model(x[rows]).float(), y[rows])
                    if scenario == "ddp" and last and fault_rank == rank:
                        loss = loss * float("inf")  # DDP's all-reduce spreads it
                    opt.backward(loss)
            before = shards(net, opt)
            if scenario == "fsdp" and fault_rank == rank:  # a NaN in this rank's shard
                grad = next(local(p.grad) for p in net.parameters()
                            if p.grad is not None and local(p.grad).numel())
                grad.view(-1)[0] = float("nan")
            if cfg["clip"]:
                opt.clip_grad_norm(1.0)
            took = bool(opt.step())
            after = shards(net, opt)
            exact = (all(torch.equal(a, b) for a, b in zip(before[0], after[0], strict=True))
                     and all(torch.equal(before[1][k], v) if k in before[1] else not v.any()
                             for k, v in after[1].items()))
            finite = all(bool(torch.isfinite(t.float()).all())
                         for t in [*after[0], *after[1].values()])
            record["steps"].append({"took": took, "fault": fault_rank is not None,
                                    "exact": exact, "finite": finite,
                                    "params": [t.float() for t in after[0]]})
    except Exception:
        record["error"] = traceback.format_exc(limit=6)
    dist.barrier()
    return record


torch.save([run(seed) for seed in SEEDS], outdir / f"{scenario}-{rank}.pt")
dist.destroy_process_group()
print("RESULT ok")
