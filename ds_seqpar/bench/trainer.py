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
import copy
import importlib.util
import json
import os
import re
import statistics
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  (the differentiable collectives DeepSpeed's path calls)

from .. import comm
from ..launch.rankpool import RankFailure
from ..sequence_parallel import SequenceParallel
from .harness import (command_line, fresh_pool, loads, machine_facts, median_ratio, ratio_range, spread,
                      strategy_config, suite_main, suite_parser, write_page)
from .train_step import train_records

PROG = "ds-seqpar bench trainer"
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
WORLD, ACCUMULATION = 4, 3
# name -> (sequence_parallel section under SequenceParallelTrainer, or None: DeepSpeed's ALST; micro batch).
# Plain: 4 replicas of micro batch 1; a size-P case has 4/P replicas of micro batch P, so every optimizer step
# covers the same 12 samples (the Trainer's sampler permutes indices alike for any batch size). ALST: 2 groups
# of 2, micro batch 2 per world rank.
CASES = {
    "plain": ({"strategy": "zigzag", "size": 1}, 1),
    **{name: (strategy_config(name, 2), 2) for name in ("ulysses", "ring", "zigzag", "striped")},
    "hybrid": (strategy_config("hybrid", 4), 4),
    "deepspeed_alst": (None, 2),
}
WIDTH = 48                       # every batch padded to this many tokens (samples are 20-44 long)
# the overhead part: the own loop's DeepSpeed config, which the Trainer's arguments match value for value
OWN_CONFIG = {
    "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
    "steps_per_print": 1000000,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0,
                                              "torch_adam": True}},
    "zero_optimization": {"stage": 2, "overlap_comm": False, "contiguous_gradients": True},
    "sequence_parallel": {"strategy": "zigzag", "size": 2},
}


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


# -- one Trainer run on the pool's ranks -------------------------------------------------------------


def fit(cls, make_model: Callable, make_args: Callable, dataset, collator, params: bool = True):
    """On every rank: ``cls(make_model(), make_args(output_dir), ...)`` trained after seeding 0; rank 0 returns
    its logged steps, step end times (a callback's) and, with ``params``, final parameters; a rank that fails
    returns its error instead. Then the global state a run leaves is reset for the next one: accelerate's
    singletons, transformers' ZeRO-3 config, DeepSpeed's mpu and ALST's groups, the "sdpa" attention entry
    (ALST overwrites it) and torch's differentiable all_gather (see alst_arguments)."""
    import transformers as T
    from accelerate.state import AcceleratorState, PartialState
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    from deepspeed.utils import groups
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    sdpa, gather, ends = ALL_ATTENTION_FUNCTIONS["sdpa"], torch.distributed.nn.functional.all_gather, []

    class StepEnds(T.TrainerCallback):
        def on_step_end(self, *args, **kwargs):
            ends.append(time.time())
    try:
        with tempfile.TemporaryDirectory() as out:
            args = make_args(out)
            torch.manual_seed(0)
            trainer = cls(model=make_model(), args=args, train_dataset=dataset, data_collator=collator,
                          callbacks=[StepEnds()])
            trainer.train()
            ex = example()
            result = {"steps": ex.logged_steps(trainer), "ends": ends}
            if params:
                result["params"] = ex.final_parameters(trainer)
            trainer.model_wrapped.destroy()             # frees the engine's hooks
            return result if trainer.is_world_process_zero() else None
    except Exception as err:                       # reported on the page, with the exact error
        where = traceback.extract_tb(err.__traceback__)[-1]
        return {"error": f"{type(err).__name__}: {err}", "at": f"{where.filename}:{where.lineno}",
                "rank": comm.global_rank()}
    finally:
        AcceleratorState._reset_state(reset_partial_state=False)
        PartialState._reset_state()
        unset_hf_deepspeed_config()
        groups.mpu = None
        parallel_state_sp._release_sequence_parallel_groups()      # ALST's groups: built again by its next run
        ALL_ATTENTION_FUNCTIONS["sdpa"], torch.distributed.nn.functional.all_gather = sdpa, gather


def run_case(name: str, steps: int) -> Optional[Dict[str, Any]]:
    """On every rank: one Trainer run of CASES[name] on the example's model and data (see ``fit``)."""
    import transformers as T
    from ..hf import SequenceParallelTrainer
    section, micro = CASES[name]
    ex, alst = example(), section is None
    with open(os.path.join(ROOT, "configs", "trainer", "zigzag_zero2.json")) as f:
        ds = {k: v for k, v in json.load(f).items() if k != "sequence_parallel"}
    if not alst:
        ds["sequence_parallel"] = section

    def collate(rows):
        # every batch at WIDTH tokens (+ position_ids, which ALST's loader adapter requires): that adapter
        # all-gathers each rank's batch at its own width, which gloo refuses
        batch = ex.pad_right(rows, WIDTH - max(len(r["input_ids"]) for r in rows))
        if alst:
            batch["position_ids"] = torch.arange(WIDTH).expand(len(rows), WIDTH).clone()
        return batch
    return fit(T.Trainer if alst else SequenceParallelTrainer, ex.tiny_model,
               lambda out: ex.arguments(ds, out, steps, ACCUMULATION, micro, **(alst_arguments() if alst else {})),
               ex.synthetic_sft(64, 96), collate)


# -- DeepSpeed's ALST on gloo ranks: the two gloo limits its path meets (quoted on the page) and the
# stand-in that lets it run anyway (the gradient its NCCL path computes); torch.distributed is called
# directly here because it is that path's own calls that are reproduced


def gather_as_nccl(tensor, group=None):
    """Torch's differentiable all_gather with the gradient its NCCL path computes: each rank's tensor in its
    own slot of zeros, summed over the group (exact: one term is not zero), so that backward all-reduces the
    stacked gradients and each rank takes its own slot. On gloo, torch's own backward scatters from the
    group-local index taken as a global rank (gloo_errors)."""
    slots = [tensor if i == dist.get_rank(group) else torch.zeros_like(tensor)
             for i in range(dist.get_world_size(group))]
    return tuple(torch.distributed.nn.functional.all_reduce(torch.stack(slots), group=group).unbind(0))


def alst_arguments() -> Dict[str, Any]:
    """DeepSpeed's Ulysses as accelerate turns it on (the TrainingArguments field); on gloo, ALST's loss
    all-gathers through gather_as_nccl until ``fit`` ends."""
    import deepspeed
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig
    # under a launcher TrainingArguments does this; on the pool the world is up already and DeepSpeed's
    # groups (which ALST builds before deepspeed.initialize) must adopt it
    deepspeed.init_distributed(dist_backend=comm.backend_name())
    if comm.backend_name() == "gloo":
        torch.distributed.nn.functional.all_gather = gather_as_nccl
    handler = DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True, sp_attn_implementation="sdpa")
    # dp_replicate_size: without it accelerate sets train_batch_size for one replica and DeepSpeed asserts
    return {"parallelism_config": ParallelismConfig(dp_replicate_size=WORLD // 2, sp_size=2, sp_backend="deepspeed",
                                                    sp_handler=handler)}


def gloo_errors() -> Dict[str, Optional[str]]:
    """On every rank of 4, in groups of 2: the two gloo limits DeepSpeed's path meets, by the calls it makes
    (its loader adapter's all-gather of unequal widths, its loss's differentiable all_gather backward).
    Each: None, or the error this rank raised (less object addresses)."""
    sp = SequenceParallel({"strategy": "ulysses", "size": 2})
    widths, x = [32 + 2 * r for r in range(sp.size)], torch.ones(1, requires_grad=True)
    calls = {"variable widths": lambda: dist.all_gather([torch.zeros(2, w, dtype=torch.long) for w in widths],
                                                        torch.zeros(2, widths[sp.rank], dtype=torch.long),
                                                        group=sp.group),
             "loss backward": lambda: torch.stack(torch.distributed.nn.functional.all_gather(x, group=sp.group))
             .sum().backward()}
    out: Dict[str, Optional[str]] = {}
    for key, call in calls.items():
        try:
            call()
            out[key] = None
        except Exception as err:                   # what the page quotes
            out[key] = re.sub(r" at 0x[0-9a-f]+", "", f"{type(err).__name__}: {err}")
    comm.barrier()
    return out


# -- overhead: the Trainer against the project's own loop -------------------------------------------


def own_loop(model: str, seq_len: int, steps: int, run_dir: str) -> Optional[Dict[str, List[float]]]:
    """On every rank: the project's own loop; rank 0 returns the end time of each step."""
    records = train_records(dict(model=model, seq_len=seq_len, steps=steps, deepspeed_config=OWN_CONFIG, quiet=True,
                                 no_wandb=True, run_dir=run_dir, corpus_bytes=1 << 20))
    return records and {"ends": [r["time"] for r in records]}


def trainer_loop(model: str, seq_len: int, steps: int) -> Optional[Dict[str, Any]]:
    """On every rank: SequenceParallelTrainer on the own loop's model (built as train/hf_model.py builds
    it), rows (the corpus rows its steps 0..steps-1 read, labels = ids) and DeepSpeed config (see ``fit``)."""
    from ..hf import SequenceParallelTrainer
    from ..hf.model_io import load_causal_lm, load_config
    from ..train import data
    tokens = data.stdlib_corpus(1 << 20)
    rows = [data.batch_for_step(tokens, step, 0, 0, 1, 2, seq_len) for step in range(steps)]
    samples = [{"input_ids": r["input_ids"][i], "labels": r["labels"][i]} for r in rows for i in range(2)]
    arguments = dict(learning_rate=1e-3, warmup_steps=0, lr_scheduler_type="constant")   # OWN_CONFIG's, in the Trainer
    return fit(SequenceParallelTrainer, lambda: load_causal_lm(model, torch.float32, config=load_config(model))[0],
               lambda out: example().arguments(copy.deepcopy(OWN_CONFIG), out, steps, 1, 1, **arguments),
               samples, lambda b: {k: torch.stack([s[k] for s in b]) for k in b[0]}, params=False)


# -- the measurement ------------------------------------------------------------------------------------


def interleave(pool, runs: Dict[str, tuple], rounds: int, skip: int, timeout: float) -> Dict[str, list]:
    """Every run (fn, *args) once per round, in order: {name: per round, rank 0's result or the first error
    of a rank}, with the 1-minute load at its end and the run's ``step_s``: the median wall time between
    consecutive step ends, the first ``skip`` intervals dropped."""
    out: Dict[str, list] = {name: [] for name in runs}
    for rnd in range(rounds):
        for name, (fn, *args) in runs.items():
            try:
                results = pool.run(fn, *args, timeout=timeout)
            except RankFailure as err:          # a rank hung or died (the pool restarts): the page says so
                results = [{"error": f"RankFailure: {str(err).splitlines()[0]}", "at": "the rank pool", "rank": "-"}]
            got = dict(next((r for r in results if r and "error" in r), results[0]), load_1min=os.getloadavg()[0])
            if "ends" in got:
                got["step_s"] = statistics.median([b - a for a, b in zip(got["ends"], got["ends"][1:])][skip:])
            print(f"round {rnd} {name}: {got.get('error') or got['step_s']}", flush=True)
            out[name].append(got)
    return out


def compare(runs: Dict[str, list], untimed: int) -> Dict[str, Any]:
    """Per case: every step's relative deviation of loss and grad_norm from plain's (round 0; every round
    must log the same steps, ``repeatable``), learning rates equal, the final parameters' largest
    difference, and the step time of the rounds after the ``untimed`` ones with its per-round ratio to
    plain's. A case that failed in any round: its first error."""
    plain = runs["plain"][0]
    plain_times = [r["step_s"] for r in runs["plain"][untimed:]]
    out = {}
    for name, rs in runs.items():
        failed = next((dict(r, round=i) for i, r in enumerate(rs) if "error" in r), None)
        if failed:
            out[name] = {k: failed[k] for k in ("error", "at", "rank", "round")}
            continue
        first, times = rs[0], [r["step_s"] for r in rs[untimed:]]

        def rel(key):
            return [abs(g[key] - w[key]) / abs(w[key]) for g, w in zip(first["steps"], plain["steps"])]
        out[name] = {"steps": first["steps"], "loss_dev": rel("loss"), "grad_norm_dev": rel("grad_norm"),
                     "lr_equal": [g["learning_rate"] for g in first["steps"]] ==
                     [w["learning_rate"] for w in plain["steps"]],
                     "param_dev": max(float((first["params"][k] - v).abs().max()) for k, v in plain["params"].items()),
                     "repeatable": all(r["steps"] == first["steps"] for r in rs), "step_s": spread(times),
                     "vs_plain": {"median": median_ratio(times, plain_times), "range": ratio_range(times, plain_times)}}
    return out


def overhead(runs: Dict[str, list], untimed: int) -> Dict[str, Any]:
    """Per round after the ``untimed`` ones: own loop and Trainer step times, their ratio, the load."""
    failed = next((r for rs in runs.values() for r in rs if "error" in r), None)
    if failed:
        raise RuntimeError(f"{PROG}: the overhead part failed on rank {failed['rank']}: {failed['error']} "
                           f"({failed['at']})")
    rounds = [{"own_s": own["step_s"], "trainer_s": hf["step_s"], "ratio": hf["step_s"] / own["step_s"],
               "load_1min": hf["load_1min"]} for own, hf in zip(runs["own"][untimed:], runs["trainer"][untimed:])]
    return {"rounds": rounds, **{k: spread([r[k] for r in rounds]) for k in ("ratio", "own_s", "trainer_s")}}


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
    load_before, start = os.getloadavg(), time.monotonic()
    over, loop = None, (args.model, args.overhead_seq, args.overhead_steps)
    with fresh_pool(WORLD, pool, 900.0) as pool, tempfile.TemporaryDirectory(prefix="ds_seqpar_bench_trainer_") as root:
        gloo = pool.run(gloo_errors, timeout=120.0)
        cases = {name: (run_case, name, args.steps) for name in CASES}
        runs = interleave(pool, cases, args.warmup + args.repeats, args.skip_steps, 300.0)
        load_mid = os.getloadavg()
        if args.overhead_rounds:            # rounds alternate own loop / Trainer
            loops = {"own": (own_loop, *loop, os.path.join(root, "own")), "trainer": (trainer_loop, *loop)}
            over = overhead(interleave(pool, loops, args.warmup + args.overhead_rounds, args.skip_steps, 900.0),
                            args.warmup)
    model = os.path.relpath(args.model, ROOT) if os.path.abspath(args.model).startswith(ROOT + os.sep) else args.model
    meta = dict(vars(args), model=model, command=command, world=WORLD, accumulation=ACCUMULATION, width=WIDTH,
                elapsed=time.monotonic() - start, load_before=loads(load_before), load_mid=loads(load_mid),
                load_during=max(load_mid[0], os.getloadavg()[0]), transformers=transformers.__version__,
                accelerate=accelerate.__version__, **machine_facts(),
                cases={k: {"sequence_parallel": section, "micro": micro} for k, (section, micro) in CASES.items()})
    return {"meta": meta, "gloo": gloo, "cases": compare(runs, args.warmup), "overhead": over}


def write(res: Dict[str, Any], out: str) -> int:
    from .trainer_rows import facts, rows
    return write_page(out, res["meta"]["name"], rows(res), facts(res), PROG)


def _measure(args, argv: List[str]) -> int:
    os.environ.setdefault("WANDB_MODE", "disabled")
    return write(measure(resolve(args), command_line(PROG, argv)), args.out)


def main(argv: Optional[List[str]] = None) -> int:
    return suite_main(argv, build_parser(), _measure)
