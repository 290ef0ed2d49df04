"""fp8 amaxes MAX-reduced over 2 real gloo ranks (each rank runs this file as a script)."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(grouped: bool):
    port = str(_free_port())
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]),
               OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, __file__, str(r), port, str(int(grouped))],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=180)
            assert p.returncode == 0, stderr[-3000:]
            line = next(ln for ln in stdout.splitlines() if ln.startswith("RESULT "))
            out.append(json.loads(line[len("RESULT "):]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return sorted(out, key=lambda d: d["rank"])


def test_every_rank_records_the_same_amax_history():
    r0, r1 = launch(grouped=True)
    assert r0["delayed"] == r1["delayed"]  # histories and scales, bit for bit
    # ... and they are the max over the ranks' own amaxes (rank 1's inputs are 4x).
    hist = r0["delayed"]["fp8_amax_history_input"]
    assert hist[:3] == [max(a, b) for a, b in zip(r0["local_amax"][::-1], r1["local_amax"][::-1])]
    assert r0["tensorwise_scale"] == r1["tensorwise_scale"] == 448.0 / 4.0


def test_without_a_group_the_ranks_diverge():
    r0, r1 = launch(grouped=False)
    assert r0["delayed"]["fp8_amax_history_input"] != r1["delayed"]["fp8_amax_history_input"]
    assert r0["tensorwise_scale"] == 448.0 and r1["tensorwise_scale"] == 448.0 / 4.0


def _worker(rank: int, port: str, grouped: bool) -> None:  # pragma: no cover - subprocess
    import torch
    import torch.distributed as dist

    import mpfunc_torch

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    group = dist.group.WORLD if grouped else None
    recipe = mpfunc_torch.Fp8Recipe("delayed", amax_history_len=4)
    torch.manual_seed(0)  # the same weights on both ranks (data parallel)
    layer = mpfunc_torch.Fp8Linear(32, 16, recipe=recipe, process_group=group, gemm="emulate")
    gen = torch.Generator().manual_seed(1 + rank)
    local = []
    for _ in range(3):
        x = torch.randn(8, 32, generator=gen) * (1 + 3 * rank)
        local.append(float(x.abs().max()))
        layer(x).square().sum().backward()
    # Current scaling: the per-tensor amax is reduced too (rank 1 holds 4.0).
    _, scale = mpfunc_torch.quantize_fp8(torch.full((4, 4), 1.0 + 3 * rank),
                                         process_group=group)
    result = {"rank": rank, "local_amax": local, "tensorwise_scale": float(scale),
              "delayed": {k: v.tolist() for k, v in layer.state_dict().items()
                          if k.startswith("fp8_")}}
    print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(int(sys.argv[1]), sys.argv[2], bool(int(sys.argv[3])))
