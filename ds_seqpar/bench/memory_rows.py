"""The memory suite's points (bench/memory.py) as rows: bytes per token, the phase model of a step's
peak (cost/memory.py's fit), the longest sequence in a budget, the per-strategy comparison and the
recompute's implied step time, held against their goals; the facts and the plots. The run's record
(meta, measurements, timing, host, elapsed_s) rides in the rows file's facts: --render re-derives
the page and plots from it, --resume continues it, plan --calibrate reads its meta.

A step's peak is the largest of its phases' peaks, each affine in the tokens per rank N (a fixed part:
weights, gradients, optimizer state, fixed-size chunks; plus bytes per token times N), so the fit
peak(N) = max_phase (a_phase + b_phase N) over the measured lengths (cost/memory.py's phase form) gives
the bytes per token at long sequence (its largest slope) and the longest sequence in a budget (its inverse).
"""
from __future__ import annotations

import os
import statistics
from typing import Any, Dict, List

from ..cost.memory import max_tokens, peak as predict_peak, phase_model
from ..report.plotting import line_figure
from ..report.rows import Row
from .harness import median_ratio, ratio_range, write_page

PROG = "ds-seqpar bench memory"
KIB, MIB, GIB = 1024, 2 ** 20, 2 ** 30
FEATURES = "Bytes per token per rank: with the features / without"
FLOOR = "Bytes per token per rank with the features / the floor (layers x hidden x 4 B)"
PEAK = "Step peak per rank, P=2 / P=1 at equal tokens per rank"
ABOVE = "Forward+backward peak above static, P=2 / P=1 at equal tokens per rank"
LONGEST = "Longest sequence in the budget with the features, P=2 / P=1"
STRATEGIES = "Every strategy: the whole step's peak above static at P ranks / one rank's, equal tokens per rank"
TWO_POINT = "Why a two-point figure misleads (zigzag): (peak at N - peak at a short length) / (N - short), KiB"
VARIANTS = "Bytes per token per rank (KiB, the largest phase slope) and the longest sequence"
POINTS = "Every measurement: peak per rank of the whole step (MiB)"
PHASES = "Bytes per token of each phase (KiB, fitted slope)"
TIMING = "Step time at a short sequence: with / without the features (predicted: the recompute's implied ratio)"


def key(model: str, world: int, features: bool) -> str:
    return f"{model}/P{world}/{'on' if features else 'off'}"


def floor(meta: Dict[str, Any]) -> int:
    """The checkpointed residual stream's bytes per token: layers x hidden x 4 B."""
    return meta["layers"] * meta["hidden"] * 4


def summarize_variant(points: List[Dict[str, Any]], floor: int, budget: float, world: int) -> Dict[str, Any]:
    """Rows per measured length plus the phase model's slope, dominant phase and longest sequence."""
    points = sorted(points, key=lambda p: p["tokens_per_rank"])
    model = phase_model(points)
    dominant = max(model, key=lambda p: model[p]["b"])
    rows = []
    for i, pt in enumerate(points):
        n, peak, static, phases = pt["tokens_per_rank"], pt["peak_bytes"], pt["resident_bytes"], pt["phase_peak_bytes"]
        prev = points[i - 1] if i else None
        rows.append({"tokens_per_rank": n, "resident_bytes": static, "peak_bytes": peak,
                     "activation_bytes": max(v for p, v in phases.items() if p != "optimizer") - static,
                     "above_static_per_token": (peak - static) / n, "peak_phase": max(phases, key=phases.get),
                     "marginal_per_token": None if prev is None else
                     (peak - prev["peak_bytes"]) / (n - prev["tokens_per_rank"]), "step_s": pt["step_s"][-1]})
    n_max = max_tokens(model, budget, unbounded=-1)
    return {"rows": rows, "phase_model": model, "bytes_per_token": model[dominant]["b"], "dominant_phase": dominant,
            "floor_ratio": model[dominant]["b"] / floor,
            "fit_max_residual": max(m["max_residual"] for m in model.values()),
            "max_tokens_per_rank": n_max, "max_seq_len": world * n_max if n_max >= 0 else None}


def summarize(measurements: List[Dict[str, Any]], floor: int, budget: float) -> Dict[str, Dict[str, Any]]:
    """{key: summarize_variant and its model, world, features} of the scaling points, by variant."""
    groups: Dict[str, List[Dict[str, Any]]] = {}
    for m in measurements:
        groups.setdefault(key(m["model"], m["world"], m["features"]), []).append(m)
    return {k: dict(summarize_variant(pts, floor, budget, pts[0]["world"]), model=pts[0]["model"],
                    world=pts[0]["world"], features=pts[0]["features"]) for k, pts in sorted(groups.items())}


def variants(res: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    scaling = [m for m in res["measurements"] if m.get("purpose", "scaling") == "scaling"]
    return summarize(scaling, floor(res["meta"]), res["meta"]["budget_bytes"])


def strategy_rows(measurements: List[Dict[str, Any]]) -> List[Row]:
    """The per-strategy comparison: each (strategy, P, N) with its whole step's peak above static
    (largest rank), phase by phase, over P=1's at the same tokens per rank; and per P the two-point
    figure (peak at N - peak at a short length) / (N - short), which the optimizer step's fixed
    transient distorts (it holds the short run's peak, more so at P=1 where ZeRO shards nothing)."""
    short = min((m["tokens_per_rank"] for m in measurements), default=0)
    long_runs = sorted((m for m in measurements if m["tokens_per_rank"] > short),
                       key=lambda m: (m["world"], -m["tokens_per_rank"], m["strategy"]))
    one, out = {m["tokens_per_rank"]: m for m in long_runs if m["world"] == 1}, []
    for m in long_runs:
        base, above, u = one.get(m["tokens_per_rank"]), m["phase_above_static_bytes"], m.get("ulysses_size", 1)
        case = m["strategy"] if u == 1 else f"hybrid ({m['strategy']} x Ulysses {u})"
        out.append(Row("memory", case if m["world"] > 1 else "(none: P=1)",
                       f"P={m['world']}, {m['tokens_per_rank']} tokens/rank", STRATEGIES, "x",
                       m["above_static_bytes"] / base["above_static_bytes"] if base else None,
                       target={2: "memory.strategy_p2", 4: "memory.strategy_p4"}.get(m["world"]) if base else None,
                       detail=dict({"static MiB": m["resident_bytes"] / MIB, "peak MiB": m["peak_bytes"] / MIB,
                                    "above static MiB": m["above_static_bytes"] / MIB,
                                    "peak phase": max(above, key=above.get)},
                                   **{f"{p} MiB": b / MIB for p, b in above.items()})))
    for world in sorted({m["world"] for m in measurements}):
        pts = sorted((m for m in measurements if m["world"] == world and m["strategy"] == "zigzag"
                      and m.get("ulysses_size", 1) == 1), key=lambda m: m["tokens_per_rank"])
        if len(pts) < 2 or pts[0]["tokens_per_rank"] != short:
            continue
        lo, hi, n = pts[0], pts[-1], pts[-1]["tokens_per_rank"]
        out.append(Row("memory", f"P={world}", f"{short} -> {n} tokens/rank", TWO_POINT, "KiB",
                       (hi["peak_bytes"] - lo["peak_bytes"]) / (n - short) / KIB, detail={
                           "peak at short MiB": lo["peak_bytes"] / MIB,
                           "its phase": max(lo["phase_peak_bytes"], key=lo["phase_peak_bytes"].get),
                           "peak MiB": hi["peak_bytes"] / MIB,
                           "above static / token KiB": hi["above_static_bytes"] / n / KIB}))
    return out


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


def timing_rows(timing: Dict[str, Dict[str, Any]], meta: Dict[str, Any]) -> List[Row]:
    """Per (model, P): step seconds with / without the features per round (median, min-max) against the
    ratio the recompute implies (step_macs_per_token)."""
    return [Row("memory", "step", f"{k}, {t['tokens_per_rank']} tokens/rank", TIMING, "x",
                median_ratio(t["on_s"], t["off_s"]), ratio_range(t["on_s"], t["off_s"]),
                predicted=implied_ratio(meta, int(k.rsplit("/P", 1)[1]), t["tokens_per_rank"]),
                target="memory.time_vs_implied", detail={
                    "without s": statistics.median(t["off_s"]), "with s": statistics.median(t["on_s"]),
                    "rounds": len(t["on_s"])}) for k, t in sorted(timing.items())]


def goal_rows(variants: Dict[str, Dict[str, Any]]) -> List[Row]:
    """Per model: the features against the plain step and the floor at each P; then, with and without
    them, P=2 against P=1 at equal tokens per rank (the step's peak, and what the tokens cost without
    the static part, which ZeRO shards over P) and the longest sequence in the budget."""
    out = []
    for model in sorted({v["model"] for v in variants.values()}):
        for p in sorted({v["world"] for v in variants.values() if v["model"] == model}):
            on, off = variants.get(key(model, p, True)), variants.get(key(model, p, False))
            if on and off:
                out.append(Row("memory", model, f"P={p}", FEATURES, "x",
                               on["bytes_per_token"] / off["bytes_per_token"], target="memory.features_vs_plain"))
            if on:
                out.append(Row("memory", model, f"P={p}", FLOOR, "x", on["floor_ratio"],
                               target="memory.features_vs_floor"))
        for features, tag in ((True, "with"), (False, "without")):
            one, two = variants.get(key(model, 1, features)), variants.get(key(model, 2, features))
            if not (one and two):
                continue
            at = {r["tokens_per_rank"]: r for r in one["rows"]}
            for r2, r1 in ((r, at[r["tokens_per_rank"]]) for r in two["rows"] if r["tokens_per_rank"] in at):
                variant = f"{tag} features, {r2['tokens_per_rank']} tokens/rank"
                out += [Row("memory", model, variant, PEAK, "x", r2["peak_bytes"] / r1["peak_bytes"],
                            target="memory.peak_p2_vs_p1"),
                        Row("memory", model, variant, ABOVE, "x", r2["activation_bytes"] / r1["activation_bytes"],
                            target="memory.p2_vs_p1")]
            if features and one["max_seq_len"] and two["max_seq_len"]:
                out.append(Row("memory", model, "with features", LONGEST, "x", two["max_seq_len"] / one["max_seq_len"],
                               target="memory.max_seq"))
    return out


def rows(res: Dict[str, Any]) -> List[Row]:
    """The page's rows: the goals, the per-strategy comparison, the step time, then every variant's
    slope and longest sequence, its points and its phases' slopes."""
    found, fl = variants(res), floor(res["meta"])
    out = goal_rows(found) + strategy_rows([m for m in res["measurements"] if m.get("purpose") == "strategies"])
    out += timing_rows(res.get("timing") or {}, res["meta"])
    tagged = [(v, f"P={v['world']} {'on' if v['features'] else 'off'}") for v in found.values()]
    out += [Row("memory", v["model"], tag, VARIANTS, "KiB", v["bytes_per_token"] / KIB, detail={
        "x floor": v["bytes_per_token"] / fl, "phase": v["dominant_phase"],
        "static MiB": v["rows"][0]["resident_bytes"] / MIB, "longest tokens/rank": v["max_tokens_per_rank"],
        "longest sequence": v["max_seq_len"], "fit residual MiB": v["fit_max_residual"] / MIB}) for v, tag in tagged]
    out += [Row("memory", v["model"], f"{tag}, {r['tokens_per_rank']} tokens/rank", POINTS, "MiB",
                r["peak_bytes"] / MIB, detail={
                    "static MiB": r["resident_bytes"] / MIB, "peak phase": r["peak_phase"],
                    "fwd+bwd above static MiB": r["activation_bytes"] / MIB,
                    "above static / token KiB": r["above_static_per_token"] / KIB,
                    "marginal / token KiB": None if r["marginal_per_token"] is None else r["marginal_per_token"] / KIB,
                    "step s": r["step_s"]})
            for v, tag in tagged for r in v["rows"]]
    return out + [Row("memory", v["model"], tag, PHASES, "KiB", v["bytes_per_token"] / KIB,
                      detail={p: m["b"] / KIB for p, m in v["phase_model"].items()}) for v, tag in tagged]


def facts(res: Dict[str, Any]) -> Dict[str, Any]:
    """The page's facts around the run's record (which they carry: plan --calibrate reads its meta)."""
    m, host = res["meta"], res["host"]
    malloc = ("glibc malloc with MALLOC_MMAP_THRESHOLD_=65536 (the resident set follows live tensors)"
              if m["malloc"] == "mmap" else "glibc malloc defaults")
    return dict(res, **{
        "title": f"Memory of a training step per rank: `{m['name']}`",
        "setup": f"Model: vocab {m['vocab']}, hidden {m['hidden']}, {m['layers']} layers, {m['heads']} heads "
                 f"({m['kv_heads']} k/v), MLP {m['intermediate']}; `llama` = Hugging Face LlamaForCausalLM from a "
                 f"LlamaConfig, `lm` = the project's LM with the same sizes. DeepSpeed ZeRO-2, fp32, AdamW, strategy "
                 f"{m['strategy']}, micro batch 1, one thread per rank, CPU (gloo). With the features: fused tiled "
                 f"loss ({m['tiled_loss_tokens']} tokens per chunk), tiled MLP ({m['tiled_mlp_tokens']}), "
                 f"checkpointing of every decoder layer. Each point runs the main job in fresh processes; peak = the "
                 f"process's resident high-water mark (VmHWM), reset per phase (data, forward, loss backward, layers "
                 f"backward, end of backward, optimizer step); allocator: {malloc}. *Static* = the resident set just "
                 f"before the step. Each phase's peak is affine in the tokens per rank N; bytes/token = the largest "
                 f"slope; the longest sequence in the budget ({m['budget_bytes'] / GIB:.2f} GiB per rank) solves "
                 f"peak(N) = budget. Floor = layers x hidden x 4 B = {floor(m) / KIB:.0f} KiB per token.",
        "command": m["command"],
        "machine": f"{host['cpu_model']}, {host['cpus']} cores (shared); torch {host['torch']}, deepspeed "
                   f"{host['deepspeed']}; whole run {res['elapsed_s'] / 60:.0f} min. Memory high-water marks do not "
                   f"depend on the load; step times do.",
        "metrics": {
            TIMING: "Both variants alternate round by round in the same processes; per round the median of its steps, "
                    "the slowest rank's. Implied: the ratio of the step's matmul multiply-accumulates with and without "
                    "the features (the recompute), elementwise work not counted.",
            POINTS: "above static per token = (peak - static) / N; marginal = the peak's rise per token from the "
                    "previous length; fwd+bwd above static = the highest forward or backward phase minus static."},
        "images": [(p, f"{m['name']}/{p}.png") for p in ("bytes_per_token", "peak_per_rank") if variants(res)]})


def write_plots(res: Dict[str, Any], out: str) -> None:
    """<out>/<name>/bytes_per_token.png and peak_per_rank.png: per variant the measured points and the
    phase model's line out to the longest sequence in the budget; the floor and the budget drawn."""
    m, fl, per_token, peak = res["meta"], floor(res["meta"]), [], []
    for v in variants(res).values():
        label = f"{v['model']} P={v['world']} {'with' if v['features'] else 'without'}"
        static, xs = v["rows"][0]["resident_bytes"], [r["tokens_per_rank"] for r in v["rows"]]
        top = max(xs + [v["max_tokens_per_rank"]])
        grid = [min(xs) * (top / min(xs)) ** (i / 60) for i in range(61)]
        lines = [(n, predict_peak(v["phase_model"], n)) for n in grid]
        per_token += [(label, n, r["above_static_per_token"] / KIB, None) for n, r in zip(xs, v["rows"])]
        per_token += [(f"{label}: phase model", n, (b - static) / n / KIB, None) for n, b in lines]
        peak += [(label, n, r["peak_bytes"] / MIB, None) for n, r in zip(xs, v["rows"])]
        peak += [(f"{label}: phase model", n, b / MIB, None) for n, b in lines]
    if not peak:
        return
    folder = os.path.join(out, m["name"])
    os.makedirs(folder, exist_ok=True)
    line_figure(per_token, [(f"floor layers x hidden x 4 B = {fl / KIB:g} KiB", fl / KIB), ("3 x floor", 3 * fl / KIB)],
                os.path.join(folder, "bytes_per_token.png"), "KiB per token per rank above static",
                "Bytes per token: points measured, lines = phase model up to the budget", log_y=True,
                xlabel="tokens per rank")
    line_figure(peak, [(f"budget {m['budget_bytes'] / GIB:.2f} GiB", m["budget_bytes"] / MIB)],
                os.path.join(folder, "peak_per_rank.png"), "peak MiB per rank (whole step)",
                "Peak memory per rank: measured points, phase model lines", xlabel="tokens per rank")


def finish(res: Dict[str, Any], out: str) -> None:
    """The plots, then <out>/<name>.md and .rows.json: the rows, and the facts with the record in them."""
    write_plots(res, out)
    write_page(out, res["meta"]["name"], rows(res), facts(res), PROG)
