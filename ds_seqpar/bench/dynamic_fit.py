"""The cost model against ``ds-seqpar bench dynamic``: each case's critical path predicted from its
schedule's priced work (schedule.rank_work: every rank's linear and attention operations and bytes)
with rates fitted on the OTHER cases (cost.steps.fit_rates: seconds per operation of each kind, per
byte, per round and per step;
leave one case out), so no case predicts itself.

    python -m ds_seqpar.bench.dynamic_fit --out reports --name dynamic_cpu P2.rows.json P4.rows.json

pools the cases of several bench runs (one P each) into one fit and one page; ``bench dynamic``
itself fits within its run.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
from typing import Dict, List, Optional, Sequence, Tuple

from ..cost.documents import SCHEDULER_RATES
from ..cost.steps import StepRates, fit_rates
from ..report.rows import Row

FIT_ROUNDS = 4          # refits: the busiest rank is chosen with the previous fit's rates
DEFAULT = SCHEDULER_RATES          # the scheduler's own weights (a byte = 100 operations) to start


def busiest(step, rates: StepRates):
    """(linear ops, attention ops, bytes, rounds) of one measured step's busiest rank under ``rates``."""
    ops, attention, sent = max(step["work"], key=lambda w: rates.seconds(*w, 0) - rates.step_s)
    return ops, attention, sent, step["rounds"]


def predict(steps, rates: StepRates) -> float:
    """The median over a case's steps of their predicted seconds (the row's value is the median)."""
    return statistics.median(rates.seconds(*busiest(step, rates)) for step in steps)


def fit(cases: Sequence[Tuple[list, float]]) -> StepRates:
    """Rates from (a case's steps, its measured seconds) pairs."""
    rates = DEFAULT
    for _ in range(FIT_ROUNDS):
        points = []
        for steps, seconds in cases:
            feats = [busiest(step, rates) for step in steps]
            points.append((*(statistics.fmean(f[i] for f in feats) for i in range(4)), seconds))
        rates = fit_rates(points)
    return rates


def with_predictions(rows: List[Row], work: Dict[str, list]) -> Tuple[List[Row], str]:
    """(``rows`` with ``predicted`` set on the critical-path rows, each from the fit over the other
    cases, and "predicted by the fit over all" in their detail; a sentence giving that fit's rates).
    ``work``: "<case> <variant>" -> its steps (bench dynamic's priced_work)."""
    timed = [i for i, r in enumerate(rows) if r.metric == "critical_cpu_s" and f"{r.case} {r.variant}" in work]
    if len(timed) < 6:                                  # five rates: fewer cases leave nothing to check
        return rows, ""
    cases = {i: (work[f"{rows[i].case} {rows[i].variant}"], rows[i].value) for i in timed}
    whole = fit(list(cases.values()))
    out = list(rows)
    for i in timed:
        rates = fit([c for j, c in cases.items() if j != i])
        detail = dict(rows[i].detail, **{"predicted by the fit over all": round(predict(cases[i][0], whole), 4)})
        out[i] = dataclasses.replace(rows[i], predicted=round(predict(cases[i][0], rates), 4), detail=detail)
    worst = max(abs(out[i].value / out[i].predicted - 1) for i in timed)
    return out, (f"Predicted (leave one case out: each case by the rates fitted on the other {len(timed) - 1}): "
                 f"worst error {worst:.0%}. The fit over all {len(timed)} cases: {_describe(whole)} "
                 f"(flops_per_byte {whole.flops_per_byte:.0f}).")


def _describe(rates: StepRates) -> str:
    return (f"{rates.s_per_op * 1e9:.3f} ns per linear-layer operation, {rates.s_per_attention_op * 1e9:.3f} ns per "
            f"attention operation, {rates.s_per_byte * 1e9:.3f} ns per byte sent, "
            f"{rates.round_s * 1e3:.1f} ms per round, {rates.step_s * 1e3:.1f} ms per step")


def main(argv: Optional[List[str]] = None) -> int:
    from ..report.render import write
    from ..report.rows import load_rows
    ap = argparse.ArgumentParser(prog="python -m ds_seqpar.bench.dynamic_fit", description=__doc__.split("\n\n")[0])
    ap.add_argument("rows", nargs="+", help="bench dynamic's <name>.rows.json, one per run")
    ap.add_argument("--out", default="reports")
    ap.add_argument("--name", default="dynamic_cpu")
    ap.add_argument("--notes", default="")
    args = ap.parse_args(argv)
    rows, runs, work = [], [], {}
    for path in args.rows:
        got, facts = load_rows(path)
        rows += got
        runs.append(facts)
        work.update(facts["meta"]["priced_work"])
    found, fitted = with_predictions(rows, work)
    facts = dict(runs[0], title="Dynamic data-sequence groups vs static sizes, predicted by the cost model",
                 command=" ; ".join(f["command"] for f in runs) + f" ; python -m ds_seqpar.bench.dynamic_fit "
                 f"--out {args.out} --name {args.name} " + " ".join(args.rows),
                 machine=" | ".join(f["machine"] for f in runs), notes=" ".join((args.notes, fitted)),
                 setup=" ".join(f["setup"] for f in runs), meta=dict(runs[0]["meta"], priced_work=work))
    write(args.out, args.name, found, facts, "dynamic_fit")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["fit", "predict", "with_predictions"]
