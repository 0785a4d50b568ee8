"""``--calibrate``'s second model: attention time as the kernel calls a rank makes plus its
exchanges, with the exchange's cost fitted to the measured reports and checked on rows it was not
fitted on.

    t_rank = kernel (cost.times: tile-aware computed pairs at the rate of the run's own
             single-process time, plus c_call per call from the timed blocks)
           + alpha x messages + bytes / beta            (no overlap: on 2 shared cores gloo's copies
                                                         take the core the kernel would use)

messages: Ulysses 8 all-to-alls; the ring family 3 (P - 1) exchanges (K/V forward, K/V backward,
dK/dV back); LASP 2 (LASP-2: all-gather + reduce-scatter; LASP-1: a state forward, a dstate back).
(alpha, beta) are least squares over reports/cpu_full.json's softmax rows; each length's rows are
predicted with the fit of the OTHER lengths (leave one length out), so no row predicts itself. The
LASP rows (cpu_full's lasp1 / lasp2 against its single-process linear kernel, and
reports/hybrid_cpu.json's real layers) are not fitted at all: they reuse the softmax fit.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from .cost import times
from .kernel_model import lstsq2
from .cost.pairs import computed_pairs

SOFTMAX = ("ulysses", "ring", "zigzag", "striped")


def messages(strategy: str, p: int) -> int:
    if strategy == "ulysses":
        return 8
    if strategy.startswith("lasp"):
        return 2
    return 3 * (p - 1)


TRUSTED_RESIDUAL = 0.3     # a block fit worse than this was timed under load: its c_call is not used


def trusted_cost(blocks: Optional[Dict[str, Any]]) -> Dict[str, float]:
    """c_call and the window factors of the timed blocks, or none of them when the fit is untrusted."""
    if not blocks or blocks.get("max_rel_residual", 1.0) > TRUSTED_RESIDUAL:
        return {"c_call_s": 0.0, "tall_factor": 1.0, "anti_factor": 1.0}
    return {"c_call_s": blocks["c_call_s"], "tall_factor": blocks.get("tall_factor", 1.0),
            "anti_factor": blocks.get("anti_factor", 1.0)}


def softmax_rows(full: Dict[str, Any], block_cost: Dict[str, float]) -> List[Dict[str, Any]]:
    """Per (N, strategy) of cpu_full: the busiest rank's kernel seconds (computed pairs at the rate
    the run's single case shows at that N, plus c_call per call when the timed blocks fit it well),
    the measured time, messages and bytes."""
    meta, rows = full["meta"], []
    c_call = trusted_cost(block_cost)["c_call_s"]
    p, heads = meta["world"], meta["heads"]
    for n_key, cases in sorted(full["attention"].items(), key=lambda kv: int(kv[0])):
        n = int(n_key)
        single = cases["single"]["time_s"]["median"]
        rate = {"c_call_s": 0.0, "t_pair_s": single / (computed_pairs(n, n, meta.get("causal", True)) * heads)}
        for s in SOFTMAX:
            if s not in cases:
                continue
            calls = max(len(c) for c in times.rank_calls(s, p, n))
            kernel = times.busiest_kernel_s(s, p, n, heads, rate) + c_call * calls
            rows.append({"n": n, "strategy": s, "kernel_s": kernel, "calls": calls, "messages": messages(s, p),
                         "bytes": cases[s]["bytes"][0], "measured_s": cases[s]["time_s"]["median"],
                         "single_s": single, "measured": cases[s]["speedup"]["median"], "c_call_s": c_call})
    return rows


def fit_exchange(rows: Sequence[Dict[str, Any]]) -> Dict[str, float]:
    """(alpha per message, beta) from measured - kernel over ``rows``."""
    a, b = lstsq2([(r["messages"], r["bytes"]) for r in rows], [r["measured_s"] - r["kernel_s"] for r in rows])
    return {"alpha_s": a, "beta_bytes_s": 1.0 / b if b > 0 else float("inf")}


def exchange_s(fit: Dict[str, float], msgs: int, nbytes: float) -> float:
    return fit["alpha_s"] * msgs + nbytes / fit["beta_bytes_s"]


def predict_softmax(rows: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Each row predicted with the fit of the other lengths; plus the fit over all rows."""
    out = []
    for r in rows:
        fit = fit_exchange([x for x in rows if x["n"] != r["n"]])
        t = r["kernel_s"] + exchange_s(fit, r["messages"], r["bytes"])
        out.append(dict(r, predicted=r["single_s"] / t, kernel_only=r["single_s"] / r["kernel_s"], fit=fit))
    return {"rows": out, "fit": fit_exchange(rows)}


def lasp_rows(full: Dict[str, Any], fit: Dict[str, float]) -> List[Dict[str, Any]]:
    """cpu_full's LASP cases: one rank runs the single-process linear kernel on N / P tokens (its time
    is linear in the tokens: a + b N, least squares over the single_linear rows) and exchanges one
    state per head, independent of N."""
    p = full["meta"]["world"]
    points = [(int(n), c["single_linear"]["time_s"]["median"]) for n, c in full["attention"].items()
              if "single_linear" in c]
    if len(points) < 2:
        return []
    b, a = lstsq2([(n, 1.0) for n, _ in points], [t for _, t in points])
    rows = []
    for n, single in sorted(points):
        for s in ("lasp2", "lasp1"):
            case = full["attention"][str(n)].get(s)
            if not case:
                continue
            t = a + b * n / p + exchange_s(fit, messages(s, p), case["bytes"][0])
            rows.append({"n": n, "strategy": s, "measured": case["speedup"]["median"], "predicted": single / t,
                         "bytes": case["bytes"][0]})
    return rows


def hybrid_rows(hybrid: Dict[str, Any], fit: Dict[str, float]) -> List[Dict[str, Any]]:
    """reports/hybrid_cpu.json's real linear layers under LASP at P = 2: the same run's local time on
    N / P tokens ("halves"), plus the transition map's extra cost where the op has one (its "ops"
    row: map - plain at the same tokens), plus the state exchange (the fit, the row's own bytes)."""
    ops = {o["family"]: o for o in hybrid.get("ops", [])}
    p, rows = hybrid.get("meta", {}).get("P", 2), []
    for family, r in hybrid.get("rows", {}).items():
        if "single" not in r or "halves" not in r:
            continue
        extra = ops[family]["map"] - ops[family]["plain"] if family in ops else 0.0
        for case in ("lasp_allgather", "lasp_ring"):
            if case not in r:
                continue
            t = r["halves"]["time"] + extra + exchange_s(fit, messages("lasp", p), r[case]["bytes"][0])
            rows.append({"family": family, "case": case,
                         "measured": r[case].get("speedup", r["single"]["time"] / r[case]["time"]),
                         "predicted": r["single"]["time"] / t, "map_extra_s": extra, "bytes": r[case]["bytes"][0]})
    return rows


__all__ = ["exchange_s", "fit_exchange", "hybrid_rows", "lasp_rows", "lm_shape", "messages", "predict_softmax",
           "predicted_steps", "softmax_rows", "step_rows", "trusted_cost"]


def lm_shape(tm: Dict[str, Any], linear: bool = False):
    """The project's LM of cpu_full's training rows (byte vocabulary, tied embeddings; linear: every
    layer lasp)."""
    import math
    from .model_shape import ModelShape
    dim, heads, layers = tm["dim"], tm["n_heads"], tm["n_layers"]
    mlp = 16 * math.ceil(8 * dim / 3 / 16)                  # models/lm.py's default MLP width
    lin = dict(kinds=("lasp",) * layers, lin_heads=heads, lin_dk=dim // heads, lin_dv=dim // heads) if linear else {}
    return ModelShape("lm", dim, layers, heads, heads, dim // heads, mlp, 256, tied=True, transition="fixed", **lin)


def predicted_steps(strategy: str, tm: Dict[str, Any], profile):
    """(shape, P = 1, P = 2): search.predict of cpu_full's training step of ``strategy`` (the project's LM
    of ``tm``, fp32, ZeRO-2) on one rank and on two."""
    from .cost.candidate import Candidate, Features
    from .search import Cluster, predict
    linear = strategy == "lasp"
    shape = lm_shape(tm, linear)
    one = predict(Candidate(strategy if linear else "ulysses", 1, 1, 2, Features()), shape, tm["seq_len"],
                  Cluster(1, 1, profile, "fp32"), own_linear=linear)
    two = predict(Candidate(strategy, 2, 2 if strategy == "ulysses" else 1, 2, Features()), shape, tm["seq_len"],
                  Cluster(2, 2, profile, "fp32"), own_linear=linear)
    return shape, one, two


def step_rows(full: Dict[str, Any], fit: Dict[str, float], profile) -> List[Dict[str, Any]]:
    """cpu_full's whole training step at P = 2 (the project's LM, fp32, ZeRO-2): the measured P = 1
    step scaled by the plan's compute ratio (search.predict: busiest rank's FLOPs at P over P = 1's),
    plus every exchange of the step at the softmax rows' (alpha, beta): the layers' bytes from the
    closed forms (per layer x layers) and ZeRO-2's reduce-scatter + all-gather (2 messages)."""
    tm = full.get("train_model") or {}
    if not tm:
        return []
    layers, p = tm["n_layers"], 2
    rows = []
    for strategy, measured in sorted(full.get("train", {}).items()):
        shape, one, two = predicted_steps(strategy, tm, profile)
        if not (one.compute_s and two.compute_s):
            continue
        layer_bytes = sum(two.comm_bytes.values()) * layers
        zero = times.zero_bytes(shape.params(), p, 2, 4, 4)
        t = (measured["one_s"]["median"] * two.compute_s / one.compute_s
             + exchange_s(fit, messages(strategy, p) * layers + 2, layer_bytes + zero))
        rows.append({"strategy": strategy, "measured": measured["speedup"]["median"],
                     "predicted": measured["one_s"]["median"] / t, "compute_ratio": two.compute_s / one.compute_s,
                     "bytes": layer_bytes + zero})
    return rows
