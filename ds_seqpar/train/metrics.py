"""One object owns the step metrics from measurement to the loggers: each rank measures its own
step (compute clock, attention bytes and seconds, memory: the trainer's StepMemory), one small all-gather reduces them
across the sequence x data ranks (the slowest or largest rank is what limits a step), and rank 0
writes the record to metrics.jsonl and wandb."""
from __future__ import annotations

import os
import time
from typing import Any, Dict

from ..step_stats import compute_clock, compute_imbalance, gather_ranks
from . import runlog

# rank-local measurements whose maximum over ranks is what the step costs
WORST_OF = ("step_s", "compute_s", "attn_comm_bytes", "attn_comm_s", "peak_mem_mb", "static_mem_mb", "step_mem_mb")


class StepMetrics:
    def __init__(self, sp, run_dir, wandb_on: bool, is_writer: bool):
        self.sp, self.is_writer, self.wandb_on = sp, is_writer, wandb_on
        self.log = runlog.RunLog(run_dir)

    # -- measurement (this rank) -----------------------------------------------------------------
    def clock(self) -> float:
        return compute_clock(self.sp.device)

    def attn_bytes(self) -> int:
        return sum(b for k, b in self.sp.stats.bytes.items() if k != "loss")

    def attn_seconds(self) -> float:
        return sum(s for k, s in self.sp.stats.seconds.items() if k != "loss")

    # -- reduction (every rank) ------------------------------------------------------------------
    def reduce(self, step: int, local: Dict[str, float], tokens: int, engine) -> Dict[str, Any]:
        """Gather every rank's numbers into the step's record; ``tokens`` trained this step."""
        col = gather_ranks(self.sp, local)
        imbalance = compute_imbalance(self.sp, col["compute_s"])
        worst = {k: col[k].max().item() for k in WORST_OF}
        return {"step": step + 1, "loss": col["loss"].mean().item(), "grad_norm": local["grad_norm"],
                "tokens_per_s": tokens / worst["step_s"], "step_s": worst["step_s"],
                "compute_s_max": worst["compute_s"], "compute_imbalance": imbalance,
                "attn_comm_bytes": int(worst["attn_comm_bytes"]), "attn_comm_s": worst["attn_comm_s"],
                "peak_mem_mb": worst["peak_mem_mb"], "static_mem_mb": worst["static_mem_mb"],
                "step_mem_mb": worst["step_mem_mb"], "lr": engine.get_lr()[0],
                "samples": engine.global_samples, "time": time.time()}

    # -- loggers (rank 0) ------------------------------------------------------------------------
    def write(self, record: Dict[str, Any], samples: int) -> None:
        if not self.is_writer:
            return
        # the writer's host load: a step timed while other work shared the cores is marked as such
        record = dict(record, load_1min=os.getloadavg()[0])
        self.log.log(record)
        if self.wandb_on:
            runlog.wandb_log(record, step=samples)


__all__ = ["StepMetrics"]
