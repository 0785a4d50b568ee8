"""``ds-seqpar plan --lengths FILE``: the step time of a global batch of real documents under the best
static configuration, power-of-two dynamic groups and this project's dynamic groups, beside the
balance bound.

    ds-seqpar plan --lengths data/lengths/wikipedia.txt.gz --model configs/plan/llama3_8b.json --gpu h100

A step is ``--tokens-per-gpu`` x GPUs tokens of documents drawn from FILE (schedule.draw_lengths,
seeded), each cut at ``--seq-len`` (the longest document a configuration must hold). Every case is
placed by the real scheduler (schedule.schedule) with the runtime's own price of a document
(cost/documents.py, at the GPU's rates: placement_pricer), then timed by the cost model (cost.steps:
each document alone on its group, times.step_time; ZeRO's collectives per round and per step), the
step being the rounds strung along the ranks (schedule.critical_path_s):

    static:<s>   every configuration the planner searches at size s <= MAX_SPLIT holding --seq-len tokens over s
                 ranks (search.plan), its best for one such sequence; the documents packed into rows
                 of --seq-len tokens, one size (the main job's --lengths with an integer size)
    power-of-two each document on the smallest power-of-two group holding it, short documents never
                 filling a group's room, a barrier after every round (Megatron's dynamic context
                 parallelism); zigzag
    ours         the scheduler as the runtime runs it (size "dynamic"); zigzag
    bound        every document's work on one rank, spread evenly over the GPUs: no communication,
                 no rounds, no ZeRO

The dynamic cases try every max_tokens_per_rank T = --seq-len / s (s <= MAX_SPLIT) that a zigzag
configuration of size s holds in memory, with that configuration's memory features, and keep the
best; every case keeps the fastest of the ZeRO stages its configuration fits with.
"""
from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional

from ..cost.candidate import Candidate
from ..cost.documents import DocumentPricer, gpu_rates
from ..cost.steps import document_s, zero_times
from ..schedule import critical_path_s, draw_lengths, group_sizes, read_lengths, schedule
from .search import Cluster, plan

GPUS = (8, 64, 512)
MAX_SPLIT = 16          # sizes tried: T = --seq-len / s >= 8K at 128K (a smaller T only adds rounds; pricing
                        # every document on hundreds of ring positions takes minutes)


def placement_pricer(strategy: str, shape, cl: Cluster) -> DocumentPricer:
    """How the runtime's scheduler would price a document on this cluster: the cost model's one price
    (cost/documents.py) at the GPU's rates and the run's element size. The runtime places exactly so
    given ``pricer=placement_pricer(...)`` (DynamicSequenceParallel.schedule); its default prices in
    operations instead (cost.documents.SCHEDULER_RATES)."""
    return DocumentPricer(strategy, shape, 1, gpu_rates(cl.gpu, cl.dtype), 4 if cl.dtype == "fp32" else 2)


def seconds_of(make: Callable[[int], Candidate], shape, cl: Cluster) -> Callable[[int, int], float]:
    """seconds(length, group size) of a document alone on its group, the candidate of each size from
    ``make`` (cost.steps.document_s: compute and exposed communication on the GPU); cached."""
    seen: Dict[tuple, float] = {}

    def seconds(n: int, g: int) -> float:
        if (n, g) not in seen:
            seen[(n, g)] = document_s(make(g), shape, n, cl.gpu, cl.gpus_per_node, cl.dtype)
        return seen[(n, g)]
    return seconds


def run_case(lengths: List[int], sizes, t: int, stages: List[Candidate], make, shape, cl: Cluster,
             barrier: bool = False, fill: bool = True) -> Dict:
    """One case: the scheduler's rounds, placed by the runtime's price (placement_pricer; once: a
    document's price does not depend on the ZeRO stage), then timed in GPU seconds (each micro-batch its
    documents' document_s on its group) along the ranks with each stage of ``stages`` that fits, the
    fastest kept."""
    zero = [zero_times(shape, cl.gpu, cl.gpus, cl.gpus_per_node, c.zero, cl.dtype, c.features.offload_optimizer)
            for c in stages]
    # ours adds a round for balance where it pays its ZeRO collectives (power-of-two: Megatron's rule, as
    # published); the price is in seconds at the GPU's rates, so a round's ZeRO seconds are in its units
    strategy = stages[0].strategy
    sched = schedule(lengths, cl.gpus, t, sizes, strategy, pricer=placement_pricer(strategy, shape, cl),
                     fill_groups=fill, round_price=zero[0][0] if fill and len(sizes) > 1 else None)
    seconds = seconds_of(make, shape, cl)
    took = {id(mb): sum(seconds(n, mb.group.size) for n in mb.lengths) for row in sched.rounds for mb in row}
    rank_s = [sum(took[id(row[r])] for row in sched.rounds) for r in range(cl.gpus)]
    best = None
    for c, (per_round, per_step) in zip(stages, zero):
        step = critical_path_s(sched, per_round, barrier or c.zero == 3, seconds=lambda mb: took[id(mb)]) + per_step
        if best is None or step < best[0]:
            best = (step, c, len(sched.rounds) * per_round + per_step)
    step, c, zero_s = best
    config = c.label() if len(sizes) == 1 else f"{c.strategy} zero={c.zero} features={c.features.label}"
    mean = sum(rank_s) / cl.gpus
    return {"config": config, "T": t, "rounds": len(sched.rounds), "step_s": step, "zero_s": zero_s,
            "work_s": mean, "imbalance": max(rank_s) / mean if mean > 0 else 1.0, "sizes": sched.group_sizes}


def _same_but_zero(a: Candidate, b: Candidate) -> bool:
    return (a.strategy, a.size, a.ulysses_size, a.features) == (b.strategy, b.size, b.ulysses_size, b.features)


def _with_size(c: Candidate, g: int) -> Candidate:
    return Candidate(c.strategy, g, 1, c.zero, c.features, c.linear_strategy, c.lasp_comm)


def predict_cluster(shape, lengths: List[int], cl: Cluster, cap: int) -> Dict[str, Dict]:
    """{case: its prediction} for one cluster (module docstring)."""
    ok, _ = plan(shape, cap, cl)
    best_of: Dict[int, List[Candidate]] = {}
    zigzag_of: Dict[int, List[Candidate]] = {}
    for p in ok:                    # ranked: the first of each size is its best; with it, its other ZeRO stages
        c = p.candidate
        for table, take in ((best_of, True), (zigzag_of, c.strategy == "zigzag" and c.ulysses_size == 1)):
            if take and (c.size not in table or _same_but_zero(table[c.size][0], c)):
                table.setdefault(c.size, []).append(c)
    out: Dict[str, Dict] = {}
    for s, cs in sorted((s, cs) for s, cs in best_of.items() if s <= MAX_SPLIT):
        out[f"static:{s}"] = run_case(lengths, (s,), cap // s, cs, lambda g, c=cs[0]: c, shape, cl)
    if not out:
        raise ValueError(f"no static configuration of {shape.name} holds {cap:,} tokens on {cl.gpus} x {cl.gpu.name}")
    pow2 = tuple(s for s in group_sizes(cl.gpus) if s & (s - 1) == 0)
    dynamic = (("power-of-two", pow2, True, False), ("ours", group_sizes(cl.gpus), False, True))
    for name, sizes, barrier, fill in dynamic:
        tries = [run_case(lengths, sizes, cap // s, cs, lambda g, c=cs[0]: _with_size(c, g), shape, cl, barrier, fill)
                 for s, cs in sorted(zigzag_of.items()) if s in sizes and cap % s == 0 and s <= MAX_SPLIT]
        if tries:
            out[name] = min(tries, key=lambda r: r["step_s"])
    first = _with_size((zigzag_of[min(zigzag_of)] if zigzag_of else next(iter(best_of.values())))[0], 1)
    one = seconds_of(lambda g: first, shape, cl)
    out["bound"] = {"config": f"{first.strategy} features={first.features.label}, every document on one rank: no "
                              f"communication, rounds or ZeRO", "candidate": first,
                    "step_s": sum(one(n, 1) for n in lengths) / cl.gpus}
    return out


def predict(shape, path: str, gpu, gpus=GPUS, gpus_per_node: int = 8, cap: int = 131072,
            tokens_per_gpu: int = 65536, dtype: str = "bf16", seed: int = 0) -> Dict[int, Dict]:
    """{gpus: {case: prediction}} for the documents of ``path``."""
    table = read_lengths(path)
    out = {}
    for g in gpus:
        lengths = draw_lengths(table, g * tokens_per_gpu, cap, seed)
        out[g] = predict_cluster(shape, lengths, Cluster(g, min(gpus_per_node, g), gpu, dtype), cap)
        out[g]["documents"] = {"count": len(lengths), "tokens": sum(lengths)}
    return out


def render(name: str, result: Dict[int, Dict]) -> List[str]:
    """Markdown: per cluster, one row per case. "work s": the documents' priced seconds per rank on
    average (compute and exposed communication); "ZeRO s": its per-round and per-step collectives."""
    lines = []
    for g, cases in result.items():
        docs = cases["documents"]
        statics = {k: v for k, v in cases.items() if k.startswith("static:")}
        best = min(statics, key=lambda k: statics[k]["step_s"])
        bound = cases["bound"]["step_s"]
        lines += [f"{name}, {g} GPUs: {docs['count']:,} documents, {docs['tokens']:,} tokens; best static {best}", "",
                  "| case | configuration | T | rounds | group sizes | priced imbalance | work s | ZeRO s | step s | "
                  "tokens/s | vs best static | vs bound |", "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
        for k, v in cases.items():
            if k == "documents":
                continue
            cells = [k, v["config"], v.get("T", "-"), v.get("rounds", "-"),
                     " / ".join(str(s) for s in v.get("sizes", [])) or "-",
                     f"{v['imbalance']:.3f}" if "imbalance" in v else "-",
                     f"{v['work_s']:.2f}" if "work_s" in v else "-", f"{v['zero_s']:.2f}" if "zero_s" in v else "-",
                     f"{v['step_s']:.2f}", f"{docs['tokens'] / v['step_s']:,.0f}",
                     f"{statics[best]['step_s'] / v['step_s']:.2f}x", f"{bound / v['step_s']:.2f}"]
            lines.append("| " + " | ".join(str(c) for c in cells) + " |")
        lines.append("")
    return lines


def run(opts) -> int:
    from .hardware import PlanError, load_gpu
    from .inputs import load_model
    if not opts.model:
        raise PlanError("--lengths needs --model (e.g. configs/plan/llama3_8b.json)")
    if (opts.seq_len is not None and opts.seq_len < 2) or opts.tokens_per_gpu < 1:
        raise PlanError(f"--seq-len={opts.seq_len} (the longest document) must be >= 2 and --tokens-per-gpu="
                        f"{opts.tokens_per_gpu} >= 1")
    paths = opts.lengths.split(",")
    for path in paths:                                   # a bad file stops before the model is loaded
        read_lengths(path)
    shape, gpu = load_model(opts.model), load_gpu(opts.gpu)
    gpus = (opts.gpus,) if opts.gpus else GPUS
    for path in paths:
        t0 = time.perf_counter()
        result = predict(shape, path, gpu, gpus, opts.gpus_per_node, opts.seq_len or 131072, opts.tokens_per_gpu,
                         opts.dtype, opts.seed)
        print("\n".join(render(path, result)))
        print(f"({time.perf_counter() - t0:.0f} s)\n")
    return 0


__all__ = ["GPUS", "placement_pricer", "predict", "predict_cluster", "render", "run", "seconds_of"]
