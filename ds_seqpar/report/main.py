"""``ds-seqpar report RUN_DIRS... --out reports/NAME.md``: compare training runs side by side, as rows
rendered by report/render.py (``--rows X.rows.json``: re-render any bench suite's saved rows).

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
from typing import Any, Dict, List, Optional, Tuple

from .plotting import MIB, colors, line_figure, pyplot, require_matplotlib, save
from .render import render
from .rows import Row, load_rows

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
    """Short names a legend can hold: model (when the runs differ in it), strategy, sp x dp, length;
    then the run's name where those collide (two seeds or dates of one setup)."""
    models = {r["config"].get("model_name") for r in runs}
    base = [(f"{r['config'].get('model_name')} " if len(models) > 1 else "") +
            f"{r['config'].get('strategy')} sp{r['config'].get('sp_size')}xdp{r['config'].get('dp_size')} "
            f"n{r['config'].get('seq_len')}" for r in runs]
    return [b if base.count(b) == 1 else f"{b} ({r['config'].get('name', os.path.basename(r['path'].rstrip('/')))})"
            for b, r in zip(base, runs)]


def loaded(run: Dict[str, Any]) -> Optional[float]:
    """The highest 1-minute load per core while the run stepped, when it exceeded 1 (other work shared
    the cores, so its times are not comparable); None for a quiet run or one that did not record it."""
    cpus = run["config"].get("machine", {}).get("cpus") or os.cpu_count() or 1
    loads = [s["load_1min"] for s in run["steps"] if "load_1min" in s]
    worst = max(loads, default=0.0) / cpus
    return worst if worst > 1.0 else None


def run_rows(runs: List[Dict[str, Any]], labels: List[str], skip: int) -> List[Row]:
    """One row per run: its facts (strategy, layout, lengths) and steady-state numbers (medians over the
    steps after the first ``skip``; peak memory: the maximum), no single value."""
    steady = [run["steps"][skip:] or run["steps"] for run in runs]
    med = lambda i, key: statistics.median(s[key] for s in steady[i])  # noqa: E731
    best = max(med(i, "tokens_per_s") for i in range(len(runs)))
    return [Row("train", label, run["config"].get("strategy"), "Training runs compared", detail={
        "sp x dp": f"{run['config'].get('sp_size')} x {run['config'].get('dp_size')}",
        "ZeRO": run["config"].get("zero_stage"), "seq": run["config"].get("seq_len"), "steps": len(run["steps"]),
        "loss first -> last": f"{run['steps'][0]['loss']:.4f} -> {run['steps'][-1]['loss']:.4f}",
        "tokens/s": round(med(i, "tokens_per_s")), "vs best": med(i, "tokens_per_s") / best,
        "s/step": med(i, "step_s"), "peak MB": round(max(s["peak_mem_mb"] for s in run["steps"])),
        "attn comm MiB/step": med(i, "attn_comm_bytes") / MIB, "attn comm s/step": med(i, "attn_comm_s"),
        "compute imbalance": med(i, "compute_imbalance"),
        "run directory": f"`{run['path']}` ({run['config'].get('name', os.path.basename(run['path'].rstrip('/')))})"})
        for i, (label, run) in enumerate(zip(labels, runs))]


def differences(runs: List[Dict[str, Any]]) -> List[str]:
    """Settings other than the strategy and layout that differ between runs (a fair comparison has none)."""
    return [k for k in COMPARED if len({json.dumps(r["config"].get(k), sort_keys=True) for r in runs}) > 1]


def facts(runs, plots, out_name: str, skip: int, argv: List[str]) -> Dict[str, Any]:
    diff = differences(runs)
    return {"title": f"Training runs compared: {out_name}", "command": f"ds-seqpar report {' '.join(argv)}",
            "setup": f"{len(runs)} runs; steady-state columns are medians over steps after the first {skip} of each "
                     f"run (peak memory: the maximum). Memory is peak allocated on CUDA, the process's peak resident "
                     f"set on CPU.",
            "notes": " ".join(filter(None, [
                f"**Not like for like:** the runs differ in {', '.join(diff)}; compare with care." if diff else "",
                _load_warning(runs)])),
            "images": plots}


def _load_warning(runs) -> str:
    busy = [(os.path.basename(r["path"].rstrip("/")), loaded(r)) for r in runs]
    busy = [f"{name} ({x:.1f} per core)" for name, x in busy if x is not None]
    return (f"**Loaded machine:** {', '.join(busy)} stepped while the 1-minute load exceeded the cores; their "
            f"times and tokens/s are not comparable with a quiet run's." if busy else "")


def write_plots(runs, rows, labels, folder: str, skip: int) -> List[Tuple[str, str]]:
    """[(title, path)]: loss curves, tokens/s per step, and the resource panel, one colour per run."""
    os.makedirs(folder, exist_ok=True)
    per_step = lambda key, skip=0: [(label, s["step"], s[key], None)  # noqa: E731
                                    for run, label in zip(runs, labels) for s in run["steps"][skip:] or run["steps"]]
    steps = dict(xlabel="optimizer step", log_x=False)
    return [("loss curves", line_figure(per_step("loss"), [], os.path.join(folder, "loss.png"), "training loss (mean "
                                        "over replicas)", "Loss curves (same data, seed and global batch: the curves "
                                        "coincide)", styles=True, **steps)),
            ("tokens per second", line_figure(per_step("tokens_per_s", skip), [],
                                              os.path.join(folder, "tokens_per_s.png"), "tokens / s (whole job)",
                                              f"Throughput per step (first {skip} step(s) of each run left out)",
                                              **steps)),
            ("memory and communication", resources(rows, labels, os.path.join(folder, "resources.png")))]


def resources(rows: List[Row], labels, path: str) -> str:
    """Peak memory, attention bytes and seconds per step (the rows' columns): one panel each, one bar per run."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.8))
    panels = [("peak MB", "peak memory per rank (MB)", "{:.0f}"),
              ("attn comm MiB/step", "attention comm per step (MiB, busiest rank)", "{:.1f}"),
              ("attn comm s/step", "attention comm wait per step (s, slowest rank)", "{:.3f}")]
    for ax, (key, title, fmt_) in zip(axes, panels):
        values = [r.detail[key] for r in rows]
        ax.bar(range(len(rows)), values, color=colors(len(rows)))
        for i, v in enumerate(values):
            ax.text(i, v, fmt_.format(v), ha="center", va="bottom", fontsize=9)
        ax.set_xticks(range(len(rows)), labels, rotation=25, ha="right", fontsize=9)
        ax.set_title(title, fontsize=11)
    return save(fig, path)


def render_rows(paths: List[str], out: str) -> int:
    """``--rows``: the page of saved rows files (any suite's <name>.rows.json), one after the other."""
    found, facts_ = [], {}
    for path in paths:
        rows, saved = load_rows(path)
        found += rows
        facts_ = facts_ or saved
    with open(out, "w") as f:
        f.write(render(found, facts_))
    print(f"ds-seqpar report: wrote {out}")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="ds-seqpar report", description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="*", help="run directories (runs/<name>) with run.json and metrics.jsonl")
    ap.add_argument("--rows", nargs="+", metavar="ROWS_JSON", help="render saved rows instead (a bench suite's "
                    "<name>.rows.json): the page the suite wrote, from its rows alone")
    ap.add_argument("--out", required=True, help="markdown path, e.g. reports/NAME.md; plots go to reports/NAME/")
    ap.add_argument("--skip-steps", type=int, default=1, help="warm-up steps left out of steady-state numbers")
    args = ap.parse_args(argv)
    if args.rows:
        return render_rows(args.rows, args.out)
    if not args.runs:
        ap.error("give run directories, or --rows")
    try:
        runs = [load_run(p) for p in args.runs]
        require_matplotlib("the plots", ReportError)
    except ReportError as err:
        print(f"ds-seqpar report: error: {err}", file=sys.stderr)
        return 2
    labels = _labels(runs)
    rows = run_rows(runs, labels, args.skip_steps)
    out_dir, name = os.path.dirname(args.out) or ".", os.path.splitext(os.path.basename(args.out))[0]
    pngs = write_plots(runs, rows, labels, os.path.join(out_dir, name), args.skip_steps)
    plots = [(title, os.path.relpath(path, out_dir)) for title, path in pngs]
    with open(args.out, "w") as f:
        f.write(render(rows, facts(runs, plots, name, args.skip_steps, argv)))
    print(f"ds-seqpar report: wrote {args.out} and {len(plots)} plots in {os.path.join(out_dir, name)}/")
    warning = _load_warning(runs)
    if warning:
        print(f"ds-seqpar report: warning: {warning}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
