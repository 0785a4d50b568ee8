"""A step of rounds: what a global batch of documents, run as micro-batches on groups, costs beyond
its documents' own work. The one place the per-round, per-step and per-byte terms live.

A step is rounds of micro-batches (ds_seqpar/schedule); each rank runs one per round, a forward and
backward of the whole model, whatever its tokens. So a step costs

    its documents' work on their groups                     document_s (GPU), or linear ops x s_per_op
                                                            + attention ops x s_per_attention_op
                                                            + bytes x s_per_byte (CPU, fitted)
    + a fixed cost per round, on every rank                 round_s: the pass itself (launches,
                                                            hooks, the per-layer exchanges' latency)
                                                            and ZeRO-2/3's per-pass collectives
    + a fixed cost per step                                 step_s: the optimizer, ZeRO-1's reduction

On a GPU the documents are priced by times.step_time (compute at the profile's rates, the ring's
or all-to-all's exposed time) and ZeRO's collectives by zero_times. On CPU ranks nothing is assumed:
fit_rates finds the five rates from measured steps (``ds-seqpar bench
dynamic``), the operations and bytes being the scheduler's (documents.work).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Tuple

import numpy as np

from .pairs import sharded_length
from .times import collective_time, step_time


@dataclass(frozen=True)
class StepRates:
    """Seconds per operation (linear layers, attention) and per byte of a document's work, per round and
    per step."""

    s_per_op: float
    s_per_attention_op: float
    s_per_byte: float
    round_s: float
    step_s: float

    @property
    def flops_per_byte(self) -> float:
        """What a byte costs in operations (SCHEDULER_RATES, documents.py: 100)."""
        return self.s_per_byte / self.s_per_op if self.s_per_op > 0 else float("inf")

    def seconds(self, ops: float, attention_ops: float, sent: float, rounds: float) -> float:
        return (ops * self.s_per_op + attention_ops * self.s_per_attention_op + sent * self.s_per_byte
                + rounds * self.round_s + self.step_s)


def fit_rates(points: Sequence[Tuple[float, float, float, float, float]]) -> StepRates:
    """Least squares over measured steps (busiest rank's linear ops, attention ops, bytes, rounds,
    seconds), in relative error (a short step counts as much as a long one), every rate >= 0: a rate
    the fit drives below 0 is dropped and the rest refitted."""
    x = np.array([[o, a, b, r, 1.0] for o, a, b, r, _ in points], dtype=np.float64)
    y = np.array([s for *_, s in points], dtype=np.float64)
    keep = [0, 1, 2, 3, 4]
    while True:
        a = x[:, keep] / y[:, None]
        coef = np.linalg.lstsq(a, np.ones(len(y)), rcond=None)[0]
        if (coef >= 0).all() or len(keep) == 1:
            break
        keep.pop(int(np.argmin(coef)))
    full = np.zeros(5)
    full[keep] = np.maximum(coef, 0.0)
    return StepRates(*(float(v) for v in full))


def document_s(c, shape, length: int, gpu, gpus_per_node: int, dtype: str) -> float:
    """Seconds of one document of ``length`` tokens alone on candidate ``c``'s c.size ranks (the busiest
    rank's compute and exposed communication: times.step_time), without ZeRO and the offloaded
    optimizer (zero_times prices those per round and per step)."""
    n = sharded_length(c.strategy, c.size, c.ulysses_size, length) // c.size
    t = step_time(c, shape, length, n, gpu, c.size, gpus_per_node, dtype)
    return t.compute_s + sum(v for k, v in t.comm_s.items() if k not in ("zero", "offload"))


def zero_times(shape, gpu, gpus: int, gpus_per_node: int, zero: int, dtype: str,
               offload: bool = False) -> Tuple[float, float]:
    """(seconds per round, seconds per step) of ZeRO's collectives over ``gpus`` ranks: stage 1 reduces
    the gradients once per step (at the accumulation boundary); stage 2 reduce-scatters them after
    every backward; stage 3 also gathers the weights for every forward and backward. The updated
    weights are gathered once per step (stages 1 and 2). An offloaded optimizer's copies and CPU
    Adam step come once per step."""
    e = 4 if dtype == "fp32" else 2
    grads = e * shape.params() * (gpus - 1) / gpus if gpus > 1 else 0.0
    time = lambda nbytes: collective_time(gpu, nbytes, gpus, gpus_per_node)   # noqa: E731
    per_round = {1: 0.0, 2: time(grads), 3: time(3 * grads)}[zero]
    per_step = {1: time(3 * grads), 2: time(grads), 3: 0.0}[zero]
    if offload:
        share = shape.params() / gpus
        per_step += 2 * e * share / gpu.pcie_bytes_s + share / gpu.assumed["cpu_adam_params_per_s"]
    return per_round, per_step


__all__ = ["StepRates", "document_s", "fit_rates", "zero_times"]
