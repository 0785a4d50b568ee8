"""``ds-seqpar bench --window``: sliding windows, softcap and sinks against plain causal attention,
for every softmax strategy, side by side in one run (not a test).

    ds-seqpar bench --window [--P 2] [--seq 8192] [--windows 1024,2048] [--softcap 50] [--heads 8]
                             [--head-dim 64] [--repeats 5] [--warmup 1] [--kernel-rounds 3]
                             [--out reports] [--name window_cpu]

Per strategy the same N causal tokens as: plain ``sp.attention``, each ``--windows`` size, softcap
and sinks (one logit per head, a leaf with a gradient, as gpt-oss's parameter). The rounds are
--packed's (packed.interleaved_rounds: every (strategy, variant) once per round after a barrier, in
a fixed order, so load from other processes hits all alike); a case's time is its slowest rank's
wall time and every ratio is taken per round, then the median. Reported, per strategy:

  window    time(window) / time(plain) beside the work ratio the mask implies: visible (q, k) pairs
            of the busiest rank with the window / without it (query i sees min(i + 1, w) keys; a
            rank's queries are layout.indices; Ulysses: every rank 1/P of the heads of all of them),
            and their quotient, goal <= 1.3 for ring and zigzag (GOAL_PER_WORK)
  bytes     bytes each rank sent per fwd+bwd against closed_form_by_kind(..., window=...) (every
            variant; softcap and sinks against the plain form): must be 1.000
  softcap   time(softcap) / time(plain) (CPU: the exact written-out path, kernels/torch_kernel.py)
  sinks     time(sinks) / time(plain), goal overhead < 3% (GOAL_SINKS)
  kernel    after the rounds, rank 0 alone: the kernel calls of the busiest rank's sub-blocks, plain
            and windowed, without merges or communication (kernel_pieces): the cost per visible
            pair of the band pieces against plain attention's big blocks (--kernel-rounds 0: skip)
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, List, Optional, Tuple

from .machine import command_line, run_lines

STRATEGIES = ("ring", "zigzag", "striped", "ulysses")
GOAL_PER_WORK = 1.3             # time ratio / work ratio, ring and zigzag
GOAL_SINKS = 0.03               # sinks: time overhead over plain attention
PROG = "ds-seqpar bench --window"


def variants(args) -> List[Tuple[str, dict]]:
    """(key, sp.attention keywords) of every variant in round order: plain first, then sinks, whose
    few-percent difference is the one most exposed to load changes between the two."""
    return [("plain", {}), ("sinks", {"sinks": True})] + [(f"window={w}", {"window": w}) for w in args.windows] + \
        [(f"softcap={args.softcap:g}", {"softcap": args.softcap})]


def _case_fns(args):
    """{(strategy, variant): (run fwd+bwd, stats)} in a fixed order, on every rank."""
    import torch
    from ..sequence_parallel import SequenceParallel
    from .cases import attention_inputs
    from .packed import _fwd_bwd, strategy_config
    q, k, v, dout = attention_inputs(args.seq, args.heads, args.head_dim)
    sinks = torch.linspace(-1.0, 2.0, args.heads).requires_grad_()
    fns = {}
    for name in args.strategies:
        sp = SequenceParallel(strategy_config(name, args.P))
        shards = [sp.shard(t).clone() for t in (q, k, v, dout)]
        for key, kw in variants(args):
            kw = dict(kw, sinks=sinks) if "sinks" in kw else kw
            attend = lambda a, b, c, sp=sp, kw=kw: sp.attention(a, b, c, causal=True, **kw)  # noqa: E731
            fns[name, key] = (lambda attend=attend, x=shards: _fwd_bwd(attend, *x), sp.stats)
    return fns


def bench_rank(args) -> Dict[str, list]:
    """What every rank runs: warmup + repeats interleaved rounds of every (strategy, variant); then
    rank 0 alone times the kernel calls of the busiest rank's sub-blocks (kernel_pieces)."""
    from .. import comm
    from .packed import interleaved_rounds
    rounds = interleaved_rounds(_case_fns(args), args.warmup, args.repeats)
    out = {"rounds": rounds, "load_1min": os.getloadavg()[0]}
    if comm.global_rank() == 0 and args.kernel_rounds:
        out["pieces"] = kernel_pieces(args)
    comm.barrier()
    return out


def _policies(name: str, args, window: Optional[int]):
    """(busiest position, sub-blocks of (position, src), positions, local length, heads) of one strategy:
    the ring family's own blocks without a window, the masked policy (varlen.py, the torch kernel's
    tiles) with one; Ulysses one position, the whole sequence, heads / P."""
    from ..kernels import get_kernel
    from ..sharding.layouts import make_layout
    from ..strategies import STRATEGIES, get_strategy
    from ..strategies.ring_loop import plain_blocks
    from ..strategies.varlen import document_blocks, one_document, whole_sequence_blocks
    kernel, n = get_kernel("torch", "cpu"), args.seq
    tile = lambda size: kernel.causal_tile(size, "cpu")  # noqa: E731
    column = lambda width: kernel.band_column(width, "cpu")  # noqa: E731
    if name == "ulysses":
        if window is None:
            return 0, lambda me, src: plain_blocks(0, 0, 1, True, n), 1, n, args.heads // args.P
        policy = whole_sequence_blocks(one_document(n, None), True, tile, window, column)
        return 0, lambda me, src: policy(me, src, 1, True, n), 1, n, args.heads // args.P
    work = window_work(name, args.P, n, window)
    busiest, n = work.index(max(work)), n // args.P
    if window is None:
        blocks = STRATEGIES[name].blocks
        return busiest, lambda me, src: blocks(me, src, args.P, True, n), args.P, n, args.heads
    layout = make_layout(get_strategy(name).layout_name, args.P)
    policy = document_blocks(one_document(args.seq, None), layout, True, tile, window, column)
    return busiest, lambda me, src: policy(me, src, args.P, True, n), args.P, n, args.heads


def kernel_pieces(args) -> List[dict]:
    """One process, one thread: the kernel calls (fwd+bwd, no merge, no communication) of the busiest
    position's sub-blocks, per strategy, plain and with each window: the kernel's share of the window's
    cost, and its time per visible pair (small and diagonal pieces cost more per pair than big blocks)."""
    import statistics
    from ..kernels import get_kernel
    from ..strategies.bands import SubBlock, visible_pairs
    from .cases import attention_inputs, timed
    kernel, scale, rows = get_kernel("torch", "cpu"), args.head_dim ** -0.5, []
    for name in args.strategies:
        for window in [None] + list(args.windows):
            me, blocks, p, n, heads = _policies(name, args, window)
            q, k_own, v_own, dout = attention_inputs(n, heads, args.head_dim, seed=1)
            kv = {True: (k_own, v_own), False: tuple(attention_inputs(n, heads, args.head_dim, seed=2)[1:3])}
            whole = lambda s: slice(*s.indices(n))  # noqa: E731
            subs = [(src == me, SubBlock(whole(b.q), whole(b.k), b.causal, b.anti))
                    for src in range(p) for b in blocks(me, src)]

            def run():
                for own, b in subs:
                    k, v = kv[own]
                    out, lse = kernel.forward_block(q[:, b.q], k[:, b.k], v[:, b.k], b.causal, b.anti, scale)
                    kernel.backward_block(dout[:, b.q], q[:, b.q], k[:, b.k], v[:, b.k], out, lse, b.causal, b.anti,
                                          scale)
            cpu = statistics.median([timed(run)["cpu"] for _ in range(args.kernel_rounds + 1)][1:])
            pairs = sum(visible_pairs(b) for _, b in subs)
            rows.append({"strategy": name, "window": window, "rank": me, "subblocks": len(subs), "pairs": pairs,
                         "cpu": cpu, "ns_per_pair": cpu / pairs * 1e9})
    return rows


# -- what the numbers are held against ---------------------------------------------------------------


def window_work(name: str, p: int, seq: int, window: Optional[int]) -> List[int]:
    """Visible causal (q, k) pairs per rank (plan/cost's count; Ulysses: all queries, 1/P of the heads)."""
    from ..masks import Mask
    from ..plan.cost import pairs_per_rank
    return [int(x) for x in pairs_per_rank(name, p, p if name == "ulysses" else 1, seq, Mask(True, window))]


def policy_work(name: str, p: int, seq: int, window: Optional[int]) -> List[int]:
    """(q, k) pairs per rank the masked block policy computes (strategies/varlen.py), ring family."""
    from ..sharding.layouts import make_layout
    from ..strategies import get_strategy
    from ..strategies.varlen import document_blocks, one_document
    layout = make_layout(get_strategy(name).layout_name, p)
    policy = document_blocks(one_document(seq, None), layout, True, None, window)
    return [sum(policy.pairs(me, src) for src in range(p)) for me in range(p)]


def closed_forms(name: str, args, window: Optional[int]) -> List[int]:
    """Bytes per rank for one fwd+bwd (strategies/closed_form.py), with the window when given."""
    from ..strategies.closed_form import Shapes, closed_form_by_kind
    sh = Shapes(1, args.seq, args.heads, args.heads, args.head_dim)
    return [sum(closed_form_by_kind(name, args.P, sh, r, causal=True, window=window).values())
            for r in range(args.P)]


def summarize(per_rank, args) -> Dict[str, dict]:
    """Per strategy and variant: times (packed_report.case_times), per-round ratios to plain, bytes
    against the closed form; windows also the work per rank and the work ratio of the busiest rank."""
    from .packed_report import case_times, median_ratio, ratio_range
    out = {}
    for name in args.strategies:
        rows = {key: case_times(per_rank, f"{name}/{key}") for key, _ in variants(args)}
        plain = rows["plain"]
        plain["work"] = window_work(name, args.P, args.seq, None)
        for key, kw in variants(args):
            r, window = rows[key], kw.get("window")
            r["form"] = closed_forms(name, args, window)
            r["bytes_ratio"] = [m / f if f else float(m == 0) for m, f in zip(r["bytes"], r["form"])]
            if key == "plain":
                continue
            r["ratio"] = median_ratio(r["walls"], plain["walls"])
            r["ratio_range"] = ratio_range(r["walls"], plain["walls"])
            r["cpu_ratio"] = median_ratio(r["cpu_rounds"], plain["cpu_rounds"])
            if window is not None:
                r["work"] = window_work(name, args.P, args.seq, window)
                r["work_ratio"] = max(r["work"]) / max(plain["work"])
                r["per_work"], r["cpu_per_work"] = r["ratio"] / r["work_ratio"], r["cpu_ratio"] / r["work_ratio"]
        out[name] = rows
    return out


# -- the page ------------------------------------------------------------------------------------------


def _j(xs, fmt="{}") -> str:
    return " / ".join(fmt.format(x) for x in xs)


def _t(r) -> str:
    return f"{r['time']:.3f} ({r['min']:.3f}-{r['max']:.3f})"


def render(rows: Dict[str, dict], meta, pieces: Optional[List[dict]] = None) -> str:
    ok = lambda good: "**PASS**" if good else "**SHORT**"  # noqa: E731
    softcap = f"softcap={meta['softcap']:g}"
    lines = [
        f"# Sliding windows, softcap and sinks on CPU ranks: each against plain causal attention", "",
        f"P={meta['P']} ranks x 1 thread (gloo), N={meta['seq']} tokens, batch 1, {meta['heads']} heads x "
        f"{meta['head_dim']}, fp32, causal, forward + backward, kernel `torch` (CPU flash SDPA); variants per "
        f"strategy: plain, window {', '.join(map(str, meta['windows']))}, softcap {meta['softcap']:g}, sinks "
        f"(one logit per head, with its gradient). {meta['repeats']} interleaved rounds after {meta['warmup']} "
        f"warm-up round(s); times are medians (min-max) of the slowest rank's wall time; ratios are taken per "
        f"round (every variant of a strategy runs back to back with plain, under the same load), median "
        f"(min-max) over rounds; CPU ratio: the same with the busiest rank's thread CPU time.", "",
        *run_lines(meta),
        "## Sliding window: time with the window / time without it, against the work the mask leaves", "",
        "Work = visible causal (q, k) pairs per rank (query i sees min(i + 1, w) keys; a ring layout's rank holds "
        "layout.indices, Ulysses' every rank 1/P of the heads of all queries). Work ratio = busiest rank's work "
        "with the window / without it (the slowest rank sets the time). Goal: time ratio / work ratio <= "
        f"{GOAL_PER_WORK} for ring and zigzag.", "",
        "| strategy | window | plain s | window s | time ratio | CPU ratio | work per rank (plain) | work "
        "ratio | time / work | CPU / work | goal |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        for w in meta["windows"]:
            x = r[f"window={w}"]
            goal = (f"<= {GOAL_PER_WORK}: wall {ok(x['per_work'] <= GOAL_PER_WORK)}, CPU "
                    f"{ok(x['cpu_per_work'] <= GOAL_PER_WORK)}") if name in ("ring", "zigzag") else ""
            lines.append(f"| {name} | {w} | {_t(r['plain'])} | {_t(x)} | {x['ratio']:.3f} ({x['ratio_range'][0]:.3f}-"
                         f"{x['ratio_range'][1]:.3f}) | {x['cpu_ratio']:.3f} | {_j(x['work'])} "
                         f"({_j(r['plain']['work'])}) | {x['work_ratio']:.3f} | {x['per_work']:.2f} | "
                         f"{x['cpu_per_work']:.2f} | {goal} |")
    lines += ["", "## Bytes per rank against the closed form", "",
              "Bytes each rank sent in one fwd+bwd (CommStats) against `closed_form_by_kind(strategy, P, Shapes(...), "
              "rank, causal=True, window=...)` (softcap and sinks: the plain form; they change no exchange). "
              "Must be 1.000.", "",
              "| strategy | variant | bytes/rank measured | closed form | measured / closed form |",
              "|---|---|---|---|---|"]
    for name, r in rows.items():
        for key, x in r.items():
            lines.append(f"| {name} | {key} | {_j(x['bytes'])} | {_j(x['form'])} | "
                         f"{_j(x['bytes_ratio'], '{:.3f}')} |")
    lines += ["", "## Softcap and sinks: time / time of plain attention", "",
              f"Same shapes; softcap {meta['softcap']:g} takes the exact written-out path on CPU (row tiles of the "
              "math kernel: no fused op caps scores); sinks fold into the final merge. Goal: sinks overhead < "
              f"{GOAL_SINKS:.0%}.", "",
              "| strategy | plain s | softcap s | softcap ratio | CPU ratio | sinks s | sinks ratio | CPU ratio | "
              "sinks overhead | goal |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        c, s = r[softcap], r["sinks"]
        lines.append(f"| {name} | {_t(r['plain'])} | {_t(c)} | {c['ratio']:.3f} ({c['ratio_range'][0]:.3f}-"
                     f"{c['ratio_range'][1]:.3f}) | {c['cpu_ratio']:.3f} | {_t(s)} | {s['ratio']:.3f} "
                     f"({s['ratio_range'][0]:.3f}-{s['ratio_range'][1]:.3f}) | {s['cpu_ratio']:.3f} | "
                     f"{s['ratio'] - 1:+.1%} | < {GOAL_SINKS:.0%}: wall {ok(s['ratio'] - 1 < GOAL_SINKS)}, CPU "
                     f"{ok(s['cpu_ratio'] - 1 < GOAL_SINKS)} |")
    if pieces:
        lines += ["", "## Kernel calls alone: the busiest rank's sub-blocks with and without the window", "",
                  "One process, one thread, after the rounds: forward + backward of every sub-block the busiest "
                  "position computes (the strategy's blocks without a window; the masked policy's band pieces, cut "
                  "into the torch kernel's tiles, with one), no merge and no communication; median of "
                  f"{meta.get('kernel_rounds')} runs. Rounds CPU: that rank's median CPU seconds in the rounds above "
                  "(kernel + merges + the ring loop). Per pair / plain: the window's cost per visible pair over "
                  "plain attention's, which is what time / work measures, less the loop.", "",
                  "| strategy | window | rank | sub-blocks | visible pairs | kernel s | ns per pair | per pair / "
                  "plain | rounds CPU s |", "|---|---|---|---|---|---|---|---|---|"]
        base = {x["strategy"]: x["ns_per_pair"] for x in pieces if x["window"] is None}
        for x in pieces:
            key = "plain" if x["window"] is None else f"window={x['window']}"
            cpu = rows.get(x["strategy"], {}).get(key, {}).get("cpu")
            rounds_cpu = "" if cpu is None else f"{cpu[x['rank']]:.3f}"
            lines.append(f"| {x['strategy']} | {x['window'] or '-'} | {x['rank']} | {x['subblocks']} | {x['pairs']} | "
                         f"{x['cpu']:.3f} | {x['ns_per_pair']:.0f} | {x['ns_per_pair'] / base[x['strategy']]:.2f} | "
                         f"{rounds_cpu} |")
    lines += ["", meta.get("notes", ""), ""]
    return "\n".join(lines)


# -- command line ----------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    from .packed import page_options
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    ap.add_argument("--P", type=int, default=2)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--windows", type=ints, default=[1024, 2048], help="sliding window sizes, comma separated")
    ap.add_argument("--softcap", type=float, default=50.0)
    ap.add_argument("--strategies", default=",".join(STRATEGIES), help="comma list of ring, zigzag, striped, ulysses")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--kernel-rounds", type=int, default=3, help="rounds of the kernel-calls-alone timing on "
                    "rank 0 after the measurement (0: skip)")
    return page_options(ap, "window_cpu")


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


def write(rows, meta, out: str, pieces: Optional[List[dict]] = None) -> int:
    """<out>/<name>.md and the numbers behind it, <out>/<name>.json (--render re-writes the page)."""
    from .packed import write_page
    return write_page(render(rows, meta, pieces), {"rows": rows, "pieces": pieces, "meta": meta}, out, meta["name"],
                      PROG)


def main(argv: Optional[List[str]] = None) -> int:
    from .machine import machine_facts
    from .packed import measure_on_pool, render_saved
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.render:
        return render_saved(args.render, write, "pieces")
    args = resolve(args)
    per_rank, meta = measure_on_pool(bench_rank, args, command_line(PROG, argv))
    facts = machine_facts()
    meta.update(cpu_model=facts["cpu_model"], torch=facts["torch"], deepspeed=facts["deepspeed"])
    return write(summarize(per_rank, args), meta, args.out, per_rank[0].get("pieces"))


__all__ = ["main", "bench_rank", "summarize", "render", "write", "window_work", "policy_work", "closed_forms",
           "variants"]


if __name__ == "__main__":
    sys.exit(main())
