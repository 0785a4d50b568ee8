"""What every PNG of ``ds-seqpar bench`` and ``ds-seqpar report`` shares: matplotlib loaded headless
(or a clear error naming the extra to install), one palette, one way to save, plain log axes.

matplotlib is imported only when a plot is drawn, so the commands' --help and the measuring code
never need it; the commands call ``require_matplotlib`` before measuring, so a missing library does
not cost a whole run's results.
"""
from __future__ import annotations

from typing import Any, List, Sequence, Type

MIB = 2 ** 20
DPI = 110


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


def log2_x(ax, xs: Sequence[int]) -> None:
    """A log2 x axis ticked at exactly these values, written as plain numbers (sequence lengths)."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(xs), [str(x) for x in xs])


def plain_log_y(ax) -> None:
    """A log y axis labelled 1, 2, 5, 10, 20, ... as plain numbers rather than powers of ten."""
    from matplotlib.ticker import FuncFormatter, LogLocator
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda y, _: ""))


__all__ = ["MIB", "require_matplotlib", "pyplot", "colors", "save", "log2_x", "plain_log_y"]
