"""Ring-family benchmark on local CPU ranks (not a test): causal fwd+bwd attention, single process
vs ring, zigzag, striped and Ulysses on the same total work, measured side by side in one run.

    python -m ds_seqpar.bench_ring [--world 2] [--seq 8192] [--heads 8] [--head-dim 64]
                                   [--repeats 5] [--warmup 1] [--out reports/ring_cpu.md]

Each round runs every case once, in a fixed order (single, ring, zigzag, striped, ulysses,
zigzag without overlap), after a barrier; rounds repeat (warm-up rounds are dropped), so load
from other processes hits all cases alike. "single" is the same local kernel on the whole
sequence on rank 0 (one thread) while the other ranks wait in a barrier. A case's time is the
slowest rank's wall time; the table reports medians. Per-rank CPU time is the main thread's
(time.thread_time: the compute), "CPU ratio" is single's CPU time over the busiest rank's (the
speedup a quiet machine would show, less communication), imbalance is max/mean of CPU time over
ranks, and "comm wait" is the time a rank sat blocked in communication (CommStats seconds),
which overlap should keep small.
"""
from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time
from typing import Dict, List

CASES = ("single", "ring", "zigzag", "striped", "ulysses", "zigzag_no_overlap")
TARGETS = {"ring": "~1.33 (P^2/(2P-1) at P=2)", "zigzag": ">= 1.80", "striped": ">= 1.70", "ulysses": ">= 1.85"}


def _configs(world: int) -> Dict[str, dict]:
    cfgs = {name: {"strategy": name, "size": world, "backend": "torch"}
            for name in ("ring", "zigzag", "striped", "ulysses")}
    cfgs["zigzag_no_overlap"] = {"strategy": "zigzag", "size": world, "backend": "torch", "overlap": False}
    return cfgs


def _inputs(seq, heads, head_dim):
    import torch
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, seq, heads, head_dim, generator=g) for _ in range(4)]   # q, k, v, dout


def _fwd_bwd(attend, q, k, v, dout):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    attend(q, k, v).backward(dout)


def _timed(fn, stats=None) -> dict:
    if stats is not None:
        stats.reset()
    wall, cpu = time.perf_counter(), time.thread_time()
    fn()
    res = {"wall": time.perf_counter() - wall, "cpu": time.thread_time() - cpu}
    if stats is not None:
        res.update(wait=stats.total_seconds, bytes=stats.total_bytes)
    return res


def _bench_rank(world, seq, heads, head_dim, warmup, repeats) -> Dict[str, List[dict]]:
    """Runs on every rank: all cases, interleaved, warmup + repeats rounds."""
    from . import comm
    from .kernels import TorchKernel, local_attention
    from .parallel import SequenceParallel
    scale = head_dim ** -0.5
    q, k, v, dout = _inputs(seq, heads, head_dim)
    sps = {name: SequenceParallel(cfg) for name, cfg in _configs(world).items()}
    shards = {name: [sp.shard(t) for t in (q, k, v, dout)] for name, sp in sps.items()}
    kernel, rank = TorchKernel(), comm.global_rank()
    results: Dict[str, List[dict]] = {name: [] for name in CASES}
    for rnd in range(warmup + repeats):
        for name in CASES:
            comm.barrier()
            if name == "single":
                attend = lambda q_, k_, v_: local_attention(q_, k_, v_, kernel, True, scale)  # noqa: E731
                res = _timed(lambda: _fwd_bwd(attend, q, k, v, dout)) if rank == 0 else None
            else:
                sp = sps[name]
                attend = lambda q_, k_, v_, sp=sp: sp.attention(q_, k_, v_, causal=True)  # noqa: E731
                res = _timed(lambda: _fwd_bwd(attend, *shards[name]), sp.stats)
            if rnd >= warmup and res is not None:
                results[name].append(res)
    comm.barrier()
    return results


def closed_form_bytes(name, world, seq, heads, head_dim, e=4, e_acc=4) -> int:
    """Bytes one rank sends for one fwd+bwd (see the strategies' design notes)."""
    n = seq // world
    s = n * heads * head_dim                  # one local q-shaped tensor, MHA: k, v alike
    if name == "ulysses":
        return 8 * e * s * (world - 1) // world
    return s * (world - 1) * (4 * e + 2 * e_acc)


def summarize(per_rank: List[Dict[str, List[dict]]], world, seq, heads, head_dim) -> List[dict]:
    """One row per case: medians over rounds; time = slowest rank per round."""
    t_single = statistics.median(r["wall"] for r in per_rank[0]["single"])
    cpu_single = statistics.median(r["cpu"] for r in per_rank[0]["single"])
    rows = []
    for name in CASES:
        ranks = [res[name] for res in per_rank if res[name]]
        walls = [max(r[i]["wall"] for r in ranks) for i in range(len(ranks[0]))]
        cpu = [statistics.median(x["cpu"] for x in r) for r in ranks]
        row = {"case": name, "time": statistics.median(walls), "min": min(walls), "max": max(walls),
               "speedup": t_single / statistics.median(walls), "cpu": cpu,
               "imbalance": max(cpu) / (sum(cpu) / len(cpu)), "cpu_ratio": cpu_single / max(cpu)}
        if name != "single":
            row["wait"] = [statistics.median(x["wait"] for x in r) for r in ranks]
            sent = {x["bytes"] for r in ranks for x in r}
            expected = closed_form_bytes(name.split("_")[0], world, seq, heads, head_dim)
            row["bytes"] = f"{sorted(sent)} = closed form {expected}" if sent == {expected} else \
                f"MISMATCH {sorted(sent)} vs closed form {expected}"
        rows.append(row)
    return rows


def render(rows, meta) -> str:
    lines = [
        "# Ring-family attention on CPU ranks: speedup over one process",
        "",
        f"P={meta['world']} ranks x 1 thread, N={meta['seq']} tokens, batch 1, {meta['heads']} heads, "
        f"head_dim {meta['head_dim']}, fp32, causal, forward + backward, torch CPU flash kernel. "
        f"{meta['repeats']} interleaved rounds after {meta['warmup']} warm-up round(s); medians.",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"Machine: {meta['cpus']} CPUs; load average before {meta['load_before']}, after {meta['load_after']}; "
        f"wall time of the whole run {meta['elapsed']:.0f} s.",
        "",
        "| case | median s (min-max) | speedup vs single | target | CPU s per rank | CPU ratio | "
        "imbalance max/mean | comm wait s per rank | bytes sent per rank |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        fmt = lambda xs: " / ".join(f"{x:.2f}" for x in xs)  # noqa: E731
        lines.append(f"| {r['case']} | {r['time']:.2f} ({r['min']:.2f}-{r['max']:.2f}) | {r['speedup']:.2f} | "
                     f"{TARGETS.get(r['case'], '')} | {fmt(r['cpu'])} | {r['cpu_ratio']:.2f} | {r['imbalance']:.2f} | "
                     f"{fmt(r['wait']) if 'wait' in r else ''} | {r.get('bytes', '')} |")
    return "\n".join(lines + ["", meta.get("notes", ""), "", ""])


def _without_notes(argv: List[str]) -> List[str]:
    """The command line as reported: the free-text --notes are printed in the report instead."""
    out, skip = [], False
    for a in argv:
        if skip or a.startswith("--notes="):
            skip = False
            continue
        skip = a == "--notes"
        if not skip:
            out.append(a)
    return out


def main(argv=None) -> List[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--out", default="reports/ring_cpu.md")
    ap.add_argument("--notes", default="", help="free text appended to the report")
    args = ap.parse_args(argv)
    from .rankpool import RankPool
    load_before, start = os.getloadavg(), time.monotonic()
    pool = RankPool(args.world, timeout_s=3600.0, threads_per_rank=1).start()
    try:
        per_rank = pool.run(_bench_rank, args.world, args.seq, args.heads, args.head_dim, args.warmup,
                            args.repeats, timeout=3600.0)
    finally:
        pool.close()
    rows = summarize(per_rank, args.world, args.seq, args.heads, args.head_dim)
    meta = dict(vars(args), world=args.world, cpus=os.cpu_count(), elapsed=time.monotonic() - start,
                load_before=" ".join(f"{x:.2f}" for x in load_before),
                load_after=" ".join(f"{x:.2f}" for x in os.getloadavg()),
                command=" ".join(["python -m ds_seqpar.bench_ring"] + [shlex.quote(a) for a in _without_notes(
                    sys.argv[1:] if argv is None else argv)]))
    report = render(rows, meta)
    print(report)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            f.write(report)
    return rows


if __name__ == "__main__":
    main()
