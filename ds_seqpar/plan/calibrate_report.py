"""reports/plan_cpu.{md,json}: the calibrated plan's predictions beside what reports/ measured.

Reads reports/cpu_full.json (attention speedups and bytes per rank at P=2) and
reports/memory_cpu.json (bytes per token per rank of a training step); never writes them.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any, Dict, List, Optional

from . import memory
from .calibrate import STRATEGIES, predict_speedups
from .memory import Features
from .model_shape import ModelShape


def _load(path: str) -> Optional[Dict[str, Any]]:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def speedup_rows(cal: Dict[str, Any], full: Dict[str, Any]) -> List[Dict[str, Any]]:
    rows = []
    meta = full["meta"]
    for n_key, cases in sorted(full["attention"].items(), key=lambda kv: int(kv[0])):
        n = int(n_key)
        ideal = predict_speedups(cal["comm"], cal["kernels"], meta, n, overlap=True)
        serial = predict_speedups(cal["comm"], cal["kernels"], meta, n, overlap=False)
        for s in STRATEGIES:
            if s not in cases:
                continue
            measured = cases[s]["speedup"]["median"]
            rows.append({"n": n, "strategy": s, "measured": measured, "predicted_overlap": ideal[s],
                         "predicted_serial": serial[s], "bytes": cases[s].get("bytes", [None])[0],
                         "bytes_form": cases[s].get("bytes_form", [None])[0]})
    return rows


def step_rows(cal: Dict[str, Any], full: Dict[str, Any], profile) -> List[Dict[str, Any]]:
    """cpu_full's whole training step (the project's LM, fp32, ZeRO-2, byte vocabulary, tied
    embeddings) at P=2 over P=1, predicted by search.predict with the calibrated profile."""
    from .search import Candidate, Cluster, predict
    tm = full.get("train_model") or {}
    if not tm:
        return []
    dim, heads = tm["dim"], tm["n_heads"]
    mlp = 16 * math.ceil(8 * dim / 3 / 16)                  # models/lm.py's default MLP width
    shape = ModelShape("lm", dim, tm["n_layers"], heads, heads, dim // heads, mlp, 256, tied=True)
    one = predict(Candidate("ulysses", 1, 1, 2, Features()), shape, tm["seq_len"], Cluster(1, 1, profile, "fp32"))
    rows = []
    for strategy, measured in sorted(full.get("train", {}).items()):
        if strategy not in ("zigzag", "ulysses"):
            continue
        c = Candidate(strategy, 2, 2 if strategy == "ulysses" else 1, 2, Features())
        two = predict(c, shape, tm["seq_len"], Cluster(2, 2, profile, "fp32"))
        rows.append({"strategy": strategy, "measured": measured["speedup"]["median"],
                     "predicted": one.step_s / two.step_s, "comm_s": two.comm_s, "compute_s": two.compute_s,
                     "one_s_measured": measured["one_s"]["median"], "one_s_predicted": one.step_s,
                     "p_s_measured": measured["p_s"]["median"], "p_s_predicted": two.step_s})
    return rows


def _fit_slope(points):
    xs, ys = zip(*points)
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def memory_rows(report: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Per measured variant with two lengths or more: the largest phase slope (bytes per token per
    rank, the benchmark's definition) beside the plan's count (fp32, ZeRO-2, checkpoints on host=device)."""
    groups: Dict[tuple, list] = {}
    for m in report.get("measurements", []):
        if m.get("purpose") in (None, "scaling"):
            groups.setdefault((m["model"], m["world"], m["features"]), []).append(m)
    rows = []
    for (model, world, features), ms in sorted(groups.items()):
        if len({m["tokens_per_rank"] for m in ms}) < 2:
            continue
        measured = max(_fit_slope([(m["tokens_per_rank"], m["phase_peak_bytes"][ph]) for m in ms])
                       for ph in ms[0]["phase_peak_bytes"])
        m = ms[0]
        shape = ModelShape(model, m["hidden"], m["layers"], m["heads"], m["kv_heads"], m["hidden"] // m["heads"],
                           m["intermediate"], m["vocab"], tied=model != "llama")
        f = Features(on=features, cpu_checkpointing=False, tiled_loss_tokens=m["tiled_loss_tokens"],
                     tiled_mlp_tokens=m["tiled_mlp_tokens"])
        bare = max(memory.per_token(shape, 4, f, True).values())
        lines = memory.phase_lines(shape, m["strategy"], world, m.get("ulysses_size", 1), world, 2, "fp32", f, True)
        rows.append({"variant": f"{model}/P{world}/{'on' if features else 'off'}", "measured": measured,
                     "predicted": bare, "predicted_with_comm": max(line["b"] for line in lines.values())})
    return rows


def render(cal: Dict[str, Any], speed: List[Dict[str, Any]], mem: List[Dict[str, Any]], note: str,
           steps: Optional[List[Dict[str, Any]]] = None) -> str:
    k, c = cal["kernels"], cal["comm"]
    out = ["# `ds-seqpar plan --calibrate`: predicted vs measured on this machine", "",
           "Command: `ds-seqpar plan --calibrate`. " + note, "",
           "## Calibration", "",
           "| quantity | value |", "|---|---:|",
           f"| matmul, one thread (1024^3 fp32) | {k['matmul_flops_s'] / 1e9:.1f} GFLOP/s |",
           f"| causal SDPA fwd+bwd, one thread (N=2048, 8 x 64) | {k['attention_flops_s'] / 1e9:.1f} GFLOP/s |"]
    for kind in ("all_to_all", "ring"):
        out.append(f"| {kind} (2 ranks, gloo): alpha / beta | {c[kind]['alpha_s'] * 1e3:.2f} ms / "
                   f"{c[kind]['beta_bytes_s'] / 1e9:.2f} GB/s (largest residual {c[kind]['max_rel_residual']:.0%}) |")
    out += ["", "## Attention fwd+bwd speedup at P=2 (reports/cpu_full.json)", "",
            "Predicted: single-process time from the SDPA rate, the busiest rank's share, plus the all-to-alls, or "
            "the ring's exposed time with ideal overlap / with none (the two bounds).", "",
            "| N | strategy | measured | predicted (overlap) | ratio | predicted (no overlap) | ratio | bytes/rank measured / closed form |",
            "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in speed:
        b = "" if not r["bytes_form"] else f"{r['bytes'] / r['bytes_form']:.3f}"
        out.append(f"| {r['n']} | {r['strategy']} | {r['measured']:.2f} | {r['predicted_overlap']:.2f} | "
                   f"{r['predicted_overlap'] / r['measured']:.2f} | {r['predicted_serial']:.2f} | "
                   f"{r['predicted_serial'] / r['measured']:.2f} | {b} |")
    if speed:
        longest = max(r["n"] for r in speed)
        near = [r for r in speed if abs(r["predicted_serial"] / r["measured"] - 1) <= 0.15]
        at_n = [r["strategy"] for r in speed if r["n"] == longest and abs(r["predicted_serial"] / r["measured"] - 1) <= 0.15]
        out += ["", f"Within 15% (no-overlap prediction): {len(near)} of {len(speed)} rows; at N={longest}: "
                f"{', '.join(at_n) or 'none'}. Not modelled: per-block kernel overheads (many small blocks at short N, "
                f"striped's token-granular blocks), gloo's copies competing with compute on 2 cores, and the load of "
                f"the machine during either run; so the predictions are optimistic where those dominate."]
    if steps:
        out += ["", "## Whole training-step speedup at P=2 (reports/cpu_full.json, the project's LM, ZeRO-2)", "",
                "Predicted by the plan itself (search.predict) with the calibrated profile: compute from FLOPs, "
                "the strategy's exchanges and ZeRO-2's collectives from the alpha/beta fit.", "",
                "| strategy | speedup measured | predicted | ratio | step s P=1 measured / predicted | step s P=2 measured / "
                "predicted | predicted comm s (P=2) |", "|---|---:|---:|---:|---:|---:|---|"]
        out += [f"| {r['strategy']} | {r['measured']:.2f} | {r['predicted']:.2f} | {r['predicted'] / r['measured']:.2f} | "
                f"{r['one_s_measured']:.2f} / {r['one_s_predicted']:.2f} | {r['p_s_measured']:.2f} / {r['p_s_predicted']:.2f} | "
                f"{', '.join(f'{k} {v:.3f}' for k, v in r['comm_s'].items())} |" for r in steps]
        factor = steps[0]["one_s_predicted"] / steps[0]["one_s_measured"]
        out += ["", f"The absolute step times are {factor:.1f}x the measured ones: the single-thread rates were measured "
                f"on this machine as loaded now (see the load above; cpu_full recorded a peak 1-minute load of "
                f"{cal.get('full_load_peak', float('nan')):.1f}), so they are what a shared core gave; the ratios "
                f"cancel most of that."]
    out += ["", "## Bytes per token per rank of a training step (reports/memory_cpu.json)", ""]
    if mem:
        out += ["| variant | measured | predicted | ratio | with comm buffers (bound) | ratio |", "|---|---:|---:|---:|---:|---:|"]
        out += [f"| {r['variant']} | {r['measured']:,.0f} | {r['predicted']:,.0f} | {r['predicted'] / r['measured']:.3f} | "
                f"{r['predicted_with_comm']:,.0f} | {r['predicted_with_comm'] / r['measured']:.3f} |" for r in mem]
    else:
        out.append("reports/memory_cpu.json held no variant measured at two lengths when this ran (being "
                   "re-measured); docs/plan.md has the rows of its previous run.")
    return "\n".join(out) + "\n"


def write(cal: Dict[str, Any], reports: str, name: str, note: str, profile=None) -> str:
    full = _load(os.path.join(reports, "cpu_full.json"))
    mem_report = _load(os.path.join(reports, "memory_cpu.json")) or {}
    speed = speedup_rows(cal, full) if full else []
    mem = memory_rows(mem_report)
    steps = step_rows(cal, full, profile) if full and profile is not None else []
    if full:
        cal = dict(cal, full_load_peak=float(full.get("machine", {}).get("load_peak", float("nan"))))
    md = os.path.join(reports, f"{name}.md")
    with open(md, "w") as f:
        f.write(render(cal, speed, mem, note, steps))
    with open(os.path.join(reports, f"{name}.json"), "w") as f:
        json.dump({"calibration": cal, "speedups": speed, "memory": mem, "steps": steps}, f, indent=1)
    return md


__all__ = ["memory_rows", "render", "speedup_rows", "write"]
