"""Embedded, real training data: Python's own standard-library source, as bytes.

Nothing is downloaded. The corpus is the first ``max_bytes`` of the sorted standard
library ``.py`` files, so a rerun on the same Python version sees the same data.
Bytes >= 128 map to ``?`` so the vocabulary is 128 symbols.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np

VOCAB = 128


def load_corpus(max_bytes: int = 600_000) -> np.ndarray:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(stdlib.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    arr = np.frombuffer(b"".join(chunks)[:max_bytes], np.uint8).copy()
    arr[arr >= VOCAB] = ord("?")
    return arr.astype(np.int32)


def split(corpus: np.ndarray, eval_fraction: float = 0.1):
    cut = int(len(corpus) * (1 - eval_fraction))
    return corpus[:cut], corpus[cut:]


def windows(data: np.ndarray, context: int, batch: int, seed: int):
    """Yields (inputs[batch, context], targets[batch, context]) forever, reproducibly."""
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(data) - context - 1, size=batch)
        idx = starts[:, None] + np.arange(context)[None, :]
        yield data[idx], data[idx + 1]
