"""Pure arithmetic of ``ds-seqpar bench memory``: from measured peaks to bytes per token, the phase
model of a step's peak, the longest sequence in a budget, the per-strategy comparison and the
recompute's implied step time (memory_rows.py holds them against the goals).

A step's peak is the largest of its phases' peaks (forward, loss backward, layers backward, end of
backward, optimizer step). Each phase's peak is affine in the tokens per rank N: a fixed part
(weights, gradient buffers, optimizer state, runtime, and fixed-size buffers such as one chunk of
logits) plus bytes per token times N. Fitting every phase over the measured lengths gives

    peak(N) = max_phase (a_phase + b_phase * N)

whose largest slope is the step's bytes per token per rank at long sequence (the asymptote the
shorter measurements approach), and whose inverse at a budget is the longest sequence that fits.
"""
from __future__ import annotations

from typing import Any, Dict, List

KIB, MIB, GIB = 1024, 2 ** 20, 2 ** 30


def key(model: str, world: int, features: bool) -> str:
    return f"{model}/P{world}/{'on' if features else 'off'}"


def fit_line(xs: List[float], ys: List[float]) -> Dict[str, float]:
    """Least-squares y = a + b x (b = 0 with one point), and the largest residual."""
    n = len(xs)
    if n == 1:
        return {"a": ys[0], "b": 0.0, "max_residual": 0.0}
    mx, my = sum(xs) / n, sum(ys) / n
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    a = my - b * mx
    return {"a": a, "b": b, "max_residual": max(abs(a + b * x - y) for x, y in zip(xs, ys))}


def phase_model(points: List[Dict[str, Any]]) -> Dict[str, Dict[str, float]]:
    """phase -> fitted line of its peak (bytes) against tokens per rank."""
    phases = points[0]["phase_peak_bytes"]
    return {p: fit_line([pt["tokens_per_rank"] for pt in points], [pt["phase_peak_bytes"][p] for pt in points])
            for p in phases}


def predict_peak(model: Dict[str, Dict[str, float]], n: float) -> float:
    return max(line["a"] + line["b"] * n for line in model.values())


def max_tokens(model: Dict[str, Dict[str, float]], budget: float) -> int:
    """The most tokens per rank whose predicted step peak stays within ``budget`` bytes."""
    limit = float("inf")
    for line in model.values():
        if line["b"] <= 0:
            if line["a"] > budget:
                return 0
            continue
        limit = min(limit, (budget - line["a"]) / line["b"])
    return max(0, int(limit)) if limit != float("inf") else -1


def summarize_variant(points: List[Dict[str, Any]], floor: int, budget: float, world: int) -> Dict[str, Any]:
    """Rows per measured length plus the phase model's slope, dominant phase and longest sequence."""
    points = sorted(points, key=lambda p: p["tokens_per_rank"])
    model = phase_model(points)
    dominant = max(model, key=lambda p: model[p]["b"])
    rows, prev = [], None
    for pt in points:
        n, peak = pt["tokens_per_rank"], pt["peak_bytes"]
        activation = max(v for p, v in pt["phase_peak_bytes"].items() if p != "optimizer") - pt["resident_bytes"]
        row = {"tokens_per_rank": n, "resident_bytes": pt["resident_bytes"], "peak_bytes": peak,
               "activation_bytes": activation,
               "above_static_per_token": (peak - pt["resident_bytes"]) / n,
               "peak_phase": max(pt["phase_peak_bytes"], key=pt["phase_peak_bytes"].get),
               "marginal_per_token": None if prev is None else (peak - prev[1]) / (n - prev[0]),
               "step_s": pt["step_s"][-1]}
        rows.append(row)
        prev = (n, peak)
    n_max = max_tokens(model, budget)
    return {"rows": rows, "phase_model": model, "bytes_per_token": model[dominant]["b"], "dominant_phase": dominant,
            "floor_ratio": model[dominant]["b"] / floor,
            "fit_max_residual": max(m["max_residual"] for m in model.values()),
            "max_tokens_per_rank": n_max, "max_seq_len": world * n_max if n_max >= 0 else None}


def summarize(measurements: List[Dict[str, Any]], floor: int, budget: float) -> Dict[str, Dict[str, Any]]:
    groups: Dict[str, List[Dict[str, Any]]] = {}
    for m in measurements:
        groups.setdefault(key(m["model"], m["world"], m["features"]), []).append(m)
    out = {}
    for k, pts in sorted(groups.items()):
        out[k] = summarize_variant(pts, floor, budget, pts[0]["world"])
        out[k].update(model=pts[0]["model"], world=pts[0]["world"], features=pts[0]["features"])
    return out


def strategy_rows(measurements: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The per-strategy comparison: each (strategy, P, N) with its whole step's peak above static
    (largest rank), phase by phase, over P=1's at the same tokens per rank; and per P the two-point
    figure (peak at N - peak at a short length) / (N - short), which the optimizer step's fixed
    transient distorts (it holds the short run's peak, more so at P=1 where ZeRO shards nothing)."""
    if not measurements:
        return {"rows": [], "two_point": []}
    short = min(m["tokens_per_rank"] for m in measurements)
    long_runs = [m for m in measurements if m["tokens_per_rank"] > short]
    one = {m["tokens_per_rank"]: m for m in long_runs if m["world"] == 1}
    rows = []
    for m in sorted(long_runs, key=lambda m: (m["world"], -m["tokens_per_rank"], m["strategy"])):
        base = one.get(m["tokens_per_rank"])
        above = m["phase_above_static_bytes"]
        name = m["strategy"] if m.get("ulysses_size", 1) == 1 else f"hybrid ({m['strategy']} x Ulysses {m['ulysses_size']})"
        rows.append({"strategy": name if m["world"] > 1 else "(none: P=1)", "world": m["world"],
                     "tokens_per_rank": m["tokens_per_rank"], "static_bytes": m["resident_bytes"],
                     "peak_bytes": m["peak_bytes"], "above_static_bytes": m["above_static_bytes"],
                     "phase_above_static_bytes": above, "peak_phase": max(above, key=above.get),
                     "vs_p1": m["above_static_bytes"] / base["above_static_bytes"] if base else None})
    two_point = []
    for world in sorted({m["world"] for m in measurements}):
        pts = sorted((m for m in measurements if m["world"] == world and m["strategy"] == "zigzag"
                      and m.get("ulysses_size", 1) == 1),
                     key=lambda m: m["tokens_per_rank"])
        if len(pts) >= 2 and pts[0]["tokens_per_rank"] == short:
            lo, hi = pts[0], pts[-1]
            n = hi["tokens_per_rank"]
            two_point.append({"world": world, "short_tokens": short, "tokens_per_rank": n,
                              "short_peak_bytes": lo["peak_bytes"], "peak_bytes": hi["peak_bytes"],
                              "short_peak_phase": max(lo["phase_peak_bytes"], key=lo["phase_peak_bytes"].get),
                              "per_token": (hi["peak_bytes"] - lo["peak_bytes"]) / (n - short),
                              "above_static_per_token": hi["above_static_bytes"] / n})
    return {"rows": rows, "two_point": two_point}


def step_macs_per_token(meta: Dict[str, Any], world: int, tokens_per_rank: int, features: bool) -> float:
    """Multiply-accumulates per token of one training step's matmuls, backward = 2 x forward: what
    the features' recompute implies. Plain: every matmul runs forward once, backward once. With the
    features: the fused loss runs the LM head's forward again per chunk in its backward; a
    checkpointed layer runs its forward again; its tiled MLP runs once more inside that recompute's
    backward. Causal attention over the global sequence S = P x N costs hidden x S per token (q.k and
    p.v over S/2 keys on average, whichever rank holds the token). Elementwise work is not counted."""
    h, L = meta["hidden"], meta["layers"]
    kv_dim = h // meta["heads"] * meta["kv_heads"]
    head = h * meta["vocab"]
    proj = h * (2 * h + 2 * kv_dim)                   # q, o and the k, v projections
    attn = h * world * tokens_per_rank
    mlp = 3 * h * meta["intermediate"]                # gate, up, down
    if not features:
        return 3 * (head + L * (proj + attn + mlp))
    return 4 * head + L * (4 * (proj + attn) + 5 * mlp)


def implied_ratio(meta: Dict[str, Any], world: int, tokens_per_rank: int) -> float:
    """Step time with / without the features if time followed the matmuls' multiply-accumulates."""
    return (step_macs_per_token(meta, world, tokens_per_rank, True)
            / step_macs_per_token(meta, world, tokens_per_rank, False))


def timing_rows(timing: Dict[str, Dict[str, Any]], meta: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Per (model, P): median step seconds without / with the features, their ratio per round, and
    the ratio the recompute implies (step_macs_per_token)."""
    import statistics
    rows = []
    for k, t in sorted(timing.items()):
        world = int(k.rsplit("/P", 1)[1])
        ratios = [on / off for on, off in zip(t["on_s"], t["off_s"])]
        rows.append({"case": k, "tokens_per_rank": t["tokens_per_rank"], "off_s": statistics.median(t["off_s"]),
                     "on_s": statistics.median(t["on_s"]), "ratio": statistics.median(ratios),
                     "ratio_min": min(ratios), "ratio_max": max(ratios), "rounds": len(ratios),
                     "implied": implied_ratio(meta, world, t["tokens_per_rank"])})
    return rows


__all__ = ["GIB", "KIB", "MIB", "strategy_rows", "fit_line", "implied_ratio", "key", "max_tokens", "phase_model",
           "predict_peak", "step_macs_per_token", "summarize", "timing_rows"]
