"""``ds-seqpar plan --calibrate``: measure this machine (measure.py), predict what the bench measured here
(calibrate.py) and write it as rows through report/render.py: REPORTS/NAME.md and NAME.rows.json (its
facts keep the calibration, so ``page`` recomputes every row from them), and NAME_profile.json (usable
as --gpu). Reads the bench's rows of REPORTS/cpu_full, hybrid_cpu, window_cpu and memory_cpu; a missing
one leaves its tables out.
"""
from __future__ import annotations

import json
import os
import time
from typing import Any, Dict, List, Optional, Tuple

from ..report.render import write
from ..report.rows import Row
from . import calibrate as cb
from ..cost.pairs import KEY_TILE, computed_pairs
from .hardware import describe
from .measure import BLOCKS, cpu_profile, measure_blocks, measure_comm, measure_kernels

def within(rows: List[Row], tol: float = 0.15) -> str:
    """How many rows' predicted / measured lies within ``tol`` of 1 (the goal of every time table)."""
    near = sum(1 for r in rows if abs(r.predicted / r.value - 1) <= tol)
    return f"Within {tol:.0%}: {near} of {len(rows)} rows."


def calibration_rows(cal: Dict[str, Any], fit: Optional[Dict[str, float]]) -> List[Row]:
    """The rates measured here, and the exchange fitted on cpu_full: (case, variant, value, detail) each."""
    k, b, gloo = cal["kernels"], cal.get("blocks") or {}, "2 ranks, gloo, 16 KiB-16 MiB"
    rows = [("matmul GFLOP/s", "one thread, 1024^3 fp32", k["matmul_flops_s"] / 1e9, {}),
            ("causal SDPA fwd+bwd GFLOP/s", "one thread, N=2048, 8 x 64", k["attention_flops_s"] / 1e9, {})]
    for kind, c in cal["comm"].items():
        res = {"largest residual": c["max_rel_residual"]}
        rows += [(f"{kind} alpha ms", gloo, c["alpha_s"] * 1e3, res),
                 (f"{kind} beta GB/s", gloo, c["beta_bytes_s"] / 1e9, res)]
    if b:
        fitted = f"kernel calls below (largest residual {b['max_rel_residual']:.0%})"
        pieces = "window pieces, not fitted"
        rows += [("c_call ms", fitted, b["c_call_s"] * 1e3, {}),
                 ("t_pair ns per computed pair and head", fitted, b["t_pair_s"] * 1e9, {}),
                 ("tall causal block / the line", pieces, b["tall_factor"], {}),
                 ("anti square / the line", pieces, b["anti_factor"], {})]
    if fit:
        on = "fitted on cpu_full's softmax rows"
        rows += [("exchange alpha ms per message", on, fit["alpha_s"] * 1e3, {}),
                 ("exchange beta GB/s", on, fit["beta_bytes_s"] / 1e9, {})]
    return [Row(cb.SUITE, case, variant, cb.CAL, "", value, detail=detail) for case, variant, value, detail in rows]


def block_rows(b: Dict[str, Any]) -> List[Row]:
    """The timed blocks against the fit c_call + t_pair x pairs (window pieces: the line, not fitted)."""
    line = lambda pairs: (b["c_call_s"] + b["t_pair_s"] * pairs) * 1e3  # noqa: E731
    rows = [Row(cb.SUITE, f"{nq} x {nk}{' causal' if m else ''}", "fitted", cb.KERNELS, "", t * 1e3,
                predicted=line(pairs), detail={"computed pairs x heads": pairs})
            for (nq, nk, m), (pairs, t) in zip(BLOCKS, b["points"])]
    for nq, nk, kind, t in b.get("window_points", []):
        pairs = computed_pairs(nq, nk, True) * b["heads"]
        rows.append(Row(cb.SUITE, f"{nq} x {nk} {kind}", "window piece, not fitted", cb.KERNELS, "", t * 1e3,
                        predicted=line(pairs), detail={"computed pairs x heads": pairs}))
    return rows


def _run(reports: str, name: str) -> Optional[cb.Run]:
    path = os.path.join(reports, f"{name}.rows.json")
    return cb.Run(path) if os.path.exists(path) else None


def page(cal: Dict[str, Any], reports: str) -> Tuple[List[Row], Dict[str, str]]:
    """Every row of the page and what each table means, from the calibration and the measured rows."""
    full, hybrid, window, mem = (_run(reports, n) for n in ("cpu_full", "hybrid_cpu", "window_cpu", "memory_cpu"))
    profile, blocks = cpu_profile(cal["comm"], cal["kernels"]), cal.get("blocks")
    soft, fit = cb.softmax_fit(full, blocks) if full else ([], None)
    step_fit, step_plan = cb.step_rows(full, fit, profile) if full else ([], [])
    ratios, wbytes = cb.window_rows(window, fit, blocks) if window and fit else ([], [])
    tables = {cb.CAL: calibration_rows(cal, fit), cb.FIRST: cb.first_model_rows(cal, full) if full else [],
              cb.KERNELS: block_rows(blocks) if blocks else [], cb.SOFTMAX_FIT: soft,
              cb.LASP: cb.lasp_rows(full, fit) if full else [],
              cb.HYBRID: cb.hybrid_rows(hybrid, fit) if hybrid and fit else [], cb.STEP_FIT: step_fit,
              cb.WINDOW: ratios, cb.WINDOW_BYTES: wbytes, cb.P4_BYTES: cb.p4_bytes_rows(),
              cb.P4_MEMORY: cb.phase_rows(mem) if mem else [], cb.STEP_PLAN: step_plan,
              cb.MEMORY: cb.memory_rows(mem) if mem else []}
    cost, step = cb.trusted_cost(blocks), step_plan[0].detail if step_plan else {}
    facts = {"tile": KEY_TILE, "trusted": cb.TRUSTED_RESIDUAL, "tall": cost["tall_factor"], "anti": cost["anti_factor"],
             "factor": step["P=1 s predicted"] / step["P=1 s measured"] if step else 1.0,
             "miss": ", ".join(f"{r.case} {r.variant}" for r in tables[cb.P4_MEMORY]
                               if abs(r.predicted / r.value - 1) > 0.05) or "none"}
    meaning = {m: cb.MEANING[m].format(**facts) + (f" {within(rows)}" if m in cb.WITHIN else "")
               for m, rows in tables.items()}
    return [r for rows in tables.values() for r in rows], meaning


def write_page(cal: Dict[str, Any], reports: str, name: str, machine: str) -> str:
    rows, metrics = page(cal, reports)
    facts = {"title": "`ds-seqpar plan --calibrate`: predicted vs measured on this machine",
             "setup": "This machine's rates (one thread; gloo between 2 local ranks) in the cost model, against "
                      "what the bench measured here (reports/cpu_full, hybrid_cpu, window_cpu, memory_cpu).",
             "command": "ds-seqpar plan --calibrate", "machine": machine, "metrics": metrics, "calibration": cal}
    return write(reports, name, rows, facts)


def run(opts) -> int:
    """Measure, write REPORTS/NAME_profile.json (usable as --gpu), NAME.md and NAME.rows.json."""
    start, load = time.time(), os.getloadavg()[0]
    cal = {"kernels": measure_kernels(), "blocks": measure_blocks(), "comm": measure_comm()}
    os.makedirs(opts.reports, exist_ok=True)
    profile_path = os.path.join(opts.reports, f"{opts.name}_profile.json")
    with open(profile_path, "w") as f:
        json.dump(describe(cpu_profile(cal["comm"], cal["kernels"])), f, indent=2)
    machine = (f"{os.cpu_count()} cores, 1-minute load {load:.1f} before and {os.getloadavg()[0]:.1f} after (the rates "
               f"move with the load); calibration took {time.time() - start:.0f} s.")
    print(f"wrote {write_page(cal, opts.reports, opts.name, machine)} and {profile_path} (usable as --gpu)")
    return 0


__all__ = ["block_rows", "calibration_rows", "page", "run", "within", "write_page"]
