"""``--calibrate``'s sliding-window rows: reports/window_cpu.json's time ratio window / plain per strategy
and window at P = 2, predicted from the kernel calls the masked policy makes, and its bytes per rank.

    t(plain)  = the busiest rank's plain calls (cost.times.rank_calls) + exchange
    t(window) = the busiest rank's window sub-blocks (cost.times.window_calls: strategies/varlen.py
                with the CPU kernel's causal_tile and band_column, so the call count and the computed
                pairs are what runs) + exchange with the window's bytes (cost.bytes.rank_bytes)
    exchange  = alpha x messages + bytes / beta (calibrate_fit: fitted on cpu_full's softmax rows)

The cost per computed pair is the window run's own plain case's (its measured time less the exchange
and the per-call cost, over its computed pairs), as the softmax rows take the single case's rate: the
machine's speed when window_cpu ran cancels, and the ratio tests how the window is cut and priced.
c_call and the tall / anti factors are this machine's timed blocks (kernel_model.measure_blocks), used
only when their fit is trusted (calibrate_fit.TRUSTED_RESIDUAL). Not counted: the work around each
kernel call in the ring loop (merges, gradient sums, slicing: a window has 70-120 sub-blocks where plain
has 1-2). window_cpu timed the busiest rank's kernel calls alone too ("pieces"); the priced kernel time
matches those, and the rounds' time exceeds them by 8-16% with a window against 2-4% without: the
prediction is that much optimistic.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

from ..strategies.closed_form import Shapes, closed_form_by_kind
from . import calibrate_fit
from .cost.bytes import rank_bytes
from ..masks import Mask
from .cost.times import busiest_calls_s, rank_calls, window_calls


def plan_bytes(strategy: str, p: int, ulysses: int, shapes: Shapes, window: Optional[int]) -> List[int]:
    """Bytes each rank sends per fwd + bwd as the plan counts them (cost.bytes.rank_bytes)."""
    return [sum(b.values()) for b in rank_bytes(strategy, p, ulysses, shapes, Mask(True, window))]


def form_bytes(strategy: str, p: int, ulysses: int, shapes: Shapes, window: Optional[int]) -> List[int]:
    return [sum(closed_form_by_kind(strategy, p, shapes, r, ulysses, causal=True, window=window).values())
            for r in range(p)]


def window_rows(report: Dict[str, Any], fit: Dict[str, float], blocks: Optional[Dict[str, Any]]
                ) -> List[Dict[str, Any]]:
    """Per (strategy, window) of window_cpu: predicted and measured time ratio window / plain, the
    busiest rank's sub-blocks, and bytes per rank (plan, closed form, measured)."""
    meta, rows = report["meta"], []
    p, n, heads = meta["P"], meta["seq"], meta["heads"]
    shapes = Shapes(1, n, heads, heads, meta["head_dim"])
    base = calibrate_fit.trusted_cost(blocks)
    for s in meta["strategies"]:
        r = report["rows"][s]
        u = p if s == "ulysses" else 1                     # Ulysses over every rank, the ring family alone
        h = heads / p if s == "ulysses" else heads
        msgs = calibrate_fit.messages(s, p)
        plain_x = calibrate_fit.exchange_s(fit, msgs, max(plan_bytes(s, p, u, shapes, None)))
        # a masked plain block is priced as causal, whichever its direction (the timed blocks' line)
        plain_calls = [[(nq, nk, c or a, False) for nq, nk, c, a in r] for r in rank_calls(s, p, n)]
        unit = busiest_calls_s(plain_calls, dict(base, c_call_s=0.0, t_pair_s=1.0), h)
        c_calls = base["c_call_s"] * max(len(c) for c in plain_calls)
        cost = dict(base, t_pair_s=(r["plain"]["time"] - plain_x - c_calls) / unit)
        for w in meta["windows"]:
            case = r[f"window={w}"]
            calls = window_calls(s, p, n, w)
            ours = plan_bytes(s, p, u, shapes, w)
            kernel = busiest_calls_s(calls, cost, h)
            x = calibrate_fit.exchange_s(fit, msgs, max(ours))
            alone = [x["cpu"] for x in report.get("pieces", []) if (x["strategy"], x["window"]) == (s, w)]
            rows.append({"strategy": s, "window": w, "measured": case["ratio"], "kernel_timed_s": alone[0] if alone else None,
                         "predicted": (kernel + x) / r["plain"]["time"], "kernel_s": kernel, "exchange_s": x,
                         "calls": max(len(c) for c in calls), "t_pair_s": cost["t_pair_s"], "bytes_plan": ours,
                         "bytes_form": form_bytes(s, p, u, shapes, w),
                         "bytes_measured": case["bytes"]})
    return rows


__all__ = ["form_bytes", "plan_bytes", "window_rows"]
