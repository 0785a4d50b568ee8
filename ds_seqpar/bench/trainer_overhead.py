"""Trainer overhead: step time of ``SequenceParallelTrainer`` (transformers' Trainer loop with the
mixin) against this project's own loop (``train.run_training``) on the same model, data, DeepSpeed
config and strategy, on one pool of local CPU ranks.

    python -m ds_seqpar.bench.trainer_overhead --repeats 5      # reports/hf_trainer_cpu.md

Same in both: the Hugging Face model of ``--model`` (random init, seed 0, fp32), rows of ``--seq_len``
tokens of the embedded byte corpus (labels = ids), micro batch 1, no accumulation, zigzag P=2 x dp 2
at ZeRO-2, AdamW, clipping 1.0, one log record per step. What is timed is the wall time between the
ends of consecutive optimizer steps on rank 0 (own loop: the ``time`` of its metrics records; Trainer:
a callback's ``on_step_end``), so each side pays its whole loop (data, sharding, logging); the first
``--warmup`` intervals of a run are dropped and a run's step time is the median of the rest. Rounds
alternate own loop / Trainer, so load from other processes hits both alike; a round's overhead is
Trainer / own, and the report gives the median over rounds.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Dict, List

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
    "steps_per_print": 1000000,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0,
                                              "torch_adam": True}},
    "zero_optimization": {"stage": 2, "overlap_comm": False, "contiguous_gradients": True},
    "sequence_parallel": {"strategy": "zigzag", "size": 2},
}


def _intervals(times: List[float], warmup: int) -> float:
    gaps = [b - a for a, b in zip(times, times[1:])][warmup:]
    return statistics.median(gaps)


def own_loop(model: str, seq_len: int, steps: int, run_dir: str) -> List[float]:
    """On every rank: the project's own loop; rank 0 returns the end time of each step."""
    import torch
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    from ..train.main import run_training
    res = run_training(dict(model=model, seq_len=seq_len, steps=steps, deepspeed_config=DS_CONFIG, quiet=True,
                            no_wandb=True, run_dir=run_dir, corpus_bytes=1 << 20))
    if not res.get("metrics_path"):
        return []
    with open(res["metrics_path"]) as f:
        return [json.loads(line)["time"] for line in f]


def trainer_loop(model: str, seq_len: int, steps: int, run_dir: str) -> List[float]:
    """On every rank: SequenceParallelTrainer on the same model, rows and config; rank 0 returns the end
    time of each step."""
    import torch
    import transformers as T
    from accelerate.state import AcceleratorState, PartialState
    from ..hf import SequenceParallelTrainer
    from ..hf.model_io import load_causal_lm, load_config
    from ..train import data
    torch.set_num_threads(1)
    tokens = data.stdlib_corpus(1 << 20)
    rows = [data.batch_for_step(tokens, step, 0, 0, 1, 2, seq_len) for step in range(steps)]
    samples = [{"input_ids": r["input_ids"][i], "labels": r["labels"][i]} for r in rows for i in range(2)]
    ends: List[float] = []

    class StepEnds(T.TrainerCallback):
        def on_step_end(self, *args, **kwargs):
            ends.append(time.time())

    ds = json.loads(json.dumps(DS_CONFIG))
    ds.update(train_micro_batch_size_per_gpu="auto", gradient_accumulation_steps="auto", gradient_clipping="auto")
    ds["optimizer"]["params"].update(lr="auto", betas="auto", eps="auto", weight_decay="auto")
    args = T.TrainingArguments(output_dir=run_dir, deepspeed=ds, max_steps=steps, per_device_train_batch_size=1,
                               gradient_accumulation_steps=1, learning_rate=1e-3, max_grad_norm=1.0,
                               lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to="none",
                               seed=0, dataloader_num_workers=0, disable_tqdm=True, use_cpu=True)
    try:
        torch.manual_seed(0)                         # as the own loop builds it (train/hf_model.py)
        net, _ = load_causal_lm(model, torch.float32, config=load_config(model))
        net.train()
        trainer = SequenceParallelTrainer(model=net, args=args, train_dataset=samples, callbacks=[StepEnds()],
                                          data_collator=lambda b: {k: torch.stack([s[k] for s in b]) for k in b[0]})
        trainer.train()
        writer = trainer.is_world_process_zero()
        trainer.model_wrapped.destroy()             # frees the engine's hooks (train/trainer.py close)
    finally:
        AcceleratorState._reset_state(reset_partial_state=False)
        PartialState._reset_state()
    return ends if writer else []


def measure(pool, model: str, seq_len: int, steps: int, warmup: int, repeats: int) -> Dict[str, Any]:
    rounds = []
    root = tempfile.mkdtemp(prefix="ds_seqpar_trainer_overhead_")
    try:
        for r in range(repeats + 1):                 # round 0 warms the pool (imports, first allocations)
            own = _intervals(pool.run(own_loop, model, seq_len, steps, root, timeout=1800)[0], warmup)
            hf = _intervals(pool.run(trainer_loop, model, seq_len, steps, os.path.join(root, "hf"),
                                     timeout=1800)[0], warmup)
            if r:
                rounds.append({"own_s": own, "trainer_s": hf, "ratio": hf / own, "load_1min": os.getloadavg()[0]})
            print(f"round {r}: own {own:.3f} s, trainer {hf:.3f} s, ratio {hf / own:.3f}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"rounds": rounds, "median_ratio": statistics.median(x["ratio"] for x in rounds),
            "own_median_s": statistics.median(x["own_s"] for x in rounds),
            "trainer_median_s": statistics.median(x["trainer_s"] for x in rounds)}


def render(res: Dict[str, Any], opts, command: str) -> str:
    lines = [f"command: `{command}`", "",
             f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
             f"4 gloo ranks of 1 thread; model {opts.model}, seq_len {opts.seq_len}, {opts.steps} steps per run, "
             f"first {opts.warmup} step intervals dropped", "",
             "| round | own loop (s/step) | SequenceParallelTrainer (s/step) | Trainer / own | load (1 min) |",
             "|---|---|---|---|---|"]
    for i, r in enumerate(res["rounds"], 1):
        lines.append(f"| {i} | {r['own_s']:.3f} | {r['trainer_s']:.3f} | {r['ratio']:.3f} | {r['load_1min']:.1f} |")
    lines += [f"| median | {res['own_median_s']:.3f} | {res['trainer_median_s']:.3f} | **{res['median_ratio']:.3f}** | |"]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ds_seqpar.bench.trainer_overhead", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=os.path.join(ROOT, "configs", "models", "llama_small.json"))
    ap.add_argument("--seq_len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None, help="also write the raw numbers here")
    opts = ap.parse_args(argv)
    os.environ.setdefault("WANDB_MODE", "disabled")
    from ..launch.rankpool import RankPool
    pool = RankPool(4, timeout_s=600.0).start()
    try:
        res = measure(pool, opts.model, opts.seq_len, opts.steps, opts.warmup, opts.repeats)
    finally:
        pool.close()
    command = "python -m ds_seqpar.bench.trainer_overhead " + " ".join(map(shlex.quote, sys.argv[1:] if argv is None
                                                                          else argv))
    print(render(res, opts, command.strip()))
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(dict(res, command=command.strip()), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
