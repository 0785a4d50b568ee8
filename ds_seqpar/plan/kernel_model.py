"""``--calibrate``'s timed kernel calls: the per-call overhead and the cost per computed pair that
cost/times.py prices a rank's calls with (``call_s``, ``rank_calls``, ``window_calls``), fitted to
kernel calls timed on this machine.

    t(call) = c_call + t_pair x computed pairs (fwd + bwd, per head)

Computed, not visible: the CPU flash kernel skips masked work only in whole key tiles (KEY_TILE
keys), so a causal (or anti-causal) square of s tokens computes its s (s + 1) / 2 visible pairs plus
the masked half of the tiles on its diagonal, about s x KEY_TILE / 2 pairs more. That is why a
rank made of causal squares (striped: both of its blocks at P = 2) is slower per visible pair than
one made of rectangles (zigzag: a causal square and a full rectangle), and the per-call term is why
many small blocks (short sequences, windows cut into tiles) fall short of the FLOP bound.

The blocks of a rank are the strategies' own (``STRATEGIES[name].blocks``, the ring loop's plan);
Ulysses runs one causal call over the whole sequence with H / P heads. With a sliding window they are
the masked policy's sub-blocks (strategies/varlen.py with the CPU kernel's causal_tile and band_column,
what the ring loop runs): per 128 keys one tall top-left causal block and one 128 x 128 anti square.
Those two shapes are timed too (WINDOW_BLOCKS): a tall block costs a few percent more per computed
pair than the line through the square blocks, an anti square more still (kernels run it on reversed
copies), so each gets its measured factor over the line (``tall_factor``, ``anti_factor``).
"""
from __future__ import annotations

import time
from typing import Dict, List, Sequence, Tuple

from .cost.pairs import computed_pairs


def lstsq2(xs: Sequence[Sequence[float]], ys: Sequence[float]) -> List[float]:
    """Least squares y = a x0 + b x1 (no intercept), by the 2 x 2 normal equations."""
    s00 = sum(x[0] * x[0] for x in xs)
    s01 = sum(x[0] * x[1] for x in xs)
    s11 = sum(x[1] * x[1] for x in xs)
    t0 = sum(x[0] * y for x, y in zip(xs, ys))
    t1 = sum(x[1] * y for x, y in zip(xs, ys))
    det = s00 * s11 - s01 * s01
    return [(t0 * s11 - t1 * s01) / det, (s00 * t1 - s01 * t0) / det]


def fit_call_cost(points: Sequence[Tuple[float, float]]) -> Dict[str, float]:
    """Least squares t = c_call + t_pair x pairs over (pairs, seconds) points, in relative error (each
    equation divided by its t: the small blocks, which carry c_call, count as much as the big ones);
    c_call clipped at 0."""
    rows = [(1.0 / t, p / t) for p, t in points]             # c_call / t + t_pair p / t = 1
    c_call, slope = lstsq2(rows, [1.0] * len(rows))
    if c_call < 0:
        c_call, slope = 0.0, sum(b for _, b in rows) / sum(b * b for _, b in rows)
    xs, ys = [p for p, _ in points], [t for _, t in points]
    return {"c_call_s": c_call, "t_pair_s": slope,
            "max_rel_residual": max(abs(c_call + slope * x - y) / y for x, y in zip(xs, ys))}


BLOCKS = ((256, 256, False), (1024, 1024, False), (2048, 1024, False), (512, 512, True), (2048, 2048, True),
          (128, 128, True))


def measure_blocks(heads: int = 8, head_dim: int = 64, repeats: int = 3) -> Dict[str, object]:
    """One thread, fp32: forward + backward of the project's CPU kernel (kernels.get_kernel("torch",
    "cpu"), what the ring loop calls) on full and causal blocks; the fastest of ``repeats`` after a
    warm-up (on a shared machine the slower ones measure the neighbours). Returns the points and their fit."""
    import torch
    from ..kernels import get_kernel
    kernel, scale = get_kernel("torch", "cpu"), head_dim ** -0.5
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    points: List[Tuple[float, float]]
    try:
        points = [(computed_pairs(nq, nk, masked) * heads,
                   _time_block(kernel, scale, nq, nk, heads, head_dim, masked, False, repeats))
                  for nq, nk, masked in BLOCKS]
        window_points = [(nq, nk, kind, _time_block(kernel, scale, nq, nk, heads, head_dim, kind == "tall",
                                                    kind == "anti", repeats))
                         for nq, nk, kind in WINDOW_BLOCKS]
    finally:
        torch.set_num_threads(threads)
    fit = fit_call_cost(points)
    line = lambda nq, nk: fit["c_call_s"] + fit["t_pair_s"] * computed_pairs(nq, nk, True) * heads  # noqa: E731
    factors = {kind: sum(t for _, _, k, t in window_points if k == kind)
               / sum(line(nq, nk) for nq, nk, k, _ in window_points if k == kind) for kind in ("tall", "anti")}
    return dict(fit, points=points, heads=heads, head_dim=head_dim, window_points=window_points,
                tall_factor=factors["tall"], anti_factor=factors["anti"])


# a window's pieces at w = 1024 and 2048 (band_column 128): tall causal blocks of about w + 128 rows
# over 128 keys, and the 128 x 128 anti squares of the far edge
WINDOW_BLOCKS = ((1152, 128, "tall"), (2176, 128, "tall"), (128, 128, "anti"))


def _time_block(kernel, scale, nq, nk, heads, head_dim, causal, anti, repeats) -> float:
    """The fastest of ``repeats`` fwd+bwd of one block (after one untimed)."""
    import torch
    q, dout = torch.randn(1, nq, heads, head_dim), torch.randn(1, nq, heads, head_dim)
    k, v = torch.randn(1, nk, heads, head_dim), torch.randn(1, nk, heads, head_dim)
    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        out, lse = kernel.forward_block(q, k, v, causal, anti, scale)
        kernel.backward_block(dout, q, k, v, out, lse, causal, anti, scale)
        if i:
            times.append(time.perf_counter() - t0)
    return min(times)


__all__ = ["BLOCKS", "WINDOW_BLOCKS", "fit_call_cost", "lstsq2", "measure_blocks"]
