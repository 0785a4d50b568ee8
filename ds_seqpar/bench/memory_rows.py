"""The memory suite's record (bench/memory.py measures it: meta, measurements, timing, host, elapsed_s)
as rows, facts and plots. The record rides in the rows file's facts: --render re-derives the page and
plots from it, --resume continues it, plan --calibrate reads its meta. A step's peak is the largest of
its phases' peaks, each affine in the tokens per rank N: cost/memory.py's phase model fitted to the
measured lengths gives the bytes per token (its largest slope) and the longest sequence in a budget.
"""
from __future__ import annotations

import os
import statistics
from typing import Any, Dict, List, Tuple

from ..cost.flops import step_per_token
from ..cost.memory import max_tokens, peak as predict_peak, phase_model
from ..cost.model_shape import ModelShape
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


def floor(meta: Dict[str, Any]) -> int:
    """The checkpointed residual stream's bytes per token: layers x hidden x 4 B."""
    return meta["layers"] * meta["hidden"] * 4


def fwd_bwd_above_static(point: Dict[str, Any]) -> float:
    """The highest forward or backward phase's peak above static (not the optimizer step's, which ZeRO shards)."""
    return max(b for p, b in point["phase_peak_bytes"].items() if p != "optimizer") - point["resident_bytes"]


def variants(res: Dict[str, Any]) -> Dict[Tuple[str, int, bool], Dict[str, Any]]:
    """The scaling points by (model, P, features): case and variant, points by length, phase model, its largest
    slope and that slope's phase, the longest tokens per rank and sequence in the budget (-1, None: unbounded)."""
    groups: Dict[Tuple[str, int, bool], List[Dict[str, Any]]] = {}
    for m in res["measurements"]:
        if m.get("purpose", "scaling") == "scaling":
            groups.setdefault((m["model"], m["world"], m["features"]), []).append(m)
    out = {}
    for (model, world, on), points in sorted(groups.items()):
        points = sorted(points, key=lambda p: p["tokens_per_rank"])
        lines = phase_model(points)
        top = max(lines, key=lambda p: lines[p]["b"])
        n = max_tokens(lines, res["meta"]["budget_bytes"], unbounded=-1)
        out[model, world, on] = {"case": model, "variant": f"P={world} {'on' if on else 'off'}", "points": points,
                                 "lines": lines, "phase": top, "bytes_per_token": lines[top]["b"], "max_tokens": n,
                                 "max_seq": world * n if n >= 0 else None}
    return out


def goal_rows(found: Dict[Tuple[str, int, bool], Dict[str, Any]], fl: int) -> List[Row]:
    """Per model: the features against the plain step and the floor at each P; with and without them, P=2 / P=1
    at equal tokens per rank (the step's peak, and its part above static) and the longest sequence in the budget."""
    out = []
    for model in sorted({m for m, _, _ in found}):
        for p in sorted({p for m, p, _ in found if m == model}):
            on, off = found.get((model, p, True)), found.get((model, p, False))
            if on and off:
                out.append(Row("memory", model, f"P={p}", FEATURES, "x", on["bytes_per_token"] / off["bytes_per_token"],
                               target="memory.features_vs_plain"))
            if on:
                out.append(Row("memory", model, f"P={p}", FLOOR, "x", on["bytes_per_token"] / fl,
                               target="memory.features_vs_floor"))
        for features, tag in ((True, "with"), (False, "without")):
            one, two = found.get((model, 1, features)), found.get((model, 2, features))
            if not (one and two):
                continue
            at = {pt["tokens_per_rank"]: pt for pt in one["points"]}
            for p2, p1 in ((pt, at[pt["tokens_per_rank"]]) for pt in two["points"] if pt["tokens_per_rank"] in at):
                variant = f"{tag} features, {p2['tokens_per_rank']} tokens/rank"
                out += [Row("memory", model, variant, PEAK, "x", p2["peak_bytes"] / p1["peak_bytes"],
                            target="memory.peak_p2_vs_p1"),
                        Row("memory", model, variant, ABOVE, "x", fwd_bwd_above_static(p2) / fwd_bwd_above_static(p1),
                            target="memory.p2_vs_p1")]
            if features and one["max_seq"] and two["max_seq"]:
                out.append(Row("memory", model, "with features", LONGEST, "x", two["max_seq"] / one["max_seq"],
                               target="memory.max_seq"))
    return out


def strategy_rows(measurements: List[Dict[str, Any]]) -> List[Row]:
    """Each (strategy, P, N): its whole step's peak above static (largest rank), phase by phase, over P=1's at
    the same N; per P the two-point figure (peak at N - peak at a short length) / (N - short), which the optimizer
    step's fixed transient distorts (it holds the short run's peak, more so at P=1 where ZeRO shards nothing)."""
    short = min((m["tokens_per_rank"] for m in measurements), default=0)
    long_runs = sorted((m for m in measurements if m["tokens_per_rank"] > short),
                       key=lambda m: (m["world"], -m["tokens_per_rank"], m["strategy"]))
    one, out = {m["tokens_per_rank"]: m for m in long_runs if m["world"] == 1}, []
    for m in long_runs:
        base, above, u = one.get(m["tokens_per_rank"]), m["phase_above_static_bytes"], m.get("ulysses_size", 1)
        case = m["strategy"] if u == 1 else f"hybrid ({m['strategy']} x Ulysses {u})"
        detail = {"static MiB": m["resident_bytes"] / MIB, "peak MiB": m["peak_bytes"] / MIB,
                  "above static MiB": m["above_static_bytes"] / MIB, "peak phase": max(above, key=above.get),
                  **{f"{p} MiB": b / MIB for p, b in above.items()}}
        ratio = m["above_static_bytes"] / base["above_static_bytes"] if base else None
        out.append(Row("memory", case if m["world"] > 1 else "(none: P=1)", f"P={m['world']}, {m['tokens_per_rank']} "
                       "tokens/rank", STRATEGIES, "x", ratio, detail=detail,
                       target={2: "memory.strategy_p2", 4: "memory.strategy_p4"}.get(m["world"]) if base else None))
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


def timing_rows(timing: Dict[str, Dict[str, Any]], meta: Dict[str, Any]) -> List[Row]:
    """Per (model, P): step seconds with / without the features per round (median, min-max) against the
    ratio of the step's matmul FLOPs over the global sequence P x N with and without them (cost/flops.py)."""
    shape = ModelShape("memory", meta["hidden"], meta["layers"], meta["heads"], meta["kv_heads"],
                       meta["hidden"] // meta["heads"], meta["intermediate"], meta["vocab"])
    out = []
    for k, t in sorted(timing.items()):
        seq = int(k.rsplit("/P", 1)[1]) * t["tokens_per_rank"]
        on, off = (sum(step_per_token(shape, seq, features).values()) for features in (True, False))
        out.append(Row("memory", "step", f"{k}, {t['tokens_per_rank']} tokens/rank", TIMING, "x",
                       median_ratio(t["on_s"], t["off_s"]), ratio_range(t["on_s"], t["off_s"]),
                       predicted=on / off, target="memory.time_vs_implied", detail={
                           "without s": statistics.median(t["off_s"]), "with s": statistics.median(t["on_s"]),
                           "rounds": len(t["on_s"])}))
    return out


def rows(res: Dict[str, Any]) -> List[Row]:
    """The page's rows: the goals, the per-strategy comparison, the step time, then every variant's
    slope and longest sequence, its points and its phases' slopes."""
    found, fl = variants(res), floor(res["meta"])
    out = goal_rows(found, fl) + strategy_rows([m for m in res["measurements"] if m.get("purpose") == "strategies"])
    out += timing_rows(res.get("timing") or {}, res["meta"])
    out += [Row("memory", v["case"], v["variant"], VARIANTS, "KiB", v["bytes_per_token"] / KIB, detail={
        "x floor": v["bytes_per_token"] / fl, "phase": v["phase"], "static MiB": v["points"][0]["resident_bytes"] / MIB,
        "longest tokens/rank": v["max_tokens"], "longest sequence": v["max_seq"],
        "fit residual MiB": max(line["max_residual"] for line in v["lines"].values()) / MIB}) for v in found.values()]
    for v in found.values():
        for prev, pt in zip([None] + v["points"], v["points"]):
            n, peak, static = pt["tokens_per_rank"], pt["peak_bytes"], pt["resident_bytes"]
            rise = None if prev is None else (peak - prev["peak_bytes"]) / (n - prev["tokens_per_rank"]) / KIB
            out.append(Row("memory", v["case"], f"{v['variant']}, {n} tokens/rank", POINTS, "MiB", peak / MIB, detail={
                "static MiB": static / MIB, "peak phase": max(pt["phase_peak_bytes"], key=pt["phase_peak_bytes"].get),
                "fwd+bwd above static MiB": fwd_bwd_above_static(pt) / MIB,
                "above static / token KiB": (peak - static) / n / KIB, "marginal / token KiB": rise,
                "step s": pt["step_s"][-1]}))
    return out + [Row("memory", v["case"], v["variant"], PHASES, "KiB", v["bytes_per_token"] / KIB,
                      detail={p: line["b"] / KIB for p, line in v["lines"].items()}) for v in found.values()]


def facts(res: Dict[str, Any]) -> Dict[str, Any]:
    """The page's facts around the run's record (which they carry: plan --calibrate reads its meta)."""
    m, host = res["meta"], res["host"]
    malloc = "MALLOC_MMAP_THRESHOLD_=65536 (the resident set follows live tensors)" if m["malloc"] == "mmap" else \
        "glibc's defaults"
    return dict(res, **{
        "title": f"Memory of a training step per rank: `{m['name']}`",
        "setup": f"Model: vocab {m['vocab']}, hidden {m['hidden']}, {m['layers']} layers, {m['heads']} heads "
                 f"({m['kv_heads']} k/v), MLP {m['intermediate']}; `llama` = Hugging Face LlamaForCausalLM, `lm` = "
                 f"the project's LM. DeepSpeed ZeRO-2, fp32, AdamW, {m['strategy']}, micro batch 1, one thread per "
                 f"rank, CPU. Features: tiled loss ({m['tiled_loss_tokens']} tokens per chunk), tiled MLP "
                 f"({m['tiled_mlp_tokens']}), every layer checkpointed. Peak: the resident high-water mark (VmHWM) "
                 f"per phase, fresh processes per point, malloc: {malloc}; *static*: the resident set before the "
                 f"step. Bytes/token: the largest phase slope; longest sequence: peak(N) = "
                 f"{m['budget_bytes'] / GIB:.2f} GiB per rank. Floor = layers x hidden x 4 B = {floor(m) / KIB:.0f} "
                 f"KiB per token.",
        "command": m["command"],
        "machine": f"{host['cpu_model']}, {host['cpus']} cores (shared); torch {host['torch']}, deepspeed "
                   f"{host['deepspeed']}; whole run {res['elapsed_s'] / 60:.0f} min (memory does not depend on the "
                   f"load, step times do).",
        "metrics": {
            TIMING: "The two variants alternate round by round on one pool; per round the median of a variant's "
                    "steps, the slowest rank's. Predicted: the step's matmul FLOPs with / without the features (the "
                    "recompute; elementwise work not counted).",
            POINTS: "above static per token = (peak - static) / N; marginal = the peak's rise per token from the "
                    "previous length; fwd+bwd above static = the highest forward or backward phase minus static."},
        "images": [(p, f"{m['name']}/{p}.png") for p in ("bytes_per_token", "peak_per_rank") if variants(res)]})


def write_plots(res: Dict[str, Any], out: str) -> None:
    """<out>/<name>/bytes_per_token.png and peak_per_rank.png: per variant the measured points and the
    phase model's line out to the longest sequence in the budget; the floor and the budget drawn."""
    m, fl, per_token, peak = res["meta"], floor(res["meta"]), [], []
    for (model, p, on), v in variants(res).items():
        label, pts = f"{model} P={p} {'with' if on else 'without'}", v["points"]
        xs = [pt["tokens_per_rank"] for pt in pts]
        grid = [xs[0] * (max(xs + [v["max_tokens"]]) / xs[0]) ** (i / 60) for i in range(61)]
        # (label, N, peak, static): measured points with their own static, the model's line with the shortest's
        for name, n, b, s in ([(label, n, pt["peak_bytes"], pt["resident_bytes"]) for n, pt in zip(xs, pts)] +
                              [(f"{label}: phase model", n, predict_peak(v["lines"], n), pts[0]["resident_bytes"])
                               for n in grid]):
            per_token.append((name, n, (b - s) / n / KIB, None))
            peak.append((name, n, b / MIB, None))
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
