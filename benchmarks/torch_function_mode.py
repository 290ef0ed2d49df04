"""What the half-param modes' function modes cost in eager mode.

naive and apex O2 run the model's forward under ``HalfModelFp32Functions``, apex O3 (and
any mode with half params and no masters) under ``HalfModelFunctions``: torch function
modes, so every torch call inside ``forward`` goes through a Python
``__torch_function__``. The listed functions (softmax, layer norm, losses) get float32
copies of their inputs, and the matmuls, attention and norms check their operands for a
float32 tensor made in ``forward`` to cast to the half dtype (the one-dtype rule). This
times a nanoGPT-style model's forward and its train step in naive mode with the mode,
without the one-dtype rule, and with the mode switched off (before either), and in apex O3
with and without its mode, interleaved, medians reported, and counts the torch calls one
forward makes, for the cost per call. Under ``torch.compile`` the modes are casts in the
graph and cost no Python.

    python benchmarks/torch_function_mode.py [--device cpu|cuda] [--d 256] [--layers 4]
        [--batch 8] [--seq 128] [--rounds 7] [--iters 10] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import platform
import statistics
import time

import torch
import torch.nn.functional as F  # noqa: N812
from torch.overrides import TorchFunctionMode

import mpfunc_torch
from mpfunc_torch._src import autocast

VOCAB = 512


class Block(torch.nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.attn, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.fc, self.out = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for z in self.attn(self.ln1(x)).split(c, 2))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        y = F.softmax(att.masked_fill(~mask, float("-inf")), dim=-1) @ v
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(torch.nn.Module):
    def __init__(self, d, layers, seq):
        super().__init__()
        self.wte, self.wpe = torch.nn.Embedding(VOCAB, d), torch.nn.Embedding(seq, d)
        self.blocks = torch.nn.ModuleList(Block(d, max(1, d // 64)) for _ in range(layers))
        self.ln_f, self.head = torch.nn.LayerNorm(d), torch.nn.Linear(d, VOCAB, bias=False)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


class _Count(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


# variant -> (mode, config, how): "on" as converted; "no rule": the one-dtype rule
# switched off; "off": the forward as it was before any function mode.
VARIANTS = {
    "naive, function mode off": ("naive", {"initial_scale": 2.0**16}, "off"),
    "naive, without the one-dtype rule": ("naive", {"initial_scale": 2.0**16}, "no rule"),
    "naive": ("naive", {"initial_scale": 2.0**16}, "on"),
    "apex O3, function mode off": ("apex", {"opt_level": "O3", "verbosity": 0}, "off"),
    "apex O3": ("apex", {"opt_level": "O3", "verbosity": 0}, "on"),
}


def build(args, mode, cfg, how):
    torch.manual_seed(0)
    net = GPT(args.d, args.layers, args.seq).to(args.device)
    eps = 1e-4 if cfg.get("opt_level") == "O3" else 1e-8  # O3 steps float16 itself
    model, opt, _ = mpfunc_torch.convert_to_amp(
        net, torch.optim.AdamW(net.parameters(), lr=1e-4, eps=eps), mode=mode, **cfg)
    if how == "off":
        vars(net)["forward"].function_mode = None  # the forward as it was before
    return model, opt


@contextlib.contextmanager
def one_dtype_rule(on: bool):
    """The one-dtype rule on or off (its list of functions emptied while off)."""
    saved = autocast._SAME_DTYPE
    if not on:
        autocast._SAME_DTYPE = frozenset()
    try:
        yield
    finally:
        autocast._SAME_DTYPE = saved


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--d", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--json")
    args = p.parse_args(argv)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, VOCAB, (args.batch, args.seq), generator=g).to(args.device)
    tgt = torch.randint(0, VOCAB, (args.batch, args.seq), generator=g).to(args.device)
    runs = {name: build(args, mode, cfg, how) for name, (mode, cfg, how) in VARIANTS.items()}
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)

    def step(model, opt):
        opt.zero_grad()
        opt.backward(model(idx, tgt))
        opt.step()

    def forward(model, opt):
        with torch.no_grad():
            model(idx, tgt)

    with _Count() as count, torch.no_grad():
        runs["naive"][0](idx, tgt)
    times: dict[str, dict[str, list[float]]] = {n: {"step": [], "forward": []} for n in runs}
    for fn in (step, forward):
        for run in runs.values():
            fn(*run)  # warm up
    for _ in range(args.rounds):
        for name, run in runs.items():
            with one_dtype_rule(VARIANTS[name][2] != "no rule"):
                for kind, fn in (("step", step), ("forward", forward)):
                    sync()
                    t0 = time.perf_counter()
                    for _ in range(args.iters):
                        fn(*run)
                    sync()
                    times[name][kind].append((time.perf_counter() - t0) / args.iters * 1e3)
    med = {n: {k: statistics.median(v) for k, v in t.items()} for n, t in times.items()}
    off, on = med["naive, function mode off"], med["naive"]
    no_rule, o3_off, o3 = (med["naive, without the one-dtype rule"],
                           med["apex O3, function mode off"], med["apex O3"])
    result = {
        "device": args.device if args.device == "cpu" else torch.cuda.get_device_name(),
        "machine": platform.machine(), "torch": torch.__version__,
        "model": {"d": args.d, "layers": args.layers, "batch": args.batch, "seq": args.seq},
        "torch_calls_per_forward": count.calls, "ms": med,
        "forward_overhead_us_per_call": (on["forward"] - off["forward"]) * 1e3 / count.calls,
        "one_dtype_rule_forward_ratio": {"naive": on["forward"] / no_rule["forward"],
                                         "apex O3": o3["forward"] / o3_off["forward"]},
    }
    print("| variant | step (ms) | forward (ms) |\n| --- | --- | --- |")
    for name, m in med.items():
        print(f"| {name} | {m['step']:.2f} | {m['forward']:.2f} |")
    ratio = result["one_dtype_rule_forward_ratio"]
    print(f"\n{count.calls} torch calls per forward; naive's mode adds "
          f"{on['forward'] - off['forward']:+.2f} ms to the forward "
          f"({result['forward_overhead_us_per_call']:+.1f} us per call), "
          f"{on['step'] - off['step']:+.2f} ms to the step; the one-dtype rule's forward "
          f"ratio: naive {ratio['naive']:.3f}, apex O3 {ratio['apex O3']:.3f} (its whole "
          f"mode); device {result['device']}, torch {torch.__version__}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
