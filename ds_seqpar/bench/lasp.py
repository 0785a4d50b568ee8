"""LASP benchmark on local CPU ranks (not a test): causal linear attention fwd+bwd, single process vs
LASP-2 (lasp_comm allgather) and LASP-1 (lasp_comm ring) on the same total work, side by side in one run.

    python -m ds_seqpar.bench_lasp [--world 2] [--seq 8192] [--heads 8] [--head-dim 64]
                                   [--repeats 7] [--warmup 1] [--no-decay] [--out reports/lasp_cpu.md]

Each round runs single, LASP-2, LASP-1, halves once, in that order, after a barrier; rounds repeat
(warm-up rounds dropped), so load from other processes hits all cases alike. "single" is the
chunked kernel (linear_attention) on the whole sequence on rank 0 (one thread) while the other
ranks wait in a barrier. "halves" is not attention over the sequence: every rank runs that kernel
on its own N/P tokens and exchanges nothing, the bound no exact scheme beats on this machine
(ranks running at once share caches and memory bandwidth). Timing, CPU ratio, imbalance and comm
wait are as in bench_ring (whose helpers this reuses): a case's time is the slowest rank's wall
time, medians over rounds; below the table, the kernel CPU time of each rank position at N/P tokens. The
decay is the small LM's, lambda_h = 1 - 2^-(5+h), unless --no-decay.
"""
from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time
from typing import Dict, List

from .cases import _fwd_bwd, _inputs, _timed

CASES = ("single", "lasp2", "lasp1", "halves")
COMM = {"lasp2": "allgather", "lasp1": "ring"}
TARGETS = {"lasp2": ">= 1.85"}
LABELS = {"single": "single", "lasp2": "lasp2 (allgather)", "lasp1": "lasp1 (ring)",
          "halves": "halves (no states: bound)"}


def _decay(heads: int, use: bool):
    import torch
    return 1 - 2.0 ** (-5 - torch.arange(heads, dtype=torch.float32)) if use else None


def _bench_rank(world, seq, heads, head_dim, use_decay, warmup, repeats) -> Dict[str, List[dict]]:
    """Runs on every rank: all cases, interleaved, warmup + repeats rounds."""
    from .. import comm
    from ..kernels.linear import linear_attention
    from ..sequence_parallel import SequenceParallel
    q, k, v, dout = _inputs(seq, heads, head_dim)
    decay = _decay(heads, use_decay)
    sps = {name: SequenceParallel({"strategy": "lasp", "size": world, "lasp_comm": mode})
           for name, mode in COMM.items()}
    shards = {name: [sp.shard(t) for t in (q, k, v, dout)] for name, sp in sps.items()}
    rank = comm.global_rank()
    results: Dict[str, List[dict]] = {name: [] for name in CASES}
    for rnd in range(warmup + repeats):
        for name in CASES:
            comm.barrier()
            if name in ("single", "halves"):
                attend = lambda q_, k_, v_: linear_attention(q_, k_, v_, decay)  # noqa: E731
                if name == "halves":    # every rank, its own N/P tokens, no states: the parallel bound
                    res = _timed(lambda: _fwd_bwd(attend, *shards["lasp2"]))
                else:
                    res = _timed(lambda: _fwd_bwd(attend, q, k, v, dout)) if rank == 0 else None
            else:
                sp = sps[name]
                attend = lambda q_, k_, v_, sp=sp: sp.linear_attention(q_, k_, v_, decay)  # noqa: E731
                res = _timed(lambda: _fwd_bwd(attend, *shards[name]), sp.stats)
            if rnd >= warmup and res is not None:
                results[name].append(res)
    comm.barrier()
    if rank == 0:   # alone on the machine's share of rank 0, after the rounds
        results["breakdown"] = _breakdown(seq // world, heads, head_dim, use_decay, repeats)
    comm.barrier()
    return results


def _rank_kernel(la, q, k, v, dout, decay, state_in, dstate_local, send_own: bool):
    """The kernel calls of one LASP rank's forward + backward (strategies/lasp.py), without the transfers."""
    fwd = la.forward_begin(q, k, v, decay)
    if send_own:
        la.forward_states(fwd)
    if state_in is not None:
        la.forward_diagonal(fwd)
        la.forward_states(fwd, state_in)
    la.forward_finish(fwd)
    bwd = la.backward_begin(dout, q, k, v, decay, 64, state_in)
    la.backward_local(bwd)
    la.backward_finish(bwd, dstate_local)


def _breakdown(local_len, heads, head_dim, use_decay, repeats) -> Dict[str, float]:
    """Median thread CPU seconds of the kernel work of one fwd+bwd at the local length: a block with
    no states (what 'halves' runs), and each LASP rank position, whose state work the single process
    never does (rank 0 sends its state and receives its gradient, the last rank the other way round)."""
    from ..kernels import linear as la
    q, k, v, dout = _inputs(local_len, heads, head_dim)
    decay = _decay(heads, use_decay)
    state = la.intra_forward(q, k, v, decay)[1]
    pieces = {"no states (intra_forward + intra_backward)":
              lambda: (la.intra_forward(q, k, v, decay), la.intra_backward(dout, q, k, v, decay)),
              "first rank (state_local out, dstate_local in)":
              lambda: _rank_kernel(la, q, k, v, dout, decay, None, state, True),
              "middle rank, allgather (both)": lambda: _rank_kernel(la, q, k, v, dout, decay, state, state, True),
              "last rank (state_in in, dstate_in out)":
              lambda: _rank_kernel(la, q, k, v, dout, decay, state, None, False)}
    names = list(pieces)
    times = {name: [] for name in names}
    # interleaved, each round starting at the next piece: load from other processes and allocator
    # state hit all pieces alike; 3x the rounds because single pieces are short and noisy
    for rnd in range(3 * repeats):
        for name in names[rnd % len(names):] + names[:rnd % len(names)]:
            times[name].append(_timed(pieces[name])["cpu"])
    return {name: statistics.median(ts) for name, ts in times.items()}


def closed_form_bytes(name, world, rank, heads, head_dim, batch=1) -> int:
    """Bytes one rank sends for one fwd+bwd (strategies/lasp.py): independent of the sequence length."""
    state_bytes = batch * heads * head_dim * head_dim * 4
    if COMM[name] == "ring":
        return state_bytes * ((rank < world - 1) + (rank > 0))
    return state_bytes * 2 * (world - 1)


def summarize(per_rank: List[Dict[str, List[dict]]], world, heads, head_dim) -> List[dict]:
    """One row per case: medians over rounds; time = slowest rank per round."""
    t_single = statistics.median(r["wall"] for r in per_rank[0]["single"])
    cpu_single = statistics.median(r["cpu"] for r in per_rank[0]["single"])
    rows = []
    for name in CASES:
        ranks = [res[name] for res in per_rank if res[name]]
        walls = [max(r[i]["wall"] for r in ranks) for i in range(len(ranks[0]))]
        cpu = [statistics.median(x["cpu"] for x in r) for r in ranks]
        row = {"case": LABELS[name], "time": statistics.median(walls),
               "min": min(walls), "max": max(walls), "speedup": t_single / statistics.median(walls), "cpu": cpu,
               "imbalance": max(cpu) / (sum(cpu) / len(cpu)), "cpu_ratio": cpu_single / max(cpu)}
        if name in COMM:
            row["wait"] = [statistics.median(x["wait"] for x in r) for r in ranks]
            sent = [sorted({x["bytes"] for x in r}) for r in ranks]
            want = [[closed_form_bytes(name, world, rank, heads, head_dim)] for rank in range(world)]
            row["bytes"] = f"{sent} = closed form" if sent == want else f"MISMATCH {sent} vs closed form {want}"
        rows.append(row)
    return rows


def render(rows, meta) -> str:
    lasp2, lasp1 = rows[1]["time"], rows[2]["time"]
    lines = [
        "# LASP (causal linear attention) on CPU ranks: speedup over one process",
        "",
        f"P={meta['world']} ranks x 1 thread, N={meta['seq']} tokens, batch 1, {meta['heads']} heads, "
        f"head_dim {meta['head_dim']}, fp32, forward + backward, decay "
        f"{'lambda_h = 1 - 2^-(5+h)' if meta['decay'] else 'none'}, chunked kernel (chunk 64). "
        f"{meta['repeats']} interleaved rounds after {meta['warmup']} warm-up round(s); medians.",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"Machine: {meta['cpus']} CPUs; load average before {meta['load_before']}, after {meta['load_after']}; "
        f"wall time of the whole run {meta['elapsed']:.0f} s.",
        "",
        "| case | median s (min-max) | speedup vs single | target | CPU s per rank | CPU ratio | "
        "imbalance max/mean | comm wait s per rank | bytes sent per rank (rank 0, 1, ...) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        fmt = lambda xs: " / ".join(f"{x:.3f}" for x in xs)  # noqa: E731
        lines.append(f"| {r['case']} | {r['time']:.3f} ({r['min']:.3f}-{r['max']:.3f}) | {r['speedup']:.2f} | "
                     f"{TARGETS.get(r['case'].split()[0], '')} | {fmt(r['cpu'])} | {r['cpu_ratio']:.2f} | "
                     f"{r['imbalance']:.2f} | {fmt(r['wait']) if 'wait' in r else ''} | {r.get('bytes', '')} |")
    halves = rows[3]["time"]
    lines += ["", f"LASP-1 / LASP-2 time ratio: {lasp1 / lasp2:.2f}. Cost of the states over halves: "
              f"LASP-2 {lasp2 / halves:.2f}x, LASP-1 {lasp1 / halves:.2f}x.", ""]
    pieces = meta["breakdown"]
    base = next(iter(pieces.values()))
    lines += [f"Kernel work of one fwd+bwd at the local length N/P = {meta['seq'] // meta['world']} (rank 0's "
              f"process after the rounds, no transfers, median CPU s; extra = over the block with no states):",
              "", "| rank position | CPU s | extra |", "|---|---|---|"]
    lines += [f"| {name} | {t:.4f} | {t / base - 1:+.1%} |" for name, t in pieces.items()]
    lines += ["", meta.get("notes", ""), ""]
    return "\n".join(lines)


def main(argv=None) -> List[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--no-decay", action="store_true", help="decay None instead of the LM's per-head decay")
    ap.add_argument("--out", default="reports/lasp_cpu.md")
    ap.add_argument("--notes", default="", help="free text appended to the report")
    args = ap.parse_args(argv)
    from ..launch.rankpool import RankPool
    load_before, start = os.getloadavg(), time.monotonic()
    pool = RankPool(args.world, timeout_s=3600.0, threads_per_rank=1).start()
    try:
        per_rank = pool.run(_bench_rank, args.world, args.seq, args.heads, args.head_dim, not args.no_decay,
                            args.warmup, args.repeats, timeout=3600.0)
    finally:
        pool.close()
    rows = summarize(per_rank, args.world, args.heads, args.head_dim)
    meta = dict(vars(args), decay=not args.no_decay, breakdown=per_rank[0]["breakdown"], cpus=os.cpu_count(),
                elapsed=time.monotonic() - start,
                load_before=" ".join(f"{x:.2f}" for x in load_before),
                load_after=" ".join(f"{x:.2f}" for x in os.getloadavg()),
                command="python -m ds_seqpar.bench_lasp " + " ".join(map(shlex.quote, argv or sys.argv[1:])))
    report = render(rows, meta)
    print(report)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            f.write(report)
    return rows


if __name__ == "__main__":
    main()
