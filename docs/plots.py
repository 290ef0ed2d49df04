"""Draws the benchmark plots the docs show, from the numbers recorded in BENCHMARKS.md.

The plots are figures of the tables, not new measurements: each bar is read from the
markdown table it illustrates (the section is named on the plot), so the page and its
plot cannot disagree.

    python docs/plots.py            # writes docs/bench-step-peak.png
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def table_after(text: str, heading: str, header_start: str) -> list[dict[str, str]]:
    """The rows of the first table whose header starts with ``header_start`` after the
    heading ``heading``, as dicts (bold markers dropped)."""
    after = text[text.index(heading):]
    lines = after.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(header_start))
    cols = [c.strip() for c in lines[start].strip("|").split("|")]
    rows = []
    for ln in lines[start + 2:]:
        if not ln.startswith("|"):
            break
        cells = [re.sub(r"\*\*", "", c).strip() for c in ln.strip("|").split("|")]
        rows.append(dict(zip(cols, cells, strict=True)))
    return rows


def step_peak_rows(text: str) -> list[tuple[str, float]]:
    rows = table_after(text, "### 7b.", "| variant | step peak (bytes/param)")
    return [(r["variant"], float(r["step peak (bytes/param)"])) for r in rows]


def plot_step_peak(text: str, path: Path) -> list[tuple[str, float]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = step_peak_rows(text)
    fig, ax = plt.subplots(figsize=(8, 3.6))
    names = [n for n, _ in rows][::-1]
    values = [v for _, v in rows][::-1]
    colours = ["#888888" if not n.startswith("mpfunc") else "#1f77b4" for n in names]
    ax.barh(names, values, color=colours)
    for y, v in enumerate(values):
        ax.text(v + 0.1, y, f"{v:.2f}", va="center", fontsize=8)
    ax.axvline(18, color="#d62728", lw=0.8, ls="--")
    ax.text(18.05, len(names) - 0.6, "Megatron's 18", color="#d62728", fontsize=8)
    ax.set(xlabel="optimizer-step peak memory (bytes per parameter)", xlim=(0, 22),
           title="torch, Adam, 10.5M-param MLP, CPU allocator (BENCHMARKS.md section 7b)")
    ax.title.set_fontsize(10)
    ax.tick_params(labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return rows


def main(argv=None) -> int:
    text = (ROOT / "BENCHMARKS.md").read_text()
    rows = plot_step_peak(text, ROOT / "docs" / "bench-step-peak.png")
    print(f"docs/bench-step-peak.png: {len(rows)} bars from BENCHMARKS.md section 7b")
    return 0


if __name__ == "__main__":
    sys.exit(main())
