"""``ds-seqpar bench gpu``: what one device can tell about the fast path, in one command (not a test).

    ds-seqpar bench gpu              # CUDA: N 8K..128K, bf16, 16 heads x 128 -> reports/gpu_<profile>.md
    ds-seqpar bench gpu --tiny       # tiny sizes (taken by itself without CUDA; fp32 on CPU) -> reports/gpu_cpu.md

(a) each local kernel alone, fwd+bwd TFLOP/s (the cost model's pairs) against the profile's peak: torch's SDPA
    backends (plain causal) and ds_seqpar's through one rank's ring loop (plain, window, softcap, sinks);
(b) the busiest rank's share of each strategy at P ranks: its blocks back to back, every transfer a
    copy of its bytes (held to strategies/closed_form.py), eager against torch.compile (outputs agree);
    Ulysses in one head chunk and in "auto"'s (ulysses_auto: what the chunks cost the kernels, beside one);
(c) the longest sequence of a 1B-class model in the device's memory: cost/memory.py's prediction;
(d) LASP's state chain at P ranks: a middle rank's work between the state arriving and its own leaving
    (LASP-1: the scan of its chunk states with state_in; All-Scan: one block's fold A S_in[k] + B[k]) and the
    bytes per rank at P and 2P of each lasp_comm (strategies/closed_form.py).
"""
from __future__ import annotations

import functools
import os
import statistics
import time
from typing import List, Optional

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..comm import CommStats
from ..cost import Features, max_tokens, pairs_per_rank, pairs_total, phase_lines
from ..cost.chunks import auto_chunks, device_rates
from ..kernels import empty_accumulators, flash_attn_kernel, get_kernel, merge_
from ..masks import Mask
from ..plan.hardware import known_gpus, load_gpu
from ..cost.model_shape import ModelShape
from ..report.rows import Row
from ..sharding.layouts import make_layout
from ..strategies import STRATEGIES as REGISTRY, StrategyContext
from ..strategies.closed_form import Shapes
from ..strategies.ring import RingAttention
from .harness import (SOFTMAX, alone, attention_inputs, closed_form, command_line, fwd_bwd, loads, strategy_config,
                      suite_main, suite_parser, write_page)

PROG = "ds-seqpar bench gpu"
STRATEGIES = SOFTMAX + ("hybrid", "ulysses_auto")   # cases of the vocabulary (harness.SP_KEYS)
PRESETS = {"gpu": dict(seqs=[8192, 16384, 32768, 65536, 131072], heads=16, head_dim=128, window=4096),
           "tiny": dict(seqs=[256, 512], heads=8, head_dim=16, window=64)}
ONE_B = ModelShape("Llama-3.2-1B shape", hidden=2048, layers=16, heads=32, kv_heads=8, head_dim=64,
                   intermediate=8192, vocab=128256, tied=True)
KERNELS = "Each local kernel alone: forward + backward, TFLOP/s"
SCHEDULE = "One rank's share of each strategy, transfers as copies: compiled / eager time"
BYTES = "Bytes the share copies for its transfers against the closed form"
MEMORY = "Longest sequence of a 1B-class model in the device's memory (predicted)"
LASP_HOP = "LASP: a middle rank's work between the state arriving and its own leaving, ms"
LASP_BYTES = "LASP: bytes per rank at 2P against P (closed form, a middle rank)"
METRICS = {KERNELS: "FLOPs: the mask's pairs (cost.pairs_total) x 2 H (d + dv) forward, x 3 forward + backward "
                    "(cost/flops.py; flash-attn's own count takes backward as 2.5 x). A row without a value says why.",
    SCHEDULE: "The busiest rank (cost.pairs_per_rank) runs its blocks with the torch kernel and its merges; each "
              "transfer is a copy on the device. Difference: the largest |compiled - eager| / the largest |eager| "
              "over the outputs; allowed: one rounding per merge and per cast. ulysses runs one head chunk, "
              "ulysses_auto the chunks \"auto\" prices for this device (cost/chunks.py; 1 on CPU), timed beside one "
              "chunk: eager / one chunk is what cutting the heads costs the kernels (the copies overlap nothing here).",
    BYTES: "The copies' bytes against strategies/closed_form.py's for that rank.",
    MEMORY: "bf16, Adam; features: tiled loss + tiled MLP + every layer checkpointed (in host memory); P > 1: zigzag, "
            "ZeRO-2; budget: the profile's usable memory. cost/memory.py's phase model: predicted, not measured.",
    LASP_HOP: "The own LM's LASP at N/P tokens per rank, fp32 states [1, H, d, d] with a decay: what one hop of the "
              "chain waits for besides the transfer. LASP-1 scans the rank's chunk states with state_in before its "
              "state can leave; All-Scan has its own state already and forwards block 1 of K (scan_blocks) after one "
              "fold. LASP-2 has no chain (one all-gather of P - 1 states).",
    LASP_BYTES: "strategies/closed_form.py's forward + backward bytes of rank 1 at 2P and at P: LASP-2's grow as "
                "(2P - 1) / (P - 1), the ring's and All-Scan's not at all."}


# -- (a) the kernels ---------------------------------------------------------------------------------


def sdpa_attend(q, k, v):                           # torch's public SDPA, causal, on bshd (bhsd views inside)
    return torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                            is_causal=True).transpose(1, 2)


def sdpa_step(backend, q, k, v, dout):
    with sdpa_kernel(backend):                      # one backend only: it runs, or says why not
        fwd_bwd(sdpa_attend, q, k, v, dout)


def rank_step(strategy, mask, softcap, sinks, q, k, v, dout):
    options = (mask, q.shape[-1] ** -0.5, softcap, sinks)
    strategy.backward(dout, q, k, v, *strategy.forward(q, k, v, *options), *options)


def kernel_cases(args, device, q, k, v, dout):
    """({(kernel, variant): fwd+bwd}, {(kernel, variant): why it does not run}) at one length."""
    sinks, cases, why = torch.linspace(-1.0, 2.0, args.heads, device=device), {}, {}
    variants = {"plain": (Mask(True), None, None), f"window={args.window}": (Mask(True, args.window), None, None),
                f"softcap={args.softcap:g}": (Mask(True), args.softcap, None), "sinks": (Mask(True), None, sinks)}
    for name in ("flash", "cudnn", "efficient"):
        backend = getattr(SDPBackend, f"{name}_attention".upper())
        cases[f"sdpa {name}", "plain"] = functools.partial(sdpa_step, backend, q, k, v, dout)
        why.update({(f"sdpa {name}", var): "SDPA takes no window, softcap or sinks" for var in list(variants)[1:]})
    for name in ("torch", "flash_attn"):
        if name == "flash_attn" and not flash_attn_kernel.available():
            why.update({(name, var): "flash-attn not importable here (or no CUDA)" for var in variants})
            continue
        one = RingAttention(StrategyContext(None, None, None, 1, 0, 1, 0, 1, 0, get_kernel(name, device), CommStats(),
                                            make_layout("contiguous", 1)))     # one rank: no group, nothing travels
        for var, (mask, cap, s) in variants.items():
            cases[f"ds_seqpar {name}", var] = functools.partial(rank_step, one, mask, cap, s, q, k, v, dout)
    return cases, why


def kernel_rows(args, device, peak) -> List[Row]:
    """Every kernel and variant at every length (interleaved rounds per length); a case that fails to run,
    or took more than --case-budget seconds at a shorter length, is a row saying so."""
    rows, over = [], {}
    for n in args.seqs:
        q, k, v, dout = attention_inputs(n, args.heads, args.head_dim, dtype=args.torch_dtype, device=device)
        cases, why = kernel_cases(args, device, q, k, v, dout)
        why.update({key: f"skipped: {over[key]:.1f} s at a shorter length" for key in cases if key in over})
        for key in [key for key in cases if key not in why]:
            try:
                cases[key]()
            except RuntimeError as err:             # no such backend here, out of memory: said, not hidden
                why[key] = f"not run: {str(err).splitlines()[0][:120]}"
        times = alone({key: cases[key] for key in cases if key not in why}, args.repeats, "wall", args.warmup, device)
        for key in list(cases) + [key for key in why if key not in cases]:
            variant = f"{key[1]} N={n}"
            if key in why:
                rows.append(Row("gpu", key[0], variant, KERNELS, "TFLOP/s", detail={"not run": why[key]}))
                continue
            # cost/flops.py's count on the mask's pairs: forward 2 H (d + dv) per pair, training 3 x forward
            window, t = (args.window if key[1].startswith("window") else None), statistics.median(times[key])
            flops = 3 * 2 * pairs_total(n, Mask(True, window)) * args.heads * 2 * args.head_dim
            over.update({key: t} if t > args.case_budget else {})
            rows.append(Row("gpu", key[0], variant, KERNELS, "TFLOP/s", flops / t / 1e12, tuple(
                flops / x / 1e12 for x in (max(times[key]), min(times[key]))), detail={
                    "ms": t * 1e3, "of peak": flops / t / peak if peak else "no peak (CPU)"}))
    return rows


# -- (b) one rank's share of a strategy --------------------------------------------------------------


def hop(tensors, sent):
    """A transfer of ``tensors`` as a copy on this device; ``sent`` counts its bytes."""
    sent[0] += sum(t.numel() * t.element_size() for t in tensors)
    return [t.clone() for t in tensors]


def a2a(x, u, sent, to_heads=True):
    """Ulysses' all-to-all in u ranks as a copy, [b, n, H, d] -> [b, u n, H/u, d] (or back); (u-1)/u sent."""
    if u == 1:
        return x
    sent[0] += x.numel() * x.element_size() * (u - 1) // u
    return torch.cat(x.chunk(u, 2), 1) if to_heads else torch.cat(x.chunk(u, 1), 2)


def ring_share(kernel, blocks, r, me, q, k, v, dout, sent):
    """The ring loop's work at position ``me`` of ``r`` (ring_loop.py's walks, the layout's causal ``blocks``): K/V
    hop r-1 times forward and again backward, the fp32 dK/dV of every other block travelling along."""
    scale = q.shape[-1] ** -0.5
    (out_acc, lse), kv = empty_accumulators(q, v.shape[-1]), [k, v]
    for step in range(r):
        for b in blocks(me, (me - step) % r, r, True, q.shape[1]):
            merge_(out_acc[:, b.q], lse[:, :, b.q],
                   *kernel.forward_block(q[:, b.q], kv[0][:, b.k], kv[1][:, b.k], b.causal, b.anti, scale))
        kv = hop(kv, sent) if step < r - 1 else kv
    out, dq, kv, away = out_acc.to(q.dtype), torch.zeros_like(out_acc), [k, v], None
    for step in range(r):
        dkv = [torch.zeros(t.shape, dtype=dq.dtype, device=t.device) for t in kv]
        for b in blocks(me, (me + step) % r, r, True, q.shape[1]):
            g = kernel.backward_block(dout[:, b.q], q[:, b.q], kv[0][:, b.k], kv[1][:, b.k], out[:, b.q],
                                      lse[:, :, b.q], b.causal, b.anti, scale)
            for acc, rows, x in zip((dq, *dkv), (b.q, b.k, b.k), g):
                acc[:, rows] += x
        home = dkv if step == 0 else home
        away = hop(dkv if away is None else [a + s for a, s in zip(away, dkv)], sent) if step else None
        kv = hop(kv, sent) if step < r - 1 else kv
    dk, dv = home if away is None else [h + a for h, a in zip(home, away)]
    return out, dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def share(kernel, blocks, u, r, me, q, k, v, dout, sent, chunks=1):
    """Ulysses' all-to-alls inside u ranks around the ring loop over r positions (u = P: Ulysses, r = 1;
    u = 1: the ring family; both: the 2D hybrid), on this rank's local [b, n, H, d] tensors; ``chunks``:
    Ulysses' head chunks (strategies/ulysses.py), one after the other (a copy overlaps nothing here)."""
    def piece(x, c):                                # head chunk c of every rank's H/u heads (ulysses._head_chunk)
        return x if chunks == 1 else x.unflatten(2, (u, chunks, -1))[:, :, :, c].flatten(2, 3)
    parts = []
    for c in range(chunks):
        qh, kh, vh, douth = (a2a(piece(t, c), u, sent) for t in (q, k, v, dout))
        parts.append([a2a(t, u, sent, False) for t in ring_share(kernel, blocks, r, me, qh, kh, vh, douth, sent)])
    if chunks == 1:
        return parts[0]
    return [torch.stack([p[i].unflatten(2, (u, -1)) for p in parts], 3).flatten(2, 4) for i in range(4)]


def schedule_rows(args, device) -> List[Row]:
    """Per strategy: the busiest rank's share eager and compiled, their outputs compared, their times, its bytes."""
    kernel, rows, n = get_kernel("torch", device), [], args.sched_seq // args.P
    q, k, v, dout = attention_inputs(n, args.heads, args.head_dim, dtype=args.torch_dtype, device=device)
    for name in args.strategies:
        cfg = strategy_config(name, args.P)
        layout = cfg["strategy"]
        u = args.P if layout == "ulysses" else cfg.get("ulysses_size", 1)     # Ulysses degree
        r, work = args.P // u, pairs_per_rank(layout, args.P, u, args.sched_seq, Mask(True))
        rank = work.index(max(work))
        blocks = REGISTRY[layout if r > 1 else "ring"].blocks           # r = 1: one causal block, the ring's
        chunks = head_chunks(cfg, u, n, args, q.element_size(), device)
        eager, sent = functools.partial(share, kernel, blocks, u, r, rank // u, q, k, v, dout, chunks=chunks), [0]
        want, compiled = eager(sent), torch.compile(eager, backend=args.compile_backend, dynamic=False)
        start = time.perf_counter()                 # dynamic=False: a recompile would make the ints symbolic
        got, compile_s = compiled([0]), time.perf_counter() - start
        diff = max(float((a.float() - b.float()).abs().max() / b.float().abs().max()) for a, b in zip(got, want))
        cases = {"eager": lambda: eager([0]), "compiled": lambda: compiled([0])}
        if "ulysses_chunks" in cfg:                 # beside one chunk, interleaved: what the chunks cost the kernels
            cases["one chunk"] = functools.partial(share, kernel, blocks, u, r, rank // u, q, k, v, dout, [0])
        t = alone(cases, args.repeats, "wall", 0, device)
        ratios = [c / e for c, e in zip(t["compiled"], t["eager"])]
        variant = f"rank {rank} of {args.P}, N={args.sched_seq}"
        vs_one = {"chunks": chunks, "eager / one chunk": statistics.median(
            e / o for e, o in zip(t["eager"], t["one chunk"]))} if "one chunk" in t else {}
        rows.append(Row("gpu", name, variant, SCHEDULE, "x", statistics.median(ratios), (min(ratios), max(ratios)),
                        detail={"eager ms": statistics.median(t["eager"]) * 1e3, "compile s": compile_s,
                                "compiled ms": statistics.median(t["compiled"]) * 1e3, "difference": diff,
                                "allowed": (r + 2) * torch.finfo(args.torch_dtype).eps, **vs_one}))
        shapes = Shapes(1, args.sched_seq, args.heads, args.heads, args.head_dim, q.element_size())
        rows.append(Row("gpu", name, variant, BYTES, "B", sent[0], target="bytes",
                        predicted=closed_form(name, args.P, shapes)[rank]))
    return rows


def head_chunks(cfg, u: int, n: int, args, elem: int, device: str) -> int:
    """A case's Ulysses head chunks: its ulysses_chunks, "auto" priced for this device as the runtime does
    (cost/chunks.py: 1 on CPU), 1 without the key."""
    chunks = cfg.get("ulysses_chunks", 1)
    if chunks != "auto":
        return chunks
    name = torch.cuda.get_device_name() if device == "cuda" else ""
    return auto_chunks(device_rates(device, name), u, n, args.heads, args.heads, args.head_dim, elem)


# -- (d) LASP's state chain ---------------------------------------------------------------------------


def lasp_rows(args, device) -> List[Row]:
    """A middle rank's per-hop work under each chained lasp_comm (interleaved rounds), then the bytes per
    rank at 2P against P of every lasp_comm."""
    from ..kernels import linear as la
    from ..kernels.linear.common import scan_states
    from ..strategies.closed_form import closed_form_by_kind
    from ..strategies.lasp_comm.allscan import scan_blocks
    n = args.sched_seq // args.P
    q, k, v, _ = attention_inputs(n, args.heads, args.head_dim, device=device)     # fp32: LASP keeps states fp32
    decay = torch.linspace(0.9, 0.999, args.heads, device=device)
    fwd = la.forward_begin(q, k, v, decay, 64)
    kv, b = fwd.kv.clone(), la.forward_states(fwd)                  # the chunk products; S_r (their scan)
    s_in, a = torch.randn_like(b), la.state_decay(decay, n, b.dtype)
    blocks = scan_blocks(args.P, b.shape[-1], b.numel() * b.element_size())
    first = (s_in.tensor_split(blocks, -1)[0], b.tensor_split(blocks, -1)[0])
    cases = {"lasp1": lambda: scan_states(fwd.blk, kv.clone(), s_in.transpose(0, 1)),
             "allscan": lambda: a * first[0] + first[1]}
    times = alone(cases, args.repeats, "wall", args.warmup, device)
    rows = [Row("gpu", name, f"P={args.P}, N={args.sched_seq}", LASP_HOP, "ms", statistics.median(t) * 1e3,
                tuple(x * 1e3 for x in (min(t), max(t))), detail={
                    "what": "scan of the chunk states with state_in (on a copy of the chunk products)" if name == "lasp1"
                    else f"fold of block 1 of {blocks}"}) for name, t in times.items()]
    shapes = Shapes(1, args.sched_seq, args.heads, args.heads, args.head_dim, 4)
    for name, comm in (("lasp2", "allgather"), ("lasp1", "ring"), ("allscan", "allscan")):
        at = [sum(closed_form_by_kind("lasp", p, shapes, 1, lasp_comm=comm).values()) for p in (args.P, 2 * args.P)]
        rows.append(Row("gpu", name, f"P={args.P} -> {2 * args.P}", LASP_BYTES, "x", at[1] / at[0],
                        detail={"bytes at P": at[0], "bytes at 2P": at[1]}))
    return rows


# -- (c) memory, and the command -------------------------------------------------------------------


def memory_rows(args, gpu) -> List[Row]:
    """Plain, the features, the features with the optimizer offloaded; one GPU and P: the longest fit."""
    rows, features = [], (Features(), Features(on=True), Features(on=True, offload_optimizer=True))
    for feats, p in [(f, p) for f in features for p in sorted({1, args.P})]:
        lines = phase_lines(ONE_B, "zigzag" if p > 1 else "ulysses", p, 1, p, 2, "bf16", feats,
                            not (feats.on and feats.cpu_checkpointing))
        per_rank = max_tokens(lines, gpu.usable_bytes)
        rows.append(Row("gpu", f"features {feats.label}", f"P={p}", MEMORY, "tokens", predicted=p * per_rank,
                        detail={"tokens per rank": per_rank, "usable GB": gpu.usable_bytes / 1e9}))
    return rows


def measure(args, argv: List[str]) -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for key, value in PRESETS["tiny" if args.tiny or device == "cpu" else "gpu"].items():
        setattr(args, key, getattr(args, key) or value)
    args.dtype = args.dtype or ("bf16" if device == "cuda" else "fp32")       # CUDA's flash SDPA: 16-bit only
    args.torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    args.sched_seq = args.sched_seq or max(args.seqs)
    args.strategies = [s for s in args.strategies.split(",") if s]
    bad = sorted(set(args.strategies) - set(STRATEGIES))
    if bad or args.sched_seq % (2 * args.P) or args.heads % args.P or args.P % 2 or (device, args.dtype) == (
            "cuda", "fp32"):                                                                # before any work
        raise SystemExit(f"{PROG}: --strategies {bad}: choose among {', '.join(STRATEGIES)}; --sched-seq "
                         f"{args.sched_seq} must be a multiple of 2P, --heads {args.heads} of --P {args.P} (even); "
                         f"--dtype {args.dtype} on {device}: CUDA runs bf16 (its flash SDPA has no fp32)")
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"     # a known profile's name in it, or h100
    gpu = load_gpu(args.gpu or next((g for g in known_gpus() if g in name.lower()), "h100"))
    peak = gpu.peaks["bf16_tflops" if args.dtype == "bf16" else "tf32_tflops"] * 1e12 if device == "cuda" else None
    found = kernel_rows(args, device, peak) + schedule_rows(args, device) + memory_rows(args, gpu) + \
        lasp_rows(args, device)
    facts = {"title": f"One device: local kernels, one rank's share of each strategy, memory, LASP's chain ({name})",
             "setup": f"{device}, {args.dtype}, batch 1, {args.heads} heads x {args.head_dim}, causal; window "
                      f"{args.window}, softcap {args.softcap:g}, sinks one logit per head; {args.repeats} rounds after "
                      f"{args.warmup} warm-up, interleaved (harness.alone), medians (min-max). Shares: P={args.P}, "
                      f"N={args.sched_seq}, torch.compile backend {args.compile_backend}. Peak: " + (
                          f"profile {gpu.name}'s dense {args.dtype} figure" if peak else "none on CPU") + f". Memory: "
                      f"{ONE_B.name}, {ONE_B.params() / 1e9:.2f} B parameters, in profile {gpu.name}'s memory.",
             "command": command_line(PROG, argv), "notes": args.notes, "metrics": METRICS,
             "machine": f"{name}, torch {torch.__version__}, {os.cpu_count()} CPUs, load {loads()}"}
    return write_page(args.out, args.name or f"gpu_{gpu.name if device == 'cuda' else 'cpu'}", found,
                      dict(facts, meta=dict(vars(args), torch_dtype=str(args.torch_dtype))), PROG)


def build_parser():
    ap = suite_parser(PROG, __doc__, "", repeats=3, P=8, heads=0, head_dim=0, window=0, sched_seq=0)
    ap.add_argument("--tiny", action="store_true", help="tiny sizes (the default without CUDA)")
    ap.add_argument("--seqs", type=lambda s: [int(x) for x in s.split(",") if x], help="kernel lengths, a,b,...")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), help="default: bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--softcap", type=float, default=50.0)
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--compile-backend", default="inductor", help="torch.compile backend of the shares")
    ap.add_argument("--case-budget", type=float, default=2.0, help="seconds a kernel case may take (then: skip N up)")
    ap.add_argument("--gpu", default=None, help=f"device profile ({', '.join(known_gpus())} or a JSON)")
    return ap


def main(argv: Optional[List[str]] = None) -> int:
    return suite_main(argv, build_parser(), measure)
