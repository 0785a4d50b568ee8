"""``ds-seqpar bench memory``: peak memory per rank of a training step (forward, backward, optimizer
step) at several tokens per rank, with and without the long-context memory features (fused tiled loss,
tiled MLP, every layer checkpointed to host), at P = 1, 2, 4; every strategy against one rank; and the
step-time cost of the features at a short sequence.

    ds-seqpar bench memory                                   # the preset -> reports/memory_cpu.{md,rows.json,/}
    ds-seqpar bench memory --models lm --P 1,2 --on-tokens 2048,8192 --name mine
    ds-seqpar bench memory --resume                          # keep the points already in the rows file
    ds-seqpar bench memory --render reports/memory_cpu.rows.json   # re-derive page and plots only

Every point runs the main job on fresh ranks, which read the kernel's high-water mark of their resident
set per phase: the process's real peak, whoever allocated. glibc keeps freed blocks below its dynamic
mmap threshold (up to 32 MB) in the heap, inflating the resident set by what the step freed last; so the
ranks map every block above 64 KiB (MALLOC_MMAP_THRESHOLD_; ``--malloc default``: glibc's).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from contextlib import closing
from dataclasses import asdict, dataclass, fields
from typing import Any, Dict, List, Optional

from ..report.plotting import require_matplotlib
from ..report.rows import load_rows
from .harness import command_line, machine_facts
from .memory_rows import PROG, finish

MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}
ON_TOKENS = {1: [2048, 8192, 16384], 2: [2048, 8192], 4: [2048, 4096]}   # the preset's scaling points by P
OFF_TOKENS = {1: [1024, 2048], 2: [1024, 2048], 4: [1024, 2048]}
# the per-strategy comparison: a Llama of configs/models/llama_small.json's sizes with configs/long_context.json's
# features, at P = 1, 2, 4 and equal tokens per rank; zigzag at a short length (the two-point figure's static)
STRATEGIES = "zigzag,ring,striped,ulysses,hybrid"
COMPARE_TOKENS, SHORT_TOKENS = {2: 8192, 4: 4096}, 256
COMPARE = dict(model="llama", features=True, layers=4, tiled_loss_tokens=1024, tiled_mlp_tokens=1024,
               purpose="strategies")


@dataclass(frozen=True)
class MemorySpec:
    """One point (picklable: it travels to the ranks). "llama": Hugging Face LlamaForCausalLM from a
    LlamaConfig (random init, sdpa, ds_seqpar.hf at P > 1); "lm": the project's LM of the same sizes."""

    model: str                      # llama | lm
    world: int                      # sequence-parallel size P (dp = 1)
    tokens_per_rank: int
    features: bool                  # tiled loss + tiled MLP + checkpointing (+ host offload)
    vocab: int = 32000
    hidden: int = 256
    layers: int = 8
    heads: int = 8
    kv_heads: int = 2
    intermediate: int = 688         # Llama's ratio: 8/3 x hidden, rounded
    tiled_loss_tokens: int = 256
    tiled_mlp_tokens: int = 1024
    strategy: str = "zigzag"
    ulysses_size: int = 1           # > 1: the 2D hybrid
    purpose: str = "scaling"        # scaling: the per-token fits; strategies: the per-strategy comparison
    steps: int = 1                  # measured steps after the first (timing runs: steps per round)


def train_options(spec: MemorySpec, workdir: str) -> Dict[str, Any]:
    """The main job's options (``python -m ds_seqpar.train``'s, as a dict) for this point: ZeRO-2, fp32,
    AdamW, micro batch 1; the features as sequence_parallel keys and host checkpointing."""
    sp = {"strategy": spec.strategy, "size": spec.world, "ulysses_size": spec.ulysses_size}
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
          "steps_per_print": 1 << 30, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
          "zero_optimization": {"stage": 2, "overlap_comm": False, "contiguous_gradients": True,
                                "reduce_bucket_size": 50_000_000},
          "sequence_parallel": sp}
    if spec.features:
        sp.update(tiled_loss_tokens=spec.tiled_loss_tokens, tiled_mlp_tokens=spec.tiled_mlp_tokens)
        ds["activation_checkpointing"] = {"cpu_checkpointing": True}
    opts = dict(deepspeed_config=ds, sp_size=spec.world, seq_len=spec.tokens_per_rank * spec.world,
                steps=spec.steps + 1, seed=0, run_dir=os.path.join(workdir, "runs"), run_name="memory",
                no_wandb=True, quiet=True)
    if spec.model == "lm":
        return dict(opts, dim=spec.hidden, n_layers=spec.layers, n_heads=spec.heads, n_kv_heads=spec.kv_heads,
                    mlp_hidden=spec.intermediate, untied=True, vocab_size=spec.vocab)
    path = os.path.join(workdir, "llama.json")
    with open(path, "w") as f:
        json.dump({"model_type": "llama", "vocab_size": spec.vocab, "hidden_size": spec.hidden,
                   "intermediate_size": spec.intermediate, "num_hidden_layers": spec.layers,
                   "num_attention_heads": spec.heads, "num_key_value_heads": spec.kv_heads,
                   "max_position_embeddings": 1 << 20, "tie_word_embeddings": False, "use_cache": False,
                   "attn_implementation": "sdpa"}, f)
    return dict(opts, model=path)


def measure_peak(spec: MemorySpec) -> Dict[str, Any]:
    """On every rank: the main job for ``steps + 1`` steps, the last step's static (the resident set before
    it), peak and phase peaks; not the first step's, which creates the gradient buffers and Adam's moments."""
    import torch
    from ..train import run_training
    os.environ["OMP_NUM_THREADS"] = "1"             # run_training gives a rank cores / P threads otherwise
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        out = run_training(train_options(spec, tmp))
    if not out["memory"] or out["memory"][-1]["static_bytes"] is None:
        raise RuntimeError(f"{PROG} needs per-phase peaks (Linux /proc/self/clear_refs or CUDA)")
    records, last = out["memory"][1:], out["memory"][-1]
    return {"resident_bytes": last["static_bytes"], "phase_peak_bytes": last["phases"],
            "peak_bytes": last["peak_bytes"], "peak_phase": last["peak_phase"], "rank": out["rank"],
            "step_s": [r["step_s"] for r in records], "losses": out["losses"][1:]}


class MemoryBenchError(ValueError):
    """A bad option, found before any rank starts."""


def build_parser() -> argparse.ArgumentParser:
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    ap = argparse.ArgumentParser(prog=PROG, description="Peak memory per rank of a full training step with and "
                                 "without the long-context memory features.")
    ap.add_argument("--models", default="llama,lm", help="comma list of llama, lm")
    ap.add_argument("--P", type=ints, default=[1, 2, 4], help="sequence-parallel sizes (ranks)")
    ap.add_argument("--on-tokens", type=ints, help="tokens per rank with the features (default: the preset's per P)")
    ap.add_argument("--off-tokens", type=ints, help="tokens per rank without them (default: the preset's per P)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--budget-gib", type=float, default=2.0, help="per-rank memory budget")
    ap.add_argument("--timing-tokens", type=int, default=1024, help="step-time comparison's tokens per rank (0: skip)")
    ap.add_argument("--timing-rounds", type=int, default=3)
    ap.add_argument("--strategies", default=STRATEGIES, help="the per-strategy comparison of the whole step's peak "
                    "above static ('' to skip); hybrid = ulysses_size 2 at P=4")
    ap.add_argument("--compare-tokens", type=int, help="tokens per rank of the strategy comparison "
                    "(default: 8192 at P=2, 4096 at P=4)")
    ap.add_argument("--malloc", choices=("mmap", "default"), default="mmap", help="glibc malloc setting of the ranks")
    ap.add_argument("--out", default="reports")
    ap.add_argument("--name", default="memory_cpu")
    ap.add_argument("--resume", action="store_true", help="reuse the points already in <out>/<name>.rows.json")
    ap.add_argument("--render", metavar="ROWS", help="measure nothing: rewrite the page and plots of a saved rows file")
    return ap


def points(args) -> List[MemorySpec]:
    """Every point in a fixed order: the per-strategy comparison (P=1 at each of its lengths, every strategy
    at P=2 and 4, hybrid = zigzag x Ulysses 2 at P=4 only, the short runs), then per model and P the scaling
    points, without the features before with, short before long."""
    names, models = [s for s in args.strategies.split(",") if s], args.models.split(",")
    unknown = sorted(set(names) - set(STRATEGIES.split(",")))
    if unknown:
        raise MemoryBenchError(f"--strategies: unknown {unknown}; choose from {STRATEGIES}")
    bad = [m for m in models if m not in ("llama", "lm")]
    if bad:
        raise MemoryBenchError(f"--models: unknown model {bad[0]!r}; choose llama, lm")
    tokens = {p: args.compare_tokens or n for p, n in COMPARE_TOKENS.items()}
    runs = [(1, n, "zigzag", 1) for n in sorted(set(tokens.values()), reverse=True)]
    runs += [(p, n, "zigzag", 2) if s == "hybrid" else (p, n, s, 1)
             for s in names for p, n in tokens.items() if s != "hybrid" or p == 4]
    runs += [(p, SHORT_TOKENS, "zigzag", 1) for p in (1, 2)]
    specs = [MemorySpec(world=p, tokens_per_rank=n, strategy=s, ulysses_size=u, hidden=args.hidden, **COMPARE)
             for p, n, s, u in runs] if names else []
    given = {False: (args.off_tokens, OFF_TOKENS), True: (args.on_tokens, ON_TOKENS)}
    return specs + [MemorySpec(model, p, n, features, hidden=args.hidden, layers=args.layers)
                    for model in models for p in args.P for features, (mine, preset) in given.items()
                    for n in mine or preset.get(p, preset[max(preset)])]


def _pool(world: int, malloc: str):
    """A fresh pool of ``world`` one-thread ranks, started with the measurement's malloc setting (spawned: glibc
    reads it when a process starts, and a forked rank keeps its fork server's heap and setting)."""
    from ..launch.env import restored_environ
    from ..launch.rankpool import RankPool
    with restored_environ(*MALLOC_ENV):
        if malloc == "mmap":
            os.environ.update(MALLOC_ENV)
        return RankPool(world, timeout_s=7200.0, threads_per_rank=1, start_method="spawn").start()


def measure_one(spec: MemorySpec, malloc: str) -> Dict[str, Any]:
    """One point on a fresh pool: its spec, its ranks' records, the largest rank's peak, per phase the largest
    peak and the largest peak above the rank's own static."""
    with closing(_pool(spec.world, malloc)) as pool:
        ranks = pool.run(measure_peak, spec, timeout=7200.0)
    top = max(ranks, key=lambda r: r["peak_bytes"])
    phases = {p: max(r["phase_peak_bytes"][p] for r in ranks) for p in ranks[0]["phase_peak_bytes"]}
    above = {p: max(r["phase_peak_bytes"][p] - r["resident_bytes"] for r in ranks) for p in phases}
    return dict(asdict(spec), ranks=ranks, peak_bytes=top["peak_bytes"], resident_bytes=top["resident_bytes"],
                phase_peak_bytes=phases, phase_above_static_bytes=above, above_static_bytes=max(above.values()),
                step_s=top["step_s"])


def measure_timing(model: str, world: int, args) -> Dict[str, Any]:
    """Step seconds without and with the features, alternating round by round on one pool (load hits both
    alike); a round's time: the median of its steps after the first, the slowest rank's."""
    pair = [MemorySpec(model, world, args.timing_tokens, features, hidden=args.hidden, layers=args.layers, steps=2)
            for features in (False, True)]
    with closing(_pool(world, "default")) as pool:
        runs = [pool.run(measure_peak, spec, timeout=7200.0) for spec in pair * args.timing_rounds]
    seconds = [max(statistics.median(r["step_s"]) for r in ranks) for ranks in runs]
    return {"tokens_per_rank": args.timing_tokens, "off_s": seconds[0::2], "on_s": seconds[1::2],
            "load_1min": os.getloadavg()[0]}


def run(args, argv: List[str]) -> None:
    """The points ``points`` lists and the step times (with --resume those the rows file lacks); the rows file
    (the record in its facts) and the page are rewritten after every point: a stop loses only that one."""
    path = os.path.join(args.out, f"{args.name}.rows.json")
    res = load_rows(path)[1] if args.resume and os.path.exists(path) else {"measurements": [], "timing": {}}
    sizes = ("vocab", "heads", "kv_heads", "intermediate", "tiled_loss_tokens", "tiled_mlp_tokens", "strategy")
    res.update(meta=dict(name=args.name, command=command_line(PROG, argv), malloc=args.malloc,
                         budget_bytes=int(args.budget_gib * 2 ** 30), hidden=args.hidden, layers=args.layers,
                         **{k: getattr(MemorySpec, k) for k in sizes}), host=machine_facts())
    done = {MemorySpec(**{f.name: m[f.name] for f in fields(MemorySpec)}) for m in res["measurements"]}
    before, start = res.get("elapsed_s", 0.0), time.monotonic()

    def save() -> None:
        res["elapsed_s"] = before + time.monotonic() - start
        finish(res, args.out)

    for spec in (s for s in points(args) if s not in done):
        print(f"{PROG}: {spec.model} P={spec.world} {spec.strategy} features={spec.features} "
              f"{spec.tokens_per_rank} tokens/rank ({spec.purpose}) ...", flush=True)
        res["measurements"].append(measure_one(spec, args.malloc))
        save()
    for model in args.models.split(",") if args.timing_tokens else []:
        for p in [p for p in args.P if p <= 2 and f"{model}/P{p}" not in res["timing"]]:
            print(f"{PROG}: step time {model}/P{p} ...", flush=True)
            res["timing"][f"{model}/P{p}"] = measure_timing(model, p, args)
            save()
    save()


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.render:
        finish(load_rows(args.render)[1], os.path.dirname(args.render) or ".")
        return 0
    try:
        points(args)
        require_matplotlib("the report's plots", MemoryBenchError)     # before measuring, not after
    except MemoryBenchError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    run(args, argv)
    return 0
