"""PyTorch quick start: convert_to_amp in every mode, and the AMP tutorial's patterns.

Part 1 trains the same small character model in each mode (torch, apex O0-O3, naive,
bf16) and prints loss, skipped steps and loss scale. Part 2 shows the patterns from the
PyTorch AMP tutorial with the wrapped optimizer: gradient clipping (unscale first),
gradient accumulation, a gradient penalty through torch.autograd.grad, and two losses
with two optimizers sharing one scale.

    python examples/quickstart_torch.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data import VOCAB, load_corpus, windows  # noqa: E402

import mpfunc_torch  # noqa: E402

CONTEXT = 8


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Embedding(VOCAB, 16), torch.nn.Flatten(),
        torch.nn.Linear(CONTEXT * 16, 128), torch.nn.LayerNorm(128), torch.nn.GELU(),
        torch.nn.Linear(128, VOCAB),
    )


def batches(steps, batch=64):
    it = windows(load_corpus(200_000), CONTEXT + 1, batch, seed=0)
    out = []
    for _ in range(steps):
        seq, _ = next(it)
        seq = torch.from_numpy(seq).long()
        out.append((seq[:, :CONTEXT], seq[:, CONTEXT]))
    return out


def part1(steps):
    print("== every mode ==")
    data = batches(steps)
    modes = [("torch", {}), ("apex", {"opt_level": "O0"}), ("apex", {"opt_level": "O1"}),
             ("apex", {"opt_level": "O2"}), ("apex", {"opt_level": "O3"}), ("naive", {}),
             ("bf16", {})]
    for mode, cfg in modes:
        net = make_model()
        # O3 keeps optimizer state in float16, where Adam's second moment underflows;
        # apex calls O3 a speed baseline. Use SGD there.
        if cfg.get("opt_level") == "O3":
            opt = torch.optim.SGD(net.parameters(), lr=0.2, momentum=0.9)
        else:
            opt = torch.optim.AdamW(net.parameters(), lr=3e-3, fused=True)
        if mode == "apex":
            cfg = dict(cfg, verbosity=0)
        model, opt, crit = mpfunc_torch.convert_to_amp(net, opt, torch.nn.CrossEntropyLoss(),
                                                       mode=mode, **cfg)
        for x, y in data:
            opt.zero_grad()
            loss = crit(model(x), y)
            opt.backward(loss)  # scales the loss
            opt.step()          # unscales, skips on inf/NaN, updates the scale
        m = opt.scale_metrics(as_python=True)
        label = mode + (f" {cfg['opt_level']}" if "opt_level" in cfg else "")
        print(f"{label:9s} loss {loss.item():.3f}  skipped {m['skipped_steps']:3d}  "
              f"loss scale {m['loss_scale']:g}  param dtype {net[2].weight.dtype}")


def part2():
    print("== the AMP tutorial's patterns ==")
    (x, y), (x2, y2) = batches(2)
    net = make_model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model, opt, crit = mpfunc_torch.convert_to_amp(net, opt, torch.nn.CrossEntropyLoss(),
                                                   mode="torch", init_scale=2.0**12)

    # Gradient clipping: the norm is of the unscaled gradients.
    opt.backward(crit(model(x), y))
    norm = opt.clip_grad_norm(1.0)
    opt.step()
    opt.zero_grad()
    print(f"clipping: unscaled grad norm {norm.item():.3f} clipped to 1.0")

    # Gradient accumulation: several backwards, one step with one scale.
    for xb, yb in ((x, y), (x2, y2)):
        opt.backward(crit(model(xb), yb) / 2)
    stepped = opt.step()
    opt.zero_grad()
    print(f"accumulation: 2 micro-batches, one step taken: {bool(stepped)}")

    # Gradient penalty: autograd.grad on the scaled loss, unscale by hand, then backward.
    loss = crit(model(x), y)
    scaled_grads = torch.autograd.grad(opt.scale_loss(loss), list(net.parameters()),
                                       create_graph=True)
    inv = 1.0 / opt.loss_scale
    penalty = torch.sqrt(sum((g * inv).pow(2).sum() for g in scaled_grads))
    opt.backward(loss + 0.1 * penalty)
    opt.step()
    opt.zero_grad()
    print(f"gradient penalty: {penalty.item():.3f} (computed from unscaled gradients)")

    # Two models, two losses, two optimizers, one shared scale.
    m1, m2 = make_model(1), make_model(2)
    o1 = torch.optim.SGD(m1.parameters(), lr=0.1)
    o2 = torch.optim.SGD(m2.parameters(), lr=0.1)
    both, (o1, o2), crit = mpfunc_torch.convert_to_amp(
        torch.nn.ModuleList([m1, m2]), [o1, o2], torch.nn.CrossEntropyLoss(), mode="torch",
        init_scale=2.0**12)
    with torch.autocast("cpu", dtype=torch.float16):
        out1, out2 = m1(x), m2(x)
    loss1, loss2 = crit(2 * out1 + 3 * out2, y), crit(3 * out1 - 5 * out2, y)
    o1.backward(loss1, retain_graph=True)
    o1.backward(loss2)
    print(f"two optimizers: stepped {bool(o1.step())} and {bool(o2.step())}, shared scale "
          f"{o1.loss_scale.item():g}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    part1(30 if args.quick else args.steps)
    part2()


if __name__ == "__main__":
    main()
