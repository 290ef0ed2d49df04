"""FSDP2 + DTensor tensor parallelism with mpfunc_torch: every rank skips together.

A small GPT-style language model (char-level, on Python's stdlib source) runs on a 2-D
device mesh ("dp", "tp"): attention heads and MLP units are split over "tp" with
``parallelize_module`` (ColwiseParallel / RowwiseParallel), and every block is sharded
over "dp" with ``fully_shard`` (FSDP2), so each rank holds 1/N of the params, of the
float32 master weights and of the optimizer state. Each mode then goes through
``mpfunc_torch.convert_to_amp`` unchanged. Per step the gradient norm is clipped
globally (the same norm on every rank), and at one step an inf is put into the last
rank's shard of one weight's gradient: every rank skips, with its params, masters and
optimizer state bit for bit unchanged, and all keep the same loss scale.

On CPU (default) 4 processes talk over gloo on loopback; on GPUs use one process per GPU
(NCCL), e.g. ``torchrun --nproc-per-node 4 examples/torch_fsdp_tp.py --device cuda``.

    python examples/torch_fsdp_tp.py [--quick] [--world 4] [--steps N] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from data import VOCAB, load_corpus, split, windows  # noqa: E402

import mpfunc_torch  # noqa: E402

CONTEXT, WIDTH, HEADS, LAYERS = 32, 64, 4, 2
KiB = 1024


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--world", type=int, default=4, help="processes on CPU (dp x tp, tp=2)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--quick", action="store_true", help="8 steps, modes naive and torch")
    return ap.parse_args(argv)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.q, self.k, self.v, self.o = (nn.Linear(WIDTH, WIDTH) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):
        b, t, _ = x.shape
        h = self.ln1(x)
        # -1 heads: with tensor parallelism each rank computes its own heads.
        q, k, v = (m(h).view(b, t, -1, WIDTH // HEADS).transpose(1, 2)
                   for m in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, -1))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(torch.zeros(CONTEXT, WIDTH))
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx):
        x = self.emb(idx) + self.pos[: idx.shape[1]]
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


def build(mesh, label, device):
    """The model on ``mesh``: TP inside each block, then FSDP2 over "dp". apex O2 keeps
    norms in float32, so each norm is a fully_shard unit of its own."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    net = GPT().to(device)
    plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(),
            "o": RowwiseParallel(), "fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
    for b in net.blocks:
        parallelize_module(b, mesh["tp"], plan)
        if label == "O2":
            fully_shard(b.ln1, mesh=mesh["dp"])
            fully_shard(b.ln2, mesh=mesh["dp"])
        fully_shard(b, mesh=mesh["dp"])
    if label == "O2":
        fully_shard(net.ln, mesh=mesh["dp"])
    fully_shard(net, mesh=mesh["dp"])
    return net


MODES = {"torch": ("torch", {}), "bf16": ("bf16", {}),
         "O1": ("apex", {"opt_level": "O1", "verbosity": 0}),
         "O2": ("apex", {"opt_level": "O2", "verbosity": 0}),
         # from 2**12, a scale this model never overflows at: the planted overflow is the
         # only skip (from the default 2**32 the warm start skips 2 or 3 steps first)
         "naive": ("naive", {"initial_scale": 2.0**12})}


def local_bytes(tensors):
    out = 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        out += t.numel() * t.element_size()
    return out


def shards(net, opt):
    """This rank's shards of params, masters and optimizer state (for the skip check)."""
    ts = list(net.parameters()) + [q for g in opt.param_groups for q in g["params"]]
    ts += [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    return [(t.to_local() if hasattr(t, "to_local") else t).detach().clone() for t in ts]


def run_mode(label, args, mesh, rank, world, device, data):
    mode, cfg = MODES[label]
    net = build(mesh, label, device)
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3, fused=device.type == "cuda")
    model, opt, crit = mpfunc_torch.convert_to_amp(net, opt, nn.CrossEntropyLoss(), mode=mode,
                                                   **cfg)
    dp_rank, dp_size = mesh.get_local_rank("dp"), mesh.size(0)
    poison_at, lines = 3, []
    for i in range(args.steps):
        x, y = next(data)  # the global batch; this rank takes its dp rows
        rows = slice(dp_rank * len(x) // dp_size, (dp_rank + 1) * len(x) // dp_size)
        x = torch.as_tensor(x[rows], dtype=torch.long, device=device)
        y = torch.as_tensor(y[rows], dtype=torch.long, device=device)
        opt.zero_grad()
        loss = crit(model(x).reshape(-1, VOCAB), y.reshape(-1))
        opt.backward(loss)
        before = shards(net, opt) if i == poison_at else None
        if i == poison_at and rank == world - 1:
            g = net.blocks[0].fc1.weight.grad  # a (dp, tp)-split weight: one rank's shard
            g.to_local().view(-1)[0] = float("inf")
        norm = opt.clip_grad_norm(1.0)
        stepped = opt.step()
        flags = torch.tensor([float(stepped), float(norm)], device=device)
        every = [torch.zeros_like(flags) for _ in range(world)]
        dist.all_gather(every, flags)
        every = torch.stack(every).cpu()
        if i == poison_at:
            same = all(torch.equal(a, b) for a, b in zip(before, shards(net, opt)))
            unchanged = torch.tensor(float(same), device=device)
            dist.all_reduce(unchanged, op=dist.ReduceOp.MIN)
            lines.append(f"  step {i}: inf in rank {world - 1}'s shard of blocks.0.fc1.weight"
                         f"'s gradient: ranks that stepped {int(every[:, 0].sum())}/{world}, "
                         f"params, masters and optimizer state unchanged on every rank: "
                         f"{bool(unchanged)}, loss scale {float(opt.loss_scale):g} on all")
        elif i in (0, args.steps - 1):
            lines.append(f"  step {i}: loss {float(loss.detach()):.4f} (rank 0's rows), grad norm "
                         f"{float(every[0, 1]):.4f} on every rank (same: "
                         f"{bool((every[:, 1] == every[0, 1]).all())}), ranks that stepped "
                         f"{int(every[:, 0].sum())}/{world}")
    params = list(net.parameters())
    model_ids = {id(p) for p in params}  # with master weights the optimizer steps others
    masters = [q for g in opt.param_groups for q in g["params"] if id(q) not in model_ids]
    state = [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    row = {"rank": rank, "params": local_bytes(params), "masters": local_bytes(masters),
           "state": local_bytes(state),
           "cuda_peak": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None}
    rows = [None] * world
    dist.all_gather_object(rows, row)
    full = sum(p.numel() for p in params)
    return lines, rows, full, opt.scale_metrics(as_python=True)


def worker(rank, world, port, args):
    if args.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if "RANK" in os.environ and port is None:  # torchrun
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    tp = 2 if world % 2 == 0 else 1
    mesh = init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
    labels = ["naive", "torch"] if args.quick else ["torch", "bf16", "O1", "O2", "naive"]
    train, _ = split(load_corpus())
    if rank == 0:
        print(f"{world} ranks ({backend}, {device.type}), mesh dp={world // tp} x tp={tp}; "
              f"GPT {LAYERS} blocks, width {WIDTH}, context {CONTEXT}; {args.steps} steps, "
              "gradients clipped to norm 1.0 over the whole mesh")
    for label in labels:
        data = windows(train, CONTEXT, args.batch, seed=0)
        lines, rows, full, metrics = run_mode(label, args, mesh, rank, world, device, data)
        if rank == 0:
            half = label in ("O2", "naive")
            print(f"\n{label}: {full:,} params; final loss scale {metrics['loss_scale']:g}, "
                  f"skipped steps {metrics['skipped_steps']}; unsharded, one rank would hold "
                  f"{full * (2 if half else 4) / KiB:.1f} KiB of params"
                  + (f" and {full * 4 / KiB:.1f} KiB of float32 masters" if half else ""))
            print("\n".join(lines))
            peak = rows[0]["cuda_peak"] is not None
            print("  per rank (the blocks are split over dp and tp, the embeddings, final "
                  "norm and head over dp only):")
            print("  | rank | params KiB | float32 masters KiB | optimizer state KiB |"
                  + (" CUDA peak MiB |" if peak else ""))
            print("  | --- | --- | --- | --- |" + (" --- |" if peak else ""))
            for r in rows:
                print(f"  | {r['rank']} | {r['params'] / KiB:.1f} | {r['masters'] / KiB:.1f} | "
                      f"{r['state'] / KiB:.1f} |"
                      + (f" {r['cuda_peak'] / 2**20:.1f} |" if peak else ""))
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None):
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.quick:
        args.steps = 8
    if "RANK" in os.environ:  # launched by torchrun: this process is one rank
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), None, args)
        return
    if args.device == "cuda":
        args.world = min(args.world, torch.cuda.device_count())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(worker, args=(args.world, port, args), nprocs=args.world,
                       start_method="spawn")


if __name__ == "__main__":
    main()
