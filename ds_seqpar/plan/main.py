"""``ds-seqpar plan``: which strategy, sizes, ZeRO stage and memory features for a model, a sequence
length and a cluster; predicted, ranked, with the reason for every rejection.

    ds-seqpar plan --model configs/models/llama_small.json --seq-len 131072 --gpus 16 --gpus-per-node 8 \
        --gpu h100 --out ds.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import OrderedDict
from typing import List, Optional, Tuple

from ..config import ConfigError
from . import hardware
from .ds_json import ds_config
from .cost.bytes import SPAN_BUDGET
from .hardware import PlanError
from .model_shape import ModelShape, from_hf_config
from .search import Cluster, Prediction, gpus_needed, longest_sequence, plan

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
    p.add_argument("--out", help="write the best configuration's DeepSpeed JSON here")
    p.add_argument("--json", dest="json_out", help="write every prediction here (machine-readable)")
    p.add_argument("--calibrate", action="store_true", help="measure this machine's alpha/beta (gloo, local ranks) and "
                   "kernel throughput; write the profile and the predicted-vs-measured report (--reports, --name)")
    p.add_argument("--reports", default="reports", help="--calibrate: where the measured reports are and the report goes")
    p.add_argument("--name", default="plan_cpu", help="--calibrate: report name (REPORTS/NAME.md, .json, _profile.json)")
    return p


OWN_LM = "ds_seqpar_lm"


def own_lm_shape(raw: dict, name: str) -> ModelShape:
    """The project's own LM (models/lm.py) from a JSON of its ModelConfig fields with "model_type":
    "ds_seqpar_lm" (configs/plan/own_lm_linear.json); validated by ModelConfig itself. Softmax: a
    Llama-style shape; linear: every layer "lasp" (strategy lasp, one [d, d] state per q head)."""
    from ..models.lm import ModelConfig
    fields = {k: v for k, v in raw.items() if k != "model_type"}
    try:
        cfg = ModelConfig(**fields)
    except (TypeError, ValueError) as err:
        raise PlanError(f"--model {name}: not a ds_seqpar_lm config ({err}); keys are ModelConfig's: "
                        f"{', '.join(ModelConfig.__dataclass_fields__)}") from None
    linear = cfg.attention == "linear"
    return ModelShape(name, cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.mlp_hidden,
                      cfg.vocab_size, tied=cfg.tie_embeddings, kinds=("lasp",) * cfg.n_layers if linear else (),
                      lin_heads=cfg.n_heads if linear else 0, lin_dk=cfg.head_dim if linear else 0,
                      lin_dv=cfg.head_dim if linear else 0, transition="fixed", model_type=OWN_LM)


def load_model(path: str) -> ModelShape:
    """The HF config through the project's loader, checked as the main job checks it; or the
    project's own LM (own_lm_shape)."""
    from ..hf.checks import check_config, text_config
    from ..hf.linear_layers import HYBRID_MODEL_TYPES, MAMBA1_MODEL_TYPES
    from ..hf.model_io import load_config
    if os.path.isdir(path) and not os.path.exists(os.path.join(path, "config.json")):
        raise PlanError(f"--model {path!r} is a directory without config.json; pass a Hugging Face model directory "
                        f"or a config JSON file (e.g. configs/models/llama_small.json)")
    if path.endswith(".json") and os.path.isfile(path):
        with open(path) as f:
            try:
                raw = json.load(f)
            except json.JSONDecodeError as err:
                raise PlanError(f"--model {path!r} is not valid JSON: {err}") from None
        if isinstance(raw, dict) and raw.get("model_type") == OWN_LM:
            return own_lm_shape(raw, os.path.basename(path))
    config = load_config(path)
    model_type = getattr(text_config(config), "model_type", None)
    check_config(config, training=True, linear_ok=model_type in HYBRID_MODEL_TYPES)
    if model_type in MAMBA1_MODEL_TYPES:
        raise PlanError(f"--model {path!r}: model_type={model_type!r} has Mamba-1 selective scans, which train "
                        f"sequence-parallel (docs/hybrids.md) but have no cost model in ds-seqpar plan yet; plan a "
                        f"Mamba2 or softmax model of the same sizes")
    return from_hf_config(config, os.path.basename(path.rstrip("/")), HYBRID_MODEL_TYPES)


def equal_documents(seq: int, doc_len: Optional[int]) -> Optional[Tuple[int, ...]]:
    """``--doc-len``: documents of doc_len tokens packed into seq (the last one shorter)."""
    if not doc_len or doc_len >= seq:
        return None
    full, rest = divmod(seq, doc_len)
    return (doc_len,) * full + ((rest,) if rest else ())


def check_args(opts) -> None:
    for name in ("model", "seq_len", "gpus"):
        if getattr(opts, name) is None:
            raise PlanError(f"--{name.replace('_', '-')} is required")
    if opts.seq_len < 2 or opts.gpus < 1 or opts.gpus_per_node < 1:
        raise PlanError(f"--seq-len={opts.seq_len} must be >= 2, --gpus={opts.gpus} and "
                        f"--gpus-per-node={opts.gpus_per_node} >= 1")
    if opts.doc_len is not None and opts.doc_len < 1:
        raise PlanError(f"--doc-len={opts.doc_len} must be >= 1 (tokens per packed document)")
    if opts.gpus > opts.gpus_per_node and opts.gpus % opts.gpus_per_node:
        raise PlanError(f"--gpus={opts.gpus} is not a whole number of nodes of --gpus-per-node={opts.gpus_per_node}")


def _gb(x: float) -> str:
    return f"{x / GB:.1f}"


def render(shape: ModelShape, opts, cluster: Cluster, ok: List[Prediction], rejected: List[Prediction]) -> str:
    gpu = cluster.gpu
    lines = [f"model {shape.name}: {shape.params() / 1e9:.2f}B parameters, {shape.layers} layers "
             f"({', '.join(f'{k} x{shape.count(k)}' for k in dict.fromkeys(shape.layer_kinds))}), hidden {shape.hidden}, "
             f"heads {shape.heads}/{shape.kv_heads} kv, vocab {shape.vocab}"
             + "".join(f"; window {w} on {k} layers" for w, k in shape.softmax_windows().items() if w),
             *([f"packed documents of {opts.doc_len:,} tokens"] if getattr(opts, "doc_len", None) else []),
             f"sequence {opts.seq_len:,} tokens; {cluster.gpus} x {gpu.name} ({gpu.description}), "
             f"{cluster.gpus_per_node} per node, {cluster.dtype}; usable memory {_gb(gpu.usable_bytes)} GB per GPU",
             f"assumed: matmul {gpu.assumed['matmul_efficiency']:.0%} and attention {gpu.assumed['attention_efficiency']:.0%}"
             f" of the datasheet peak, NVLink {gpu.assumed['nvlink_efficiency']:.0%}, inter-node "
             f"{gpu.assumed['inter_node_efficiency']:.0%} of theirs (docs/plan.md)", ""]
    hdr = ("rank", "strategy", "size", "u", "lin", "dp", "zero", "features", "static GB", "KB/token", "peak GB (phase)",
           "comm MB/layer", "comm s", "compute s", "step s", "tokens/s", "MFU")
    rows = []
    for i, p in enumerate(ok[:opts.top], 1):
        c = p.candidate
        comm_mb = ", ".join(f"{k} {v / MB:.0f}" for k, v in p.comm_bytes.items()) or "-"
        comm_s = ", ".join(f"{k} {v:.2f}" for k, v in p.comm_s.items() if v > 0.005) or "0"
        rows.append((str(i), c.strategy, str(c.size), str(c.ulysses_size), c.linear_strategy if shape.hybrid else
                     (c.lasp_comm if c.strategy == "lasp" else "-"),
                     str(p.dp), str(c.zero), c.features.label, _gb(p.static_bytes), f"{p.per_token_bytes / KB:.0f}",
                     f"{_gb(p.peak_bytes)} ({p.peak_phase})", comm_mb, comm_s, f"{p.compute_s:.2f}", f"{p.step_s:.2f}",
                     f"{p.tokens_s:,.0f}", f"{p.mfu:.0%}"))
    lines += _table(hdr, rows) if rows else ["no configuration fits (see the rejections)"]
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
    return {"strategy": c.strategy, "size": c.size, "ulysses_size": c.ulysses_size, "linear_strategy": c.linear_strategy,
            "lasp_comm": c.lasp_comm if c.strategy == "lasp" else None, "zero": c.zero, "features": c.features.label,
            "dp": p.dp, "ok": p.ok, "reason": p.reason,
            "static_bytes": p.static_bytes, "per_token_bytes": p.per_token_bytes, "peak_bytes": p.peak_bytes,
            "peak_phase": p.peak_phase, "host_bytes": p.host_bytes, "comm_bytes_per_layer": p.comm_bytes,
            "comm_s": p.comm_s, "compute_s": p.compute_s, "step_s": p.step_s, "tokens_s": p.tokens_s, "mfu": p.mfu,
            "max_seq": p.max_seq, "phases": p.phases}


def run(opts) -> int:
    if opts.calibrate:
        return calibrate_here(opts)
    check_args(opts)
    gpu = hardware.load_gpu(opts.gpu)
    shape = load_model(opts.model)
    own_linear = shape.count("lasp") > 0
    cluster = Cluster(opts.gpus, min(opts.gpus_per_node, opts.gpus), gpu, opts.dtype)
    docs = equal_documents(opts.seq_len, opts.doc_len)
    span_budget = float("inf") if opts.exact_bytes else SPAN_BUDGET
    ok, rejected = plan(shape, opts.seq_len, cluster, opts.zero, own_linear, docs=docs, span_budget=span_budget)
    print(render(shape, opts, cluster, ok, rejected))
    bounded = sorted({f"{p.candidate.strategy} x{p.candidate.size // p.candidate.ulysses_size}"
                      for p in ok + rejected if p.bytes_bounded})
    if bounded:
        print(f"note: the ring bytes of windowed / packed layers are the no-mask closed form (an upper bound) for "
              f"{', '.join(bounded)}: their exact spans cost seconds to minutes at this size; --exact-bytes computes them")
    if opts.json_out:
        with open(opts.json_out, "w") as f:
            json.dump({"model": shape.name, "seq_len": opts.seq_len, "gpus": opts.gpus, "gpu": hardware.describe(gpu),
                       "feasible": [_as_json(p) for p in ok], "rejected": [_as_json(p) for p in rejected]}, f, indent=1)
    if not ok:
        print(no_fit_message(shape, opts, cluster, own_linear), file=sys.stderr)
        return 1
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump(ds_config(ok[0].candidate, opts.dtype, shape.hybrid), f, indent=2)
            f.write("\n")
        print(f"\nwrote {opts.out}: {ok[0].candidate.label()}")
        if shape.model_type == OWN_LM:
            print(f"run it with the model's sizes: python -m ds_seqpar.train --deepspeed_config {opts.out} "
                  f"--dim {shape.hidden} --n_layers {shape.layers} --n_heads {shape.heads} --n_kv_heads "
                  f"{shape.kv_heads} --mlp_hidden {shape.intermediate}" + (" --untied" if not shape.tied else ""))
    return 0


def calibrate_here(opts) -> int:
    """Measure, write REPORTS/NAME_profile.json (usable as --gpu) and REPORTS/NAME.md."""
    import time as _time
    from . import calibrate, calibrate_report
    start = _time.time()
    load = os.getloadavg()[0]
    from . import kernel_model
    kernels = calibrate.measure_kernels()
    blocks = kernel_model.measure_blocks()
    comm = calibrate.measure_comm(2, 7)
    profile = calibrate.cpu_profile(comm, kernels)
    os.makedirs(opts.reports, exist_ok=True)
    with open(os.path.join(opts.reports, f"{opts.name}_profile.json"), "w") as f:
        json.dump(hardware.describe(profile), f, indent=2)
    note = (f"Machine: {os.cpu_count()} cores, 1-minute load {load:.1f} before and {os.getloadavg()[0]:.1f} after "
            f"(the rates move with the load); calibration took {_time.time() - start:.0f} s.")
    md = calibrate_report.write({"kernels": kernels, "comm": comm, "blocks": blocks}, opts.reports, opts.name, note,
                                profile)
    print(f"wrote {md} and {os.path.join(opts.reports, opts.name + '_profile.json')} (usable as --gpu)")
    return 0


def main(argv: Optional[list] = None) -> int:
    opts = build_parser().parse_args(argv)
    try:
        return run(opts)
    except (ConfigError, OSError) as err:
        print(f"ds-seqpar plan: error: {err}", file=sys.stderr)
        return 2


__all__ = ["build_parser", "load_model", "main", "render", "run"]
