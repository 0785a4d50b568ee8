"""PNG plots of ``ds-seqpar report``: loss curves, tokens/s per step, and a resource panel (peak
memory, attention bytes and seconds per step). One colour per run in every figure."""
from __future__ import annotations

import os
from typing import Any, Dict, List, Tuple

from .plotting import colors, pyplot, save

STYLES = ("-", "--", ":", "-.")       # runs with identical losses must stay visible on top of each other


def _integer_steps(ax) -> None:
    from matplotlib.ticker import MaxNLocator
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def plot_loss(runs, labels, path: str) -> str:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 5))
    for i, (run, label, color) in enumerate(zip(runs, labels, colors(len(runs)))):
        ax.plot([s["step"] for s in run["steps"]], [s["loss"] for s in run["steps"]], marker=".", color=color,
                ls=STYLES[i % len(STYLES)], lw=1.5 + 0.8 * (len(runs) - 1 - i), label=label)
    _integer_steps(ax)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss (mean over replicas)")
    ax.set_title("Loss curves (same data, seed and global batch: the curves coincide)")
    ax.legend(fontsize=9)
    return save(fig, path)


def plot_tokens(runs, labels, path: str, skip: int) -> str:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 5))
    for run, label, color in zip(runs, labels, colors(len(runs))):
        steps = run["steps"][skip:] or run["steps"]
        ax.plot([s["step"] for s in steps], [s["tokens_per_s"] for s in steps], marker="o", color=color, label=label)
    ax.set_ylim(bottom=0)
    _integer_steps(ax)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("tokens / s (whole job)")
    ax.set_title(f"Throughput per step (first {skip} step(s) of each run left out)")
    ax.legend(fontsize=9)
    return save(fig, path)


def plot_resources(rows: List[Dict[str, Any]], labels, path: str) -> str:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.8))
    palette = colors(len(rows))
    panels = [("peak_mem_mb", "peak memory per rank (MB)", "{:.0f}"),
              ("comm_mib", "attention comm per step (MiB, busiest rank)", "{:.1f}"),
              ("comm_s", "attention comm wait per step (s, slowest rank)", "{:.3f}")]
    for ax, (key, title, fmt) in zip(axes, panels):
        values = [r[key] for r in rows]
        ax.bar(range(len(rows)), values, color=palette)
        for i, v in enumerate(values):
            ax.text(i, v, fmt.format(v), ha="center", va="bottom", fontsize=9)
        ax.set_xticks(range(len(rows)), labels, rotation=25, ha="right", fontsize=9)
        ax.set_title(title, fontsize=11)
    return save(fig, path)


def write_plots(runs, rows, labels, folder: str, skip: int) -> List[Tuple[str, str]]:
    """[(title, path)] of the PNGs written into ``folder``."""
    os.makedirs(folder, exist_ok=True)
    return [("loss curves", plot_loss(runs, labels, os.path.join(folder, "loss.png"))),
            ("tokens per second", plot_tokens(runs, labels, os.path.join(folder, "tokens_per_s.png"), skip)),
            ("memory and communication", plot_resources(rows, labels, os.path.join(folder, "resources.png")))]


__all__ = ["write_plots"]
