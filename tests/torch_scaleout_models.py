"""A small transformer for the scale-out tests, its splits, its data, and the
single-process reference runs the sharded runs are compared with.

Imported by the test files and by `torch_scaleout_worker.py` (one process per rank).
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import mpfunc_torch

VOCAB, D, HEADS, LAYERS, T, BATCH = 32, 16, 2, 2, 6, 8

MODES = [  # (label, mode, config); naive starts low so that the first steps are taken
    ("torch", "torch", {}),
    ("bf16", "bf16", {}),
    ("O1", "apex", {"opt_level": "O1", "verbosity": 0}),
    ("O2", "apex", {"opt_level": "O2", "verbosity": 0}),
    ("O3", "apex", {"opt_level": "O3", "verbosity": 0}),
    ("naive", "naive", {"initial_scale": 2.0**10}),
]
MODE = {label: (mode, cfg) for label, mode, cfg in MODES}
INJECT_STEP = 1  # the step whose gradients get an inf (on one rank's shard only)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def attend(self, h):
        b, t, _ = h.shape
        # -1 heads: under tensor parallelism each rank holds a part of the heads.
        q, k, v = (m(h).view(b, t, -1, D // HEADS).transpose(1, 2)
                   for m in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return a.transpose(1, 2).reshape(b, t, -1)

    def forward(self, x):
        x = x + self.o(self.attend(self.ln1(x)))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, idx):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


def make_model(seed=0):
    torch.manual_seed(seed)
    return Tiny()


def loss_fn(logits, y):
    return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


def batch(step):
    """The global batch of a step: sequences counting up by a per-row stride, so the
    next token is learnable."""
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, VOCAB, (BATCH, 1), generator=g)
    stride = torch.randint(1, 4, (BATCH, 1), generator=g)
    seq = (start + stride * torch.arange(T + 1)) % VOCAB
    return seq[:, :-1], seq[:, 1:]


CLIP = 0.5  # below the first steps' gradient norms (about 0.86), so clipping acts


def make_optimizer(params, label, fused=False):
    """SGD with momentum, whose update is linear in the gradients, so sharded and
    single-process runs can be held to a tight tolerance; or fused AdamW (the fused
    path, whose kernel skips on found_inf; O3 keeps its float16 state and uses SGD, as in
    tests/torch_task.py). Adam normalises each element, so an element whose gradient is
    below the rounding noise of the sharded sum takes a full step of either sign: its
    runs are held to a looser tolerance."""
    if fused and label != "O3":
        return torch.optim.AdamW(params, lr=1e-2, fused=True)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


# -- tensor parallelism ------------------------------------------------------------------

def tp_plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(),
            "o": RowwiseParallel(), "fc1": ColwiseParallel(), "fc2": RowwiseParallel()}


class _CopyToTP(torch.autograd.Function):  # Megatron's f: identity, all-reduce backward
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        torch.distributed.all_reduce(g, group=ctx.group)
        return g, None


class _ReduceFromTP(torch.autograd.Function):  # Megatron's g: all-reduce, identity backward
    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        torch.distributed.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


class ColumnParallel(nn.Module):
    """Rows ``part`` of a Linear's output (and bias): the Megatron column split."""

    def __init__(self, full, part, group):
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(full.weight.detach()[part].clone())
        self.bias = nn.Parameter(full.bias.detach()[part].clone())

    def forward(self, x):
        return F.linear(_CopyToTP.apply(x, self.group), self.weight, self.bias)


class RowParallel(nn.Module):
    """Columns ``part`` of a Linear's input; the bias is added once, after the sum, and is
    replicated on every rank of the group."""

    def __init__(self, full, part, group):
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(full.weight.detach()[:, part].clone())
        self.bias = nn.Parameter(full.bias.detach().clone())

    def forward(self, x):
        return _ReduceFromTP.apply(F.linear(x, self.weight), self.group) + self.bias


def megatron_split(full: Tiny, rank: int, size: int, group) -> Tiny:
    """``full`` split by hand over ``group`` (plain tensors, no DTensor): attention heads
    and the MLP's hidden units are divided; norms, embeddings, the head and the biases
    of the row-parallel layers are replicated and marked so with `mark_replicated`."""
    d_part = slice(rank * D // size, (rank + 1) * D // size)
    h_part = slice(rank * 4 * D // size, (rank + 1) * 4 * D // size)
    for b in full.blocks:
        for name in ("q", "k", "v"):
            setattr(b, name, ColumnParallel(getattr(b, name), d_part, group))
        b.o = RowParallel(b.o, d_part, group)
        b.fc1 = ColumnParallel(b.fc1, h_part, group)
        b.fc2 = RowParallel(b.fc2, h_part, group)
    split = {id(p) for b in full.blocks for m in (b.q, b.k, b.v, b.fc1) for p in m.parameters()}
    split |= {id(b.o.weight) for b in full.blocks} | {id(b.fc2.weight) for b in full.blocks}
    replicated = [p for p in full.parameters() if id(p) not in split]
    mpfunc_torch.mark_replicated(replicated, group)
    return full


# -- pipeline stages ---------------------------------------------------------------------

class FirstStage(nn.Module):
    def __init__(self, full):
        super().__init__()
        self.emb, self.block = full.emb, full.blocks[0]

    def forward(self, idx):
        return self.block(self.emb(idx))


class LastStage(nn.Module):
    def __init__(self, full):
        super().__init__()
        self.block, self.ln, self.head = full.blocks[1], full.ln, full.head

    def forward(self, x):
        return self.head(self.ln(self.block(x)))


STAGE_PREFIX = [{"emb.": "emb.", "block.": "blocks.0."},
                {"block.": "blocks.1.", "ln.": "ln.", "head.": "head."}]


def stage_names(stage: int, name: str) -> str:
    for short, full in STAGE_PREFIX[stage].items():
        if name.startswith(short):
            return full + name[len(short):]
    raise KeyError(name)


# -- the single-process reference --------------------------------------------------------

def reference(label, steps=3, inject=INJECT_STEP, clip=None, fused=False):
    """The same training in one process on the whole batch: per step (stepped, scale,
    clipping norm), losses, and the final float32 params (masters where there are any)."""
    mode, cfg = MODE[label]
    net = make_model()
    opt = make_optimizer(net.parameters(), label, fused)
    model, opt, crit = mpfunc_torch.convert_to_amp(net, opt, loss_fn, mode=mode, **cfg)
    report, losses = [], []
    for i in range(steps):
        x, y = batch(i)
        opt.zero_grad()
        loss = crit(model(x), y)
        opt.backward(loss)
        if i == inject:
            net.blocks[0].fc1.weight.grad.view(-1)[0] = float("inf")
        norm = float(opt.clip_grad_norm(clip)) if clip is not None else None
        report.append((bool(opt.step()), float(opt.loss_scale), norm))
        losses.append(float(loss.detach()))
    return {"report": report, "losses": losses, "params": full_params(net, opt)}


def full_params(net, opt):
    """name -> float32 value of each param: the master weight where there is one."""
    master_of = {id(p): m for p, m in opt._pairs}
    out = {}
    for name, p in net.named_parameters():
        t = master_of.get(id(p), p)
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        out[name] = t.detach().float().clone()
    return out


# -- launching the workers ---------------------------------------------------------------

WORKER = Path(__file__).with_name("torch_scaleout_worker.py")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(scenario, world, outdir, timeout=420, worker=None):
    """Runs ``scenario`` on ``world`` gloo ranks over loopback (``worker``, a script in
    this folder, defaults to torch_scaleout_worker.py); raises with the failing rank's
    stderr. Results land in ``outdir/SCENARIO-RANK.pt``."""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]),
               OMP_NUM_THREADS="1")
    env.pop("XLA_FLAGS", None)
    port = str(_free_port())
    script = WORKER if worker is None else Path(__file__).parent / worker
    procs = [subprocess.Popen([sys.executable, str(script), scenario, str(r), str(world), port,
                               str(outdir)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(world)]
    errors = []
    try:
        for r, p in enumerate(procs):
            _, stderr = p.communicate(timeout=timeout)
            if p.returncode != 0:
                errors.append(f"rank {r} exited with {p.returncode}:\n{stderr[-3000:]}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if errors:
        raise RuntimeError("\n".join(errors))


def launch_results(worker, scenario, world, timeout=300):
    """Runs ``scenario`` of ``worker`` (a script in this folder that prints one line
    ``RESULT <json>`` with its ``rank``) on ``world`` gloo ranks over loopback; returns
    the ranks' results in rank order, or fails with the failing rank's stderr."""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]),
               OMP_NUM_THREADS="1")
    port = str(_free_port())
    script = Path(__file__).parent / worker
    procs = [subprocess.Popen([sys.executable, str(script), scenario, str(r), str(world), port],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    out = {}
    for p in procs:
        stdout, stderr = p.communicate(timeout=timeout)
        assert p.returncode == 0, stderr[-3000:]
        line = next(ln for ln in stdout.splitlines() if ln.startswith("RESULT "))
        data = json.loads(line[len("RESULT "):])
        out[data["rank"]] = data
    return [out[r] for r in range(world)]


def launched(tmp_path_factory, scenario, world, section):
    """The ranks' results of ``section`` of ``scenario``, run once per test session even
    under pytest-xdist (the workers share the session's temp root and take turns on a
    lock)."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "scaleout"
    root.mkdir(exist_ok=True)
    marker = root / f"{scenario}-{world}.status"
    if scenario == "four":  # loads the 2-rank run's checkpoint
        launched(tmp_path_factory, "two", 2, "fsdp")
    with FileLock(str(root / "lock")):
        if not marker.exists():
            try:
                launch(scenario, world, root)
                marker.write_text("ok")
            except Exception as e:  # the other xdist worker reports the same failure
                marker.write_text(f"failed: {e}")
        status = marker.read_text()
    if status != "ok":
        raise RuntimeError(f"{scenario} on {world} ranks {status}")
    return [torch.load(root / f"{scenario}-{r}.pt", weights_only=False)[section]
            for r in range(world)]


def check_combinations(scenario, tmp_path, *, same_params):
    """Runs torch_combos_worker.py's ``scenario`` on 2 ranks and checks every seed: no
    error; at every step the ranks took the same decision, no injected fault was
    stepped on, a skip left every rank's params, masters and state bit for bit, nothing
    is non-finite (and, with ``same_params``, the ranks hold equal params); and some
    steps were taken."""
    launch(scenario, 2, tmp_path, worker="torch_combos_worker.py")
    ranks = [torch.load(tmp_path / f"{scenario}-{r}.pt", weights_only=False) for r in range(2)]
    for seed, (r0, r1) in enumerate(zip(*ranks, strict=True)):
        assert r0["error"] is None and r1["error"] is None, (seed, r0["error"] or r1["error"])
        for step, (s0, s1) in enumerate(zip(r0["steps"], r1["steps"], strict=True)):
            where = (seed, r0["cfg"], step)
            assert s0["took"] == s1["took"], where
            assert not (s0["took"] and (s0["fault"] or s1["fault"])), where
            assert s0["took"] or (s0["exact"] and s1["exact"]), where
            assert s0["finite"] and s1["finite"], where
            if same_params:
                assert all(torch.equal(a, b) for a, b in zip(s0["params"], s1["params"],
                                                             strict=True)), where
        assert any(s["took"] for s in r0["steps"]), (seed, r0["cfg"])


def update_error(params, ref_params, init_params):
    """|sharded - reference| / |reference - initial| over all params (Frobenius): how far
    the sharded run's total update is from the single-process one's."""
    num = sum(((params[n] - ref_params[n]) ** 2).sum() for n in ref_params).sqrt()
    den = sum(((ref_params[n] - init_params[n]) ** 2).sum() for n in ref_params).sqrt()
    return float(num / den)


def initial_params():
    return {n: p.detach().float().clone() for n, p in make_model().named_parameters()}
