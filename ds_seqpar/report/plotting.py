"""What every PNG of ``ds-seqpar bench`` and ``ds-seqpar report`` shares: matplotlib loaded headless
(or a clear error naming the extra to install), one palette, one way to save, one line figure and one bar figure.

matplotlib is imported only when a plot is drawn, so the commands' --help and the measuring code
never need it; the commands call ``require_matplotlib`` before measuring, so a missing library does
not cost a whole run's results.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple, Type

MIB = 2 ** 20
DPI = 110
STYLES = ("-", "--", ":", "-.")


def require_matplotlib(what: str = "the plots", error: Type[Exception] = ImportError) -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise error(f"{what} need matplotlib: pip install 'ds_seqpar[bench]'") from None


def pyplot():
    """matplotlib.pyplot on the Agg backend (benchmark machines have no display), one style."""
    require_matplotlib()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    plt.rcParams.update({"font.size": 11, "axes.grid": True, "grid.alpha": 0.3})
    return plt


def colors(n: int) -> List[Any]:
    """n colours of one palette, in order: the same key gets the same colour in every figure."""
    import matplotlib
    cmap = matplotlib.colormaps["tab10"]
    return [cmap(i % 10) for i in range(n)]


def save(fig, path: str) -> str:
    import matplotlib.pyplot as plt
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def plain_log_y(ax) -> None:
    """A log y axis labelled 1, 2, 5, 10, 20, ... as plain numbers rather than powers of ten."""
    from matplotlib.ticker import FuncFormatter, LogLocator
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda y, _: ""))


def line_figure(points: Sequence[Tuple[str, float, float, Optional[Tuple[float, float]]]],
                marks: Sequence[Tuple[str, float]], path: str, ylabel: str, title: str, log_y: bool = False,
                xlabel: str = "sequence length N (tokens)", log_x: bool = True, styles: bool = False) -> str:
    """One line per label through its (x, y) points, min-max error bars where a spread is given;
    ``marks``: labelled horizontal lines (ideal, bounds, budgets). A prediction (a label ending "closed
    form" or "model") is dashed, without markers, in the colour of the label before its ":"; the x axis
    is ticked at the measured x values (log2 unless ``log_x`` is off); ``styles``: every line its own
    dash pattern, so lines that coincide stay visible (equal loss curves)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(10, 5))
    series: Dict[str, List[tuple]] = {}
    for label, x, y, spread in points:
        series.setdefault(label, []).append((x, y, spread))
    cases = list(dict.fromkeys(label.split(":")[0] for label in series))
    color = dict(zip(cases, colors(len(cases))))
    for i, (label, pts) in enumerate(series.items()):
        pts.sort(key=lambda p: p[0])
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        err = [[y - (s or (y, y))[0] for _, y, s in pts], [(s or (y, y))[1] - y for _, y, s in pts]]
        form = label.endswith(("closed form", "model"))
        ax.errorbar(xs, ys, yerr=None if form else err, marker="" if form else "o", capsize=3, label=label,
                    ls="--" if form else STYLES[i % len(STYLES)] if styles else "-", color=color[label.split(":")[0]])
    for i, (label, y) in enumerate(marks):
        ax.axhline(y, color="black" if i == 0 else "grey", ls="--" if i == 0 else ":", lw=1, label=label)
    if log_x:
        xs = sorted({p[1] for p in points if not p[0].endswith(("closed form", "model"))})
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
    if log_y:
        plain_log_y(ax)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9)
    return save(fig, path)


def bar_figure(per_rank: Dict[str, Sequence[float]], path: str, ylabel: str, title: str) -> str:
    """Grouped bars: per case one bar per rank (CPU seconds), max/mean above each group."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 5))
    cases, ranks = list(per_rank), max(len(v) for v in per_rank.values())
    width = 0.8 / ranks
    for r in range(ranks):
        ax.bar([i + (r - (ranks - 1) / 2) * width for i in range(len(cases))],
               [per_rank[c][r] if r < len(per_rank[c]) else 0.0 for c in cases], width, label=f"rank {r}")
    for i, c in enumerate(cases):
        ax.text(i, max(per_rank[c]), f"{max(per_rank[c]) / (sum(per_rank[c]) / len(per_rank[c])):.2f}", ha="center",
                va="bottom", fontsize=9)
    ax.set_xticks(range(len(cases)), cases, rotation=20)
    ax.set_ylabel(ylabel)
    ax.set_title(f"{title}; label: imbalance max/mean")
    ax.legend(fontsize=9)
    return save(fig, path)
