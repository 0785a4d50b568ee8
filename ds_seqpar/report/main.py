"""``ds-seqpar report RUN_DIRS... --out reports/NAME.md``: compare training runs side by side.

Reads what the main job writes in every run directory (run.json: the configuration; metrics.jsonl:
one record per optimizer step) and writes a markdown page with a summary table and PNG plots in
reports/NAME/: loss curves, tokens/s per step, and peak memory and attention communication
(bytes and seconds per step) per run. Steady-state numbers leave out the first ``--skip-steps``
steps of each run (engine warm-up and first allocations).

    ds-seqpar report runs/zigzag-sp2-dp2-n512-* runs/ulysses-sp2-dp2-n512-* --out reports/zigzag_vs_ulysses.md
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any, Dict, List, Optional

from .plotting import MIB, require_matplotlib

COMPARED = ("seq_len", "micro_batch", "grad_accum", "world_size", "zero_stage", "model")


class ReportError(ValueError):
    """A run directory that cannot be read; the message names it."""


def load_run(path: str) -> Dict[str, Any]:
    cfg_path, metrics_path = os.path.join(path, "run.json"), os.path.join(path, "metrics.jsonl")
    if not os.path.isfile(cfg_path) or not os.path.isfile(metrics_path):
        raise ReportError(f"{path!r} is not a training run directory: it needs run.json and metrics.jsonl "
                          f"(written by `ds-seqpar train` on rank 0)")
    with open(cfg_path) as f:
        config = json.load(f)
    with open(metrics_path) as f:
        steps = [json.loads(line) for line in f if line.strip()]
    if not steps:
        raise ReportError(f"{metrics_path!r} has no steps yet")
    return {"path": path, "config": config, "steps": steps}


def _labels(runs: List[Dict[str, Any]]) -> List[str]:
    """Short names a legend can hold: strategy, sp x dp, length; #k only where they collide."""
    base = [f"{r['config'].get('strategy')} sp{r['config'].get('sp_size')}xdp{r['config'].get('dp_size')} "
            f"n{r['config'].get('seq_len')}" for r in runs]
    return [b if base.count(b) == 1 else f"{b} #{base[:i + 1].count(b)}" for i, b in enumerate(base)]


def summarize(run: Dict[str, Any], skip: int) -> Dict[str, Any]:
    cfg, steps = run["config"], run["steps"]
    steady = steps[skip:] or steps
    med = lambda key: statistics.median(s[key] for s in steady)  # noqa: E731
    return {"name": cfg.get("name", os.path.basename(run["path"].rstrip("/"))), "strategy": cfg.get("strategy"),
            "sp": cfg.get("sp_size"), "dp": cfg.get("dp_size"), "zero": cfg.get("zero_stage"),
            "seq_len": cfg.get("seq_len"), "steps": len(steps), "first_loss": steps[0]["loss"],
            "final_loss": steps[-1]["loss"], "tokens_per_s": med("tokens_per_s"), "step_s": med("step_s"),
            "peak_mem_mb": max(s["peak_mem_mb"] for s in steps), "comm_mib": med("attn_comm_bytes") / MIB,
            "comm_s": med("attn_comm_s"), "imbalance": med("compute_imbalance"), "kernel": cfg.get("kernel"),
            "device": cfg.get("device")}


def differences(runs: List[Dict[str, Any]]) -> List[str]:
    """Settings other than the strategy and layout that differ between runs (a fair comparison has none)."""
    return [k for k in COMPARED if len({json.dumps(r["config"].get(k), sort_keys=True) for r in runs}) > 1]


def render(runs, rows, labels, plots, out_name: str, skip: int, argv: List[str]) -> str:
    best = max(r["tokens_per_s"] for r in rows)
    lines = [f"# Training runs compared: {out_name}", "",
             f"Command: `ds-seqpar report {' '.join(argv)}`", "",
             f"{len(runs)} runs; steady-state columns are medians over steps after the first {skip} of each run "
             f"(peak memory: the maximum). Memory is peak allocated on CUDA, the process's peak resident set on CPU.",
             ""]
    diff = differences(runs)
    if diff:
        lines += [f"**Not like for like:** the runs differ in {', '.join(diff)}; compare with care.", ""]
    lines += ["| run | strategy | sp x dp | ZeRO | seq | steps | loss first -> last | tokens/s | vs best | s/step | "
              "peak MB | attn comm MiB/step | attn comm s/step | compute imbalance |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, r in zip(labels, rows):
        lines.append(f"| {label} | {r['strategy']} | {r['sp']} x {r['dp']} | {r['zero']} | {r['seq_len']} | "
                     f"{r['steps']} | {r['first_loss']:.4f} -> {r['final_loss']:.4f} | {r['tokens_per_s']:.0f} | "
                     f"{r['tokens_per_s'] / best:.2f} | {r['step_s']:.3f} | {r['peak_mem_mb']:.0f} | "
                     f"{r['comm_mib']:.2f} | {r['comm_s']:.3f} | {r['imbalance']:.2f} |")
    lines += ["", "Run directories:", ""] + [f"- {label}: `{r['path']}` ({rw['name']})"
                                              for label, r, rw in zip(labels, runs, rows)]
    lines += [""] + [f"![{title}]({path})" for title, path in plots] + [""]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="ds-seqpar report", description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="run directories (runs/<name>) with run.json and metrics.jsonl")
    ap.add_argument("--out", required=True, help="markdown path, e.g. reports/NAME.md; plots go to reports/NAME/")
    ap.add_argument("--skip-steps", type=int, default=1, help="warm-up steps left out of steady-state numbers")
    args = ap.parse_args(argv)
    try:
        runs = [load_run(p) for p in args.runs]
        require_matplotlib("the plots", ReportError)
    except ReportError as err:
        print(f"ds-seqpar report: error: {err}", file=sys.stderr)
        return 2
    from .plots import write_plots
    labels = _labels(runs)
    rows = [summarize(r, args.skip_steps) for r in runs]
    out_dir, name = os.path.dirname(args.out) or ".", os.path.splitext(os.path.basename(args.out))[0]
    pngs = write_plots(runs, rows, labels, os.path.join(out_dir, name), args.skip_steps)
    plots = [(title, os.path.relpath(path, out_dir)) for title, path in pngs]
    with open(args.out, "w") as f:
        f.write(render(runs, rows, labels, plots, name, args.skip_steps, argv))
    print(f"ds-seqpar report: wrote {args.out} and {len(plots)} plots in {os.path.join(out_dir, name)}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
