"""From what the ranks measured (cases.run_rank, train_step.measure_training) to the attention
suite's summary: per length and case the ratios, each beside its bound and closed form
(bench/predict.py); attention.py turns it into rows.

Only ratios from the same run count: a speedup is the median over rounds of the per-round ratio
baseline wall time / case wall time (a case's wall time in a round is its slowest rank's), with
the min-max of those ratios as the spread.
"""
from __future__ import annotations

import statistics
from typing import Any, Dict, List

from .cases import BASELINE, CASES
from .harness import spread
from .predict import attention_closed_form, expected_imbalance, speedup_bound


def _walls(per_rank: List[Dict[str, Any]], seq: int, case: str) -> List[float]:
    """Per round, the slowest rank's wall time (rank 0 alone for single cases)."""
    ranks = [r["lengths"][seq]["rounds"][case] for r in per_rank if r["lengths"][seq]["rounds"][case]]
    return [max(r[i]["wall"] for r in ranks) for i in range(len(ranks[0]))]


def _per_rank(per_rank, seq, case, key) -> List[float]:
    return [statistics.median(x[key] for x in r["lengths"][seq]["rounds"][case])
            for r in per_rank if r["lengths"][seq]["rounds"][case]]


def case_row(per_rank: List[Dict[str, Any]], seq: int, case: str, meta: Dict[str, Any]) -> Dict[str, Any]:
    """Every number of one case at one length."""
    p, causal = meta["world"], meta["causal"]
    base = BASELINE[CASES[case].attention]
    walls, base_walls = _walls(per_rank, seq, case), _walls(per_rank, seq, base)
    cpu, base_cpu = _per_rank(per_rank, seq, case, "cpu"), _per_rank(per_rank, seq, base, "cpu")[0]
    saved = [r["lengths"][seq]["saved_bytes"][case] for r in per_rank]
    saved = [s for s in saved if s is not None]
    base_saved = per_rank[0]["lengths"][seq]["saved_bytes"][base]
    row = {"case": case, "seq": seq, "baseline": base, "time_s": spread(walls),
           "speedup": spread([b / w for b, w in zip(base_walls, walls)]),
           "cpu_s": cpu, "cpu_ratio": base_cpu / max(cpu), "imbalance": max(cpu) / statistics.mean(cpu),
           "inflation": sum(cpu) / base_cpu, "saved_bytes": saved, "mem_ratio": max(saved) / base_saved,
           "mem_extra_bytes": max(saved) - base_saved / p,
           "bound": speedup_bound(case, p, causal) if case != base else 1.0,
           "expected_imbalance": expected_imbalance(case, p, causal) if case != base else 1.0}
    if CASES[case].runner in ("sp", "deepspeed"):        # the cases that communicate
        row["wait_s"] = _per_rank(per_rank, seq, case, "wait") if CASES[case].runner == "sp" else None
        row.update(_bytes_fields(per_rank, seq, case, meta))
    return row


def _bytes_fields(per_rank, seq, case, meta) -> Dict[str, Any]:
    """Measured bytes per rank (one value per rank over all rounds, else it is a FAIL) against the
    closed form; DeepSpeed's collectives bypass CommStats, so only the form is given there."""
    c = CASES[case]
    form = attention_closed_form(dict(c.config), meta, seq)
    if c.runner != "sp":
        return {"bytes": None, "bytes_form": form, "bytes_ratio": None}
    sent = [sorted({x["bytes"] for x in r["lengths"][seq]["rounds"][case]}) for r in per_rank]
    ratio = [max(s) / f if f else float(max(s) == 0) for s, f in zip(sent, form)]
    constant = all(len(s) == 1 for s in sent)
    return {"bytes": [s[-1] for s in sent], "bytes_form": form, "bytes_ratio": ratio if constant else None}


def attention_rows(per_rank: List[Dict[str, Any]], meta: Dict[str, Any]) -> Dict[str, Dict[str, Dict[str, Any]]]:
    """{str(N): {case: row}}: string keys, as the JSON file has them."""
    out = {}
    for seq in meta["seq_lens"]:
        rows = out[str(seq)] = {case: case_row(per_rank, seq, case, meta) for case in meta["cases"]}
        if "ds_ulysses" in rows and "ulysses" in rows:
            # paired per round, like the speedups: ours / DeepSpeed's wall time
            ours, theirs = _walls(per_rank, seq, "ulysses"), _walls(per_rank, seq, "ds_ulysses")
            rows["ds_ulysses"]["ours_over_theirs"] = spread([o / t for o, t in zip(ours, theirs)])
    return out


def max_seq_rows(per_rank: List[Dict[str, Any]], meta: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    """Longest sequence within the budget per case, and its ratio to the baseline's."""
    found = dict(per_rank[0].get("max_seq", {}))
    rows = {}
    for case, res in found.items():
        base = found.get(BASELINE[CASES[case].attention])
        if base and base["max_seq"]:
            rows[case] = dict(res, ratio=res["max_seq"] / base["max_seq"])
    return rows


def train_rows(measured: Dict[str, Dict[str, Any]], p: int) -> Dict[str, Dict[str, Any]]:
    return {s: {"one_s": spread(m["one_s"]), "p_s": spread(m["p_s"]), "speedup": spread(m["ratios"]),
                "compute_speedup": spread(m["compute_ratios"]),
                "tokens_per_s": [statistics.median(m["one_tokens_per_s"]), statistics.median(m["p_tokens_per_s"])],
                "loss_rel_diff": m["loss_rel_diff"], "max_load_1min": max(m["load_1min"]),
                "bound": float(p)}
            for s, m in measured.items()}


__all__ = ["attention_rows", "max_seq_rows", "train_rows"]
