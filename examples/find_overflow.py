"""Which layer overflowed? The precision report and forward watch, in torch and in JAX.

A small classifier (fc1 -> fc2 -> fc3 -> head, ReLU between) whose ``fc2`` has a weight
4000x too large is trained with float16 mixed precision ("torch" mode: autocast and a
dynamic loss scale) in both frameworks. Every few steps an outlier batch (inputs 60x
larger) drives fc2's float16 output past 65504. Each step builds a precision report of
the gradients on the device (no host sync) with the forward watched:

* at an outlier batch the report names the first module whose output went non-finite:
  fc2, the layer with the large weight (the forward watch); at the other skipped steps
  the forward was finite and only gradients overflowed while the loss scale backed off,
  and the loss-scale state names the gradient leaves that made each step skip;
* each layer's gradient headroom (log2 of float16's max over the scaled gradient's
  amax) is plotted over the steps, and its mean over the second half is printed.

Writes ``find_overflow.png`` to ``--out``.

    python examples/find_overflow.py [--quick] [--out out]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

LARGE, OUTLIER, EVERY = 4000.0, 60.0, 8
SIZES = (16, 64, 64, 64, 4)
NAMES = ("fc1", "fc2", "fc3", "head")


def batch(step: int, n: int = 32):
    """Inputs and labels of ``step`` (a random linear teacher); every EVERY-th batch,
    from the fifth step, is an outlier batch."""
    rng = np.random.default_rng(step)
    x = rng.standard_normal((n, SIZES[0])).astype(np.float32)
    teacher = np.random.default_rng(0).standard_normal((SIZES[0], SIZES[-1]))
    y = np.argmax(x @ teacher, axis=1)
    if step % EVERY == 5:
        x *= OUTLIER
    return x, y


def run_torch(steps: int) -> dict:
    import torch

    import mpfunc_torch

    torch.manual_seed(0)
    layers = [torch.nn.Linear(a, b) for a, b in zip(SIZES[:-1], SIZES[1:])]
    net = torch.nn.Sequential()
    for name, layer in zip(NAMES, layers):
        net.add_module(name, layer)
        if name != "head":
            net.add_module(name + "_act", torch.nn.ReLU())
    with torch.no_grad():
        net.fc2.weight.mul_(LARGE)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    model, opt, crit = mpfunc_torch.convert_to_amp(net, opt, torch.nn.CrossEntropyLoss(),
                                                   mode="torch")
    mpfunc_torch.watch_nonfinite(model)
    reports, events = [], []
    for step in range(steps):
        x, y = (torch.from_numpy(a) for a in batch(step))
        opt.zero_grad()
        opt.backward(crit(model(x), y))
        reports.append(opt.precision_report())  # on the device; read after training
        opt.step()
        m = opt.scale_metrics(as_python=True, skip_leaves=True)  # a log line: one read
        events.append(None if m["last_finite"] else m["skip_leaves"])
    return summarize("torch", reports, events)


def run_jax(steps: int) -> dict:
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax

    import mpfunc

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            for name, width in zip(NAMES[:-1], SIZES[1:-1]):
                x = nn.relu(nn.Dense(width, name=name)(x))
            return nn.Dense(SIZES[-1], name="head")(x)

    model = Net()
    params = model.init(jax.random.key(0), jnp.ones((1, SIZES[0])))["params"]
    params["fc2"]["kernel"] = params["fc2"]["kernel"] * LARGE

    def apply(params, x):
        with mpfunc.watch_nonfinite() as watch:  # Linen calls, through flax's interceptor
            logits = model.apply({"params": params}, x)
        return logits, watch.flags

    # record_skip_leaves: the state keeps which leaves made the last step skip.
    amp = mpfunc.convert_to_amp(apply, optax.adam(1e-3), mode="torch", record_skip_leaves=True)
    state = amp.optimizer.init(params)

    def loss_fn(params, x, y):
        logits, flags = amp.apply_fn(params, x)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return loss, flags

    @jax.jit
    def train_step(params, state, x, y):
        out = mpfunc.value_and_grad(loss_fn, has_aux=True)(state, params, x, y)
        report = mpfunc.precision_report(out.grads, loss_scale=state, forward=out.value[1])
        updates, state = amp.optimizer.update(out, state, params)
        return optax.apply_updates(params, updates), state, report

    reports, events = [], []
    for step in range(steps):
        x, y = batch(step)
        params, state, report = train_step(params, state, jnp.asarray(x), jnp.asarray(y))
        reports.append(report)
        m = mpfunc.scale_metrics(state, skip_leaves=params)  # a log line: one read
        events.append(None if bool(m["last_finite"]) else m["skip_leaves"])
    return summarize("jax", reports, events)


def summarize(framework: str, reports: list, events: list) -> dict:
    """Prints the skipped steps and returns each weight's headroom per step."""
    headroom: dict[str, list] = {}
    firsts = []
    for step, (report, skip) in enumerate(zip(reports, events)):
        rows = report.rows()
        for r in rows:
            if "weight" in r["name"] or "kernel" in r["name"]:
                headroom.setdefault(r["name"], []).append(
                    np.nan if r["nonfinite"] else r["headroom_bits"])
        if skip is not None:
            first = report.first_nonfinite_module
            firsts.append(first)
            bad = sum(r["nonfinite"] for r in rows)
            print(f"{framework} step {step:3d}: skipped; first non-finite module in the "
                  f"forward: {first}; non-finite gradients: {bad} of {len(rows)}; "
                  f"skip_leaves: {skip[:2]}{' ...' if len(skip) > 2 else ''}")
    outliers = [s for s in range(len(reports)) if s % EVERY == 5]
    skipped = [s for s, e in enumerate(events) if e is not None]
    at_outliers = all(s in skipped and reports[s].first_nonfinite_module == "fc2"
                      for s in outliers)
    elsewhere = all(reports[s].first_nonfinite_module is None
                    for s in skipped if s not in outliers)
    print(f"{framework}: {len(skipped)} skipped steps; at every outlier batch (steps "
          f"{', '.join(map(str, outliers))}) the forward watch names fc2 as the first "
          f"non-finite module: {at_outliers}; at the {len(skipped) - len(outliers)} other "
          f"skips the forward was finite (only gradients overflowed): {elsewhere}")
    late = {k: np.nanmean(v[len(v) // 2:]) for k, v in headroom.items()}
    print(f"{framework}: mean headroom in bits over the second half, least first: "
          + ", ".join(f"{k} {v:.1f}" for k, v in sorted(late.items(), key=lambda kv: kv[1])))
    if outliers:
        print("\n".join(str(reports[outliers[0]]).splitlines()[:4]))
    return headroom


def plot(results: dict, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for ax, (framework, headroom) in zip(axes[0], results.items()):
        for name, values in sorted(headroom.items()):
            ax.plot(values, label=name)
        ax.set_title(f"{framework}: gradient headroom per layer (float16)")
        ax.set_xlabel("step (gaps: non-finite)")
        ax.set_ylabel("log2(65504 / scaled amax)")
        ax.axhline(0, color="k", lw=0.5)
        ax.legend(fontsize=7)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "find_overflow.png"
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="24 steps instead of 120")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--out", default="out", help="folder for the PNG")
    args = ap.parse_args(argv)
    steps = args.steps or (24 if args.quick else 120)
    results = {"torch": run_torch(steps), "jax": run_jax(steps)}
    print(f"plot: {plot(results, Path(args.out))}")


if __name__ == "__main__":
    main()
