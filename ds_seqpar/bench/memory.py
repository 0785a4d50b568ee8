"""``ds-seqpar bench memory``: peak memory per rank of a full training step (forward, backward,
optimizer step) at several tokens per rank, with and without the long-context memory features
(fused tiled loss, tiled MLP, checkpointing of every layer with host offload), at P = 1, 2, 4;
and the step-time cost of the features at a short sequence.

    ds-seqpar bench memory                                   # the preset -> reports/memory_cpu.{md,json,/}
    ds-seqpar bench memory --models lm --P 1,2 --on-tokens 2048,8192 --name mine
    ds-seqpar bench memory --resume                          # keep the measurements already in the JSON
    ds-seqpar bench memory --render reports/memory_cpu.json  # re-render page and plots only

Models: an HF Llama-architecture config (LlamaForCausalLM from LlamaConfig, vocab 32000, hidden
256, 8 layers, 8 heads, 2 k/v heads, random init; at P > 1 its attention goes through
ds_seqpar.hf) and the project's LM with the same sizes. DeepSpeed ZeRO-2, fp32, AdamW, zigzag.

How memory is measured: every measurement runs in fresh processes (a new P-rank pool), which
read the kernel's high-water mark of their resident set (VmHWM in /proc/self/status, reset per
phase through /proc/self/clear_refs): the real peak of the process, whoever allocated. glibc's
malloc keeps freed blocks below its dynamic mmap threshold (up to 32 MB) in the heap, where they
inflate the resident set by whatever the step freed last; the pools therefore run with
MALLOC_MMAP_THRESHOLD_=65536 (tensors are mapped and unmapped, so resident memory follows live
tensors). ``--malloc default`` measures with glibc's defaults instead. memory_rows.py holds the
arithmetic, the rows and the plots.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional

import torch

from ..report.plotting import require_matplotlib
from .harness import command_line, machine_facts, write_page

MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}
# the per-strategy comparison: the main job on a Llama-architecture config (configs/models/llama_small.json's
# sizes) with configs/long_context.json's memory features, the same tokens per rank at P = 1, 2, 4; and
# a short length at P = 1, 2 (what a two-point "slope" from a short run would take as static)
COMPARE = {"strategies": "zigzag,ring,striped,ulysses,hybrid", "tokens_per_rank": {2: 8192, 4: 4096},
           "short_tokens": 256, "layers": 4, "tiled_loss_tokens": 1024, "tiled_mlp_tokens": 1024}
PRESET = {"models": "llama,lm", "P": "1,2,4", "budget_gib": 2.0,
          "on_tokens": {1: [2048, 8192, 16384], 2: [2048, 8192], 4: [2048, 4096]},
          "off_tokens": {1: [1024, 2048], 2: [1024, 2048], 4: [1024, 2048]},
          "timing_tokens": 1024, "timing_rounds": 3, "timing_steps": 2}


# -- the rank side: the main job itself (``run_training``: its data, model, DeepSpeed engine and step),
# with or without the features, and each phase's peak of its last step (the trainer's StepMemory).
# Static is the resident set just before the step; the first step creates what every later step holds
# (gradient buffers, Adam's moments), so the measured step is the last of ``steps + 1``. Models: "llama",
# Hugging Face LlamaForCausalLM from a LlamaConfig given to the main job as ``--model`` (random init,
# sdpa, ds_seqpar.hf at P > 1), or "lm", the project's LM with the same sizes.


@dataclass(frozen=True)
class MemorySpec:
    """One measurement (picklable: it travels to the ranks)."""

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
    seed: int = 0

    def as_dict(self) -> Dict[str, Any]:
        return asdict(self)


def ds_config(spec: MemorySpec) -> dict:
    sp = {"strategy": spec.strategy, "size": spec.world}
    if spec.ulysses_size > 1:
        sp["ulysses_size"] = spec.ulysses_size
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
          "steps_per_print": 1 << 30,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
          "zero_optimization": {"stage": 2, "overlap_comm": False, "contiguous_gradients": True,
                                "reduce_bucket_size": 50_000_000},
          "sequence_parallel": sp}
    if spec.features:
        sp.update(tiled_loss_tokens=spec.tiled_loss_tokens, tiled_mlp_tokens=spec.tiled_mlp_tokens)
        ds["activation_checkpointing"] = {"cpu_checkpointing": True}
    return ds


def _join_deepspeed() -> None:
    """deepspeed.init_distributed, then drop the name of this rank's /dev/shm all-reduce buffer
    (launch/env.py release_deepspeed_shm): every fresh process would leak one otherwise."""
    import deepspeed
    from .. import comm
    from ..launch.env import release_deepspeed_shm
    deepspeed.init_distributed(dist_backend="gloo")
    comm.barrier()
    release_deepspeed_shm(os.environ)


def train_options(spec: MemorySpec, workdir: str) -> Dict[str, Any]:
    """The main job's options (``python -m ds_seqpar.train``'s, as a dict) for this measurement."""
    opts = dict(deepspeed_config=ds_config(spec), sp_size=spec.world, seq_len=spec.tokens_per_rank * spec.world,
                steps=spec.steps + 1, seed=spec.seed, run_dir=os.path.join(workdir, "runs"), run_name="memory",
                no_wandb=True, quiet=True)
    if spec.ulysses_size > 1:
        opts["ulysses_size"] = spec.ulysses_size
    if spec.model == "lm":
        return dict(opts, dim=spec.hidden, n_layers=spec.layers, n_heads=spec.heads, n_kv_heads=spec.kv_heads,
                    mlp_hidden=spec.intermediate, untied=True, vocab_size=spec.vocab)
    path = os.path.join(workdir, "llama.json")
    with open(path, "w") as f:
        json.dump(llama_config(spec), f)
    return dict(opts, model=path)


def llama_config(spec: MemorySpec) -> Dict[str, Any]:
    return {"model_type": "llama", "vocab_size": spec.vocab, "hidden_size": spec.hidden,
            "intermediate_size": spec.intermediate, "num_hidden_layers": spec.layers,
            "num_attention_heads": spec.heads, "num_key_value_heads": spec.kv_heads,
            "max_position_embeddings": 1 << 20, "tie_word_embeddings": False, "use_cache": False,
            "attn_implementation": "sdpa"}


def measure_peak(spec: MemorySpec) -> Dict[str, Any]:
    """On every rank of a fresh P-rank pool: the main job for ``steps + 1`` steps; the last step's
    static, peak and phase peaks (the trainer's StepMemory records)."""
    from ..train import run_training
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    _join_deepspeed()
    with tempfile.TemporaryDirectory() as tmp:
        out = run_training(train_options(spec, tmp))
    if not out["memory"] or out["memory"][-1]["static_bytes"] is None:
        raise RuntimeError("ds-seqpar bench memory needs per-phase peaks (Linux /proc/self/clear_refs or CUDA)")
    records = out["memory"][1:]                     # the first step creates the buffers every step holds
    last = records[-1]
    return {"resident_bytes": last["static_bytes"], "phase_peak_bytes": last["phases"],
            "peak_bytes": last["peak_bytes"], "peak_phase": last["peak_phase"], "rank": out["rank"],
            "step_s": [r["step_s"] for r in records], "losses": out["losses"][1:]}


PHASES = ("data", "forward", "loss_backward", "layers_backward", "end_of_backward", "optimizer")


class MemoryBenchError(ValueError):
    """A bad option, found before any rank starts."""


def build_parser() -> argparse.ArgumentParser:
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    ap = argparse.ArgumentParser(prog="ds-seqpar bench memory", description="Peak memory per rank of a full "
                                 "training step with and without the long-context memory features.")
    ap.add_argument("--models", default=PRESET["models"], help="comma list of llama, lm")
    ap.add_argument("--P", type=ints, default=ints(PRESET["P"]), help="sequence-parallel sizes (ranks)")
    ap.add_argument("--on-tokens", type=ints, help="tokens per rank with the features (default: the preset's per P)")
    ap.add_argument("--off-tokens", type=ints, help="tokens per rank without them (default: the preset's per P)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--budget-gib", type=float, default=PRESET["budget_gib"], help="per-rank memory budget")
    ap.add_argument("--timing-tokens", type=int, default=PRESET["timing_tokens"],
                    help="tokens per rank of the step-time comparison (0: skip it)")
    ap.add_argument("--timing-rounds", type=int, default=PRESET["timing_rounds"])
    ap.add_argument("--strategies", default=COMPARE["strategies"],
                    help="the per-strategy comparison of the whole step's peak above static ('' to skip); hybrid = "
                         "ulysses_size 2 at P=4")
    ap.add_argument("--compare-tokens", type=int, default=None,
                    help="tokens per rank of the per-strategy comparison (default: 8192 at P=2, 4096 at P=4)")
    ap.add_argument("--malloc", choices=("mmap", "default"), default="mmap", help="glibc malloc setting of the ranks")
    ap.add_argument("--out", default="reports")
    ap.add_argument("--name", default="memory_cpu")
    ap.add_argument("--resume", action="store_true", help="reuse the measurements already in <out>/<name>.json")
    ap.add_argument("--render", metavar="JSON", help="measure nothing: rewrite the page and plots of a results file")
    return ap


def plan(args) -> List[MemorySpec]:
    """Every peak measurement, in a fixed order: the per-strategy comparison, then per model, P,
    without before with, short before long."""
    specs = compare_plan(args)
    for model in args.models.split(","):
        if model not in ("llama", "lm"):
            raise MemoryBenchError(f"--models: unknown model {model!r}; choose llama, lm")
        for world in args.P:
            for features in (False, True):
                table = PRESET["on_tokens" if features else "off_tokens"]
                given = args.on_tokens if features else args.off_tokens
                for n in given or table.get(world, table[max(table)]):
                    specs.append(MemorySpec(model=model, world=world, tokens_per_rank=n, features=features,
                                            hidden=args.hidden, layers=args.layers))
    return specs


def compare_plan(args) -> List[MemorySpec]:
    """The per-strategy comparison: every strategy at P=2 and 4 (hybrid: 2 x 2 at P=4 only), P=1 at
    each of their tokens per rank (no strategy runs at size 1), and zigzag at a short length at P=1
    and 2 (what a two-point "slope" would take as static)."""
    names = [s for s in args.strategies.split(",") if s]
    unknown = sorted(set(names) - set(COMPARE["strategies"].split(",")))
    if unknown:
        raise MemoryBenchError(f"--strategies: unknown {unknown}; choose from {COMPARE['strategies']}")
    if not names:
        return []
    base = dict(model="llama", features=True, hidden=args.hidden, layers=COMPARE["layers"], purpose="strategies",
                tiled_loss_tokens=COMPARE["tiled_loss_tokens"], tiled_mlp_tokens=COMPARE["tiled_mlp_tokens"])
    tokens = {p: args.compare_tokens or n for p, n in COMPARE["tokens_per_rank"].items()}
    specs = [MemorySpec(world=1, tokens_per_rank=n, **base) for n in sorted(set(tokens.values()), reverse=True)]
    for name in names:
        for world, n in tokens.items():
            if name == "hybrid":
                if world == 4:
                    # the 2D hybrid: zigzag across 2 groups of 2 Ulysses ranks (sequence_parallel.ulysses_size)
                    specs.append(MemorySpec(world=4, tokens_per_rank=n, strategy="zigzag", ulysses_size=2, **base))
            else:
                specs.append(MemorySpec(world=world, tokens_per_rank=n, strategy=name, **base))
    specs += [MemorySpec(world=w, tokens_per_rank=COMPARE["short_tokens"], **base) for w in (1, 2)]
    return specs


def hf_available() -> bool:
    """ds_seqpar.hf in THIS package (an editable install's finder may resolve it elsewhere)."""
    import ds_seqpar
    return os.path.exists(os.path.join(os.path.dirname(ds_seqpar.__file__), "hf", "__init__.py"))


def _pool(world: int, malloc: str):
    """A fresh pool of ``world`` one-thread ranks, started with the measurement's malloc setting."""
    from ..launch.env import restored_environ
    from ..launch.rankpool import RankPool
    with restored_environ(*MALLOC_ENV):
        if malloc == "mmap":
            os.environ.update(MALLOC_ENV)
        return RankPool(world, timeout_s=7200.0, threads_per_rank=1).start()


def measure_one(spec: MemorySpec, malloc: str) -> Dict[str, Any]:
    pool = _pool(spec.world, malloc)
    try:
        ranks = pool.run(measure_peak, spec, timeout=7200.0)
    finally:
        pool.close()
    top = max(ranks, key=lambda r: r["peak_bytes"])          # the per-rank figure is the largest rank's
    phases = {p: max(r["phase_peak_bytes"][p] for r in ranks) for p in ranks[0]["phase_peak_bytes"]}
    above = {p: max(r["phase_peak_bytes"][p] - r["resident_bytes"] for r in ranks) for p in phases}
    return dict(spec.as_dict(), ranks=ranks, peak_bytes=top["peak_bytes"], resident_bytes=top["resident_bytes"],
                phase_peak_bytes=phases, phase_above_static_bytes=above, above_static_bytes=max(above.values()),
                step_s=top["step_s"])


def measure_timing(model: str, world: int, args) -> Dict[str, Any]:
    """Step seconds without and with the features: rounds alternate the two runs of the main job on one
    pool (load from other processes hits both alike); per round the median of a run's steps after its
    first, the slowest rank's (a step ends when its slowest rank ends)."""
    base = dict(model=model, world=world, tokens_per_rank=args.timing_tokens, hidden=args.hidden,
                layers=args.layers, steps=PRESET["timing_steps"])
    pool, out = _pool(world, "default"), {"tokens_per_rank": args.timing_tokens, "off_s": [], "on_s": []}
    try:
        for _ in range(args.timing_rounds):
            for key, features in (("off_s", False), ("on_s", True)):
                ranks = pool.run(measure_peak, MemorySpec(features=features, **base), timeout=7200.0)
                out[key].append(max(statistics.median(r["step_s"]) for r in ranks))
    finally:
        pool.close()
    return dict(out, load_1min=os.getloadavg()[0])


def _spec_id(m: Dict[str, Any]) -> tuple:
    return (m["model"], m["world"], m["features"], m["tokens_per_rank"], m["hidden"], m["layers"],
            m.get("purpose", "scaling"), m.get("strategy", "zigzag"), m.get("ulysses_size", 1))


def run(args, argv: List[str]) -> Dict[str, Any]:
    path = os.path.join(args.out, f"{args.name}.json")
    res = load_json(path) if args.resume and os.path.exists(path) else {"measurements": [], "timing": {}, "skipped": []}
    res["meta"] = {"name": args.name, "command": command_line("ds-seqpar bench memory", argv), "malloc": args.malloc,
                   "budget_bytes": int(args.budget_gib * 2 ** 30), "hidden": args.hidden, "layers": args.layers,
                   "vocab": MemorySpec.vocab, "heads": MemorySpec.heads, "kv_heads": MemorySpec.kv_heads,
                   "intermediate": MemorySpec.intermediate, "tiled_loss_tokens": MemorySpec.tiled_loss_tokens,
                   "tiled_mlp_tokens": MemorySpec.tiled_mlp_tokens, "strategy": MemorySpec.strategy}
    done = {_spec_id(m) for m in res["measurements"]}
    start = time.monotonic()
    for spec in plan(args):
        if spec.model == "llama" and spec.world > 1 and not hf_available():
            why = "HF Llama at P>1 needs ds_seqpar.hf (the Hugging Face attention integration), not in this build"
            if why not in res["skipped"]:
                res["skipped"].append(why)
            continue
        if _spec_id(spec.as_dict()) in done:
            continue
        print(f"ds-seqpar bench memory: {spec.model} P={spec.world} {spec.strategy} features={spec.features} "
              f"{spec.tokens_per_rank} tokens/rank ({spec.purpose}) ...", flush=True)
        res["measurements"].append(measure_one(spec, args.malloc))
        save_json(path, res)
    if args.timing_tokens:
        for model in args.models.split(","):
            for world in [p for p in args.P if p <= 2]:
                k = f"{model}/P{world}"
                if k in res["timing"] or (model == "llama" and world > 1 and not hf_available()):
                    continue
                print(f"ds-seqpar bench memory: step time {k} ...", flush=True)
                res["timing"][k] = measure_timing(model, world, args)
                save_json(path, res)
    res["elapsed_s"] = res.get("elapsed_s", 0.0) + time.monotonic() - start
    return finish(res, args.out)


def finish(res: Dict[str, Any], out: str) -> Dict[str, Any]:
    """Summaries (memory_rows.py) and machine facts; the JSON, the plots and the page with its rows."""
    from . import memory_rows as R
    floor = res["meta"]["layers"] * res["meta"]["hidden"] * 4
    scaling = [m for m in res["measurements"] if m.get("purpose", "scaling") == "scaling"]
    res["variants"] = R.summarize(scaling, floor, res["meta"]["budget_bytes"])
    res.setdefault("machine", machine_facts())
    R.write_plots(res, out)
    save_json(os.path.join(out, f"{res['meta']['name']}.json"), res)
    write_page(out, res["meta"]["name"], R.rows(res), dict(R.facts(res), meta=res["meta"]),  # meta: for plan --calibrate
               "ds-seqpar bench memory")
    return res


def save_json(path: str, res: Dict[str, Any]) -> None:
    """The measurements file (every point, what --resume continues and --render redraws the plots from);
    written whole or not at all (a run stopped mid-write leaves the previous file)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(res, f, indent=1, default=str)
    os.replace(path + ".tmp", path)


def load_json(path: str) -> Dict[str, Any]:
    with open(path) as f:
        return json.load(f)


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.render:
        res = load_json(args.render)
        finish(res, os.path.dirname(args.render) or ".")
        return 0
    try:
        plan(args)
        require_matplotlib("the report's plots", MemoryBenchError)     # before measuring, not after
    except MemoryBenchError as err:
        print(f"ds-seqpar bench memory: error: {err}", file=sys.stderr)
        return 2
    run(args, argv)
    return 0
