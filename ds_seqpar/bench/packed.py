"""``ds-seqpar bench --packed``: packed documents (cu_seqlens) against one document of the same
length, for every strategy, side by side in one run (not a test).

    ds-seqpar bench --packed [--P 2] [--seq 8192] [--docs 8] [--heads 8] [--head-dim 64]
                             [--repeats 5] [--warmup 1] [--out reports] [--name packed_cpu]

Per strategy three variants of the same N tokens: one document (cu_seqlens=None, the ordinary
call), ``--docs`` equal documents, and documents of mixed lengths (``--mixed``). Every round runs
every (strategy, variant) once after a barrier, in a fixed order, so load from other processes hits
all alike; "single" is the one-process kernel (rank 0, one thread; documents: one kernel call per
document) while the other ranks wait. A case's time is the slowest rank's wall time, medians over
rounds. Reported: time(equal documents) / time(one document) beside the ideal 1/docs (causal work
is the sum of squared document lengths) and the goal 0.20; per-rank CPU time and the per-rank work
of the mixed documents (pairs computed, from the policy) with their imbalance max/mean; bytes per
rank against the document closed forms; and, on one process, one rank's block computed as
per-document sub-blocks against one masked block (the CPU flash kernel's attn_mask) per document
length. Timing helpers are bench/cases.py's.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Dict, List, Optional, Tuple

from .cases import attention_inputs, timed
from .machine import command_line

SOFTMAX = ("ulysses", "ring", "zigzag", "striped")
LINEAR = ("lasp2", "lasp1")
VARIANTS = ("one", "equal", "mixed")
MIXED = (3000, 101, 1499, 700, 2047, 53, 744, 48)          # sums to 8192; odd, short and long documents


def strategy_config(name: str, world: int) -> dict:
    if name in LINEAR:
        return {"strategy": "lasp", "size": world, "lasp_comm": "allgather" if name == "lasp2" else "ring"}
    if name == "hybrid":
        return {"strategy": "zigzag", "size": world, "ulysses_size": 2, "backend": "torch"}
    return {"strategy": name, "size": world, "backend": "torch"}


def variant_bounds(variant: str, seq: int, docs: int, mixed: Tuple[int, ...]) -> Optional[List[int]]:
    if variant == "one":
        return None
    lengths = [seq // docs] * docs if variant == "equal" else list(mixed)
    return [sum(lengths[:i]) for i in range(len(lengths) + 1)]


def _single(kind: str, bounds, kernel, scale, decay):
    """One process: the whole sequence, or one kernel call per document."""
    import torch
    from ..kernels import local_attention
    from ..kernels.linear import linear_attention

    def attend(q, k, v):
        spans = [(0, q.shape[1])] if bounds is None else list(zip(bounds, bounds[1:]))
        if kind == "softmax":
            parts = [local_attention(q[:, a:b], k[:, a:b], v[:, a:b], kernel, True, scale) for a, b in spans]
        else:
            parts = [linear_attention(q[:, a:b], k[:, a:b], v[:, a:b], decay) for a, b in spans]
        return parts[0] if len(parts) == 1 else torch.cat(parts, 1)
    return attend


def _case_fns(args, rank):
    """{(strategy, variant): (run fwd+bwd or None on this rank, stats or None)} in a fixed order."""
    import torch
    from ..kernels import get_kernel
    from ..sequence_parallel import SequenceParallel
    q, k, v, dout = attention_inputs(args.seq, args.heads, args.head_dim)
    decay = 1 - 2.0 ** (-5 - torch.arange(args.heads, dtype=torch.float32))
    scale, kernel = args.head_dim ** -0.5, get_kernel("torch", "cpu")
    fns = {}
    for name in ("single", "single_linear") + tuple(args.strategies):
        sp = None if name.startswith("single") else SequenceParallel(strategy_config(name, args.P))
        shards = (q, k, v, dout) if sp is None else [sp.shard(t).clone() for t in (q, k, v, dout)]
        linear = name in LINEAR or name == "single_linear"
        for variant in VARIANTS:
            cu = variant_bounds(variant, args.seq, args.docs, tuple(args.mixed))
            if sp is None:
                attend = _single("linear" if linear else "softmax", cu, kernel, scale, decay)
            elif linear:
                attend = lambda a, b, c, sp=sp, cu=cu: sp.linear_attention(a, b, c, decay, cu_seqlens=cu)  # noqa: E731
            else:
                attend = lambda a, b, c, sp=sp, cu=cu: sp.attention(a, b, c, causal=True, cu_seqlens=cu)  # noqa: E731
            run = None if sp is None and rank != 0 else \
                (lambda attend=attend, x=shards: _fwd_bwd(attend, *x))
            fns[name, variant] = (run, None if sp is None else sp.stats)
    return fns


def _fwd_bwd(attend, q, k, v, dout):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    attend(q, k, v).backward(dout)


def interleaved_rounds(fns, warmup: int, repeats: int) -> Dict[str, list]:
    """{(strategy, variant): (run or None, stats or None)} -> {"strategy/variant": measured rounds}:
    warmup + repeats rounds, each running every case once after a barrier, in a fixed order (--window
    shares it). A round's entry: wall and CPU seconds, and with stats the bytes sent, by CommStats kind."""
    from .. import comm
    rounds = {f"{n}/{v}": [] for n, v in fns}
    for rnd in range(warmup + repeats):
        for (name, variant), (run, stats) in fns.items():
            comm.barrier()
            if run is None:
                continue
            res = timed(run, stats)
            if stats is not None:
                res["by_kind"] = {kd: b for kd, b in stats.bytes.items() if kd != "cu_seqlens_check"}
            if rnd >= warmup:
                rounds[f"{name}/{variant}"].append(res)
    comm.barrier()
    return rounds


def bench_rank(args) -> Dict[str, list]:
    """What every rank runs: warmup + repeats interleaved rounds; then (rank 0) masked vs sub-blocks."""
    from .. import comm
    rank = comm.global_rank()
    rounds = interleaved_rounds(_case_fns(args, rank), args.warmup, args.repeats)
    out = {"rounds": rounds, "load_1min": os.getloadavg()[0]}
    if rank == 0:
        out["masked"] = masked_vs_subblocks(args)
    comm.barrier()
    return out


def masked_vs_subblocks(args) -> List[dict]:
    """One rank's diagonal block (n = N/P tokens) of documents of one length: per-document causal
    sub-blocks (what varlen.py does) vs one masked block (attn_mask, same CPU flash kernel), fwd+bwd."""
    import torch
    n = args.seq // args.P
    q, k, v, dout = (t.transpose(1, 2) for t in attention_inputs(n, args.heads, args.head_dim))     # [b, h, s, d]
    scale, aten, rows = args.head_dim ** -0.5, torch.ops.aten, []
    for length in (n // 2, n // 8, 64, 16):
        doc = torch.arange(n) // length
        mask = (doc[:, None] == doc[None, :]) & torch.ones(n, n, dtype=torch.bool).tril()
        bias = torch.zeros(n, n).masked_fill(~mask, float("-inf"))

        def masked():
            out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=bias,
                                                                        scale=scale)
            aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, False,
                                                                    attn_mask=bias, scale=scale)

        def subblocks():
            for a in range(0, n, length):
                s = slice(a, a + length)
                out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q[:, :, s], k[:, :, s], v[:, :, s], 0.0,
                                                                            True, scale=scale)
                aten._scaled_dot_product_flash_attention_for_cpu_backward(dout[:, :, s], q[:, :, s], k[:, :, s],
                                                                        v[:, :, s], out, lse, 0.0, True, scale=scale)
        times = {"masked": [], "subblocks": []}
        for rnd in range(args.repeats + 1):
            for name, fn in (("masked", masked), ("subblocks", subblocks)):
                t = timed(fn)["wall"]
                if rnd:
                    times[name].append(t)
        rows.append({"doc_len": length, "docs": n // length, "masked": statistics.median(times["masked"]),
                     "subblocks": statistics.median(times["subblocks"])})
    return rows


def build_parser() -> argparse.ArgumentParser:
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    ap = argparse.ArgumentParser(prog="ds-seqpar bench --packed", description=__doc__.splitlines()[0])
    ap.add_argument("--P", type=int, default=2)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--docs", type=int, default=8, help="equal documents of the packed variant")
    ap.add_argument("--mixed", type=ints, default=list(MIXED), help="lengths of the mixed variant (sum = --seq)")
    ap.add_argument("--strategies", default=None, help="comma list (default: every strategy that runs at --P)")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--sweep-trials", type=int, default=200, help="random packings in the balance sweep (0: skip)")
    return page_options(ap, "packed_cpu")


def page_options(ap: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The options every one-page bench mode shares (--packed, --window, --hybrid): rounds and the page."""
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--out", default="reports")
    ap.add_argument("--name", default=name)
    ap.add_argument("--notes", default="", help="free text added to the page")
    ap.add_argument("--render", metavar="JSON", help="measure nothing: rewrite the page of a saved results file")
    return ap


def resolve(args) -> argparse.Namespace:
    default = SOFTMAX + (("hybrid",) if args.P >= 4 and args.P % 2 == 0 else ()) + LINEAR
    args.strategies = default if args.strategies is None else tuple(args.strategies.split(","))
    if sum(args.mixed) != args.seq or args.seq % args.docs or args.seq % (4 * args.P):
        raise SystemExit(f"ds-seqpar bench --packed: --seq {args.seq} must be a multiple of --docs {args.docs} and of "
                         f"4*P, and --mixed must sum to it (sums to {sum(args.mixed)})")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    from .packed_report import imbalance_sweep, summarize
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.render:
        return _write(**_load(args.render), out=os.path.dirname(args.render) or ".")
    args = resolve(args)
    per_rank, meta = measure_on_pool(bench_rank, args, command_line("ds-seqpar bench --packed", argv))
    meta["sweep"] = imbalance_sweep(args.seq, trials=args.sweep_trials) if args.sweep_trials else None
    return _write(summarize(per_rank, args), per_rank[0]["masked"], meta, args.out)


def measure_on_pool(rank_fn, args, command: str):
    """``rank_fn(args)`` on P fresh local CPU ranks (one thread each): (per-rank results, the page's
    meta: the options, CPUs, elapsed seconds, load before / after / at the end of the rounds, command).
    Each rank's result carries its "load_1min" at the end of the rounds."""
    from ..launch.rankpool import RankPool
    load_before, start = os.getloadavg(), time.monotonic()
    pool = RankPool(args.P, timeout_s=3600.0, threads_per_rank=1).start()
    try:
        per_rank = pool.run(rank_fn, args, timeout=3600.0)
    finally:
        pool.close()
    meta = dict(vars(args), cpus=os.cpu_count(), elapsed=time.monotonic() - start,
                load_before=" ".join(f"{x:.2f}" for x in load_before),
                load_after=" ".join(f"{x:.2f}" for x in os.getloadavg()),
                load_during=max(r["load_1min"] for r in per_rank), command=command)
    return per_rank, meta


def _load(path: str) -> dict:
    import json
    with open(path) as f:
        saved = json.load(f)
    saved["meta"]["sweep"] = {name: {int(p): tuple(v) for p, v in per.items()}
                              for name, per in (saved["meta"].get("sweep") or {}).items()} or None
    return saved


def _write(rows, masked, meta, out: str) -> int:
    """<out>/<name>.md and the numbers behind it, <out>/<name>.json (--render re-writes the page)."""
    from .packed_report import render
    return write_page(render(rows, masked, meta), {"rows": rows, "masked": masked, "meta": meta}, out, meta["name"],
                      "ds-seqpar bench --packed")


def render_saved(path: str, write, *extras: str) -> int:
    """--render of a one-page mode: ``write(rows, meta, out, *extras)`` from the JSON ``write_page`` saved at
    ``path``, the page written beside it."""
    import json
    with open(path) as f:
        saved = json.load(f)
    return write(saved["rows"], saved["meta"], os.path.dirname(path) or ".", *(saved.get(k) for k in extras))


def write_page(page: str, saved: dict, out: str, name: str, prog: str) -> int:
    """<out>/<name>.md = ``page`` and <out>/<name>.json = ``saved`` (what --render reads back)."""
    import json
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"{name}.md")
    with open(path, "w") as f:
        f.write(page)
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(saved, f, indent=1, default=list)
    print(page)
    print(f"{prog}: wrote {path}")
    return 0


__all__ = ["main", "bench_rank", "strategy_config", "variant_bounds", "interleaved_rounds", "measure_on_pool",
           "page_options", "write_page"]
