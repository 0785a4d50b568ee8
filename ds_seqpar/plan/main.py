"""``ds-seqpar plan``: which strategy, sizes, ZeRO stage and memory features for a model, a sequence
length and a cluster; predicted, ranked, with the reason for every rejection.

    ds-seqpar plan --model configs/models/llama_small.json --seq-len 131072 --gpus 16 --gpus-per-node 8 \
        --gpu h100 --out ds.json
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter, OrderedDict
from typing import List, Optional

from ..config import ConfigError
from . import hardware
from .ds_json import ds_config
from ..cost.bytes import SPAN_BUDGET
from .inputs import OWN_LM, check_args, equal_documents, load_model
from ..cost.model_shape import ModelShape
from .search import HEADROOM, Cluster, Prediction, gpus_needed, lasp_comm_reasons, longest_sequence, plan

GB, KB, MB = 1e9, 1e3, 1e6


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ds-seqpar plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="Hugging Face model directory (with config.json) or config JSON file")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (one sequence per data-parallel replica)")
    p.add_argument("--gpus", type=int, help="GPUs in all")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gpu", default="h100", help=f"{' | '.join(hardware.known_gpus())} | a JSON profile path")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    p.add_argument("--exact-bytes", action="store_true", help="find the masked layers' exact ring spans at any "
                   "size (slow past 8M positions x tokens: minutes at 4M tokens on 32 GPUs)")
    p.add_argument("--doc-len", type=int, default=None, help="packed documents of this many tokens (the last one "
                   "shorter): attention work and ring bytes follow their mask")
    p.add_argument("--zero", type=int, choices=(1, 2, 3), help="ZeRO stage (default: try 1, 2 and 3)")
    p.add_argument("--top", type=int, default=12, help="feasible configurations to print")
    p.add_argument("--headroom", type=float, default=HEADROOM, help="fraction of each GPU's usable memory a "
                   "configuration must leave free (default %(default)s); near-ties in tokens/s go to fewer moving "
                   "parts, then more free memory")
    p.add_argument("--out", help="write the best configuration's DeepSpeed JSON here")
    p.add_argument("--json", dest="json_out", help="write every prediction here (machine-readable)")
    p.add_argument("--lengths", help="document-length files (comma list; one integer per line, .gz too): predict "
                   "the step of the best static configuration, power-of-two and dynamic groups (docs/dynamic.md)")
    p.add_argument("--tokens-per-gpu", type=int, default=65536, help="--lengths: tokens per GPU in a step")
    p.add_argument("--seed", type=int, default=0, help="--lengths: which documents are drawn")
    p.add_argument("--calibrate", action="store_true", help="measure this machine's alpha/beta (gloo, local ranks) and "
                   "kernel throughput; write the profile and the predicted-vs-measured report (--reports, --name)")
    p.add_argument("--reports", default="reports",
                   help="--calibrate: where the measured reports are and the report goes")
    p.add_argument("--name", default="plan_cpu",
                   help="--calibrate: report name (REPORTS/NAME.md, .rows.json, _profile.json)")
    return p


def _gb(x: float) -> str:
    return f"{x / GB:.1f}"


def render(shape: ModelShape, opts, cluster: Cluster, ok: List[Prediction], rejected: List[Prediction]) -> str:
    gpu, a = cluster.gpu, cluster.gpu.assumed
    lines = [f"model {shape.name}: {shape.params() / 1e9:.2f}B parameters, {shape.layers} layers "
             f"({', '.join(f'{k} x{n}' for k, n in Counter(shape.layer_kinds).items())}), "
             f"hidden {shape.hidden}, heads {shape.heads}/{shape.kv_heads} kv, vocab {shape.vocab}"
             + "".join(f"; window {w} on {k} layers" for w, k in shape.softmax_windows().items() if w),
             *([f"packed documents of {opts.doc_len:,} tokens"] if getattr(opts, "doc_len", None) else []),
             f"sequence {opts.seq_len:,} tokens; {cluster.gpus} x {gpu.name} ({gpu.description}), "
             f"{cluster.gpus_per_node} per node, {cluster.dtype}; usable memory {_gb(gpu.usable_bytes)} GB per GPU",
             f"assumed: matmul {a['matmul_efficiency']:.0%} and attention {a['attention_efficiency']:.0%} of the "
             f"datasheet peak, NVLink {a['nvlink_efficiency']:.0%}, inter-node {a['inter_node_efficiency']:.0%} of "
             f"theirs (docs/plan.md)", ""]
    hdr = ("rank", "strategy", "size", "u", "lin", "dp", "zero", "features", "static GB", "KB/token", "peak GB (phase)",
           "free", "longest seq", "comm MB/layer", "comm s", "a2a chunks (why)", "compute s", "step s", "tokens/s",
           "MFU")
    rows = []
    for i, p in enumerate(ok[:opts.top], 1):
        c = p.candidate
        comm_mb = ", ".join(f"{k} {v / MB:.0f}" for k, v in p.comm_bytes.items()) or "-"
        comm_s = ", ".join(f"{k} {v:.2f}" for k, v in p.comm_s.items() if v > 0.005) or "0"
        rows.append((str(i), c.strategy, str(c.size), str(c.ulysses_size), c.linear_strategy if shape.hybrid else
                     (c.lasp_comm if c.strategy == "lasp" else "-"),
                     str(p.dp), str(c.zero), c.features.label, _gb(p.static_bytes), f"{p.per_token_bytes / KB:.0f}",
                     f"{_gb(p.peak_bytes)} ({p.peak_phase})", f"{p.free:.0%}", f"{p.max_seq:,}", comm_mb, comm_s,
                     p.chunks_why or "-", f"{p.compute_s:.2f}", f"{p.step_s:.2f}", f"{p.tokens_s:,.0f}",
                     f"{p.mfu:.0%}"))
    lines += _table(hdr, rows) if rows else ["no configuration fits (see the rejections)"]
    lines += [f"why: {line}" for line in lasp_comm_reasons(ok)]
    if len(ok) > opts.top:
        lines.append(f"... {len(ok) - opts.top} more feasible configurations (--top N)")
    lines += ["", f"rejected: {len(rejected)} configurations"]
    # a refusal reads the same for many candidates: one line per reason, first; a candidate that does
    # not fit is listed by itself (nearest misses first), its twins (other linear_strategy) folded in
    groups: "OrderedDict[str, List[Prediction]]" = OrderedDict()
    for p in sorted(rejected, key=lambda p: (p.reason.startswith("does not fit"), p.reason.split(":")[0], -p.max_seq)):
        fits = p.reason.startswith("does not fit")
        groups.setdefault(p.candidate.label() if fits else p.reason, []).append(p)
    for i, ps in enumerate(groups.values()):
        if i == 20:
            lines.append(f"  ... {len(groups) - 20} more reasons")
            break
        twins = f" (and {len(ps) - 1} alike)" if len(ps) > 1 else ""
        lines.append(f"  {ps[0].candidate.label()}: {ps[0].reason}{twins}")
    return "\n".join(lines)


def _table(hdr, rows) -> List[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(hdr)]
    fmt = lambda r: "  ".join(x.ljust(w) for x, w in zip(r, widths))       # noqa: E731
    return [fmt(hdr), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]


def no_fit_message(shape: ModelShape, opts, cluster: Cluster, own_linear: bool = False) -> str:
    longest = longest_sequence(shape, cluster, opts.zero, own_linear)
    need = gpus_needed(shape, opts.seq_len, cluster, opts.zero, own_linear)
    more = (f"{need} x {cluster.gpu.name} ({cluster.gpus_per_node} per node) would fit it" if need else
            "no cluster up to 16384 GPUs fits it")
    return (f"ds-seqpar plan: no configuration fits {opts.seq_len:,} tokens of {shape.name} on {cluster.gpus} x "
            f"{cluster.gpu.name}: the longest sequence these GPUs fit is {longest:,} tokens; {more}")


def _as_json(p: Prediction) -> dict:
    c = p.candidate
    return {"strategy": c.strategy, "size": c.size, "ulysses_size": c.ulysses_size,
            "linear_strategy": c.linear_strategy, "lasp_comm": c.lasp_comm if c.strategy == "lasp" else None,
            "zero": c.zero, "features": c.features.label,
            "dp": p.dp, "ok": p.ok, "reason": p.reason,
            "static_bytes": p.static_bytes, "per_token_bytes": p.per_token_bytes, "peak_bytes": p.peak_bytes,
            "peak_phase": p.peak_phase, "host_bytes": p.host_bytes, "comm_bytes_per_layer": p.comm_bytes,
            "comm_s": p.comm_s, "ulysses_chunks": p.ulysses_chunks, "chunks_why": p.chunks_why,
            "compute_s": p.compute_s, "step_s": p.step_s, "tokens_s": p.tokens_s, "mfu": p.mfu,
            "max_seq": p.max_seq, "phases": p.phases}


def run(opts) -> int:
    if opts.calibrate:
        from .calibrate_report import run as calibrate
        return calibrate(opts)
    if opts.lengths:
        from .lengths import run as lengths
        return lengths(opts)
    check_args(opts)
    gpu = hardware.load_gpu(opts.gpu)
    shape = load_model(opts.model)
    own_linear = shape.count("lasp") > 0
    cluster = Cluster(opts.gpus, min(opts.gpus_per_node, opts.gpus), gpu, opts.dtype)
    docs = equal_documents(opts.seq_len, opts.doc_len)
    span_budget = float("inf") if opts.exact_bytes else SPAN_BUDGET
    ok, rejected = plan(shape, opts.seq_len, cluster, opts.zero, own_linear, docs=docs, span_budget=span_budget,
                        headroom=opts.headroom)
    print(render(shape, opts, cluster, ok, rejected))
    bounded = sorted({f"{p.candidate.strategy} x{p.candidate.size // p.candidate.ulysses_size}"
                      for p in ok + rejected if p.bytes_bounded})
    if bounded:
        print(f"note: the ring bytes of windowed / packed layers are the no-mask closed form (an upper bound) for "
              f"{', '.join(bounded)}: their exact spans cost seconds to minutes at this size; --exact-bytes computes "
              f"them")
    if opts.json_out:
        with open(opts.json_out, "w") as f:
            json.dump({"model": shape.name, "seq_len": opts.seq_len, "gpus": opts.gpus, "gpu": hardware.describe(gpu),
                       "feasible": [_as_json(p) for p in ok], "rejected": [_as_json(p) for p in rejected]}, f, indent=1)
    if not ok:
        print(no_fit_message(shape, opts, cluster, own_linear), file=sys.stderr)
        return 1
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump(ds_config(ok[0].candidate, opts.dtype, shape.hybrid, ok[0].ulysses_chunks), f, indent=2)
            f.write("\n")
        print(f"\nwrote {opts.out}: {ok[0].candidate.label()}")
        if shape.model_type == OWN_LM:
            print(f"run it with the model's sizes: python -m ds_seqpar.train --deepspeed_config {opts.out} "
                  f"--dim {shape.hidden} --n_layers {shape.layers} --n_heads {shape.heads} --n_kv_heads "
                  f"{shape.kv_heads} --mlp_hidden {shape.intermediate}" + (" --untied" if not shape.tied else ""))
    return 0


def main(argv: Optional[list] = None) -> int:
    opts = build_parser().parse_args(argv)
    try:
        return run(opts)
    except (ConfigError, OSError, ValueError) as err:
        print(f"ds-seqpar plan: error: {err}", file=sys.stderr)
        return 2


__all__ = ["build_parser", "load_model", "main", "render", "run"]
