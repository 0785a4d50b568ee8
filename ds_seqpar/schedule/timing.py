"""How long a schedule takes: the rounds' micro-batches, each costing its price (``MicroBatch.cost``)
plus a fixed ``round_s``, strung along the ranks that run them.

A micro-batch's ranks exchange data inside it (ring steps, all-to-alls), so it starts when the last of
them has finished its previous round; ranks of other groups do not wait (ZeRO-1 and 2 reduce once
the step's last backward is done, or, stage 2, asynchronously per bucket). With ``barrier`` every
round starts when every rank has finished the previous one: Megatron's dynamic context parallelism
synchronises its groups between rounds, and ZeRO-3 gathers each layer's parameters over every rank.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple

from ..cost.documents import work
from ..cost.model_shape import ModelShape
from .batch import MicroBatch
from .rounds import Schedule


def critical_path_s(schedule: Schedule, round_s: float = 0.0, barrier: bool = False,
                    seconds: Optional[Callable[[MicroBatch], float]] = None) -> float:
    """The time at which the last rank finishes its last round (the step's fixed cost not included).
    ``seconds(mb)``: what a micro-batch takes (default: its price, ``mb.cost``; the planner places by
    the price and times the placed micro-batches in GPU seconds)."""
    seconds = seconds or (lambda mb: mb.cost)
    done = [0.0] * schedule.world_size
    for row in schedule.rounds:
        begin = max(done) if barrier else None
        seen = set()
        for mb in row:
            if id(mb) in seen:
                continue
            seen.add(id(mb))
            ranks = mb.group.ranks
            start = begin if barrier else max(done[r] for r in ranks)
            end = start + seconds(mb) + round_s
            for r in ranks:
                done[r] = end
    return max(done) if done else 0.0


def rank_work(schedule: Schedule, strategy: str, shape: ModelShape = ModelShape()) -> List[Tuple[float, float, float]]:
    """(linear operations, attention operations, bytes sent) of each rank over the step: its
    micro-batches' documents, each priced on its micro-batch's group (cost.documents.work, the parts
    ``price`` adds up)."""
    out = [[0.0, 0.0, 0.0] for _ in range(schedule.world_size)]
    for row in schedule.rounds:
        for r, mb in enumerate(row):
            for n in mb.lengths:
                for i, part in enumerate(work(n, mb.group.size, strategy, shape)):
                    out[r][i] += part
    return [(a, b, c) for a, b, c in out]


__all__ = ["critical_path_s", "rank_work"]
