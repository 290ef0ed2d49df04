"""A small real task for the torch tests: next-byte prediction on stdlib source."""

import sysconfig
from pathlib import Path

import numpy as np
import torch

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
