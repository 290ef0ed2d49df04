"""A small real task for the torch tests: next-byte prediction on stdlib source."""

import sysconfig
from pathlib import Path

import numpy as np
import torch

import mpfunc_torch

CONTEXT, VOCAB = 8, 128


def corpus(n_bytes=200_000):
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    data = b"".join(p.read_bytes() for p in sorted(stdlib.glob("a*.py")))[:n_bytes]
    arr = np.frombuffer(data, np.uint8).copy()
    arr[arr >= VOCAB] = ord("?")
    return torch.from_numpy(arr.astype(np.int64))


def batches(n, batch=128, seed=0):
    data = corpus()
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        starts = torch.randint(0, len(data) - CONTEXT - 1, (batch,), generator=g)
        idx = starts[:, None] + torch.arange(CONTEXT + 1)[None, :]
        seq = data[idx]
        out.append((seq[:, :CONTEXT], seq[:, CONTEXT]))
    return out


class CharMLP(torch.nn.Module):
    def __init__(self, hidden=128, norm="layer"):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.fc1 = torch.nn.Linear(CONTEXT * 16, hidden)
        self.norm = torch.nn.LayerNorm(hidden) if norm == "layer" else torch.nn.BatchNorm1d(hidden)
        self.fc2 = torch.nn.Linear(hidden, VOCAB)

    def forward(self, x):
        h = self.embed(x).flatten(1)
        h = torch.nn.functional.gelu(self.norm(self.fc1(h)))
        return self.fc2(h)


def make_model(seed=0, **kw):
    torch.manual_seed(seed)
    return CharMLP(**kw)


ALL_MODES = [
    ("torch", {}),
    ("torch", {"dtype": "bfloat16"}),
    ("apex", {"opt_level": "O0", "verbosity": 0}),
    ("apex", {"opt_level": "O1", "verbosity": 0}),
    ("apex", {"opt_level": "O2", "verbosity": 0}),
    ("apex", {"opt_level": "O3", "verbosity": 0}),
    ("naive", {"initial_scale": 2.0**16}),
    ("bf16", {}),
    ("fp8", {}),  # bf16 with the Linear matmuls in fp8 (tensorwise)
]
ids = [f"{m}-{c.get('opt_level', c.get('dtype', ''))}" for m, c in ALL_MODES]


def is_o3(cfg):
    return cfg.get("opt_level") == "O3"


def make_opt(params, kind="adam", fused=True, eps=1e-8):
    # O3 keeps optimizer state in float16 too, where Adam's second moment underflows to
    # zero; apex calls O3 a speed baseline. Its runs use SGD with momentum instead.
    if kind == "sgd":  # fused SGD on CPU mishandles half params: see the guard's test
        return torch.optim.SGD(params, lr=0.2, momentum=0.9)
    return torch.optim.Adam(params, lr=3e-3, fused=fused, eps=eps)


def train(mode, cfg, steps=60, fused=True, data=None, seed=0, kind=None):
    net = make_model(seed)
    kind = kind or ("sgd" if is_o3(cfg) else "adam")
    # (O3's Adam: an eps that is not 0 in float16; convert_to_amp refuses 1e-8 there.)
    opt = make_opt(net.parameters(), kind, fused, eps=1e-4 if is_o3(cfg) else 1e-8)
    model, opt, crit = mpfunc_torch.convert_to_amp(
        net, opt, torch.nn.CrossEntropyLoss(), mode=mode, **cfg)
    losses = []
    for x, y in (data or batches(steps)):
        opt.zero_grad()
        loss = crit(model(x), y)
        opt.backward(loss)
        opt.step()
        losses.append(loss.item())
    return model, opt, losses


_FP32 = {}


def fp32_losses(kind):
    if kind not in _FP32:
        _FP32[kind] = train("torch", {"enabled": False}, kind=kind)[2]
    return _FP32[kind]


def tiny_model(seed=0, n=6):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(n, n), torch.nn.Tanh(), torch.nn.Linear(n, 1))


def tiny_batch(seed=0, n=6):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(16, n, generator=g), torch.randn(16, 1, generator=g)


def same(a, b):
    """Whether two nested states (dicts, lists, tensors, numbers) are bit for bit equal,
    tensors of the same dtype included."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    return a == b


# Every mode the trainers take, with small initial scales so that only a test's planted
# inf skips (tests/test_lightning_plugin.py, tests/test_hf_trainer.py).
TRAINER_MODES = [
    ("torch", {"init_scale": 2.0**8}),
    ("torch", {"init_scale": 2.0**8, "dtype": "bfloat16"}),
    ("apex", {"opt_level": "O1", "verbosity": 0, "loss_scale": 2.0**8}),
    ("apex", {"opt_level": "O2", "verbosity": 0, "max_loss_scale": 2.0**8}),
    ("apex", {"opt_level": "O3", "verbosity": 0}),
    ("naive", {"initial_scale": 2.0**8}),
    ("bf16", {}),
    ("fp8", {}),
]
