"""Bytes per rank of float32 master weights (and the rest of the state) under FSDP2.

naive mode (float16 params, float32 masters, Adam) on an MLP of ``--layers`` Linear
layers of ``--hidden`` x ``--hidden`` with biases (the model of
``benchmarks/jax_sharding.py``), each Linear a ``fully_shard`` unit over N ranks,
N = 1, 2, 4. Counts the bytes of each rank's local shards (exact, from the tensors)
after one real training step; on CUDA also ``torch.cuda.max_memory_allocated``.

On CPU the N ranks are N processes on this machine talking over gloo on loopback; on
CUDA one process per GPU over NCCL (N is capped at the GPU count).

    python benchmarks/torch_sharding.py [--device cpu|cuda] [--hidden 2048] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
from pathlib import Path

import torch


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--sizes", default="1,2,4")
    ap.add_argument("--json", action="store_true", help="print one JSON line instead")
    return ap.parse_args(argv)


def _local_bytes(tensors):
    total = 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def _rank(rank, world, port, args, out):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import mpfunc_torch

    cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    mesh = init_device_mesh(device.type, (world,))
    torch.manual_seed(0)
    h = args.hidden
    net = torch.nn.Sequential(*[torch.nn.Linear(h, h) for _ in range(args.layers)]).to(device)
    for layer in net:
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    n_params = sum(p.numel() for p in net.parameters())
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    model, opt, _ = mpfunc_torch.convert_to_amp(net, opt, mode="naive", initial_scale=2.0**12)
    x = torch.ones(64 // world, h, device=device)
    opt.zero_grad()
    opt.backward(model(x).float().square().mean())
    stepped = bool(opt.step())
    model_ids = {id(p) for p in net.parameters()}
    masters = [q for g in opt.param_groups for q in g["params"] if id(q) not in model_ids]
    state = [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    row = {"rank": rank, "master_bytes": _local_bytes(masters),
           "param_bytes": _local_bytes(net.parameters()),
           "opt_state_bytes": _local_bytes(masters) + _local_bytes(state),
           "cuda_peak_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
           "stepped": stepped, "params": n_params}
    rows = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def _run(world, args):
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        mp.start_processes(_rank, args=(world, port, args, str(out)), nprocs=world,
                           start_method="spawn")
        return json.loads(out.read_text())


def measure(args):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sizes = [int(n) for n in args.sizes.split(",")]
    if args.device == "cuda":
        sizes = [n for n in sizes if n <= torch.cuda.device_count()]
    rows = []
    for n in sizes:
        ranks = _run(n, args)
        rows.append({"ranks": n,
                     "master_bytes_per_rank": max(r["master_bytes"] for r in ranks),
                     "param_bytes_per_rank": max(r["param_bytes"] for r in ranks),
                     "opt_state_bytes_per_rank": max(r["opt_state_bytes"] for r in ranks),
                     "cuda_peak_bytes_per_rank": ranks[0]["cuda_peak_bytes"],
                     "stepped": all(r["stepped"] for r in ranks)})
        n_params = ranks[0]["params"]
    if args.device == "cuda":
        name = torch.cuda.get_device_name(0)
    else:
        import platform

        name = f"CPU ({platform.processor() or platform.machine()}), {os.cpu_count()} cores"
    return {"device": name, "torch": torch.__version__, "params": n_params,
            "layers": args.layers, "hidden": args.hidden, "rows": rows}


def to_markdown(r):
    mib = lambda b: "n/a" if b is None else f"{b / 2**20:.2f}"  # noqa: E731
    base = r["rows"][0]["master_bytes_per_rank"]
    lines = [f"Device: {r['device']}; torch {r['torch']}; naive mode (float16 params, float32 "
             f"masters, Adam); MLP {r['layers']} x Linear({r['hidden']}, {r['hidden']}) with "
             f"bias, {r['params']:,} params, each Linear a fully_shard unit over N ranks.", "",
             "| N ranks | float32 masters / rank MiB | vs N=1 | float16 params / rank MiB "
             "| optimizer state / rank MiB (masters + Adam) | CUDA peak / rank MiB | step taken |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in r["rows"]:
        lines.append(
            f"| {row['ranks']} | {mib(row['master_bytes_per_rank'])} | "
            f"{row['master_bytes_per_rank'] / base:.3f} | {mib(row['param_bytes_per_rank'])} | "
            f"{mib(row['opt_state_bytes_per_rank'])} | {mib(row['cuda_peak_bytes_per_rank'])} | "
            f"{row['stepped']} |")
    return "\n".join(lines)


def main(argv=None):
    args = parse(sys.argv[1:] if argv is None else argv)
    r = measure(args)
    print(json.dumps(r) if args.json else to_markdown(r))
    return r


if __name__ == "__main__":
    main()
