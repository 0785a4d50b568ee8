"""PNG plots of a benchmark's results (matplotlib, headless): speedup vs sequence length, bytes
per rank, activation memory per rank, per-rank work imbalance. One figure per file, large type,
one colour per case across all figures so a case is found at a glance."""
from __future__ import annotations

import os
from typing import Any, Dict, List

from ..report.plotting import MIB, colors as palette, log2_x, plain_log_y, pyplot, save


def _colors(cases: List[str]) -> Dict[str, Any]:
    return dict(zip(cases, palette(len(cases))))


def _parallel_cases(res) -> List[str]:
    first = res["attention"][str(res["meta"]["seq_lens"][0])]
    return [c for c in res["meta"]["cases"] if first[c]["baseline"] != c]


def _merged(curves: Dict[str, List[float]]) -> List[tuple]:
    """[(label, first case, values)]: cases with identical curves share one line and one label (ring,
    zigzag and striped send the same bytes; every softmax strategy saves the same memory)."""
    groups: Dict[tuple, List[str]] = {}
    for case, ys in curves.items():
        groups.setdefault(tuple(ys), []).append(case)
    return [(" = ".join(cases), cases[0], list(ys)) for ys, cases in groups.items()]


def plot_speedup(res, path: str) -> str:
    plt, m = pyplot(), res["meta"]
    seqs, cases = m["seq_lens"], _parallel_cases(res)
    colors = _colors(m["cases"])
    fig, ax = plt.subplots(figsize=(10, 5))
    for case in cases:
        sp = [res["attention"][str(n)][case]["speedup"] for n in seqs]
        med = [s["median"] for s in sp]
        err = [[s["median"] - s["min"] for s in sp], [s["max"] - s["median"] for s in sp]]
        ax.errorbar(seqs, med, yerr=err, marker="o", capsize=3, label=case, color=colors[case])
    ax.axhline(m["world"], color="black", ls="--", lw=1, label=f"ideal P={m['world']}")
    if "ring" in cases and m["causal"]:
        bound = res["attention"][str(seqs[0])]["ring"]["bound"]
        ax.axhline(bound, color=colors["ring"], ls=":", lw=1, label=f"ring causal bound {bound:.2f}")
    log2_x(ax, seqs)
    ax.set_xlabel("sequence length N (tokens)")
    ax.set_ylabel("speedup over one process (fwd+bwd)")
    top = max(res["attention"][str(n)][c]["speedup"]["max"] for n in seqs for c in cases)
    ax.set_ylim(0, max(m["world"], top) * 1.1)
    ax.set_title(f"Speedup vs sequence length, P={m['world']} ({m['dtype']}, "
                 f"{'causal' if m['causal'] else 'non-causal'}); bars: min-max over rounds")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9)
    return save(fig, path)


def plot_bytes(res, path: str) -> str:
    plt, m = pyplot(), res["meta"]
    seqs, colors = m["seq_lens"], _colors(m["cases"])
    fig, ax = plt.subplots(figsize=(10, 5))
    rows = {c: [res["attention"][str(n)][c] for n in seqs] for c in _parallel_cases(res)
            if "bytes_form" in res["attention"][str(seqs[0])][c]}          # the cases that communicate
    forms = {c: [max(r["bytes_form"]) / MIB for r in rs] for c, rs in rows.items()}
    for label, case, form in _merged(forms):
        ax.plot(seqs, form, ls="--", color=colors[case], lw=1.5, label=f"{label}: closed form")
    for case, rs in rows.items():
        if rs[0].get("bytes"):
            ax.plot(seqs, [max(r["bytes"]) / MIB for r in rs], marker="o", ms=8, ls="none", color=colors[case],
                    mfc="none", mew=1.5)
    ax.plot([], [], marker="o", ls="none", color="grey", mfc="none", label="measured (CommStats; not for ds_ulysses)")
    log2_x(ax, seqs)
    plain_log_y(ax)
    ax.set_xlabel("sequence length N (tokens)")
    ax.set_ylabel("MiB sent by the busiest rank, one fwd+bwd")
    ax.set_title("Bytes sent per rank: measured (circles) on the closed form (dashed)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9)
    return save(fig, path)


def plot_memory(res, path: str) -> str:
    plt, m = pyplot(), res["meta"]
    seqs, colors = m["seq_lens"], _colors(m["cases"])
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5.5))
    curves = {c: [max(res["attention"][str(n)][c]["saved_bytes"]) / MIB for n in seqs] for c in m["cases"]}
    for label, case, ys in _merged(curves):
        single = res["attention"][str(seqs[0])][case]["baseline"] == case
        ax.plot(seqs, ys, marker="s" if single else "o", ls="-" if single else "--", lw=2.5 if single else 1.5,
                color=("black" if case == "single" else "dimgrey") if single else colors[case],
                label=f"{label} (one process)" if single else label)
    log2_x(ax, seqs)
    plain_log_y(ax)
    ax.set_xlabel("sequence length N (tokens)")
    ax.set_ylabel("MiB saved for backward, fullest rank")
    ax.set_title("Activation memory per rank")
    ax.legend(fontsize=8)
    found = {c: r for c, r in res.get("max_seq", {}).items() if res["attention"][str(seqs[0])][c]["baseline"] != c}
    if found:
        names = list(found)
        bx.bar(names, [found[c]["ratio"] for c in names], color=[colors[c] for c in names])
        bx.axhline(m["world"], color="black", ls="--", lw=1, label=f"ideal P={m['world']}")
        bx.axhline(0.95 * m["world"], color="red", ls=":", lw=1, label=f"target {0.95 * m['world']:.2f}")
        for i, c in enumerate(names):
            bx.text(i, found[c]["ratio"], f"{found[c]['ratio']:.2f}", ha="center", va="bottom")
        bx.tick_params(axis="x", rotation=30)
        bx.legend(fontsize=9, loc="lower right")
    else:
        bx.text(0.5, 0.5, "not measured (--mem-budget-n 0)", ha="center", va="center", transform=bx.transAxes)
    bx.set_ylabel("longest N in the budget: P ranks / one process")
    bx.set_title(f"Longest sequence in a fixed per-rank budget\n(budget: one process's saved bytes at "
                 f"N={m.get('mem_budget_n')})")
    return save(fig, path)


def plot_imbalance(res, path: str) -> str:
    plt, m = pyplot(), res["meta"]
    seq = max(m["seq_lens"])
    rows = res["attention"][str(seq)]
    cases = _parallel_cases(res)
    fig, ax = plt.subplots(figsize=(9, 5))
    width = 0.8 / m["world"]
    for r in range(m["world"]):
        ax.bar([i + (r - (m["world"] - 1) / 2) * width for i in range(len(cases))],
               [rows[c]["cpu_s"][r] for c in cases], width, label=f"rank {r}")
    for i, c in enumerate(cases):
        ideal = rows[rows[c]["baseline"]]["cpu_s"][0] / m["world"]
        ax.plot([i - 0.45, i + 0.45], [ideal, ideal], color="black", ls="--", lw=1)
        ax.text(i, max(rows[c]["cpu_s"]), f"{rows[c]['imbalance']:.2f}", ha="center", va="bottom", fontsize=9)
    ax.set_xticks(range(len(cases)), cases, rotation=20)
    ax.set_ylabel("CPU seconds per rank (fwd+bwd)")
    ax.set_title(f"Per-rank compute at N={seq}; label: imbalance max/mean; dashed: single / P")
    ax.legend(fontsize=9)
    return save(fig, path)


def write_plots(res: Dict[str, Any], folder: str) -> List[str]:
    os.makedirs(folder, exist_ok=True)
    return [plot_speedup(res, os.path.join(folder, "speedup.png")),
            plot_bytes(res, os.path.join(folder, "bytes.png")),
            plot_memory(res, os.path.join(folder, "memory.png")),
            plot_imbalance(res, os.path.join(folder, "imbalance.png"))]


__all__ = ["write_plots"]
