"""The attention suite's rows: from what the ranks measured (cases.run_rank, train_step.measure_training,
kept in the run's ``res["raw"]``) straight to rows (per length and case the ratios, each beside its bound
from the cost model and its closed form), then the page's facts and the plots.

Only ratios from the same run count: a speedup is the median over rounds of the per-round ratio
baseline wall time / case wall time (a case's wall time in a round is its slowest rank's), with the
min-max of those ratios as the spread. Targets are checked at the longest measured length, as
docs/design.md states them (N=8192); a missed target says why in the row's "why": compute itself (the
CPU ratio is short too) or waiting and scheduling, and whether the machine was loaded.
"""
from __future__ import annotations

import os
import statistics
from typing import Any, Dict, List

from ..cost import expected_imbalance, speedup_bound
from ..report.plotting import MIB
from ..report.rows import Row
from ..report.targets import TARGETS
from ..strategies.closed_form import Shapes
from .cases import BASELINE, CASES, DTYPES
from .harness import ULYSSES_CHUNKED, case_times, closed_form, machine_line, spread, versus

SPEEDUP = "Attention fwd+bwd speedup over one process"
BYTES = "Bytes per rank against the closed form"
MEMORY = "Activation memory per rank / single process (bytes saved for backward)"
MAX_SEQ = "Longest sequence in a fixed per-rank budget, P ranks vs 1"
PEER = "Ours vs DeepSpeed's Ulysses (DistributedAttention, same local kernel): ours / theirs time"
LASP = "LASP-1 (ring) vs LASP-2 (all-gather)"
CHUNKS = "Ulysses in head chunks vs one chunk: time ratio (the all-to-alls' blocked seconds from sp.stats)"
TRAIN = "Whole training step, ZeRO-2: P ranks (sp=P, dp=1) vs one"


def _why(cpu_ratio: float, imbalance: float, inflation: float, wait, wall: float, bound_target: float) -> str:
    """A measured reason for a missed speedup: compute (CPU ratio, imbalance, inflation) vs waiting."""
    if cpu_ratio < bound_target:
        return (f"compute itself: CPU ratio {cpu_ratio:.2f} (imbalance {imbalance:.2f}, total work "
                f"{inflation:.2f}x single)")
    return (f"compute is on target (CPU ratio {cpu_ratio:.2f}); the rest is waiting and scheduling (comm wait "
            f"up to {max(wait or [0.0]):.3f} s per rank, wall {wall:.3f} s)")


def _loaded(load: float, cpus: int) -> str:
    return f"; timed under load (1-minute load {load:.1f} on {cpus} cores)" if load > cpus else ""


def _attention(res, seq: int, last: bool) -> List[Row]:
    """One length's rows: each case against its family's baseline, per round (harness.case_times, versus)."""
    per_rank, m, out = res["raw"]["ranks"], res["meta"], []
    p, variant = m["world"], f"N={seq}"
    load, cpus = res.get("load_by_length", {}).get(str(seq), 0.0), res["meta"]["cpus"]
    times = {case: case_times(per_rank, f"{case}/{seq}") for case in m["cases"]}
    saved = {case: [x for x in (r["saved_bytes"][f"{case}/{seq}"] for r in per_rank) if x is not None]
             for case in m["cases"]}
    for case, t in times.items():
        base = BASELINE[CASES[case].attention]
        vs, base_cpu, cpu = versus(times[base], t), times[base]["cpu"][0], t["cpu"]
        bound = speedup_bound(case, p, m["causal"]) if case != base else 1.0
        expected = expected_imbalance(case, p, m["causal"]) if case != base else 1.0
        wait = t["wait"] if CASES[case].runner == "sp" else None
        key = f"speedup.{case}" if last and case != base and f"speedup.{case}" in TARGETS else None
        why = _why(base_cpu / max(cpu), t["imbalance"], sum(cpu) / base_cpu, wait, t["time"],
                   TARGETS[key].threshold(bound)) + _loaded(load, cpus) if key else ""
        out.append(Row("attention", case, variant, SPEEDUP, "x", vs["ratio"], vs["ratio_range"], bound=bound,
                       target=key, detail={
                           "wall s": t["time"], "CPU s per rank": cpu, "CPU ratio": base_cpu / max(cpu),
                           "imbalance (expected)": f"{t['imbalance']:.2f} ({expected:.2f})",
                           "work vs single": sum(cpu) / base_cpu, "comm wait s per rank": wait, "why": why}))
    shapes = Shapes(m["batch"], seq, m["heads"], m["kv_heads"], m["head_dim"], DTYPES[m["dtype"]].itemsize)
    for case in (c for c in m["cases"] if CASES[c].runner in ("sp", "deepspeed")):   # the cases that communicate
        form = closed_form(case, p, shapes)
        if CASES[case].runner == "deepspeed":
            out.append(Row("attention", case, variant, BYTES, "B", None, predicted=form,
                           detail={"measured": "not measured (DeepSpeed's own collectives)"}))
            continue
        sent = [sorted({x["bytes"] for x in r["rounds"][f"{case}/{seq}"]}) for r in per_rank]
        varied = any(len(s) > 1 for s in sent)
        out.append(Row("attention", case, variant, BYTES, "B", [float("nan")] * p if varied else [s[-1] for s in sent],
                       predicted=form, target="bytes", detail={"why": "bytes varied between rounds" if varied else ""}))
    for case in m["cases"]:
        base = BASELINE[CASES[case].attention]
        held = last and case != base and CASES[case].runner != "local"
        base_saved = saved[base][0]
        out.append(Row("attention", case, variant, MEMORY, "x", max(saved[case]) / base_saved, bound=1 / p,
                       target="activation_memory" if held else None, detail={
                           "MiB per rank": [b / MIB for b in saved[case]], "baseline MiB": base_saved / MIB,
                           "why": f"{max(saved[case]) - base_saved / p:.0f} bytes per rank beyond 1/P of one "
                                  f"process's: state that does not shrink with N (LASP: one d x d state per head)"}))
    for case in [c for c in ("ulysses",) + ULYSSES_CHUNKED if c in times and "ds_ulysses" in times]:
        ours, theirs = times[case], times["ds_ulysses"]
        vs = versus(ours, theirs)                 # paired per round, like the speedups
        out.append(Row("attention", f"{case} / ds_ulysses", variant, PEER, "x", vs["ratio"], vs["ratio_range"],
                       target="vs_deepspeed" if last and case == "ulysses" else None, detail={
                           "ours s": ours["time"], "DeepSpeed s": theirs["time"], "CPU ratio": vs["cpu_ratio"],
                           "why": f"compute is the same (CPU per rank ours {max(ours['cpu']):.3f} s, theirs "
                                  f"{max(theirs['cpu']):.3f} s), so the gap is in the all-to-alls (ours waited up to "
                                  f"{max(ours['wait'] or [0.0]):.3f} s per rank)" + _loaded(load, cpus)}))
    for case in [c for c in ("ulysses",) + ULYSSES_CHUNKED[1:] if c in times and "ulysses_c1" in times]:
        vs, mine, one = versus(times[case], times["ulysses_c1"]), times[case], times["ulysses_c1"]
        out.append(Row("attention", f"{case} / ulysses_c1", variant, CHUNKS, "x", vs["ratio"], vs["ratio_range"],
                       detail={"CPU ratio": vs["cpu_ratio"], "blocked s per rank": mine["wait"],
                               "blocked s per rank, 1 chunk": one["wait"]}))
    if "lasp1" in times and "lasp2" in times:
        t = {c: times[c]["time"] for c in ("lasp1", "lasp2", "allscan", "halves") if c in times}
        pairs = [("LASP-1 / LASP-2 time", "lasp1", "lasp2")] + \
            ([("All-Scan / LASP-2 time", "allscan", "lasp2"), ("All-Scan / LASP-1 time", "allscan", "lasp1")]
             if "allscan" in times else []) + \
            ([("LASP-2 / halves time", "lasp2", "halves"), ("LASP-1 / halves time", "lasp1", "halves")]
             if "halves" in t else [])
        cpu = {c: statistics.median(times[c]["cpu_rounds"]) for c in t}       # the busiest rank's, per round
        out += [Row("attention", label, variant, LASP, "x", t[a] / t[b],
                    detail={"busiest-rank CPU ratio": cpu[a] / cpu[b], "busiest-rank CPU s": f"{cpu[a]:.4f} / {cpu[b]:.4f}"})
                for label, a, b in pairs]
    return out


def rows(res: Dict[str, Any]) -> List[Row]:
    """Every number of an attention run: per length the speedups, bytes, memory, peers and LASP; then
    the longest sequences, the LASP pieces and the training step."""
    m, out = res["meta"], []
    for seq in m["seq_lens"]:
        out += _attention(res, seq, seq == max(m["seq_lens"]))
    found = dict(res["raw"]["ranks"][0].get("max_seq", {}))
    for case, r in found.items():
        single, base = CASES[case].runner == "single", found.get(BASELINE[CASES[case].attention])
        if not (base and base["max_seq"]):
            continue
        out.append(Row("attention", case, f"budget: one process at N={m['mem_budget_n']}", MAX_SEQ, "x",
                       r["max_seq"] / base["max_seq"], bound=None if single else float(m["world"]),
                       target=None if single else "max_seq", detail={
                           "budget MiB": r["budget_bytes"] / MIB, "longest N": r["max_seq"],
                           "why": f"search step {r['step']} tokens; fixed per-rank state"}))
    pieces = res["raw"]["ranks"][0].get("lasp_breakdown")
    if pieces:
        base = next(iter(pieces["cpu_s"].values()))
        out += [Row("attention", name, f"N/P={pieces['local_len']}", f"LASP kernel work per rank position (N/P = "
                    f"{pieces['local_len']}, no transfers)", "s", t, detail={"extra": f"{t / base - 1:+.1%}"})
                for name, t in pieces["cpu_s"].items()]
    cpus = res["meta"]["cpus"]
    for s, t in res["raw"]["train"].items():
        c = statistics.median(t["compute_ratios"])
        short = c < TARGETS["train_step"].threshold(float(m["world"]))
        why = (f"the busiest rank's fwd+bwd CPU time shrinks only {c:.2f}x" if short else
               f"fwd+bwd CPU time shrinks {c:.2f}x; the rest of the step (ZeRO-2 gradient reduction, optimizer, "
               f"loss all-reduce, waiting for the slower rank) does not shrink with P")
        out.append(step_row("attention", s, f"seq {res['train_model']['seq_len']}", TRAIN, t, bound=float(m["world"]),
                            target="train_step", why=why + _loaded(max(t["load_1min"]), cpus)))
    return out


def step_row(suite: str, case: str, variant: str, metric: str, t: Dict[str, Any], **kw) -> Row:
    """One training-step comparison (train_step.measure_training's result of one strategy): P ranks over one,
    per round; ``why`` (if given) goes into the detail."""
    s, why = spread(t["ratios"]), kw.pop("why", "")
    detail = {"1 rank s/step": statistics.median(t["one_s"]), "P ranks s/step": statistics.median(t["p_s"]),
              "compute speedup": statistics.median(t["compute_ratios"]),
              "tokens/s 1 -> P": [statistics.median(t["one_tokens_per_s"]), statistics.median(t["p_tokens_per_s"])],
              "losses, max rel diff": f"{t['loss_rel_diff']:.1e}"}
    return Row(suite, case, variant, metric, "x", s["median"], (s["min"], s["max"]),
               detail=dict(detail, why=why) if why else detail, **kw)


def facts(res: Dict[str, Any]) -> Dict[str, Any]:
    m, t = res["meta"], res.get("train_model") or {}
    loaded = " **The machine was loaded** (1-minute load above its cores at some point): treat wall-clock speedups " \
        "as lower bounds; the CPU ratio is the less load-sensitive number." if m["load_during"] > m["cpus"] else ""
    model = (f"Hugging Face model `{os.path.basename(t['model'])}`" if t.get("model") else
             f"the small LM (dim {t.get('dim')}, {t.get('n_layers')} layers, {t.get('n_heads')} heads)")
    return {
        "title": f"Sequence-parallel benchmark `{m['name']}`",
        "setup": f"P={m['world']} ranks x 1 thread ({m['device']}, {m['comm_backend']}), {m['dtype']}, "
                 f"{'causal' if m['causal'] else 'non-causal'}, batch {m['batch']}, {m['heads']} heads "
                 f"({m['kv_heads']} k/v), head_dim {m['head_dim']}, kernel `{m['backend']}`, forward + backward; "
                 f"lengths {', '.join(map(str, m['seq_lens']))}; {m['warmup']} warm-up + {m['repeats']} interleaved "
                 f"rounds per length; medians over rounds with (min-max).{loaded}",
        "command": m["command"], "notes": m.get("notes", ""), "machine": machine_line(m),
        "metrics": {
            SPEEDUP: "Per round, baseline wall time / case wall time (a case's: its slowest rank's; baseline: the "
                     "single-process kernel, `single` for softmax, `single_linear` for LASP). CPU ratio = baseline CPU "
                     "/ busiest rank's CPU: the speedup without communication. imbalance = max/mean CPU over ranks. "
                     "work vs single = sum of per-rank CPU / baseline CPU. halves: every rank the single-process "
                     "kernel on its own N/P tokens, no exchange: the bound no exact scheme beats here.",
            BYTES: "What CommStats recorded per rank for one fwd+bwd, against `strategies/closed_form.py`.",
            TRAIN: f"{model}, micro-batch {t.get('micro_batch')}, {t.get('steps')} steps per run (the first is "
                   f"warm-up), through train.run_training; rounds alternate the 1-rank and the P-rank run. "
                   + ("" if res["raw"]["train"] else res.get("train_skipped", "not measured"))},
        "images": [(caption, f"{m['name']}/{png}.png") for png, caption in PLOTS.items()]}


PLOTS = {"speedup": "speedup vs sequence length", "bytes": "bytes per rank", "memory": "memory per rank",
         "imbalance": "CPU seconds per rank"}


def write_plots(rows_: List[Row], meta: Dict[str, Any], folder: str) -> List[str]:
    """speedup (with bounds), bytes (on the closed form), memory per rank over N; CPU per rank at the
    longest length. One colour per case across the figures."""
    from ..report.plotting import bar_figure, line_figure
    n = lambda r: int(r.variant[2:])  # noqa: E731
    last, p = max(meta["seq_lens"]), meta["world"]
    parallel = [c for c in meta["cases"] if CASES[c].runner != "single"]
    pick = lambda metric: [r for r in rows_ if r.metric == metric and r.case in parallel]  # noqa: E731
    os.makedirs(folder, exist_ok=True)
    speed = pick(SPEEDUP)
    lines = [(r.case, n(r), r.value, r.spread) for r in speed]
    marks = [(f"ideal P={p}", float(p))] + sorted({(f"{r.case} bound {r.bound:.2f}", r.bound) for r in speed
                                                   if r.bound != p})
    return [line_figure(lines, marks, os.path.join(folder, "speedup.png"), "speedup over one process (fwd+bwd)",
                        f"Speedup vs sequence length, P={p}; bars: min-max over rounds"),
            line_figure([(r.case, n(r), max(r.values()) / MIB, None) for r in pick(BYTES) if r.value]
                        + [(f"{r.case}: closed form", n(r), max(r.predicted) / MIB, None) for r in pick(BYTES)], [],
                        os.path.join(folder, "bytes.png"), "MiB sent by the busiest rank", "Bytes per rank: measured "
                        "and the closed form", log_y=True),
            line_figure([(r.case, n(r), max(r.detail["MiB per rank"]), None) for r in rows_ if r.metric == MEMORY],
                        [], os.path.join(folder, "memory.png"), "MiB saved for backward, fullest rank",
                        "Activation memory per rank", log_y=True),
            bar_figure({r.case: r.detail["CPU s per rank"] for r in speed if r.variant == f"N={last}"},
                       os.path.join(folder, "imbalance.png"), "CPU seconds per rank (fwd+bwd)",
                       f"Per-rank compute at N={last}")]
