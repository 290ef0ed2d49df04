"""The reports of `compare_modes.py`: the table, the parity check, the plot, the JSON."""

from __future__ import annotations

import numpy as np

# A speed whose per-round ratios to fp32 spread wider than this (max - min over the
# median) is flagged: the machine was too busy for that row's figure to mean much.
UNRELIABLE_SPREAD = 0.5


def speed_ratio(rates, base_rates):
    """Median and min-max of the per-round ratios (both runs timed in the same round)."""
    ratios = np.asarray(rates) / np.asarray(base_rates)
    median = float(np.median(ratios))
    return median, float(ratios.min()), float(ratios.max())


def is_unreliable(median, lo, hi):
    return (hi - lo) > UNRELIABLE_SPREAD * median


def _speed_cell(r, base):
    if not base:
        return "-"
    median, lo, hi = speed_ratio(r["rates"], base["rates"])
    cell = f"{median:.2f}x ({lo:.2f}-{hi:.2f})"
    return cell + " unreliable" if is_unreliable(median, lo, hi) else cell


def table(results, cfg):
    """The main table. Speeds are medians over the interleaved timing rounds; each speed
    ratio is the median of the per-round ratios, with its min-max over the rounds in
    brackets, and "unreliable" where that spread is wider than half the median. With a
    TF32 run (on a GPU) there is a second ratio column, against it."""
    base = {r["framework"]: r for r in results if r["mode"] == "fp32"}
    tf32 = {r["framework"]: r for r in results if r["mode"] == "tf32"}
    kind = results[0]["mem_kind"]
    head = (f"| framework | mode | {'peak' if kind == 'peak' else 'state after a step'} MiB "
            "| steps/s | samples/s | train loss | eval loss | skipped | loss scale "
            "| speed vs strict fp32 (min-max) |")
    if tf32:
        head += " speed vs TF32 (min-max) |"
    head += " memory vs fp32 |"
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for r in results:
        b = base.get(r["framework"])
        steps_s = float(np.median(r["rates"]))
        memr = f"{r['mem'] / b['mem']:.2f}x" if b else "-"
        row = (f"| {r['framework']} | {r['mode']} | {r['mem'] / 2**20:.1f} | {steps_s:.1f} "
               f"| {steps_s * cfg.batch:.0f} | {np.mean(r['losses'][-10:]):.4f} "
               f"| {r['eval']:.4f} | {r['skipped']} | {r['scale']:g} | {_speed_cell(r, b)} |")
        if tf32:
            row += f" {_speed_cell(r, tf32.get(r['framework']))} |"
        lines.append(row + f" {memr} |")
    return "\n".join(lines)


def compile_summary(results):
    """One line per JAX run: how often its train and eval steps compiled, and how long
    the train step's compile took, cold / warm (from the persistent cache)."""
    from _jax_compiles import compile_cell  # benchmarks/, on the path with jax

    rows = [r for r in results if r["framework"] == "jax"]
    return "\n".join(
        f"  jax {r['mode']}: train step compiled {r['compiles']['step']}x "
        f"({compile_cell(r['compile'])}), eval {r['compiles']['eval']}x" for r in rows)


def parity_rows(results):
    by = {(r["framework"], r["mode"]): r for r in results}
    out = []
    for mode in dict.fromkeys(r["mode"] for r in results):
        j, t = by.get(("jax", mode)), by.get(("torch", mode))
        if not (j and t):
            continue
        skip_j = np.flatnonzero(np.diff(np.concatenate([[0], j["scales"]])) < 0)
        skip_t = np.flatnonzero(np.diff(np.concatenate([[0], t["scales"]])) < 0)
        out.append({
            "mode": mode,
            "same_scales": bool(np.array_equal(j["scales"].view(np.uint32),
                                               t["scales"].view(np.uint32))),
            "same_skips": bool(np.array_equal(skip_j, skip_t)),
            "max_rel_loss_diff": float(np.max(np.abs(j["losses"] - t["losses"])
                                              / np.abs(t["losses"]))),
        })
    return out


def parity(results):
    lines = ["| mode | same loss-scale trajectory | same skipped steps | max rel. loss diff |",
             "| --- | --- | --- | --- |"]
    for p in parity_rows(results):
        lines.append(f"| {p['mode']} | {'yes' if p['same_scales'] else 'NO'} | "
                     f"{'yes' if p['same_skips'] else 'NO'} | {p['max_rel_loss_diff']:.2e} |")
    return "\n".join(lines)


def _groups(results, key, rel=0.0):
    """Runs whose ``key`` curves coincide (to ``rel`` of the curves' range: a line width
    on the plot), as ``(curve, runs)`` pairs, first seen first."""
    groups: list[tuple[np.ndarray, list]] = []
    span = max((np.ptp(np.asarray(r[key])) for r in results), default=0.0) or 1.0
    for r in results:
        curve = np.asarray(r[key])
        for ref, runs in groups:
            if ref.shape == curve.shape and np.max(np.abs(ref - curve)) <= rel * span:
                runs.append(r)
                break
        else:
            groups.append((curve, [r]))
    return groups


def _label(runs, suffix=""):
    """'jax & torch: fp32, torch' for modes run in both, then each framework's own."""
    import textwrap

    by_fw: dict[str, list] = {}
    for r in runs:
        by_fw.setdefault(r["framework"], []).append(r["mode"])
    both = [m for m in by_fw.get("jax", []) if m in by_fw.get("torch", [])]
    parts = [f"jax & torch: {', '.join(both)}"] if both else []
    for fw, modes in by_fw.items():
        if own := [m for m in modes if m not in both]:
            parts.append(f"{fw}: {', '.join(own)}")
    return "\n".join(textwrap.wrap("; ".join(parts) + suffix, 48))


def plot(results, path):
    """Loss curves and loss-scale trajectories. Runs whose curves coincide draw one line,
    labelled with every run it stands for, so no legend entry hides under another."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5))
    cmap = plt.get_cmap("tab10")
    for i, (curve, runs) in enumerate(_groups(results, "losses", rel=0.005)):
        a.plot(curve, lw=1, color=cmap(i % 10), label=_label(runs))
    scaled = [r for r in results if r["mode"] not in ("fp32", "tf32")]
    for i, (curve, runs) in enumerate(_groups(scaled, "scales")):
        b.plot(curve, lw=1.2, color=cmap(i % 10), label=_label(runs, f" (ends at {curve[-1]:g})"))
    a.set(title="training loss (curves within a line width share one)", xlabel="step",
          ylabel="cross-entropy (nats)")
    b.set(title="loss scale (skipped steps back it off)", xlabel="step",
          ylabel="loss scale (log scale)", yscale="log")
    a.legend(fontsize=7)
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def to_json(results, cfg, extra):
    """Every figure of the run, for benchmarks/gpu.sh and BENCHMARKS.md."""
    base = {r["framework"]: r for r in results if r["mode"] == "fp32"}
    tf32 = {r["framework"]: r for r in results if r["mode"] == "tf32"}
    rows = []
    for r in results:
        row = {k: r[k] for k in ("framework", "mode", "mem", "mem_kind", "eval", "skipped",
                                 "scale")}
        row.update(steps_s=float(np.median(r["rates"])), rates=[float(x) for x in r["rates"]],
                   final_train_loss=float(np.mean(r["losses"][-10:])))
        for name, ref in (("vs_fp32", base), ("vs_tf32", tf32)):
            if ref.get(r["framework"]):
                m, lo, hi = speed_ratio(r["rates"], ref[r["framework"]]["rates"])
                row[f"speed_{name}"] = {"median": m, "min": lo, "max": hi,
                                        "unreliable": is_unreliable(m, lo, hi)}
        if r["framework"] == "jax":
            row.update(compiles=r["compiles"], compile_s=r["compile_s"],
                       compile_cold_s=r["compile"]["cold_s"],
                       compile_warm_s=r["compile"]["warm_s"], compile=r["compile"],
                       eval_compile_s=r["eval_compile_s"])
        rows.append(row)
    return {"config": {k: v for k, v in vars(cfg).items() if not k.startswith("_")},
            "rows": rows, "parity": parity_rows(results), **extra}
