"""``ds-seqpar bench packed``: packed documents (cu_seqlens) against one document of the same length,
for every strategy, side by side in one run (not a test).

Per strategy three variants of the same N tokens: one document (the ordinary call), ``--docs`` equal
documents and documents of mixed lengths (``--mixed``), in the harness's interleaved rounds; "single"
is the one-process kernel (rank 0; documents: one kernel call per document). After the rounds, rank 0
alone times one rank's block as per-document sub-blocks against one masked block. The page (facts
below) says what each table means; the work is the cost model's, the bytes the closed forms.
"""
from __future__ import annotations

import argparse
import statistics
from typing import Dict, List, Optional, Tuple

from ..cost import imbalance, pairs_per_rank, position_pairs
from ..masks import Mask
from ..report.rows import Row
from ..report.targets import TARGETS
from ..strategies.closed_form import Shapes
from .harness import (LINEAR, SOFTMAX, alone, attention_inputs, attention_line, case_times, closed_form, command_line,
                      fwd_bwd, measure_on_pool, rank_rounds, strategy_config, suite_facts, suite_main, suite_parser,
                      versus, write_page)

PROG = "ds-seqpar bench packed"
VARIANTS = ("one", "equal", "mixed")
MIXED = (3000, 101, 1499, 700, 2047, 53, 744, 48)          # sums to 8192; odd, short and long documents


def variant_bounds(variant: str, seq: int, docs: int, mixed: Tuple[int, ...]) -> Optional[List[int]]:
    if variant == "one":
        return None
    lengths = [seq // docs] * docs if variant == "equal" else list(mixed)
    return [sum(lengths[:i]) for i in range(len(lengths) + 1)]


def work_per_rank(name: str, args, bounds) -> List[int]:
    """(q, k) pairs each rank computes for these documents (causal); linear attention: tokens."""
    if name in LINEAR:                               # linear attention: work follows tokens, L per rank
        return [args.seq // args.P] * args.P
    cfg = strategy_config(name, args.P)
    return [int(x) for x in pairs_per_rank(cfg["strategy"], args.P, cfg.get("ulysses_size", 1), args.seq,
                                           Mask.from_boundaries(bounds))]


def imbalance_sweep(seq: int, ps=(2, 4, 8), trials: int = 200, seed: int = 0) -> Dict[str, Dict[int, tuple]]:
    """Causal work imbalance (max/mean over ranks) of random packings, per ring layout and P: (mean,
    worst) over ``trials`` packings of documents with log-normal lengths (median 400 tokens, long tail)
    cut to ``seq``. A rank's work is the sum over its queries of the keys they see in their document."""
    import torch
    g = torch.Generator().manual_seed(seed)
    out = {name: {p: [] for p in ps} for name in ("contiguous", "zigzag", "striped")}
    for _ in range(trials):
        lengths = (torch.randn(64, generator=g) * 1.2 + 6.0).exp().clamp(1, seq).long().tolist()
        bounds = [0]
        for n in lengths:
            bounds.append(min(bounds[-1] + n, seq))
            if bounds[-1] == seq:
                break
        bounds[-1] = seq
        mask = Mask.from_boundaries(bounds)
        for name, per_p in out.items():
            for p in ps:
                per_p[p].append(imbalance(position_pairs(name, p, seq, seq, mask)))
    return {name: {p: (statistics.mean(v), max(v)) for p, v in per_p.items()} for name, per_p in out.items()}


def _case_fns(args, rank):
    """{(strategy, variant): (run fwd+bwd or None on this rank, stats or None)} in a fixed order; "single"
    and "single_linear": one process, the whole sequence, one kernel call per document (rank 0)."""
    import torch
    from ..kernels import get_kernel, local_attention
    from ..kernels.linear import linear_attention
    from ..models.lm import head_decay
    from ..sequence_parallel import SequenceParallel
    q, k, v, dout = attention_inputs(args.seq, args.heads, args.head_dim)
    decay, scale, kernel = head_decay(args.heads), args.head_dim ** -0.5, get_kernel("torch", "cpu")

    def attend(q, k, v, sp, linear, cu):
        if sp is not None:
            return sp.linear_attention(q, k, v, decay, cu_seqlens=cu) if linear else \
                sp.attention(q, k, v, causal=True, cu_seqlens=cu)
        spans = list(zip(cu, cu[1:])) if cu else [(0, q.shape[1])]
        parts = [linear_attention(q[:, a:b], k[:, a:b], v[:, a:b], decay) if linear else
                 local_attention(q[:, a:b], k[:, a:b], v[:, a:b], kernel, True, scale) for a, b in spans]
        return parts[0] if len(parts) == 1 else torch.cat(parts, 1)
    fns = {}
    for name in ("single", "single_linear") + tuple(args.strategies):
        sp = None if name.startswith("single") else SequenceParallel(strategy_config(name, args.P))
        shards = (q, k, v, dout) if sp is None else [sp.shard(t).clone() for t in (q, k, v, dout)]
        linear = name in LINEAR or name == "single_linear"
        for variant in VARIANTS:
            cu = variant_bounds(variant, args.seq, args.docs, tuple(args.mixed))
            run = None if sp is None and rank != 0 else \
                (lambda x=shards, kw=dict(sp=sp, linear=linear, cu=cu): fwd_bwd(lambda *t: attend(*t, **kw), *x))
            fns[name, variant] = (run, None if sp is None else sp.stats)
    return fns


def bench_rank(args) -> Dict[str, list]:
    """Every rank: the interleaved rounds; then rank 0 alone: masked block vs sub-blocks."""
    return rank_rounds(args, _case_fns, ("masked", masked_vs_subblocks))


def masked_vs_subblocks(args) -> List[dict]:
    """One rank's diagonal block (n = N/P tokens) of documents of one length: per-document causal
    sub-blocks (what the masked plan computes) vs one masked block (attn_mask, same CPU flash kernel), fwd+bwd."""
    import torch
    n = args.seq // args.P
    bhsd = [t.transpose(1, 2) for t in attention_inputs(n, args.heads, args.head_dim)]     # q, k, v, dout
    scale, rows = args.head_dim ** -0.5, []
    for length in (n // 2, n // 8, 64, 16):
        doc = torch.arange(n) // length
        mask = (doc[:, None] == doc[None, :]) & torch.ones(n, n, dtype=torch.bool).tril()
        bias = torch.zeros(n, n).masked_fill(~mask, float("-inf"))

        def subblocks():
            for a in range(0, n, length):
                _flash_fwd_bwd(*(t[:, :, a:a + length] for t in bhsd), True, scale)
        t = alone({"masked": lambda: _flash_fwd_bwd(*bhsd, False, scale, bias), "subblocks": subblocks},
                  args.repeats, key="wall", warmup=1)
        rows.append({"doc_len": length, "docs": n // length, "masked": statistics.median(t["masked"]),
                     "subblocks": statistics.median(t["subblocks"])})
    return rows


def _flash_fwd_bwd(q, k, v, dout, causal: bool, scale: float, bias=None) -> None:
    """Forward and backward of the CPU flash kernel on [b, h, s, d] tensors; ``bias``: an additive mask."""
    import torch
    aten = torch.ops.aten
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=bias, scale=scale)
    aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal, attn_mask=bias,
                                                              scale=scale)


def build_parser() -> argparse.ArgumentParser:
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    ap = suite_parser(PROG, __doc__, "packed_cpu", P=2, seq=8192, heads=8, head_dim=64)
    ap.add_argument("--docs", type=int, default=8, help="equal documents of the packed variant")
    ap.add_argument("--mixed", type=ints, default=list(MIXED), help="lengths of the mixed variant (sum = --seq)")
    ap.add_argument("--strategies", default=None, help="comma list (default: every strategy that runs at --P)")
    ap.add_argument("--sweep-trials", type=int, default=200, help="random packings in the balance sweep (0: skip)")
    return ap


def resolve(args) -> argparse.Namespace:
    default = SOFTMAX + (("hybrid",) if args.P >= 4 and args.P % 2 == 0 else ()) + LINEAR
    args.strategies = default if args.strategies is None else tuple(args.strategies.split(","))
    if sum(args.mixed) != args.seq or args.seq % args.docs or args.seq % (4 * args.P):
        raise SystemExit(f"{PROG}: --seq {args.seq} must be a multiple of --docs {args.docs} and of "
                         f"4*P, and --mixed must sum to it (sums to {sum(args.mixed)})")
    return args


def measure(args, argv: List[str]) -> int:
    per_rank, meta = measure_on_pool(bench_rank, resolve(args), command_line(PROG, argv))
    meta["sweep"] = imbalance_sweep(args.seq, trials=args.sweep_trials) if args.sweep_trials else None
    return write(rows(per_rank, args, meta), meta, args.out)


def main(argv: Optional[List[str]] = None) -> int:
    return suite_main(argv, build_parser(), measure)


def _ratio_metric(docs: int) -> str:
    return (f"Time of {docs} equal documents / time of one document (ideal {1 / docs:.3f}, goal "
            f"{TARGETS['packed'].text()})")


def rows(per_rank, args, meta) -> List[Row]:
    """Per case (harness.case_times; equal documents against one per round, harness.versus) the ratio, bytes
    per variant against the document closed forms and the mixed documents' balance; the random packings'
    imbalance; the masked block per document length (rank 0's, after the rounds)."""
    ratio, equal, sent, balance = _ratio_metric(args.docs), [], [], []
    mixed = f"Mixed document lengths {list(args.mixed)}: per-rank balance"
    shapes = Shapes(1, args.seq, args.heads, args.heads, args.head_dim)
    for name in ("single", "single_linear") + tuple(args.strategies):
        t = {v: case_times(per_rank, f"{name}/{v}") for v in VARIANTS}
        vs, linear = versus(t["equal"], t["one"]), name in LINEAR or name == "single_linear"
        equal.append(Row("packed", name, f"{args.docs} equal", ratio, "x", vs["ratio"], tuple(vs["ratio_range"]),
                         predicted=1.0 if linear else 1 / args.docs, target=None if linear else "packed",
                         detail={"one document s": t["one"]["time"], "equal documents s": t["equal"]["time"],
                                 "CPU ratio": vs["cpu_ratio"]}))
        if name.startswith("single"):
            continue
        bounds = {v: variant_bounds(v, args.seq, args.docs, tuple(args.mixed)) for v in VARIANTS}
        sent += [Row("packed", name, v, "Bytes per rank against the document closed forms", "B", t[v]["bytes"],
                     predicted=closed_form(name, args.P, shapes, cu_seqlens=bounds[v]), target="bytes")
                 for v in VARIANTS]
        work = work_per_rank(name, args, bounds["mixed"])
        balance.append(Row("packed", name, "mixed", mixed, "s", t["mixed"]["cpu"], detail={
            "time s": t["mixed"]["time"], "measured imbalance": t["mixed"]["imbalance"], "work per rank": work,
            "work imbalance": max(work) / (sum(work) / len(work))}))
    out = equal + sent + balance
    for layout, per_p in (meta.get("sweep") or {}).items():
        out += [Row("packed", layout, f"P={p}", "Random packings: causal work imbalance max/mean", "x", mean,
                    detail={"worst": worst}) for p, (mean, worst) in sorted(per_p.items())]
    block = f"One rank's block (n = {args.seq // args.P}): masked / sub-blocks"
    out += [Row("packed", f"documents of {m['doc_len']}", f"{m['docs']} documents", block, "x",
                m["masked"] / m["subblocks"], detail={"masked block s": m["masked"], "sub-blocks s": m["subblocks"]})
            for m in per_rank[0]["masked"]]
    return out


def facts(meta) -> dict:
    """What the page says around the rows: the setup, the run, what each table means."""
    sweep, docs = meta.get("sweep"), meta["docs"]
    best = ""
    if sweep:
        ps = sorted(next(iter(sweep.values())))
        best = min(sweep, key=lambda n: max(sweep[n][p][1] for p in ps))
        best = (f"Over {meta['sweep_trials']} random packings of N={meta['seq']} (log-normal document lengths, "
                f"median 400 tokens), mean per layout and P; Ulysses is 1.00 by construction and LASP follows "
                f"tokens. Best balanced ring layout for packed data (smallest worst case): **{best}**.")
    return suite_facts(
        meta, f"Packed documents on CPU ranks: {docs} equal documents vs one document of the same length",
        f"{attention_line(meta)}.", {
            _ratio_metric(docs):
                "Softmax attention: causal work is the sum of squared document lengths, 1/docs of one "
                "document's (predicted). Linear attention (LASP, single_linear) does O(N) work either way.",
            f"Mixed document lengths {list(meta['mixed'])}: per-rank balance":
                "Value: median CPU seconds per rank. Work = (q, k) pairs each rank computes (from the mask "
                "policy; LASP: tokens), imbalance = max/mean.",
            "Random packings: causal work imbalance max/mean": best,
            f"One rank's block (n = {meta['seq'] // meta['P']}): masked / sub-blocks":
                "Fwd+bwd on one process, the same CPU flash kernel: causal squares per document (what the "
                "strategies do) against one call over the whole block with an additive mask (attn_mask)."}, rounds=True)


def write(found: List[Row], meta, out: str) -> int:
    return write_page(out, meta["name"], found, facts(meta), PROG)
