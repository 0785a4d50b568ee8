"""The cost of the attention kernel calls a rank makes, for ``--calibrate``: a per-call overhead plus
a cost per computed pair, fitted to kernel calls timed on this machine.

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

KEY_TILE = 512        # keys per tile of torch's CPU flash kernel (kernels/torch_kernel.py's causal_tile note)


def computed_pairs(nq: int, nk: int, masked: bool) -> float:
    """Pairs the kernel computes for one block: every pair of a full block; a masked square's visible
    pairs plus the masked parts of its diagonal tiles (never more than the full block)."""
    if not masked:
        return float(nq * nk)
    s = min(nq, nk)
    return float(min(nq * nk, s * (s + 1) / 2 + (nq - s) * nk + s * min(KEY_TILE, s) / 2))


def fit_call_cost(points: Sequence[Tuple[float, float]]) -> Dict[str, float]:
    """Least squares t = c_call + t_pair x pairs over (pairs, seconds) points, in relative error (each
    equation divided by its t: the small blocks, which carry c_call, count as much as the big ones);
    c_call clipped at 0."""
    rows = [(1.0 / t, p / t) for p, t in points]             # c_call / t + t_pair p / t = 1
    s00 = sum(a * a for a, _ in rows)
    s01 = sum(a * b for a, b in rows)
    s11 = sum(b * b for _, b in rows)
    t0, t1 = sum(a for a, _ in rows), sum(b for _, b in rows)
    det = s00 * s11 - s01 * s01
    c_call, slope = (t0 * s11 - t1 * s01) / det, (s00 * t1 - s01 * t0) / det
    if c_call < 0:
        c_call, slope = 0.0, t1 / s11
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


def rank_calls(strategy: str, p: int, seq: int, causal: bool = True) -> List[List[Tuple[int, int, bool]]]:
    """Per rank, the (queries, keys, masked) of every kernel call of one attention fwd + bwd (the
    strategy's blocks; Ulysses: one call over the whole sequence, counted at H / P heads by the caller)."""
    if strategy == "ulysses" or p == 1:
        return [[(seq, seq, causal)] for _ in range(p)]
    from ..strategies import STRATEGIES
    n, out = seq // p, []
    for me in range(p):
        calls = []
        for src in range(p):
            for b in STRATEGIES[strategy].blocks(me, src, p, causal, n):
                q0, q1, _ = b.q.indices(n)
                k0, k1, _ = b.k.indices(n)
                calls.append((q1 - q0, k1 - k0, bool(b.causal or b.anti)))
        out.append(calls)
    return out


def window_calls(strategy: str, p: int, seq: int, window: int) -> List[List[Tuple[int, int, bool, bool]]]:
    """Per rank, (queries, keys, causal, anti) of every sub-block the masked policy gives a causal
    sliding window on CPU: strategies/varlen.py with the torch kernel's causal_tile and band_column
    (what the ring loop runs, and what ``ds-seqpar bench --window`` times). Ulysses: one position holding
    the whole sequence (its H / P heads counted by the caller)."""
    from ..kernels import get_kernel
    from ..sharding.layouts import make_layout
    from ..strategies import get_strategy
    from ..strategies.varlen import document_blocks, one_document, whole_sequence_blocks
    kernel = get_kernel("torch", "cpu")
    tile = lambda size: kernel.causal_tile(size, "cpu")  # noqa: E731
    column = lambda width: kernel.band_column(width, "cpu")  # noqa: E731
    docs = one_document(seq, None)
    if strategy == "ulysses" or p == 1:
        policy, positions, n = whole_sequence_blocks(docs, True, tile, window, column), 1, seq
    else:
        layout = make_layout(get_strategy(strategy).layout_name, p)
        policy, positions, n = document_blocks(docs, layout, True, tile, window, column), p, seq // p
    out = []
    for me in range(positions):
        subs = [b for src in range(positions) for b in policy(me, src, positions, True, n)]
        out.append([(b.q.stop - b.q.start, b.k.stop - b.k.start, bool(b.causal), bool(b.anti)) for b in subs])
    return out * p if positions == 1 else out


def call_s(cost: Dict[str, float], nq: int, nk: int, causal: bool, anti: bool, heads: float) -> float:
    """One sub-block's seconds: c_call + t_pair x computed pairs x heads, times the measured factor of
    a tall causal block or an anti square (1 when the cost has none)."""
    factor = cost.get("anti_factor", 1.0) if anti else cost.get("tall_factor", 1.0) if causal and nq > nk else 1.0
    return factor * (cost["c_call_s"] + cost["t_pair_s"] * computed_pairs(nq, nk, causal or anti) * heads)


def busiest_kernel_s(strategy: str, p: int, seq: int, heads: int, cost: Dict[str, float], causal: bool = True) -> float:
    """Seconds of kernel work of the busiest rank: its calls at c_call each plus t_pair per computed
    pair (per head; Ulysses' rank holds H / P heads)."""
    h = heads / p if strategy == "ulysses" else heads
    return max(sum(cost["c_call_s"] + cost["t_pair_s"] * computed_pairs(nq, nk, m) * h for nq, nk, m in calls)
               for calls in rank_calls(strategy, p, seq, causal))


__all__ = ["BLOCKS", "KEY_TILE", "WINDOW_BLOCKS", "busiest_kernel_s", "call_s", "computed_pairs", "fit_call_cost",
           "measure_blocks", "rank_calls", "window_calls"]
