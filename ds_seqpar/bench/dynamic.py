"""``ds-seqpar bench dynamic``: dynamic data-sequence groups against every static size, on real
document lengths, interleaved in one run (not a test).

    ds-seqpar bench dynamic [--lengths FILE,FILE] [--P 4] [--max_tokens_per_rank 512]
                            [--tokens_per_step 16384] [--strategy zigzag] [--zero 2] [--repeats 5]

Every case (``cases``: each static size, dynamic at T and at the tokens per rank each static size
holds) trains the own LM (the main job's default model, ZeRO ``--zero``) one optimizer step per round
on the same documents: the round's global batch drawn from FILE (data.documents_for_step, seeded by
the round) and cut at the largest group's capacity C = P x T. Rounds run every case once after a
barrier, in a fixed order. With more ranks than cores the wall clock measures the machine's sharing,
so the primary figure is the critical path: the busiest rank's CPU seconds of the whole step (process
time: its communication threads included), median over rounds; its bound is the mean over ranks
(the step's work spread evenly). The cases' losses must agree (the same token-level mean): a
speed-up of a different computation would mean nothing. Each step's schedule is kept priced
(schedule.rank_work), and each case's critical path is predicted from the rates the other cases fit
(dynamic_fit.py: the ``predicted`` column).
"""
from __future__ import annotations

import argparse
import os
import statistics
from typing import Any, Dict, List, Optional

from ..report.rows import Row
from .dynamic_fit import with_predictions
from .harness import command_line, measure_on_pool, suite_facts, suite_main, suite_parser, write_page

PROG = "ds-seqpar bench dynamic"
LOSS_REL = 1e-4
MODEL = dict(vocab_size=256, dim=128, n_layers=4, n_heads=4)     # the main job's default LM


def parser() -> argparse.ArgumentParser:
    ap = suite_parser(PROG, __doc__, "dynamic_cpu", P=4)
    ap.add_argument("--lengths", default="tests/data/lengths/wikipedia_5k.txt,tests/data/lengths/wlbllm_5k.txt",
                    help="comma list of length files (one integer per line, .gz too)")
    ap.add_argument("--max_tokens_per_rank", type=int, default=512)
    ap.add_argument("--tokens_per_step", type=int, default=16384)
    ap.add_argument("--strategy", default="zigzag")
    ap.add_argument("--zero", type=int, default=2, choices=(0, 1, 2, 3))
    return ap


def cases(P: int, t: int) -> Dict[str, Dict[str, Any]]:
    """case -> (size or "dynamic", tokens per rank): static sizes hold rows of C = P x T tokens."""
    from ..schedule import group_sizes
    cap = P * t
    out = {f"static:{s}": {"size": s, "per_rank": cap // s} for s in group_sizes(P)}
    out["dynamic"] = {"size": "dynamic", "per_rank": t}
    for s in group_sizes(P)[1:-1]:
        out[f"dynamic:T={cap // s}"] = {"size": "dynamic", "per_rank": cap // s}
    return out


def _runner(strategy: str, case: Dict[str, Any], P: int, heads: int):
    from ..dynamic import DynamicSequenceParallel
    from ..sequence_parallel import SequenceParallel
    if case["size"] == "dynamic":
        return DynamicSequenceParallel({"strategy": strategy, "size": "dynamic",
                                        "max_tokens_per_rank": case["per_rank"]}, heads=heads)
    return DynamicSequenceParallel.fixed(SequenceParallel({"strategy": strategy, "size": case["size"]}),
                                         case["per_rank"])


def _engine(runner, zero: int):
    import deepspeed
    import torch
    from ..models import CausalLM, ModelConfig
    torch.manual_seed(0)
    model = CausalLM(ModelConfig(**MODEL), runner)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": zero},
              "steps_per_print": 1 << 30}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                      mpu=runner.mpu)
    return engine, model.cfg


def bench_rank(args) -> Dict[str, Any]:
    """On every rank: per length file, per round, per case one optimizer step; this rank's numbers."""
    import time
    import deepspeed
    from .. import comm
    from ..dynamic import train_step
    from ..cost.model_shape import ModelShape
    from ..schedule import rank_work
    from ..train import data
    from ..deepspeed_shm import skip_deepspeed_shm_op
    skip_deepspeed_shm_op()
    deepspeed.init_distributed(dist_backend="gloo")
    table = cases(args.P, args.max_tokens_per_rank)
    cap, tokens = args.P * args.max_tokens_per_rank, data.stdlib_corpus(1 << 20)
    out: Dict[str, Any] = {}
    for path in args.lengths.split(","):
        lengths = data.read_lengths(path)
        runners = {c: _runner(args.strategy, spec, args.P, MODEL["n_heads"]) for c, spec in table.items()}
        engines = {c: _engine(r, args.zero) for c, r in runners.items()}
        shape = ModelShape.of_lm(next(iter(engines.values()))[1])
        per = {c: [] for c in table}
        for rnd in range(args.warmup + args.repeats):
            docs, cut = data.documents_for_step(tokens, lengths, rnd, args.tokens_per_step, cap)
            for c, runner in runners.items():
                comm.barrier()
                runner.reset_stats()
                wall, cpu = time.perf_counter(), time.process_time()
                schedule = runner.schedule([int(d.numel()) for d in docs], shape=shape)
                res = train_step(runner, engines[c][0], docs, schedule=schedule)
                cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
                if rnd >= args.warmup:
                    sent = sum(b for k, b in runner.stats.bytes.items() if k != "loss")
                    per[c].append({"cpu": cpu, "wall": wall, "loss": res["loss"], "rounds": res["rounds"],
                                   "bytes": sent, "tokens": sum(int(d.numel()) for d in docs), "cut": cut,
                                   "priced_imbalance": schedule.imbalance, "sizes": schedule.group_sizes,
                                   "work": rank_work(schedule, args.strategy, shape)})
        out[os.path.basename(path)] = per
    return {"rank": comm.global_rank(), "per": out, "load_1min": os.getloadavg()[0]}


def summarize(per_rank: List[Dict[str, Any]]) -> Dict[str, Dict[str, Dict[str, Any]]]:
    """file -> case -> per round: the busiest rank's CPU seconds, the mean rank's, tokens per wall second, ..."""
    out: Dict[str, Dict[str, Dict[str, Any]]] = {}
    for name, by_case in per_rank[0]["per"].items():
        out[name] = {}
        for case, rounds in by_case.items():
            at = [[r["per"][name][case][i] for r in per_rank] for i in range(len(rounds))]   # [round][rank]
            crit = [max(x["cpu"] for x in rnd) for rnd in at]
            mean = [statistics.fmean(x["cpu"] for x in rnd) for rnd in at]
            out[name][case] = {
                "critical_cpu_s": crit, "mean_cpu_s": mean, "imbalance": [c / m for c, m in zip(crit, mean)],
                "tokens_per_s": [rnd[0]["tokens"] / max(x["wall"] for x in rnd) for rnd in at],
                "bytes": [max(x["bytes"] for x in rnd) for rnd in at], "rounds": [rnd[0]["rounds"] for rnd in at],
                "losses": [rnd[0]["loss"] for rnd in at], "sizes": sorted({s for rnd in at for s in rnd[0]["sizes"]}),
                "priced_imbalance": [rnd[0]["priced_imbalance"] for rnd in at],
                "work": [{"rounds": rnd[0]["rounds"], "work": rnd[0]["work"]} for rnd in at]}
    return out


def check_losses(summary) -> float:
    """Largest relative loss difference between cases on the same documents; raises past LOSS_REL."""
    worst = 0.0
    for name, by_case in summary.items():
        ref = by_case["static:1"]["losses"]
        for case, r in by_case.items():
            rel = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref))
            worst = max(worst, rel)
            if rel > LOSS_REL:
                raise AssertionError(f"{name}: {case}'s losses {r['losses']} differ from static:1's {ref}")
    return worst


def rows(summary, meta) -> List[Row]:
    med = statistics.median
    out = []
    for name, by_case in summary.items():
        variant = f"{name} P={meta['P']} T={meta['max_tokens_per_rank']}"
        per_rank = cases(meta["P"], meta["max_tokens_per_rank"])
        static = {c: med(r["critical_cpu_s"]) for c, r in by_case.items() if c.startswith("static:")}
        best = min(static, key=static.get)
        for case, r in by_case.items():
            crit = r["critical_cpu_s"]
            detail = {"tokens per rank": per_rank[case]["per_rank"], "rounds": med(r["rounds"]),
                      "imbalance": round(med(r["imbalance"]), 3),
                      "priced imbalance": round(med(r["priced_imbalance"]), 3), "bytes": med(r["bytes"]),
                      "group sizes": r["sizes"], "vs best static": round(static[best] / med(crit), 3)}
            out.append(Row("dynamic", case, variant, "critical_cpu_s", "s", med(crit), (min(crit), max(crit)),
                           bound=med(r["mean_cpu_s"]), detail=detail))
            tps = r["tokens_per_s"]
            out.append(Row("dynamic", case, variant, "tokens_per_s", "", med(tps), (min(tps), max(tps))))
    return out


def priced_work(summary, meta) -> Dict[str, Any]:
    """"<case> <variant>" -> per step: its rounds and every rank's priced (operations, bytes)."""
    return {f"{case} {name} P={meta['P']} T={meta['max_tokens_per_rank']}": r["work"]
            for name, by_case in summary.items() for case, r in by_case.items()}


def facts(meta) -> Dict[str, Any]:
    return suite_facts(
        meta, f"Dynamic data-sequence groups vs static sizes at P={meta['P']}, T={meta['max_tokens_per_rank']}",
        f"{meta['P']} ranks x 1 thread (gloo), the own LM {MODEL}, {meta['strategy']}, ZeRO-{meta['zero']}, "
        f"AdamW, clipping 1.0, fp32; {meta['tokens_per_step']} tokens per step drawn from each file, cut at "
        f"{meta['P'] * meta['max_tokens_per_rank']} tokens; {meta['repeats']} interleaved rounds after "
        f"{meta['warmup']} warm-up round(s), median (min-max) over rounds; largest loss difference between "
        f"cases {meta['loss_rel']:.1e}.", {
            "critical_cpu_s": "The busiest rank's CPU seconds of a whole step (process time); bound: the mean over "
                              "ranks (perfect balance). Detail: tokens each rank holds at once, rounds, measured and "
                              "priced imbalance (max/mean), bytes the busiest rank sent, busiest static size's time "
                              "over this case's.",
            "tokens_per_s": "Step tokens over the slowest rank's wall time (ranks share the cores: read "
                            "critical_cpu_s first)."})


def measure(args, argv) -> int:
    per_rank, meta = measure_on_pool(bench_rank, args, command_line(PROG, argv), versions=True)
    summary = summarize(per_rank)
    meta["loss_rel"] = check_losses(summary)
    meta["priced_work"] = priced_work(summary, meta)
    found, fitted = with_predictions(rows(summary, meta), meta["priced_work"])
    return write_page(args.out, args.name, found, dict(facts(meta), notes=" ".join((meta["notes"], fitted)), meta=meta),
                      PROG)


def main(argv: Optional[List[str]] = None) -> int:
    return suite_main(argv, parser(), measure)


__all__ = ["main", "bench_rank", "cases", "summarize", "rows"]
