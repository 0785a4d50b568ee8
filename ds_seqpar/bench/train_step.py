"""Whole training-step speedup of the small LM (or a ``--model`` Hugging Face model) under ZeRO-2:
sp=P, dp=1 on P ranks against the same run on one rank (same global batch, sequence, model and
data), measured through ``train.run_training`` itself, so what is timed is exactly the main job.

Two pools: the benchmark's P-rank pool and a 1-rank pool, both one thread per rank. Rounds
alternate (1-rank run, P-rank run, per strategy), so load from other processes hits both alike;
each run trains ``steps`` optimizer steps and the first step of a run is its warm-up (engine
set-up, first allocations). A run's step time is the median of the rest (``step_s`` in
metrics.jsonl: the slowest rank's wall time), and the speedup of a round is 1-rank / P-rank.
The P-rank run's losses must equal the 1-rank run's (rel. 1e-4): a speedup of a different
computation would mean nothing. ``train_records`` (one run's metrics records) is also the trainer
suite's own loop.
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile
from typing import Any, Dict, List, Optional

# model and batch per preset; a strategy's LM uses linear attention for lasp, softmax otherwise
TRAIN_PRESETS = {
    "quick": dict(dim=128, n_layers=2, n_heads=4, seq_len=2048, micro_batch=1, steps=3),
    "full": dict(dim=256, n_layers=4, n_heads=8, seq_len=4096, micro_batch=1, steps=3),
}
LOSS_REL = 1e-4


def train_records(args: Dict[str, Any]) -> Optional[List[dict]]:
    """On every rank of a pool: one training run (``train.run_training``'s options); the writer rank returns
    its metrics records (one per step), the others None."""
    import torch
    # run_training gives a lone rank all cores when OMP_NUM_THREADS is unset; the comparison is
    # one thread per rank at 1 and at P ranks
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    from ..train.main import run_training
    res = run_training(args)
    if not res.get("metrics_path"):
        return None
    with open(res["metrics_path"]) as f:
        return [json.loads(line) for line in f]


def _run(pool, args: Dict[str, Any]) -> List[dict]:
    return next(r for r in pool.run(train_records, args, timeout=3600.0) if r is not None)


def _median(records: List[dict], key: str) -> float:
    timed = records[1:] or records              # the first step of a run is its warm-up
    return statistics.median(r[key] for r in timed)


def measure_training(pool_p, pool_1, strategies: List[str], model: Dict[str, Any], warmup: int,
                     repeats: int) -> Dict[str, Dict[str, Any]]:
    """Per strategy: step times at 1 and P ranks per round, their ratios (and those of the fwd+bwd
    compute alone), tokens/s, loss agreement."""
    p = pool_p.world_size
    out = {s: {"one_s": [], "p_s": [], "ratios": [], "compute_ratios": [], "one_tokens_per_s": [],
               "p_tokens_per_s": [], "loss_rel_diff": 0.0, "load_1min": []} for s in strategies}
    with tempfile.TemporaryDirectory(prefix="ds_seqpar_bench_train_") as run_root:
        base = dict(model, zero_stage=2, quiet=True, no_wandb=True, run_dir=run_root, corpus_bytes=1 << 20)
        for rnd in range(warmup + repeats):
            for s in strategies:
                one = _run(pool_1, dict(base, strategy=s, sp_size=1))
                par = _run(pool_p, dict(base, strategy=s, sp_size=p))
                _check_same_losses(s, one, par, out[s])
                if rnd < warmup:
                    continue
                t1, tp = _median(one, "step_s"), _median(par, "step_s")
                out[s]["one_s"].append(t1)
                out[s]["p_s"].append(tp)
                out[s]["ratios"].append(t1 / tp)
                # forward + backward CPU time of the busiest rank: the part that should shrink P-fold
                out[s]["compute_ratios"].append(_median(one, "compute_s_max") / _median(par, "compute_s_max"))
                out[s]["one_tokens_per_s"].append(_median(one, "tokens_per_s"))
                out[s]["p_tokens_per_s"].append(_median(par, "tokens_per_s"))
                out[s]["load_1min"].append(os.getloadavg()[0])
    return out


def _check_same_losses(strategy: str, one: List[dict], par: List[dict], acc: Dict[str, Any]) -> None:
    l1, lp = [r["loss"] for r in one], [r["loss"] for r in par]
    rel = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(l1, lp))
    acc["loss_rel_diff"] = max(acc["loss_rel_diff"], rel)
    if len(l1) != len(lp) or rel > LOSS_REL:
        raise AssertionError(f"training {strategy}: the {len(lp)}-step P-rank losses {lp} differ from the 1-rank "
                             f"losses {l1} (rel {rel:.1e} > {LOSS_REL}): the speedup would compare different runs")


__all__ = ["TRAIN_PRESETS", "measure_training", "train_records"]
