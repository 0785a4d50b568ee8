"""``--calibrate``'s models: what the bench measured here (its rows, report/rows.py; a run's parameters
in facts["meta"]) predicted by the cost model with this machine's calibration (measure.py), one row per
measured number; MEANING says each table's model. Exchanges are not overlapped with the kernel (on 2
shared cores gloo's copies take the core the kernel would use): alpha per message (Ulysses 8 all-to-alls,
the ring family 3 (P - 1), LASP 2) + bytes / beta, fitted on cpu_full's softmax rows and reused by the
LASP, hybrid, step and window tables. P = 4 is not timed (2 cores: it would measure the oversubscription):
its bytes are held to the closed forms and its memory to memory_cpu.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..masks import Mask
from ..report.rows import Row, load_rows
from ..strategies.closed_form import Shapes, closed_form_by_kind, closed_form_bytes
from ..cost import memory, times
from ..cost.bytes import rank_bytes
from ..cost.candidate import Candidate, Features
from ..cost.pairs import computed_pairs
from .hardware import Link, PlanError
from .measure import lstsq2
from ..cost.model_shape import ModelShape

SOFTMAX = ("ulysses", "ring", "zigzag", "striped")
TRUSTED_RESIDUAL = 0.3     # a block fit worse than this was timed under load: its c_call is not used
P4_LAYOUTS = (("ulysses", 4), ("ring", 1), ("zigzag", 1), ("striped", 1), ("zigzag", 2))
SUITE = "plan"


# The page's tables: each one's title (its rows' metric) and what it means (the text under the title, the
# model the functions below compute); a table in WITHIN ends with how many of its rows the model predicts
# within 15%.
CAL = "Calibration: this machine's rates"
KERNELS = "Kernel calls timed here (one thread, fp32, 8 heads x 64, fwd + bwd), ms"
SOFTMAX_FIT = "Attention fwd+bwd speedup at P=2: kernel calls + fitted exchange (cpu_full)"
FIRST = "Attention fwd+bwd speedup at P=2, first model: FLOPs and gloo's alpha/beta (cpu_full)"
LASP = "LASP at P=2: lasp2 / lasp1 over the single-process linear kernel (cpu_full)"
HYBRID = "Hybrids' linear layers under LASP at P=2 (hybrid_cpu)"
STEP_FIT = "Whole training step at P=2 with the fitted exchange (cpu_full, the project's LM, ZeRO-2)"
WINDOW = "Sliding windows at P=2: time with the window / without it (window_cpu, N=8192)"
WINDOW_BYTES = "Sliding windows at P=2: bytes per rank measured against the plan's (window_cpu)"
P4_BYTES = "P=4: bytes per rank per fwd+bwd, the plan against closed_form_by_kind (N=8192, 8 heads x 64, fp32)"
P4_MEMORY = "P=4: bytes per token per rank by phase (memory_cpu's P=4 scaling runs)"
MEMORY = "Bytes per token per rank of a training step (memory_cpu)"
STEP_PLAN = "Whole training-step speedup at P=2, the plan itself: search.predict with the calibrated profile"
WITHIN = (FIRST, SOFTMAX_FIT, LASP, HYBRID, STEP_FIT, WINDOW)
MEANING = {
    CAL: "Measured by this command; the exchange's (alpha, beta) are fitted on cpu_full's softmax rows (below).",
    FIRST: "FLOPs only: the SDPA rate on the busiest rank's share, plus the all-to-alls or the ring's exchange (with "
           "overlap: its excess over the compute) at gloo's alpha/beta as timed now. The tables below add what it "
           "misses: the masked tile work of causal squares and the per-call cost.",
    KERNELS: "Fit t = c_call + t_pair x computed pairs (a causal square of s tokens computes s (s+1)/2 + s x {tile}/2: "
             "the masked halves of its diagonal key tiles). c_call is used below only when the fit is within "
             "{trusted:.0%} (a fit timed under load is not).",
    SOFTMAX_FIT: "Predicted = single-process time / (the busiest rank's kernel calls at the rate of the run's own "
                 "single case, + c_call per call + alpha x messages + bytes / beta, no overlap); (alpha, beta) fitted "
                 "on the OTHER lengths. Kernel only: without the exchange.",
    LASP: "Nothing fitted on these rows: the linear kernel's time is a + b N (least squares over single_linear), a "
          "rank runs it on N / 2 tokens, plus 2 messages of the state bytes at the fitted exchange.",
    HYBRID: "The run's own 'halves' time (the layer on N / 2 tokens) + the map's extra time (map - plain of its op, "
            "where measured) + the exchange at the fitted (alpha, beta): a check of the exchange and map terms.",
    STEP_FIT: "Predicted = measured P=1 step x the plan's compute ratio (busiest rank's FLOPs at P=2 / P=1) + every "
              "exchange of the step (the layers' closed-form bytes, ZeRO-2's reduce-scatter and all-gather) at the "
              "fitted (alpha, beta), not overlapped.",
    WINDOW: "Predicted = (the busiest rank's window pieces + exchange) / the measured plain time; a piece (per "
            "128 keys a tall causal block and a 128 x 128 anti square, as the CPU kernel cuts the band) costs "
            "c_call + t_pair x computed pairs at the run's own plain rate, tall x {tall:.2f}, anti x {anti:.2f}. "
            "The loop around the calls is not priced (window_cpu's rounds exceed its calls alone by 8-16%, 2-4% "
            "without a window).",
    WINDOW_BYTES: "Measured: window_cpu's CommStats; predicted: the plan's (cost.bytes.rank_bytes); closed form: "
                  "strategies/closed_form.py.",
    P4_BYTES: "This machine has 2 cores: a P=4 time measures the oversubscription, so no P=4 time is predicted; bytes "
              "and memory do not depend on the cores.",
    P4_MEMORY: "Off by more than 5%: {miss}. A phase whose P=1 ratio is the same is the count's miss at every P (the "
               "forward phase with the features never holds the peak).",
    STEP_PLAN: "Compute from FLOPs, the exchanges and ZeRO-2's collectives from the gloo alpha/beta. The absolute step "
               "times are {factor:.1f}x the measured ones (single-thread rates measured under this machine's load); "
               "the ratios cancel most of that.",
    MEMORY: "The largest phase slope measured against the plan's count (fp32, ZeRO-2, checkpoints on the device); with "
            "the strategy's comm buffers: an upper bound.",
}


class Run:
    """One bench run: its rows and parameters (facts["meta"]). ``table`` finds rows by the first words of
    the metric their suite names them with (bench/attention.py, window.py, hybrid.py, memory_rows.py):
    a metric renamed there is renamed here (tests/unit/test_plan_calibrate.py reads every one)."""

    def __init__(self, path: str):
        self.rows, facts = load_rows(path)
        if "meta" not in facts:
            raise PlanError(f"{path}: its facts lack \"meta\", the run's parameters --calibrate reads (the bench's "
                            f"meta of the run: P or world, seq, heads, head_dim, ...)")
        self.meta = facts["meta"]

    def table(self, metric: str) -> Dict[Tuple[str, str], Row]:
        return {(r.case, r.variant): r for r in self.rows if r.metric.startswith(metric)}


def messages(strategy: str, p: int) -> int:
    return 8 if strategy == "ulysses" else 2 if strategy.startswith("lasp") else 3 * (p - 1)


def trusted_cost(blocks: Optional[Dict[str, Any]]) -> Dict[str, float]:
    """c_call and the window factors of the timed blocks, or none of them when the fit is untrusted."""
    if not blocks or blocks.get("max_rel_residual", 1.0) > TRUSTED_RESIDUAL:
        return {"c_call_s": 0.0, "tall_factor": 1.0, "anti_factor": 1.0}
    return {k: blocks.get(k, 1.0) for k in ("c_call_s", "tall_factor", "anti_factor")}


def exchange_s(fit: Dict[str, float], msgs: int, nbytes: float) -> float:
    return fit["alpha_s"] * msgs + nbytes / fit["beta_bytes_s"]


def fit_exchange(rows: Sequence[Dict[str, Any]]) -> Dict[str, float]:
    """(alpha per message, beta) from measured - kernel over ``rows``."""
    a, b = lstsq2([(r["messages"], r["bytes"]) for r in rows], [r["measured_s"] - r["kernel_s"] for r in rows])
    return {"alpha_s": a, "beta_bytes_s": 1.0 / b if b > 0 else float("inf")}


def attention_cases(full: Run) -> Dict[int, Dict[str, Dict[str, Any]]]:
    """{N: {case: wall seconds, speedup, bytes and closed-form bytes of rank 0}} of an attention run."""
    sent, out = full.table("Bytes per rank"), {}
    for (case, variant), r in full.table("Attention fwd+bwd speedup").items():
        b = sent.get((case, variant))
        out.setdefault(int(variant[2:]), {})[case] = {"s": r.detail["wall s"], "speedup": r.value,
                                                      "bytes": b.value[0] if b and b.value else None,
                                                      "form": b.predicted[0] if b else None}
    return dict(sorted(out.items()))


def softmax_fit(full: Run, blocks: Optional[Dict[str, Any]]) -> Tuple[List[Row], Dict[str, float]]:
    """cpu_full's softmax rows predicted by kernel calls + exchange, each length with the fit of the
    others; and the fit over every row (what the other models reuse)."""
    p, heads, causal, c_call = full.meta["world"], full.meta["heads"], full.meta.get("causal", True), \
        trusted_cost(blocks)["c_call_s"]
    pts = []
    for n, cases in attention_cases(full).items():
        single = cases["single"]["s"]
        rate = {"c_call_s": 0.0, "t_pair_s": single / (computed_pairs(n, n, causal) * heads)}
        for s in (s for s in SOFTMAX if s in cases):
            calls = max(len(c) for c in times.rank_calls(s, p, n))
            kernel = times.busiest_kernel_s(s, p, n, heads, rate) + c_call * calls
            pts.append({"n": n, "strategy": s, "kernel_s": kernel, "calls": calls, "messages": messages(s, p),
                        "bytes": cases[s]["bytes"], "measured_s": cases[s]["s"], "single_s": single,
                        "measured": cases[s]["speedup"]})
    rows = []
    for r in pts:
        fit = fit_exchange([x for x in pts if x["n"] != r["n"]])
        t = r["kernel_s"] + exchange_s(fit, r["messages"], r["bytes"])
        rows.append(Row(SUITE, r["strategy"], f"N={r['n']}", SOFTMAX_FIT, "x", r["measured"],
                        predicted=r["single_s"] / t,
                        detail={"kernel only": r["single_s"] / r["kernel_s"], "busiest rank's calls": r["calls"],
                                "alpha ms (other lengths)": fit["alpha_s"] * 1e3,
                                "beta GB/s (other lengths)": fit["beta_bytes_s"] / 1e9}))
    return rows, fit_exchange(pts)


def lasp_rows(full: Run, fit: Dict[str, float]) -> List[Row]:
    """cpu_full's LASP cases (MEANING[LASP]); the state exchanged is one per head, whatever N."""
    p, cases = full.meta["world"], attention_cases(full)
    points = [(n, c["single_linear"]["s"]) for n, c in cases.items() if "single_linear" in c]
    if len(points) < 2:
        return []
    b, a = lstsq2([(n, 1.0) for n, _ in points], [t for _, t in points])
    return [Row(SUITE, s, f"N={n}", LASP, "x", cases[n][s]["speedup"], detail={"bytes/rank": cases[n][s]["bytes"]},
                predicted=single / (a + b * n / p + exchange_s(fit, messages(s, p), cases[n][s]["bytes"])))
            for n, single in points for s in ("lasp2", "lasp1") if s in cases[n]]


def hybrid_rows(hybrid: Run, fit: Dict[str, float]) -> List[Row]:
    """hybrid_cpu's real linear layers under LASP (MEANING[HYBRID])."""
    layer, sent, p = hybrid.table("One layer"), hybrid.table("Bytes per rank"), hybrid.meta.get("P", 2)
    ops = {fam: r.detail["map CPU s"] - r.detail["plain CPU s"] for (fam, _), r in hybrid.table("The local op").items()}
    rows = []
    for (fam, case), r in layer.items():
        if case not in ("lasp_allgather", "lasp_ring") or (fam, "single") not in layer or (fam, "halves") not in layer:
            continue
        single, extra, nbytes = layer[fam, "single"].detail["wall s"], ops.get(fam, 0.0), sent[fam, case].value[0]
        t = layer[fam, "halves"].detail["wall s"] + extra + exchange_s(fit, messages("lasp", p), nbytes)
        rows.append(Row(SUITE, fam, case, HYBRID, "x", r.value, predicted=single / t,
                        detail={"map extra s": extra, "bytes/rank": nbytes}))
    return rows


def step_rows(full: Run, fit: Dict[str, float], profile) -> Tuple[List[Row], List[Row]]:
    """cpu_full's training step at P = 2 over P = 1: (MEANING[STEP_FIT], MEANING[STEP_PLAN]). The step is
    the project's LM of the run's "train_model", fp32, ZeRO-2 (linear: every layer lasp)."""
    from .inputs import own_lm_shape
    from .search import Cluster, predict
    tm, fitted, planned = full.meta.get("train_model") or {}, [], []
    for (strategy, _), r in sorted(full.table("Whole training step").items()):
        linear, layers = strategy == "lasp", tm["n_layers"]
        shape = own_lm_shape({"dim": tm["dim"], "n_layers": layers, "n_heads": tm["n_heads"],
                              "attention": "linear" if linear else "softmax"}, "lm")
        one, two = (predict(Candidate(s, p, u, 2, Features()), shape, tm["seq_len"], Cluster(p, p, profile, "fp32"),
                            own_linear=linear)
                    for s, p, u in ((strategy if linear else "ulysses", 1, 1),
                                    (strategy, 2, 2 if strategy == "ulysses" else 1)))
        if not (one.compute_s and two.compute_s):
            continue
        one_s = r.detail["1 rank s/step"]
        nbytes = sum(two.comm_bytes.values()) * layers + times.zero_bytes(shape.params(), 2, 2, 4, 4)
        t = one_s * two.compute_s / one.compute_s + exchange_s(fit, messages(strategy, 2) * layers + 2, nbytes)
        fitted.append(Row(SUITE, strategy, f"seq {tm['seq_len']}", STEP_FIT, "x", r.value, predicted=one_s / t,
                          detail={"compute ratio": two.compute_s / one.compute_s, "bytes/rank per step": nbytes}))
        if strategy in ("zigzag", "ulysses"):
            planned.append(Row(SUITE, strategy, f"seq {tm['seq_len']}", STEP_PLAN, "x", r.value,
                               predicted=one.step_s / two.step_s, detail={
                                   "P=1 s measured": one_s, "P=1 s predicted": one.step_s,
                                   "P=2 s measured": r.detail["P ranks s/step"], "P=2 s predicted": two.step_s,
                                   "predicted comm s (P=2)": ", ".join(f"{k} {v:.3f}" for k, v in two.comm_s.items())}))
    return fitted, planned


def predict_speedups(comm: Dict[str, Any], kernels: Dict[str, float], meta: Dict[str, Any], n: int,
                     overlap: bool = True) -> Dict[str, float]:
    """The first model: attention fwd+bwd speedup at P ranks from the SDPA rate alone (the busiest rank's
    share: the contiguous ring does (2P-1)/P of the average) plus the all-to-alls, or the ring's
    exposed excess (overlapped) / all of it (not)."""
    p, e = meta["world"], 4 if meta["dtype"] == "fp32" else 2
    h, d = meta["heads"], meta["head_dim"]
    single = 3 * 2 * (n / 2) * h * (d + d) * n / kernels["attention_flops_s"]
    sh = Shapes(meta["batch"], n, h, meta["kv_heads"], d, e)
    out = {}
    for strategy in SOFTMAX:
        by_kind = closed_form_by_kind(strategy, p, sh)
        compute = single / p * ((2 * p - 1) / p if strategy == "ring" else 1.0)
        kind = "all_to_all" if strategy == "ulysses" else "ring"
        link = Link(comm[kind]["alpha_s"], comm[kind]["beta_bytes_s"])
        comm_s = link.time(by_kind["all_to_all"], 8) if strategy == "ulysses" else \
            times.ring_time(link, by_kind["ring"] + by_kind["ring_grad"], p, compute, overlap)
        out[strategy] = single / (compute + comm_s)
    return out


def first_model_rows(cal: Dict[str, Any], full: Run) -> List[Row]:
    rows = []
    for n, cases in attention_cases(full).items():
        ideal, serial = (predict_speedups(cal["comm"], cal["kernels"], full.meta, n, o) for o in (True, False))
        rows += [Row(SUITE, s, f"N={n}", FIRST, "x", cases[s]["speedup"], predicted=serial[s], detail={
            "predicted with overlap": ideal[s], "bytes / closed form": cases[s]["bytes"] / cases[s]["form"]})
            for s in SOFTMAX if s in cases]
    return rows


def plan_bytes(strategy: str, p: int, ulysses: int, shapes: Shapes, window: Optional[int]) -> List[int]:
    """Bytes each rank sends per fwd + bwd as the plan counts them (cost.bytes.rank_bytes)."""
    return [sum(b.values()) for b in rank_bytes(strategy, p, ulysses, shapes, Mask(True, window))]


def form_bytes(strategy: str, p: int, ulysses: int, shapes: Shapes, window: Optional[int]) -> List[int]:
    return [closed_form_bytes(strategy, p, shapes, r, ulysses, window=window) for r in range(p)]


def window_rows(window: Run, fit: Dict[str, float], blocks: Optional[Dict[str, Any]]) -> Tuple[List[Row], List[Row]]:
    """window_cpu's time ratio window / plain per (strategy, window) (MEANING[WINDOW]) and its bytes per
    rank: measured, plan, closed form."""
    m, base, times_, sent = window.meta, trusted_cost(blocks), window.table("Sliding window"), window.table("Bytes")
    alone = {(s, v.split(",")[0]): r.detail["kernel s"] for (s, v), r in window.table("Kernel calls alone").items()}
    p, n, heads = m["P"], m["seq"], m["heads"]
    shapes, ratios, nbytes = Shapes(1, n, heads, heads, m["head_dim"]), [], []
    for s in m["strategies"]:
        u, h, msgs = (p, heads / p, messages(s, p)) if s == "ulysses" else (1, heads, messages(s, p))
        plain_s = times_[s, str(m["windows"][0])].detail["plain s"]
        # the plain rate: its time less exchange and calls over its computed pairs (masked blocks as causal)
        plain_calls = [[(nq, nk, c or a, False) for nq, nk, c, a in r] for r in times.rank_calls(s, p, n)]
        unit = times.busiest_calls_s(plain_calls, dict(base, c_call_s=0.0, t_pair_s=1.0), h)
        plain_x = exchange_s(fit, msgs, max(plan_bytes(s, p, u, shapes, None)))
        cost = dict(base, t_pair_s=(plain_s - plain_x - base["c_call_s"] * max(len(c) for c in plain_calls)) / unit)
        for w in m["windows"]:
            calls, ours = times.rank_calls(s, p, n, True, w), plan_bytes(s, p, u, shapes, w)
            kernel, x = times.busiest_calls_s(calls, cost, h), exchange_s(fit, msgs, max(ours))
            ratios.append(Row(SUITE, s, f"w={w}", WINDOW, "x", times_[s, str(w)].value,
                              predicted=(kernel + x) / plain_s,
                              detail={"busiest rank's pieces": max(len(c) for c in calls), "kernel s priced": kernel,
                                      "kernel s timed alone": alone.get((s, str(w))), "exchange s": x}))
            nbytes.append(Row(SUITE, s, f"w={w}", WINDOW_BYTES, "B", sent[s, f"window={w}"].value, predicted=ours,
                              target="bytes", detail={"closed form": form_bytes(s, p, u, shapes, w)}))
    return ratios, nbytes


def p4_bytes_rows(seq: int = 8192, heads: int = 8, head_dim: int = 64, windows: Sequence[int] = (1024, 2048)
                  ) -> List[Row]:
    """P = 4: the plan's bytes per rank (cost.bytes.rank_bytes) against the closed form, every softmax
    strategy and the 2D hybrid, plain and windowed."""
    shapes = Shapes(1, seq, heads, heads, head_dim)
    return [Row(SUITE, s, f"U={u}, window={w or '-'}", P4_BYTES, "B", plan_bytes(s, 4, u, shapes, w),
                predicted=form_bytes(s, 4, u, shapes, w), target="bytes") for s, u in P4_LAYOUTS
            for w in (None,) + tuple(windows)]


def memory_variants(mem: Run, world: Optional[int] = None):
    """(label, P, tokens per rank fitted, {phase: measured bytes per token}, shape, features) of every
    variant memory_cpu fitted on two lengths or more (at P = ``world`` when given)."""
    m, points = mem.meta, mem.table("Every measurement")
    for (model, variant), r in mem.table("Bytes per token of each phase").items():
        p, on = int(variant.split()[0][2:]), variant.endswith(" on")
        lengths = sorted(int(v.split(", ")[1].split()[0]) for c, v in points
                         if c == model and v.startswith(variant + ","))
        if world not in (None, p) or len(lengths) < 2:
            continue
        shape = ModelShape(model, m["hidden"], m["layers"], m["heads"], m["kv_heads"], m["hidden"] // m["heads"],
                           m["intermediate"], m["vocab"], tied=model != "llama")
        f = Features(on=on, cpu_checkpointing=False, tiled_loss_tokens=m["tiled_loss_tokens"],
                     tiled_mlp_tokens=m["tiled_mlp_tokens"])
        yield f"{model}/P{p}/{'on' if on else 'off'}", p, lengths, {k: v * 1024 for k, v in r.detail.items()}, shape, f


def memory_rows(mem: Run) -> List[Row]:
    """Per variant: the largest phase slope (the bench's bytes per token per rank, MEANING[MEMORY])."""
    rows = []
    for label, p, _, slopes, shape, f in memory_variants(mem):
        lines = memory.phase_lines(shape, mem.meta["strategy"], p, 1, p, 2, "fp32", f, True)
        rows.append(Row(SUITE, label, "largest phase slope", MEMORY, "B", max(slopes.values()),
                        predicted=max(memory.per_token(shape, 4, f, True).values()),
                        detail={"with comm buffers (bound)": max(line["b"] for line in lines.values())}))
    return rows


def phase_rows(mem: Run, world: int = 4) -> List[Row]:
    """Per P = ``world`` variant and phase (and the step: its largest slope): the measured bytes per token
    per rank against the plan's, beside the P = 1 variant's ratio (a miss the same at P = 1 is the
    count's at every P)."""
    p1 = {(r.case.replace("/P1/", f"/P{world}/"), r.variant): r for r in (phase_rows(mem, 1) if world > 1 else [])}
    rows = []
    for label, _, lengths, slopes, shape, f in memory_variants(mem, world):
        ours, phases = memory.per_token(shape, 4, f, True), ("forward", "loss_backward", "layers_backward")
        measured, predicted = {ph: slopes[ph] for ph in phases}, {ph: ours[ph] for ph in phases}
        for d in (measured, predicted):
            d["step (largest slope)"] = max(d.values())
        for ph, value in measured.items():
            detail, o = {"tokens/rank fitted": ", ".join(map(str, lengths))}, p1.get((label, ph))
            if world > 1:
                ratio = f"{o.value / o.predicted:.3f} ({o.detail['tokens/rank fitted']})" if o else "-"
                detail["P=1 measured / predicted"] = ratio
            rows.append(Row(SUITE, label, ph, P4_MEMORY, "B", value, predicted=predicted[ph], detail=detail))
    return rows


__all__ = ["P4_LAYOUTS", "Run", "attention_cases", "exchange_s", "first_model_rows", "fit_exchange", "form_bytes",
           "hybrid_rows", "lasp_rows", "messages", "plan_bytes", "predict_speedups",
           "softmax_fit", "step_rows", "trusted_cost"]
