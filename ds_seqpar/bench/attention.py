"""``ds-seqpar bench [attention]``: every strategy, the single-process kernels and DeepSpeed's own
Ulysses, measured side by side in one run, with the ratios docs/design.md sets targets for.

    ds-seqpar bench --preset quick                     # ~1 minute on 2 CPU cores
    ds-seqpar bench --preset full                      # P=2, N up to 8192, fp32, causal -> reports/cpu_full.md
    ds-seqpar bench --preset ring                      # the ring family and Ulysses at N=8192, no training
    ds-seqpar bench --preset lasp                      # LASP-1/LASP-2/All-Scan vs the halves bound, per-piece kernel work
    ds-seqpar bench --preset ulysses                   # Ulysses in 1, 2, 4 head chunks and auto vs DeepSpeed's
    ds-seqpar bench --strategies zigzag,lasp --P 4 --seq-lens 4096,8192 --no-causal --name mine
    torchrun --nproc_per_node 2 -m ds_seqpar.cli bench ...   # under a launcher (GPUs: --device cuda)

Without a launcher the command starts P local CPU ranks itself (RankPool, one thread each, gloo).
The ranks run cases.py; train_step.py times the training step; attention_rows.py turns both into
the rows and the plots (what each metric means is written on the page). Writes
<out>/<name>.md, .rows.json and <out>/<name>/*.png; with --wandb one wandb run per case.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import asdict
from typing import Any, Dict, List, Optional

from ..kernels.base import check_head_groups
from ..launch.spawn import under_launcher
from ..report.plotting import require_matplotlib
from ..strategies import STRATEGIES
from .attention_rows import write_plots
from .cases import BASELINE, CASES, DTYPES, BenchSpec
from .harness import (command_line, fresh_pool, loads, log_rows, machine_facts, suite_main, suite_parser,
                      write_page)
from .suites import SUITES

ALIASES = {"lasp": ["lasp2", "lasp1", "allscan"], "deepspeed": ["ds_ulysses"]}
# every registered strategy (lasp: both exchanges) and DeepSpeed's Ulysses
DEFAULT_STRATEGIES = ",".join(list(STRATEGIES) + ["ds_ulysses"])
_BASE = dict(P=2, heads=8, head_dim=64, warmup=1, repeats=5, strategies=DEFAULT_STRATEGIES, train_strategies="none",
             train_preset="full", lasp_breakdown=False)
PRESETS = {
    "quick": dict(_BASE, seq_lens=[512, 1024, 2048], mem_budget_n=1024, train_strategies="zigzag",
                  train_preset="quick"),
    "full": dict(_BASE, seq_lens=[1024, 2048, 4096, 8192], mem_budget_n=2048, train_strategies="zigzag,ulysses,lasp"),
    # the ring family against Ulysses and zigzag without overlap
    "ring": dict(_BASE, seq_lens=[8192], mem_budget_n=0, strategies="ring,zigzag,striped,ulysses,zigzag_no_overlap"),
    # Ulysses in head chunks (1, 2, 4; "ulysses" = auto) against DeepSpeed's, at N=8192
    "ulysses": dict(_BASE, seq_lens=[8192], mem_budget_n=0,
                    strategies="ulysses,ulysses_c1,ulysses_c2,ulysses_c4,ds_ulysses"),
    # LASP-2 and LASP-1 against the halves bound, and where a LASP rank's time goes
    "lasp": dict(_BASE, seq_lens=[8192], repeats=7, mem_budget_n=0, strategies="lasp,halves", lasp_breakdown=True),
}


class BenchError(ValueError):
    """A bad option, found before any rank starts."""


def build_parser() -> argparse.ArgumentParser:
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    # sizes, rounds and --name default to the preset's (resolve)
    ap = suite_parser("ds-seqpar bench [attention]", __doc__, None, repeats=None, P=None, heads=None, head_dim=None)
    ap.description = ("The attention suite: every sequence-parallel strategy, the single-process kernels and "
                      "DeepSpeed's Ulysses side by side in one run; write <out>/<name>.{md,rows.json} and plots. Other "
                      f"suites: ds-seqpar bench {{{','.join(s for s in SUITES if s != 'attention')}}} --help "
                      "(ds-seqpar bench --list: what each measures).")
    ap.epilog = "presets: " + "; ".join(f"{k}: P={v['P']}, N={','.join(map(str, v['seq_lens']))}, {v['heads']} heads x "
                                        f"{v['head_dim']}, cases {v['strategies']}, training {v['train_strategies']}"
                                        for k, v in PRESETS.items())
    ap.set_defaults(warmup=None)
    ap.add_argument("--world", dest="P", type=int, help=argparse.SUPPRESS)       # the former name of --P
    ap.add_argument("--preset", choices=sorted(PRESETS), default="quick",
                    help="defaults for the options below (quick: ~1 minute on 2 cores; ring, lasp: one family "
                         "at N=8192)")
    ap.add_argument("--strategies", help=f"comma list of {', '.join(c for c in CASES if c not in BASELINE.values())}; "
                    f"lasp = lasp2,lasp1,allscan (the single-process baselines are always measured); default: the "
                    f"preset's ({DEFAULT_STRATEGIES} for quick and full)")
    ap.add_argument("--seq-lens", type=ints, help="global sequence lengths, comma separated")
    ap.add_argument("--kv-heads", type=int, help="k/v heads (GQA); default = heads")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="bf16/fp16 need CUDA")
    ap.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--no-decay", action="store_true", help="linear attention without the LM's per-head decay")
    ap.add_argument("--backend", default="torch", choices=("torch", "math", "flash_attn", "auto"),
                    help="local attention kernel (flash_attn needs CUDA and the flash-attn package)")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--mem-budget-n", type=int, help="memory budget = what one process saves at this N (0: skip)")
    ap.add_argument("--train-strategies", help="training-step comparison, comma list ('none' to skip)")
    ap.add_argument("--train-seq-len", type=int, help="training sequence length (default: the preset's)")
    ap.add_argument("--lasp-breakdown", action=argparse.BooleanOptionalAction, default=None,
                    help="after the rounds, the kernel work of each LASP rank position at N/P on rank 0 "
                         "(on in --preset lasp)")
    ap.add_argument("--model", metavar="PATH", help="the training-step case trains this local Hugging Face model "
                    "(a model directory or a config JSON, as `ds_seqpar.train --model`) instead of the small LM")
    ap.add_argument("--wandb", action="store_true", help="one wandb run per case (offline without credentials)")
    ap.add_argument("--wandb-project", default="ds_seqpar")
    ap.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)      # the deepspeed launcher's
    return ap


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Preset defaults under explicit options; then every check that can fail, before any rank starts."""
    preset = dict(PRESETS[args.preset])
    args.train_preset = preset.pop("train_preset")            # the model the training comparison uses
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.kv_heads = args.kv_heads or args.heads
    args.device = _device(args)
    args.name = args.name or f"{args.device}_{args.preset}"
    args.cases = _cases(args.strategies)
    args.train = [] if args.train_strategies in ("", "none") else args.train_strategies.split(",")
    _check(args)
    require_matplotlib("the report's plots", BenchError)     # before measuring, not after
    return args


def _device(args) -> str:
    import torch
    cuda = torch.cuda.is_available()
    if args.device == "cuda" and not cuda:
        raise BenchError("--device cuda: CUDA is not available on this machine; use --device cpu")
    device = args.device if args.device != "auto" else ("cuda" if cuda and under_launcher() else "cpu")
    if device == "cpu" and args.dtype in ("bf16", "fp16"):
        raise BenchError(f"--dtype {args.dtype} needs CUDA (--device cuda under a launcher): on CPU the local "
                         f"kernels would time a half-precision emulation no GPU run resembles; use --dtype fp32")
    if device == "cpu" and args.backend == "flash_attn":
        raise BenchError("--backend flash_attn needs CUDA and the flash-attn package; use --backend torch on CPU")
    if device == "cuda" and not under_launcher():
        raise BenchError("--device cuda runs under a launcher (one GPU per rank), e.g. "
                         "`torchrun --nproc_per_node P -m ds_seqpar.cli bench --device cuda ...`")
    return device


def _cases(strategies: str) -> List[str]:
    chosen = set()
    for name in (s.strip() for s in strategies.split(",") if s.strip()):
        for case in ALIASES.get(name, [name]):
            if case not in CASES or case in BASELINE.values():
                valid = [c for c in CASES if c not in BASELINE.values()] + list(ALIASES)
                raise BenchError(f"--strategies: unknown case {name!r}; choose from {', '.join(valid)}")
            chosen.add(case)
    chosen |= {BASELINE[CASES[c].attention] for c in chosen}
    return [c for c in CASES if c in chosen]          # a fixed order: baselines first in each family


def _check(a) -> None:
    if a.P < 2:
        raise BenchError(f"--P {a.P}: a sequence-parallel benchmark needs at least 2 ranks")
    try:
        check_head_groups(a.heads, a.kv_heads)
    except ValueError as err:
        raise BenchError(f"--heads {a.heads}, --kv-heads {a.kv_heads}: {err}") from None
    if any(c in a.cases for c in ("ulysses", "ds_ulysses", "hybrid")) and a.heads % a.P:
        raise BenchError(f"--heads {a.heads} is not divisible by --P {a.P}: Ulysses splits heads over ranks; "
                         f"drop ulysses/ds_ulysses from --strategies or pick --heads divisible by {a.P}")
    if "hybrid" in a.cases and (a.P < 4 or a.P % 2):
        raise BenchError(f"--strategies hybrid (ulysses_size 2 x zigzag ring) needs an even --P >= 4, got {a.P}")
    multiple = 2 * a.P * (2 if "hybrid" in a.cases else 1)
    bad = [n for n in a.seq_lens if n % multiple]
    if bad or not a.seq_lens:
        raise BenchError(f"--seq-lens {bad or a.seq_lens}: every length must be a positive multiple of {multiple} "
                         f"(zigzag's 2P chunks)")
    if a.model and "lasp" in a.train:
        raise BenchError(f"--model {a.model!r} with --train-strategies lasp: Hugging Face models use softmax "
                         f"attention; choose from ulysses, ring, zigzag, striped")
    if a.model and not os.path.exists(a.model):
        raise BenchError(f"--model {a.model!r} does not exist: pass a local model directory or config JSON")
    if a.repeats < 1 or a.warmup < 0:
        raise BenchError(f"--repeats {a.repeats} must be >= 1 and --warmup {a.warmup} >= 0")


def run(args: argparse.Namespace, argv: List[str], pools=None) -> Optional[Dict[str, Any]]:
    """Measure, write the rows; returns the results dict (the run's facts and what the ranks measured, "raw")
    on the writing rank (None elsewhere).
    ``pools``: an already started (P-rank, 1-rank) RankPool pair to use instead of starting them."""
    load_before, start = os.getloadavg(), time.monotonic()
    spec = BenchSpec(world=args.P, cases=tuple(args.cases), batch=args.batch, heads=args.heads,
                     kv_heads=args.kv_heads, head_dim=args.head_dim, dtype=args.dtype, causal=args.causal,
                     backend=args.backend, device=args.device, decay=not args.no_decay, warmup=args.warmup,
                     repeats=args.repeats, lasp_breakdown=args.lasp_breakdown)
    per_rank, train, skipped = _measure(args, spec, pools)
    if per_rank is None:
        return None
    load_by_length = {str(n): per_rank[0]["load_1min"][n] for n in args.seq_lens}
    # the machine line every suite writes (harness.machine_line): the load before, after, and the highest
    # 1-minute value seen during the run
    meta = dict(asdict(spec), **machine_facts(), name=args.name, cases=args.cases, seq_lens=args.seq_lens,
                comm_backend="nccl" if args.device == "cuda" else "gloo", mem_budget_n=args.mem_budget_n,
                preset=args.preset, notes=args.notes, load_before=loads(load_before), elapsed=time.monotonic() - start,
                load_during=max(list(load_by_length.values()) + [x for t in train.values() for x in t["load_1min"]]),
                command=(f"(each of WORLD_SIZE={os.environ.get('WORLD_SIZE')} ranks of a launcher) "
                         if under_launcher() else "") + command_line("ds-seqpar bench", argv))
    res = {"meta": meta, "train_skipped": skipped, "train_model": _train_model(args), "load_by_length": load_by_length,
           "raw": {"ranks": per_rank, "train": train}}
    found = write(res, args.out)
    if args.wandb:
        log_rows(found, meta, os.path.join(args.out, args.name), args.wandb_project)
    return res


def _train_model(args) -> Dict[str, Any]:
    from .train_step import TRAIN_PRESETS
    model = dict(TRAIN_PRESETS[args.train_preset])
    if args.train_seq_len:
        model["seq_len"] = args.train_seq_len
    if getattr(args, "model", None):
        # the Hugging Face model replaces the small LM's sizes; ranks may run elsewhere: absolute path
        model = {k: v for k, v in model.items() if k in ("seq_len", "micro_batch", "steps")}
        model["model"] = os.path.abspath(args.model)
    return model


def _measure(args, spec: BenchSpec, pools=None):
    """(per-rank results, training results, why training was skipped); None on non-writing ranks."""
    from .cases import run_rank
    if under_launcher():
        return _measure_under_launcher(args, spec)
    pool, solo = pools or (None, None)
    with fresh_pool(args.P, pool) as pool:
        per_rank = pool.run(run_rank, spec, args.seq_lens, args.mem_budget_n, timeout=3600.0)
        train = {}
        if args.train:
            from .train_step import measure_training
            # started only now: its process start and imports would load the attention timings
            with fresh_pool(1, solo) as solo:
                train = measure_training(pool, solo, args.train, _train_model(args), args.warmup, args.repeats)
    return per_rank, train, "" if args.train else "skipped (--train-strategies none)"


def _measure_under_launcher(args, spec: BenchSpec):
    import deepspeed
    from .. import comm
    from ..launch.env import launch_env, local_device
    from .cases import run_rank
    # rank, local rank and rendezvous as the launcher gave them (Open MPI's local rank is not the
    # rank): with every env:// variable set, DeepSpeed runs no MPI discovery of its own
    os.environ.update(launch_env(os.environ))
    if args.device == "cuda":
        import torch
        torch.cuda.set_device(local_device(os.environ, torch.cuda.device_count()))   # nccl object collectives use it
    from ..deepspeed_shm import skip_deepspeed_shm_op
    skip_deepspeed_shm_op()
    deepspeed.init_distributed(dist_backend="nccl" if args.device == "cuda" else "gloo", auto_mpi_discovery=False)
    if args.device == "cpu":
        import torch
        torch.set_num_threads(1)        # the comparison is one thread per rank, as with RankPool
    if comm.world_size() != args.P:
        raise BenchError(f"--P {args.P} but the launcher started {comm.world_size()} ranks")
    mine = run_rank(spec, args.seq_lens, args.mem_budget_n)
    per_rank = comm.gather_object(mine)
    why = ("not measured under a launcher: it needs a 1-rank world beside the P-rank one; run without a "
           "launcher (CPU), or compare `ds-seqpar train` runs with `ds-seqpar report`")
    return (per_rank if comm.global_rank() == 0 else None), {}, why


def write(res: Dict[str, Any], out: str) -> list:
    """<out>/<name>.md, .rows.json and the plots of a run's results (attention_rows.py); its rows."""
    from .attention_rows import facts, rows
    found = rows(res)
    write_plots(found, res["meta"], os.path.join(out, res["meta"]["name"]))
    meta = dict(res["meta"], train_model=res.get("train_model"))      # the run's parameters plan --calibrate reads
    write_page(out, res["meta"]["name"], found, dict(facts(res), meta=meta), "ds-seqpar bench")
    return found


def measure(args: argparse.Namespace, argv: List[str]) -> int:
    try:
        args = resolve(args)
    except BenchError as err:
        print(f"ds-seqpar bench: error: {err}", file=sys.stderr)
        return 2
    run(args, argv)
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    return suite_main(argv, build_parser(), measure, plots=write_plots)
