"""``ds-seqpar bench window``: sliding windows, softcap and sinks against plain causal attention, for
every softmax strategy, side by side in one run (not a test).

Per strategy the same N causal tokens as plain ``sp.attention``, each ``--windows`` size, softcap and
sinks (one logit per head, a leaf with a gradient), in the harness's interleaved rounds; every ratio is
taken per round against plain, then the median. After the rounds rank 0 alone times the kernel calls of
the busiest rank's sub-blocks (``--kernel-rounds 0``: skip). The page (facts below) says what each table
means and which goal it is held to; the work is the cost model's, the bytes the closed forms.
"""
from __future__ import annotations

import argparse
from typing import Dict, List, Optional, Tuple

from ..cost import pairs_per_rank
from ..cost.times import rank_calls
from ..masks import Mask
from ..report.rows import Row
from ..report.targets import TARGETS
from ..strategies.closed_form import Shapes
from .harness import (alone, attention_inputs, attention_line, case_times, closed_form, command_line, fwd_bwd,
                      measure_on_pool, rank_rounds, strategy_config, suite_facts, suite_main, suite_parser, versus,
                      write_page)

STRATEGIES = ("ring", "zigzag", "striped", "ulysses")
PROG = "ds-seqpar bench window"


def variants(args) -> List[Tuple[str, dict]]:
    """(key, sp.attention keywords) of every variant in round order: plain first, then sinks, whose
    few-percent difference is the one most exposed to load changes between the two."""
    return [("plain", {}), ("sinks", {"sinks": True})] + [(f"window={w}", {"window": w}) for w in args.windows] + \
        [(f"softcap={args.softcap:g}", {"softcap": args.softcap})]


def _case_fns(args, rank: int):
    """{(strategy, variant): (run fwd+bwd, stats)} in a fixed order, on every rank."""
    import torch
    from ..sequence_parallel import SequenceParallel
    q, k, v, dout = attention_inputs(args.seq, args.heads, args.head_dim)
    sinks = torch.linspace(-1.0, 2.0, args.heads).requires_grad_()
    fns = {}
    for name in args.strategies:
        sp = SequenceParallel(strategy_config(name, args.P))
        shards = [sp.shard(t).clone() for t in (q, k, v, dout)]
        for key, kw in variants(args):
            kw = dict(kw, sinks=sinks) if "sinks" in kw else kw
            attend = lambda a, b, c, sp=sp, kw=kw: sp.attention(a, b, c, causal=True, **kw)  # noqa: E731
            fns[name, key] = (lambda attend=attend, x=shards: fwd_bwd(attend, *x), sp.stats)
    return fns


def bench_rank(args) -> Dict[str, list]:
    """Every rank: the interleaved rounds of every (strategy, variant); then rank 0 alone times the kernel
    calls of the busiest rank's sub-blocks (kernel_pieces)."""
    return rank_rounds(args, _case_fns, ("pieces", kernel_pieces) if args.kernel_rounds else None)


def window_work(name: str, p: int, seq: int, window: Optional[int]) -> List[int]:
    """Visible causal (q, k) pairs per rank (Ulysses: all queries, 1/P of the heads)."""
    return [int(x) for x in pairs_per_rank(name, p, p if name == "ulysses" else 1, seq, Mask(True, window))]


def kernel_pieces(args) -> List[dict]:
    """One process, one thread: the kernel calls (fwd+bwd, no merge, no communication) of the busiest
    position, per strategy, plain and with each window: the calls the cost model prices
    (cost.times.rank_calls: the ring family's own blocks without a window, the masked plan's bands as the
    torch kernel's ``band`` cuts them with one; Ulysses one position, heads / P). The kernel's share of the
    window's cost, and its time per visible pair (small and diagonal pieces cost more than big blocks)."""
    import statistics
    import torch
    from ..kernels import get_kernel
    from ..kernels.bands import SubBlock, visible_pairs
    kernel, scale, rows = get_kernel("torch", "cpu"), args.head_dim ** -0.5, []
    g, d = torch.Generator().manual_seed(1), args.head_dim
    for name in args.strategies:
        heads = args.heads // args.P if name == "ulysses" else args.heads
        for window in [None] + list(args.windows):
            work = window_work(name, args.P, args.seq, window)
            me = 0 if name == "ulysses" else work.index(max(work))
            calls = rank_calls(name, args.P, args.seq, True, window)[me]
            # every call on views of one buffer's first rows, as a rank's calls are views of its tokens
            q, dout = (torch.randn(1, max(c[0] for c in calls), heads, d, generator=g) for _ in range(2))
            k, v = (torch.randn(1, max(c[1] for c in calls), heads, d, generator=g) for _ in range(2))

            def run():
                for nq, nk, causal, anti in calls:
                    qs, ks, vs, ds = q[:, :nq], k[:, :nk], v[:, :nk], dout[:, :nq]
                    out, lse = kernel.forward_block(qs, ks, vs, causal, anti, scale)
                    kernel.backward_block(ds, qs, ks, vs, out, lse, causal, anti, scale)
            cpu = statistics.median(alone({"run": run}, args.kernel_rounds, warmup=1)["run"])
            pairs = sum(visible_pairs(SubBlock(slice(0, nq), slice(0, nk), c, a)) for nq, nk, c, a in calls)
            rows.append({"strategy": name, "window": window, "rank": me, "subblocks": len(calls), "pairs": pairs,
                         "cpu": cpu, "ns_per_pair": cpu / pairs * 1e9})
    return rows


# -- the rows ------------------------------------------------------------------------------------------


WINDOW = "Sliding window: time with the window / time without it, against the work the mask leaves"
BYTES = "Bytes per rank against the closed form"
SOFTCAP_SINKS = (f"Softcap and sinks: time / time of plain attention (sinks overhead: goal "
                 f"{TARGETS['sinks'].text()})")
KERNEL = "Kernel calls alone: the busiest rank's sub-blocks with and without the window"


def rows(per_rank, args, pieces: Optional[List[dict]] = None) -> List[Row]:
    """Per strategy (harness.case_times, each variant against plain per round, harness.versus): the window's
    time ratio against its work ratio, bytes per variant against the closed form, softcap and sinks against
    plain; then the kernel calls alone per visible pair."""
    win, sent, capped, times = [], [], [], {}
    shapes = Shapes(1, args.seq, args.heads, args.heads, args.head_dim)
    for name in args.strategies:
        t = times[name] = {key: case_times(per_rank, f"{name}/{key}") for key, _ in variants(args)}
        plain, plain_work = t["plain"], window_work(name, args.P, args.seq, None)
        for w in args.windows:
            x, work = t[f"window={w}"], window_work(name, args.P, args.seq, w)
            vs, work_ratio = versus(x, plain), max(work) / max(plain_work)
            win.append(Row("window", name, str(w), WINDOW, "x", vs["ratio"], tuple(vs["ratio_range"]),
                           predicted=work_ratio, target="window" if name in ("ring", "zigzag") else None,
                           detail={"plain s": plain["time"], "window s": x["time"], "CPU ratio": vs["cpu_ratio"],
                                   "CPU / work": vs["cpu_ratio"] / work_ratio, "work per rank": work,
                                   "work per rank (plain)": plain_work}))
        sent += [Row("window", name, key, BYTES, "B", t[key]["bytes"], target="bytes",
                     predicted=closed_form(name, args.P, shapes, window=kw.get("window")))
                 for key, kw in variants(args)]
        for key in (f"softcap={args.softcap:g}", "sinks"):
            vs = versus(t[key], plain)
            capped.append(Row("window", name, key, SOFTCAP_SINKS, "x", vs["ratio"], tuple(vs["ratio_range"]),
                              target="sinks" if key == "sinks" else None,
                              detail={"plain s": plain["time"], "s": t[key]["time"], "CPU ratio": vs["cpu_ratio"]}))
    out = win + sent + capped
    base = {x["strategy"]: x["ns_per_pair"] for x in pieces or [] if x["window"] is None}
    for x in pieces or []:
        key = "plain" if x["window"] is None else f"window={x['window']}"
        cpu = times.get(x["strategy"], {}).get(key, {}).get("cpu")
        out.append(Row("window", x["strategy"], f"{x['window'] or '-'}, rank {x['rank']}", KERNEL, "ns per pair",
                       x["ns_per_pair"], detail={
                           "sub-blocks": x["subblocks"], "visible pairs": x["pairs"], "kernel s": x["cpu"],
                           "per pair / plain": x["ns_per_pair"] / base[x["strategy"]],
                           "rounds CPU s": None if cpu is None else cpu[x["rank"]]}))
    return out


def facts(meta) -> dict:
    return suite_facts(
        meta, "Sliding windows, softcap and sinks on CPU ranks: each against plain causal attention",
        f"{attention_line(meta)}; variants per strategy: plain, window {', '.join(map(str, meta['windows']))}, "
        f"softcap {meta['softcap']:g}, sinks (one logit per head, with its gradient).", {
            WINDOW: "Predicted: the work ratio, visible causal (q, k) pairs of the busiest rank with the window / "
                    "without it (query i sees min(i + 1, w) keys; a ring layout's rank holds layout.indices, "
                    "Ulysses' every rank 1/P of the heads of all queries). Goal: time ratio / work ratio "
                    f"{TARGETS['window'].text()} for ring and zigzag.",
            BYTES: "Bytes each rank sent in one fwd+bwd (CommStats) against `closed_form_by_kind(strategy, P, "
                   "Shapes(...), rank, causal=True, window=...)` (softcap and sinks: the plain form).",
            SOFTCAP_SINKS: f"Same shapes; softcap {meta['softcap']:g} takes the exact written-out path on CPU (row "
                           f"tiles of the math kernel: no fused op caps scores); sinks fold into the final merge.",
            KERNEL: "One process, one thread, after the rounds: forward + backward of every sub-block the busiest "
                    "position computes (the strategy's blocks without a window; the masked policy's band pieces with "
                    f"one), no merge and no communication; median of {meta.get('kernel_rounds')} runs. Rounds CPU: "
                    "that rank's median CPU seconds in the rounds above (kernel + merges + the ring loop)."},
        rounds=True)


# -- command line ----------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    ap = suite_parser(PROG, __doc__, "window_cpu", P=2, seq=8192, heads=8, head_dim=64)
    ap.add_argument("--windows", type=ints, default=[1024, 2048], help="sliding window sizes, comma separated")
    ap.add_argument("--softcap", type=float, default=50.0)
    ap.add_argument("--strategies", default=",".join(STRATEGIES), help="comma list of ring, zigzag, striped, ulysses")
    ap.add_argument("--kernel-rounds", type=int, default=3, help="rounds of the kernel-calls-alone timing on "
                    "rank 0 after the measurement (0: skip)")
    return ap


def resolve(args) -> argparse.Namespace:
    args.strategies = tuple(s for s in args.strategies.split(",") if s)
    bad = [s for s in args.strategies if s not in STRATEGIES]
    if bad or not args.strategies:
        raise SystemExit(f"{PROG}: --strategies {bad or args.strategies}: choose from {', '.join(STRATEGIES)}")
    if args.P < 2 or args.seq % (4 * args.P) or ("ulysses" in args.strategies and args.heads % args.P):
        raise SystemExit(f"{PROG}: --seq {args.seq} must be a multiple of 4*P and --heads {args.heads} of P "
                         f"(Ulysses), with --P {args.P} >= 2")
    if not args.windows or min(args.windows) < 1 or args.softcap <= 0 or args.repeats < 1 or args.warmup < 0:
        raise SystemExit(f"{PROG}: --windows {args.windows} must be sizes >= 1, --softcap {args.softcap} > 0, "
                         f"--repeats >= 1, --warmup >= 0")
    return args


def write(found: List[Row], meta, out: str) -> int:
    return write_page(out, meta["name"], found, dict(facts(meta), meta=meta),
                      PROG)        # meta: the run's parameters plan --calibrate reads


def measure(args, argv: List[str]) -> int:
    per_rank, meta = measure_on_pool(bench_rank, resolve(args), command_line(PROG, argv), versions=True)
    return write(rows(per_rank, args, per_rank[0].get("pieces")), meta, args.out)


def main(argv: Optional[List[str]] = None) -> int:
    return suite_main(argv, build_parser(), measure)
