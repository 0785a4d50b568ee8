"""PNG plots of ``ds-seqpar bench memory`` (from the results dict memory.py saves as JSON): bytes per
token per rank and the peak per rank over tokens per rank, measured points and the phase model's lines."""
from __future__ import annotations

import os
from typing import Any, Dict, List

from ..report.plotting import colors, pyplot, save
from .memory_summary import KIB, MIB
from .predict import predict_peak


def _label(v: Dict[str, Any]) -> str:
    return f"{v['model']} P={v['world']} {'with' if v['features'] else 'without'}"


def plot_bytes_per_token(res, path: str) -> str:
    """Bytes per token per rank above static vs tokens per rank: measured points, the phase model's
    curve out to the budget, with and without the features; the floor drawn."""
    plt = pyplot()
    floor = res["meta"]["layers"] * res["meta"]["hidden"] * 4
    models = sorted({v["model"] for v in res["variants"].values()})
    fig, axes = plt.subplots(1, len(models), figsize=(7 * len(models), 5.5), squeeze=False)
    by_world = dict(zip((1, 2, 4, 8), colors(4)))
    for ax, model in zip(axes[0], models):
        for v in (v for v in res["variants"].values() if v["model"] == model):
            c, style = by_world.get(v["world"], "k"), "-" if v["features"] else "--"
            static = v["rows"][0]["resident_bytes"]
            xs = [r["tokens_per_rank"] for r in v["rows"]]
            ax.plot(xs, [r["above_static_per_token"] / KIB for r in v["rows"]], "o", color=c)
            top = max(v["max_tokens_per_rank"], max(xs)) if v["max_tokens_per_rank"] > 0 else max(xs)
            grid = [min(xs) * (top / min(xs)) ** (i / 60) for i in range(61)]
            ax.plot(grid, [(predict_peak(v["phase_model"], n) - static) / n / KIB for n in grid], style, color=c,
                    label=f"P={v['world']} {'with' if v['features'] else 'without'} features")
        ax.axhline(floor / KIB, color="k", lw=1.5, ls=":", label=f"floor layers x hidden x 4 B = {floor / KIB:g} KiB")
        ax.axhline(3 * floor / KIB, color="grey", lw=1, ls=":", label="3 x floor")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens per rank")
        ax.set_ylabel("KiB per token per rank above static")
        ax.set_title(f"{model}: points measured, lines = phase model up to the budget")
        ax.legend(fontsize=9)
    return save(fig, path)


def plot_peak(res, path: str) -> str:
    plt = pyplot()
    budget = res["meta"]["budget_bytes"]
    fig, ax = plt.subplots(figsize=(10, 5.5))
    palette = colors(len(res["variants"]))
    for i, v in enumerate(res["variants"].values()):
        xs = [r["tokens_per_rank"] for r in v["rows"]]
        top = max(xs + [max(0, v["max_tokens_per_rank"])])
        grid = [min(xs) * (top / min(xs)) ** (j / 60) for j in range(61)]
        ax.plot(xs, [r["peak_bytes"] / MIB for r in v["rows"]], "o", color=palette[i])
        ax.plot(grid, [predict_peak(v["phase_model"], n) / MIB for n in grid], "-" if v["features"] else "--",
                color=palette[i], label=_label(v))
    ax.axhline(budget / MIB, color="k", ls=":", label=f"budget {budget / 2 ** 30:.2f} GiB")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per rank")
    ax.set_ylabel("peak MiB per rank (whole step)")
    ax.set_title("Peak memory per rank: measured points, phase model lines")
    ax.legend(fontsize=8, ncol=2)
    return save(fig, path)


def write_plots(res: Dict[str, Any], out: str) -> List[str]:
    plot_dir = os.path.join(out, res["meta"]["name"])
    os.makedirs(plot_dir, exist_ok=True)
    if not res["variants"]:
        return []
    return [plot_bytes_per_token(res, os.path.join(plot_dir, "bytes_per_token.png")),
            plot_peak(res, os.path.join(plot_dir, "peak_per_rank.png"))]


__all__ = ["write_plots"]
