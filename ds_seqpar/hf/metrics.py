"""The Trainer's per-step metrics, in the main job's vocabulary (docs/dashboards.md), so that one
wandb view compares runs of both: transformers' WandbCallback logs them as ``train/<name>``, the
names the main job logs (train/metrics.py).

Each rank measures its optimizer steps between two logs (wall and compute time, tokens of its
shards, attention bytes and seconds, memory: static, peak, above static); at a log, one all-gather
over the world reduces them as the main job does (the slowest or largest rank is what limits a
step; the imbalance is the worst sequence group's max / mean compute time).
"""
from __future__ import annotations

import time
from typing import Dict

from ..memory.usage import StepMemory
from ..step_stats import compute_clock, compute_imbalance, gather_ranks

# CommStats kinds that are not the attention's exchanges: the loss, the batch check, eval, TRL's metrics
NOT_ATTENTION = ("loss", "batch_check", "eval_loss", "eval_gather", "unshard", "trl_metrics")
# per-step numbers summed over the steps between two logs, then divided by their count
SUMMED = ("step_s", "compute_s", "tokens", "attn_comm_bytes", "attn_comm_s")
LARGEST = ("static_mem_mb", "peak_mem_mb", "step_mem_mb")


class StepMeter:
    """This rank's measurements of the steps since the last log; ``tokens`` counted by the caller."""

    def __init__(self, sp):
        self.sp = sp
        self.memory = StepMemory(sp.device)
        self.totals: Dict[str, float] = {}
        self.steps = 0
        self.tokens = 0

    def clock(self) -> float:
        return compute_clock(self.sp.device)

    def _attention(self):
        stats = self.sp.stats
        return (sum(b for k, b in stats.bytes.items() if k not in NOT_ATTENTION),
                sum(s for k, s in stats.seconds.items() if k not in NOT_ATTENTION))

    def begin(self) -> None:
        self.tokens = 0
        self._t0, self._c0 = time.perf_counter(), self.clock()
        self._bytes0, self._seconds0 = self._attention()
        self.memory.begin()
        self.memory.mark("step")

    def end(self) -> None:
        c1, t1 = self.clock(), time.perf_counter()
        used = self.memory.end()
        sent, seconds = self._attention()
        mib = lambda b: float("nan") if b is None else b / 2**20  # noqa: E731
        step = {"step_s": t1 - self._t0, "compute_s": c1 - self._c0, "tokens": self.tokens,
                "attn_comm_bytes": sent - self._bytes0, "attn_comm_s": seconds - self._seconds0,
                "static_mem_mb": mib(used["static_bytes"]), "peak_mem_mb": mib(used["peak_bytes"]),
                "step_mem_mb": mib(used["above_static_bytes"])}
        for k in SUMMED:
            self.totals[k] = self.totals.get(k, 0.0) + step[k]
        for k in LARGEST:
            self.totals[k] = max(self.totals.get(k, float("-inf")), step[k])
        self.steps += 1

    def record(self) -> Dict[str, float]:
        """The steps since the last call, reduced over the world (a collective: every rank calls it)."""
        n = max(self.steps, 1)
        means = {k: self.totals.get(k, 0.0) / (n if k in SUMMED else 1) for k in SUMMED + LARGEST}
        col = gather_ranks(self.sp, means)
        step_s = col["step_s"].max().item()
        self.totals, self.steps = {}, 0
        return {"tokens_per_s": col["tokens"].sum().item() / max(step_s, 1e-12), "step_s": step_s,
                "compute_s_max": col["compute_s"].max().item(),
                "compute_imbalance": compute_imbalance(self.sp, col["compute_s"]),
                "attn_comm_bytes": int(col["attn_comm_bytes"].max().item()),
                "attn_comm_s": col["attn_comm_s"].max().item(),
                **{k: col[k].max().item() for k in LARGEST}}


def meter_callback(meter: StepMeter):
    """The TrainerCallback that brackets each optimizer step with the meter."""
    from transformers import TrainerCallback

    class MeterSteps(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            meter.begin()

        def on_step_end(self, args, state, control, **kwargs):
            meter.end()
    return MeterSteps()


__all__ = ["StepMeter", "meter_callback", "NOT_ATTENTION"]
