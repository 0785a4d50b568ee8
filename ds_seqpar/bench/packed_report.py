"""Summary and markdown page of ``ds-seqpar bench --packed`` (bench/packed.py measures)."""
from __future__ import annotations

import statistics
from typing import Dict, List

from .packed import LINEAR, strategy_config, variant_bounds

GOAL = 0.20


def case_times(per_rank, key) -> dict:
    """One case's rounds over the ranks that ran it: medians (min-max) of the slowest rank's wall time,
    per-rank CPU, per-round walls and busiest-rank CPU (for per-round ratios), bytes and wait per rank."""
    ranks = [r["rounds"][key] for r in per_rank if r["rounds"][key]]
    walls = [max(r[i]["wall"] for r in ranks) for i in range(len(ranks[0]))]
    cpu = [statistics.median(x["cpu"] for x in r) for r in ranks]
    cpu_rounds = [max(r[i]["cpu"] for r in ranks) for i in range(len(ranks[0]))]
    row = {"time": statistics.median(walls), "min": min(walls), "max": max(walls), "cpu": cpu,
           "imbalance": max(cpu) / (sum(cpu) / len(cpu)), "walls": walls, "cpu_rounds": cpu_rounds}
    if "by_kind" in ranks[0][0]:
        row["bytes"] = [sum(r[-1]["by_kind"].values()) for r in ranks]
        row["wait"] = [statistics.median(x["wait"] for x in r) for r in ranks]
    return row


def work_per_rank(name: str, args, bounds) -> List[int]:
    """(q, k) pairs each rank computes for these documents (causal; plan/cost's count); LASP: tokens."""
    from ..masks import Mask
    from ..plan.cost import pairs_per_rank
    if name in LINEAR:                               # linear attention: work follows tokens, L per rank
        return [args.seq // args.P] * args.P
    cfg = strategy_config(name, args.P)
    return [int(x) for x in pairs_per_rank(cfg["strategy"], args.P, cfg.get("ulysses_size", 1), args.seq,
                                           Mask.from_boundaries(bounds))]


def closed_form(name: str, args, bounds) -> List[int]:
    """Bytes per rank for one fwd+bwd of these documents (strategies/closed_form.py)."""
    from ..strategies.closed_form import Shapes, closed_form_bytes
    cfg, sh = strategy_config(name, args.P), Shapes(1, args.seq, args.heads, args.heads, args.head_dim)
    return [closed_form_bytes(cfg["strategy"], args.P, sh, r, cfg.get("ulysses_size", 1),
                              cfg.get("lasp_comm", "allgather"), bounds) for r in range(args.P)]


def imbalance_sweep(seq: int, ps=(2, 4, 8), trials: int = 200, seed: int = 0) -> Dict[str, Dict[int, tuple]]:
    """Causal work imbalance (max/mean over ranks) of random packings, per ring layout and P: (mean,
    worst) over ``trials`` packings of documents with log-normal lengths (median 400 tokens, long tail)
    cut to ``seq``. A rank's work is the sum over its queries of the keys they see in their document."""
    import torch
    from ..masks import Mask
    from ..plan.cost import imbalance, position_pairs
    g = torch.Generator().manual_seed(seed)
    out = {name: {p: [] for p in ps} for name in ("contiguous", "zigzag", "striped")}
    for _ in range(trials):
        lengths = (torch.randn(64, generator=g) * 1.2 + 6.0).exp().clamp(1, seq).long().tolist()
        bounds = [0]
        for n in lengths:
            bounds.append(min(bounds[-1] + n, seq))
            if bounds[-1] == seq:
                break
        bounds[-1] = seq
        for name, per_p in out.items():
            for p in ps:
                per_p[p].append(imbalance(position_pairs(name, p, seq, seq, Mask.from_boundaries(bounds))))
    return {name: {p: (statistics.mean(v), max(v)) for p, v in per_p.items()} for name, per_p in out.items()}


def median_ratio(a, b) -> float:
    return statistics.median(x / y for x, y in zip(a, b))


def ratio_range(a, b):
    ratios = [x / y for x, y in zip(a, b)]
    return min(ratios), max(ratios)


def summarize(per_rank, args) -> Dict[str, dict]:
    out = {}
    for name in ("single", "single_linear") + tuple(args.strategies):
        rows = {v: case_times(per_rank, f"{name}/{v}") for v in ("one", "equal", "mixed")}
        # per round (the two variants ran back to back, under the same load), then the median
        rows["ratio"] = median_ratio(rows["equal"]["walls"], rows["one"]["walls"])
        rows["ratio_range"] = ratio_range(rows["equal"]["walls"], rows["one"]["walls"])
        rows["cpu_ratio"] = median_ratio(rows["equal"]["cpu_rounds"], rows["one"]["cpu_rounds"])
        if not name.startswith("single"):
            mixed = variant_bounds("mixed", args.seq, args.docs, tuple(args.mixed))
            work = work_per_rank(name, args, mixed)
            rows["work"], rows["work_imbalance"] = work, max(work) / (sum(work) / len(work))
            rows["forms"] = {v: closed_form(name, args, variant_bounds(v, args.seq, args.docs, tuple(args.mixed)))
                             for v in ("one", "equal", "mixed")}
        out[name] = rows
    return out


def _f(xs, fmt="{:.3f}") -> str:
    return " / ".join(fmt.format(x) for x in xs)


def render(rows: Dict[str, dict], masked: List[dict], meta) -> str:
    ideal = 1 / meta["docs"]
    lines = [
        f"# Packed documents on CPU ranks: {meta['docs']} equal documents vs one document of the same length", "",
        f"P={meta['P']} ranks x 1 thread (gloo), N={meta['seq']} tokens, batch 1, {meta['heads']} heads x "
        f"{meta['head_dim']}, fp32, causal, forward + backward, kernel `torch` (CPU flash SDPA); "
        f"{meta['repeats']} interleaved rounds after {meta['warmup']} warm-up round(s); medians (min-max) of the "
        f"slowest rank's wall time. Ratios are taken per round (the two variants run back to back, under "
        f"the same load) and their median reported, with (min-max) over rounds; CPU ratio: the same with "
        f"the busiest rank's thread CPU time.", "",
        f"Command: `{meta['command']}`", "",
        f"Machine: {meta['cpus']} CPUs, shared with other engineers' jobs during this run: load average before "
        f"{meta['load_before']}, after {meta['load_after']}, highest 1-minute value at the end of the rounds "
        f"{meta['load_during']:.2f}; whole run {meta['elapsed']:.0f} s. Interleaving puts the load on every case "
        f"alike; the CPU-time ratio is the less load-sensitive number.", "",
        f"## Time of {meta['docs']} equal documents / time of one document (ideal {ideal:.3f}, goal <= {GOAL:.2f})", "",
        "Softmax attention: causal work is the sum of squared document lengths, 1/docs of one document's. "
        "Linear attention (LASP, single_linear) does O(N) work either way: its ideal ratio is 1.", "",
        "| case | one document s | equal documents s | ratio | CPU ratio | ideal | goal | bytes/rank one doc "
        "(closed form) | bytes/rank documents (closed form) |",
        "|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        linear = name in LINEAR or name == "single_linear"
        verdict = lambda x: "**PASS**" if x <= GOAL else "**SHORT**"  # noqa: E731
        ok = "" if linear else f"wall {verdict(r['ratio'])}, CPU {verdict(r['cpu_ratio'])}"
        forms = r.get("forms", {})
        b1 = f"{_f(r['one']['bytes'], '{}')} ({_f(forms['one'], '{}')})" if "bytes" in r["one"] else ""
        b2 = f"{_f(r['equal']['bytes'], '{}')} ({_f(forms['equal'], '{}')})" if "bytes" in r["equal"] else ""
        lines.append(f"| {name} | {r['one']['time']:.3f} ({r['one']['min']:.3f}-{r['one']['max']:.3f}) | "
                     f"{r['equal']['time']:.3f} ({r['equal']['min']:.3f}-{r['equal']['max']:.3f}) | {r['ratio']:.3f} "
                     f"({r['ratio_range'][0]:.3f}-{r['ratio_range'][1]:.3f}) | "
                     f"{r['cpu_ratio']:.3f} | {'1' if linear else f'{ideal:.3f}'} | {'' if linear else f'<= {GOAL}'} "
                     f"{ok} | {b1} | {b2} |")
    lines += ["", f"## Mixed document lengths {list(meta['mixed'])}: per-rank balance", "",
              "Work = (q, k) pairs each rank computes (from the mask policy; LASP: tokens), imbalance = max/mean; "
              "measured = median CPU seconds per rank.", "",
              "| case | time s | CPU s per rank | measured imbalance | work per rank | work imbalance | "
              "bytes/rank (closed form) |", "|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        if name.startswith("single"):
            continue
        m = r["mixed"]
        lines.append(f"| {name} | {m['time']:.3f} | {_f(m['cpu'])} | {m['imbalance']:.2f} | {_f(r['work'], '{}')} | "
                     f"{r['work_imbalance']:.2f} | {_f(m['bytes'], '{}')} ({_f(r['forms']['mixed'], '{}')}) |")
    sweep = meta.get("sweep")
    if sweep:
        ps = sorted(next(iter(sweep.values())))
        lines += ["", f"Over {meta['sweep_trials']} random packings of N={meta['seq']} (log-normal document lengths, "
                  "median 400 tokens), causal work imbalance max/mean, mean (worst) per layout; Ulysses is 1.00 "
                  "by construction (every rank: all documents, 1/P of the heads) and LASP follows tokens (1.00):",
                  "", "| layout | " + " | ".join(f"P={p}" for p in ps) + " |", "|---|" + "---|" * len(ps)]
        lines += [f"| {name} | " + " | ".join(f"{m:.3f} ({w:.3f})" for m, w in (per[p] for p in ps)) + " |"
                  for name, per in sweep.items()]
        best = min(sweep, key=lambda n: max(sweep[n][p][1] for p in ps))
        lines += ["", f"Best balanced ring layout for packed data (smallest worst case): **{best}**."]
    lines += ["", f"## One rank's block (n = {meta['seq'] // meta['P']}): per-document sub-blocks vs one masked block",
              "", "Fwd+bwd on one process, the same CPU flash kernel: causal squares per document (what the strategies "
              "do) against one call over the whole block with an additive mask (attn_mask).", "",
              "| document length | documents | masked block s | sub-blocks s | masked / sub-blocks |",
              "|---|---|---|---|---|"]
    lines += [f"| {m['doc_len']} | {m['docs']} | {m['masked']:.3f} | {m['subblocks']:.3f} | "
              f"{m['masked'] / m['subblocks']:.1f}x |" for m in masked]
    lines += ["", meta.get("notes", ""), ""]
    return "\n".join(lines)


__all__ = ["summarize", "render", "work_per_rank", "closed_form", "case_times", "median_ratio", "ratio_range"]
