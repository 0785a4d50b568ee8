"""``ds-seqpar bench trainer``: the Hugging Face Trainer with sequence parallelism on 4 local CPU ranks
(gloo, one thread each; not a test). Side by side: plain data parallelism, every strategy under
SequenceParallelTrainer and DeepSpeed's own Ulysses (ALST) through accelerate's ParallelismConfig,
each step's loss and grad_norm and the final parameters against plain's, and the step time; then the
Trainer's overhead over this project's own loop (trainer_rows.py's page says what each table means).

A run's step time is the median wall time between the ends of consecutive optimizer steps on rank 0
(a callback's ``on_step_end``; the own loop: its metrics records' ``time``), the first ``--skip-steps``
intervals dropped, so each side pays its whole loop (data, sharding, logging, callbacks).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import statistics
import tempfile
import time
from typing import Any, Dict, List, Optional

from .harness import (command_line, loads, machine_facts, median_ratio, ratio_range, spread, strategy_config,
                      suite_main, suite_parser, write_page)

PROG = "ds-seqpar bench trainer"
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
WORLD, ACCUMULATION = 4, 3
# name -> (runner, sequence_parallel section, micro batch). Plain: 4 replicas of micro batch 1; a size-P case
# has 4/P replicas of micro batch P, so every optimizer step covers the same 12 samples (the Trainer's
# sampler permutes indices alike for any batch size). ALST: 2 groups of 2, micro batch 2 per world rank.
CASES = {
    "plain": ("mixin", {"strategy": "zigzag", "size": 1}, 1),
    **{name: ("mixin", strategy_config(name, 2), 2) for name in ("ulysses", "ring", "zigzag", "striped")},
    "hybrid": ("mixin", strategy_config("hybrid", 4), 4),
    "deepspeed_alst": ("alst", None, 2),
}
WIDTH = 48                       # every batch padded to this many tokens (samples are 20-44 long)


def example():
    """examples/hf_trainer.py (the tested user script): its model, data, collator and arguments."""
    path = os.path.join(ROOT, "examples", "hf_trainer.py")
    if not os.path.exists(path):
        raise SystemExit(f"{PROG}: needs the repository's examples/hf_trainer.py ({path} is missing): run it from a "
                         f"checkout")
    spec = importlib.util.spec_from_file_location("hf_trainer_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ds_config(section: Optional[dict]) -> dict:
    with open(os.path.join(ROOT, "configs", "trainer", "zigzag_zero2.json")) as f:
        cfg = json.load(f)
    cfg.pop("sequence_parallel", None)
    if section is not None:
        cfg["sequence_parallel"] = section
    return cfg


def _step_ends():
    import transformers as T
    ends: List[float] = []

    class StepEnds(T.TrainerCallback):
        def on_step_end(self, *args, **kwargs):
            ends.append(time.time())
    return ends, StepEnds()


def _reset(attention: Dict[str, Any]) -> None:
    """After a Trainer run on a pool rank: accelerate's singletons, transformers' global ZeRO-3 config,
    DeepSpeed's global mpu and ALST's groups, and the attention functions (ALST overwrites the global
    "sdpa" entry)."""
    from accelerate.state import AcceleratorState, PartialState
    from deepspeed.utils import groups
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    AcceleratorState._reset_state(reset_partial_state=False)
    PartialState._reset_state()
    unset_hf_deepspeed_config()
    groups.mpu = None
    parallel_state_sp._release_sequence_parallel_groups()      # ALST's groups: built again by its next run
    for key, fn in attention.items():
        ALL_ATTENTION_FUNCTIONS[key] = fn


def fixed_width(pad_right, width: int, positions: bool = False):
    """The example's right padding widened to ``width`` tokens (+ position_ids, which ALST's loader adapter
    requires): ALST's adapter all-gathers each rank's batch at its own length, which gloo refuses."""
    import torch

    def collate(rows):
        batch = pad_right(rows)
        extra = width - batch["input_ids"].shape[1]
        fill = {"input_ids": 0, "labels": -100, "attention_mask": 0}
        batch = {k: torch.nn.functional.pad(v, (0, extra), value=fill[k]) for k, v in batch.items()}
        if positions:
            batch["position_ids"] = torch.arange(batch["input_ids"].shape[1]).expand_as(batch["input_ids"]).clone()
        return batch
    return collate


def run_case(name: str, steps: int, out_root: str) -> Optional[Dict[str, Any]]:
    """On every rank: one Trainer run of CASES[name]; rank 0 returns its steps, final parameters and step
    end times; a rank that fails returns its error instead."""
    import torch
    import transformers as T
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from .. import comm
    from ..hf import SequenceParallelTrainer
    runner, section, micro = CASES[name]
    ex, attention, patched = example(), {"sdpa": ALL_ATTENTION_FUNCTIONS["sdpa"]}, None
    ends, callback = _step_ends()
    overrides, cls, collator = {}, SequenceParallelTrainer, fixed_width(ex.pad_right, WIDTH)
    if runner == "alst":
        import deepspeed
        from accelerate.parallelism_config import ParallelismConfig
        from accelerate.utils import DeepSpeedSequenceParallelConfig
        # under a launcher TrainingArguments does this; on the pool the world is up already and DeepSpeed's
        # groups (which ALST builds before deepspeed.initialize) must adopt it
        deepspeed.init_distributed(dist_backend=comm.backend_name())
        # dp_replicate_size: without it accelerate sets train_batch_size for one replica and DeepSpeed asserts
        handler = DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True, sp_attn_implementation="sdpa")
        overrides["parallelism_config"] = ParallelismConfig(dp_replicate_size=WORLD // 2, sp_size=2,
                                                            sp_backend="deepspeed", sp_handler=handler)
        cls, collator = T.Trainer, fixed_width(ex.pad_right, WIDTH, positions=True)
        patched = gather_with_group_ranks() if comm.backend_name() == "gloo" else None
    try:
        with tempfile.TemporaryDirectory(dir=out_root) as out:
            args = ex.arguments(ds_config(section), out, steps, ACCUMULATION, micro, **overrides)
            torch.manual_seed(0)
            trainer = cls(model=ex.tiny_model(), args=args, train_dataset=ex.synthetic_sft(64, 96),
                          data_collator=collator, callbacks=[callback])
            trainer.train()
            result = {"steps": ex.logged_steps(trainer), "params": ex.final_parameters(trainer), "ends": ends}
            trainer.model_wrapped.destroy()
            return result if trainer.is_world_process_zero() else None
    except Exception as err:                       # reported on the page, with the exact error
        import traceback
        where = traceback.extract_tb(err.__traceback__)[-1]
        return {"error": f"{type(err).__name__}: {err}", "at": f"{where.filename}:{where.lineno}",
                "rank": comm.global_rank(), "traceback": traceback.format_exc()}
    finally:
        _reset(attention)
        if patched is not None:
            torch.distributed.nn.functional.all_gather = patched


# -- DeepSpeed's ALST on gloo ranks: the two gloo limits its path meets (quoted on the page) and the
# stand-in that lets it run anyway (the gradient its NCCL path computes); torch.distributed is called
# directly here because it is that path's own calls that are reproduced


def gather_with_group_ranks():
    """On gloo, torch's differentiable all_gather (ALST's loss) goes backward through a scatter from the
    group-local index taken as a global rank (gloo_errors); until run_case ends it is replaced by the
    gradient its NCCL path computes (all-reduce of the stacked gradients, own slice). Returns the original."""
    import torch
    import torch.distributed as dist
    functional = torch.distributed.nn.functional
    original = functional.all_gather

    class Gather(torch.autograd.Function):
        @staticmethod
        def forward(ctx, group, x):
            ctx.group = group
            out = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
            dist.all_gather(out, x.contiguous(), group=group)
            return tuple(out)

        @staticmethod
        def backward(ctx, *grads):
            summed = torch.stack(grads).contiguous()
            dist.all_reduce(summed, group=ctx.group)
            return None, summed[dist.get_rank(ctx.group)]

    functional.all_gather = lambda tensor, group=dist.group.WORLD: Gather.apply(group, tensor)
    return original


def gloo_errors() -> Dict[str, Optional[str]]:
    """On every rank of 4, in groups of 2: the two gloo limits DeepSpeed's path meets, by the calls it makes
    (its loader adapter's all-gather of unequal widths, its loss's differentiable all_gather backward).
    Each: None, or the error this rank raised."""
    import torch
    import torch.distributed as dist
    import torch.distributed.nn  # noqa: F401  (the differentiable collectives)
    from .. import comm
    from ..sequence_parallel import SequenceParallel
    sp = SequenceParallel({"strategy": "ulysses", "size": 2})
    out: Dict[str, Optional[str]] = {}

    def attempt(key, fn):
        try:
            fn()
            out[key] = None
        except Exception as err:                   # what the page quotes (less object addresses)
            out[key] = re.sub(r" at 0x[0-9a-f]+", "", f"{type(err).__name__}: {err}")

    widths = [32 + 2 * r for r in range(sp.size)]
    attempt("variable widths", lambda: dist.all_gather([torch.zeros(2, w, dtype=torch.long) for w in widths],
                                                       torch.zeros(2, widths[sp.rank], dtype=torch.long),
                                                       group=sp.group))
    x = torch.ones(1, requires_grad=True)
    attempt("loss backward", lambda: torch.stack(torch.distributed.nn.functional.all_gather(x, group=sp.group))
            .sum().backward())
    comm.barrier()
    return out


# -- overhead: the Trainer against the project's own loop -------------------------------------------

OWN_CONFIG = {
    "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
    "steps_per_print": 1000000,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0,
                                              "torch_adam": True}},
    "zero_optimization": {"stage": 2, "overlap_comm": False, "contiguous_gradients": True},
    "sequence_parallel": {"strategy": "zigzag", "size": 2},
}


def own_loop(model: str, seq_len: int, steps: int, run_dir: str) -> List[float]:
    """On every rank: the project's own loop; rank 0 returns the end time of each step."""
    from ..train.main import run_training
    res = run_training(dict(model=model, seq_len=seq_len, steps=steps, deepspeed_config=OWN_CONFIG, quiet=True,
                            no_wandb=True, run_dir=run_dir, corpus_bytes=1 << 20))
    if not res.get("metrics_path"):
        return []
    with open(res["metrics_path"]) as f:
        return [json.loads(line)["time"] for line in f]


def trainer_loop(model: str, seq_len: int, steps: int, run_dir: str) -> List[float]:
    """On every rank: SequenceParallelTrainer on the own loop's model, rows (the corpus rows its steps
    0..steps-1 read, labels = ids) and DeepSpeed config; rank 0 returns the end time of each step."""
    import torch
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from ..hf import SequenceParallelTrainer
    from ..hf.model_io import load_causal_lm, load_config
    from ..train import data
    tokens = data.stdlib_corpus(1 << 20)
    rows = [data.batch_for_step(tokens, step, 0, 0, 1, 2, seq_len) for step in range(steps)]
    samples = [{"input_ids": r["input_ids"][i], "labels": r["labels"][i]} for r in rows for i in range(2)]
    ends, callback = _step_ends()
    ds = json.loads(json.dumps(OWN_CONFIG))
    ds.update(train_micro_batch_size_per_gpu="auto", gradient_accumulation_steps="auto", gradient_clipping="auto")
    ds["optimizer"]["params"].update(lr="auto", betas="auto", eps="auto", weight_decay="auto")
    attention = {k: ALL_ATTENTION_FUNCTIONS[k] for k in ("sdpa",)}
    args = example().arguments(ds, run_dir, steps, 1, 1, learning_rate=1e-3, warmup_steps=0,
                               lr_scheduler_type="constant", disable_tqdm=True)
    try:
        torch.manual_seed(0)                         # as the own loop builds it (train/hf_model.py)
        net, _ = load_causal_lm(model, torch.float32, config=load_config(model))
        net.train()
        trainer = SequenceParallelTrainer(model=net, args=args, train_dataset=samples, callbacks=[callback],
                                          data_collator=lambda b: {k: torch.stack([s[k] for s in b]) for k in b[0]})
        trainer.train()
        writer = trainer.is_world_process_zero()
        trainer.model_wrapped.destroy()             # frees the engine's hooks (train/trainer.py close)
    finally:
        _reset(attention)
    return ends if writer else []


# -- the measurement ------------------------------------------------------------------------------------


def step_time(ends: List[float], warmup: int) -> float:
    """Median wall time between consecutive step ends, the first ``warmup`` intervals dropped."""
    return statistics.median([b - a for a, b in zip(ends, ends[1:])][warmup:])


def side_by_side(pool, opts, root: str) -> Dict[str, Any]:
    """Every case once per round in CASES' order, the first ``--warmup`` rounds (first imports and
    allocations) not timed; then the per-case summary against plain."""
    from ..launch.rankpool import RankFailure
    runs: Dict[str, list] = {name: [] for name in CASES}
    for rnd in range(opts.warmup + opts.repeats):
        for name in CASES:
            try:
                results = pool.run(run_case, name, opts.steps, root, timeout=300.0)
            except RankFailure as err:          # a rank hung or died (the pool restarts): the page says so
                results = [{"error": f"RankFailure: {str(err).splitlines()[0]}", "at": "the rank pool", "rank": "-"}]
            runs[name].append(next((r for r in results if r and "error" in r), results[0]))
            got = runs[name][-1]
            print(f"round {rnd} {name}: {got.get('error') or step_time(got['ends'], opts.skip_steps)}", flush=True)
    return compare(runs, opts.skip_steps, opts.warmup)


def compare(runs: Dict[str, list], skip: int, untimed: int = 1) -> Dict[str, Any]:
    """Per case: every step's relative deviation of loss and grad_norm from plain's (round 0; every round
    must log the same steps, ``repeatable``), learning rates equal, the final parameters' largest
    difference, and the step time of the rounds after the ``untimed`` ones (``skip`` intervals dropped
    per run) with its per-round ratio to plain's. A case that failed in any round: its first error."""
    plain = runs["plain"][0]
    plain_times = [step_time(r["ends"], skip) for r in runs["plain"][untimed:]]
    out = {}
    for name, rs in runs.items():
        failed = next((dict(r, round=i) for i, r in enumerate(rs) if "error" in r), None)
        if failed:
            out[name] = {k: failed[k] for k in ("error", "at", "rank", "round")}
            continue
        first = rs[0]
        rel = lambda key: [abs(g[key] - w[key]) / abs(w[key]) for g, w in zip(first["steps"], plain["steps"])]  # noqa: E731
        times = [step_time(r["ends"], skip) for r in rs[untimed:]]
        out[name] = {"steps": first["steps"], "loss_dev": rel("loss"), "grad_norm_dev": rel("grad_norm"),
                     "lr_equal": [g["learning_rate"] for g in first["steps"]] ==
                     [w["learning_rate"] for w in plain["steps"]],
                     "param_dev": max(float((first["params"][k] - v).abs().max()) for k, v in plain["params"].items()),
                     "repeatable": all(r["steps"] == first["steps"] for r in rs),
                     "step_s": spread(times), "step_s_rounds": times,
                     "vs_plain": {"median": median_ratio(times, plain_times), "range": ratio_range(times, plain_times)}}
    return out


def overhead(pool, opts, root: str) -> Dict[str, Any]:
    """Rounds alternating own loop / Trainer; the first ``--warmup`` (imports, first allocations) not counted."""
    rounds = []
    for r in range(opts.warmup + opts.overhead_rounds):
        args = (opts.model, opts.overhead_seq, opts.overhead_steps)
        own = step_time(pool.run(own_loop, *args, os.path.join(root, "own"), timeout=900.0)[0], opts.skip_steps)
        hf = step_time(pool.run(trainer_loop, *args, os.path.join(root, "hf"), timeout=900.0)[0], opts.skip_steps)
        print(f"overhead round {r}: own {own:.3f} s, trainer {hf:.3f} s, ratio {hf / own:.3f}", flush=True)
        if r >= opts.warmup:
            rounds.append({"own_s": own, "trainer_s": hf, "ratio": hf / own, "load_1min": os.getloadavg()[0]})
    ratios = [x["ratio"] for x in rounds]
    return {"rounds": rounds, "ratio": spread(ratios), "own_s": spread([x["own_s"] for x in rounds]),
            "trainer_s": spread([x["trainer_s"] for x in rounds])}


def build_parser() -> argparse.ArgumentParser:
    ap = suite_parser(PROG, __doc__, "hf_trainer_cpu", repeats=3)   # timed side-by-side rounds after --warmup
    ap.add_argument("--steps", type=int, default=6, help="optimizer steps per side-by-side run")
    ap.add_argument("--skip-steps", type=int, default=1, help="step intervals dropped at the start of every run")
    ap.add_argument("--overhead-rounds", type=int, default=4, help="counted overhead rounds (0: skip the part)")
    ap.add_argument("--overhead-steps", type=int, default=6)
    ap.add_argument("--overhead-seq", type=int, default=512, help="tokens per row in the overhead part")
    ap.add_argument("--model", default=os.path.join(ROOT, "configs", "models", "llama_small.json"),
                    help="the overhead part's model (a config JSON or model directory)")
    return ap


def resolve(args) -> argparse.Namespace:
    if args.repeats < 1 or args.warmup < 0 or args.steps < args.skip_steps + 2 or args.overhead_rounds < 0 or \
            (args.overhead_rounds and args.overhead_steps < args.skip_steps + 2):
        raise SystemExit(f"{PROG}: --repeats >= 1, --warmup >= 0, --steps / --overhead-steps >= --skip-steps + 2 (at "
                         f"least one measured step interval), --overhead-rounds >= 0")
    if args.overhead_rounds and not os.path.exists(args.model):
        raise SystemExit(f"{PROG}: --model {args.model!r} does not exist: pass a model config JSON or directory")
    return args


def measure(args, command: str, pool=None) -> Dict[str, Any]:
    """Both parts on one pool of 4 ranks (``pool``: an already started one), the machine facts, versions."""
    import accelerate
    import transformers
    from ..launch.rankpool import RankPool
    load_before, start = os.getloadavg(), time.monotonic()
    own = pool is None
    pool = pool or RankPool(WORLD, timeout_s=900.0, threads_per_rank=1).start()
    if pool.world_size != WORLD:
        raise SystemExit(f"{PROG}: needs a pool of {WORLD} ranks, got {pool.world_size}")
    try:
        with tempfile.TemporaryDirectory(prefix="ds_seqpar_bench_trainer_") as root:
            gloo = pool.run(gloo_errors, timeout=120.0)
            cases = side_by_side(pool, args, root)
            load_mid = os.getloadavg()
            over = overhead(pool, args, root) if args.overhead_rounds else None
    finally:
        if own:
            pool.close()
    model = os.path.relpath(args.model, ROOT) if os.path.abspath(args.model).startswith(ROOT + os.sep) else args.model
    meta = dict(vars(args), model=model, command=command, world=WORLD, accumulation=ACCUMULATION, width=WIDTH,
                elapsed=time.monotonic() - start, load_before=loads(load_before), load_mid=loads(load_mid),
                load_during=max(load_mid[0], os.getloadavg()[0]), transformers=transformers.__version__,
                accelerate=accelerate.__version__, **machine_facts(),
                cases={k: {"runner": v[0], "sequence_parallel": v[1], "micro": v[2]} for k, v in CASES.items()})
    return {"meta": meta, "gloo": gloo, "cases": cases, "overhead": over}


def write(res: Dict[str, Any], out: str) -> int:
    from .trainer_rows import facts, rows
    return write_page(out, res["meta"]["name"], rows(res), facts(res), PROG)


def _measure(args, argv: List[str]) -> int:
    os.environ.setdefault("WANDB_MODE", "disabled")
    return write(measure(resolve(args), command_line(PROG, argv)), args.out)


def main(argv: Optional[List[str]] = None) -> int:
    return suite_main(argv, build_parser(), _measure)
