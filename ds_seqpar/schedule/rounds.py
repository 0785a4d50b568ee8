"""The dynamic data-sequence scheduler: a global batch of documents -> rounds of micro-batches.

Pure arithmetic over the cost seam (cost.py), unit-tested without processes: the same lengths give
the same schedule on every rank, so no rank has to send its plan to another.

Rules, in order:

1. Each document gets the smallest group size s of ``sizes`` with s x T >= its length (T =
   ``max_tokens_per_rank``). A document longer than max(sizes) x T is an error naming it.
2. Groups are aligned: a group of s ranks is ranks [k*s, (k+1)*s). The runtime pre-builds one
   such family per size once (ds_seqpar.dynamic), so nothing is created per step.
3. Documents needing s > 1 ranks are packed whole, first fit, into micro-batches of at most s x T
   tokens (with power-of-two sizes each runs alone: it has more than (s/2) x T tokens; with one
   size, ``sizes=(P,)``, this is static sequence parallelism over packed rows). The micro-batches
   are placed largest size and cost first, each in the first round with a free aligned block, on
   the block whose ranks carry the least cost so far.
4. Documents that fit on one rank (when 1 is a size) are placed one by one, costliest first, where
   they leave their busiest rank the least loaded: into a one-rank micro-batch with room (at most
   T tokens), a free (round, rank) cell, or the room a multi-rank micro-batch leaves under its
   group's capacity (the document is then split over that group; not with ``fill_groups=False``,
   Megatron's power-of-two rule the planner compares with). A new round only when none has room:
   every round is a forward and backward on every rank (or, given ``round_price``, when every cell
   is taken and a fresh round balances the ranks by more than a round costs). room.py finds the place
   with arrays.
5. Every rank runs one micro-batch per round, an empty one (no token, zero loss, on its group of
   the smallest size) where it has nothing: under ZeRO-3 every rank must run the same number of forward and backward passes.

The loss of the step is the mean over all target tokens of the global batch: every micro-batch
carries that count (``loss_tokens``) as the divisor of its token-loss sum.

    lengths [700, 90, 300, 60, 250], T = 400, 4 ranks, sizes (1, 2, 4):
    round 0   ranks 0-1: [700]       rank 2: [300, 60]    rank 3: [90, 250]
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..cost.documents import DocumentPricer
from ..cost.model_shape import ModelShape
from .batch import Group, MicroBatch
from .family import group_sizes
from .room import ShortPlacer


@dataclass(frozen=True)
class Schedule:
    """``rounds[i][rank]``: the micro-batch ``rank`` runs in round i (the ranks of one group hold the
    same object). ``rank_costs``: each rank's priced work over the step."""

    rounds: Tuple[Tuple[MicroBatch, ...], ...]
    world_size: int
    max_tokens_per_rank: int
    loss_tokens: int
    rank_costs: Tuple[float, ...] = field(default=())

    def for_rank(self, rank: int) -> List[MicroBatch]:
        """This rank's micro-batches, one per round (empty ones included)."""
        return [r[rank] for r in self.rounds]

    @property
    def group_sizes(self) -> List[int]:
        """The sizes of the groups non-empty micro-batches ran on, sorted, each once."""
        return sorted({mb.group.size for r in self.rounds for mb in r if not mb.empty})

    @property
    def imbalance(self) -> float:
        """max / mean of the ranks' priced work (1.0 = perfectly balanced)."""
        mean = sum(self.rank_costs) / max(len(self.rank_costs), 1)
        return max(self.rank_costs) / mean if mean > 0 else 1.0


def schedule(lengths: Sequence[int], world_size: int, max_tokens_per_rank: int, sizes: Sequence[int],
             strategy: str = "zigzag", shape: ModelShape = ModelShape(),
             loss_tokens: Optional[int] = None, ulysses_size: int = 1,
             pricer: Optional[Callable[[int, int], float]] = None, fill_groups: bool = True,
             round_price: Optional[float] = None) -> Schedule:
    """Rounds of micro-batches for one global batch of documents (module docstring).
    ``loss_tokens``: target tokens of the global batch, default sum(length - 1) (labels shifted
    inside each document, every one counted). ``ulysses_size``: the 2D hybrid's U, priced on the
    groups it runs on (topology.ulysses_degree). ``pricer(length, group size)``: what a document costs
    (default cost.documents.DocumentPricer(strategy, shape, ulysses_size): the cost model's price in
    operations; the planner passes the same price at a GPU's rates). ``fill_groups`` False: short
    documents never fill the room of multi-rank micro-batches (Megatron's power-of-two rule, which the
    planner compares with).
    ``round_price``: what one more round costs in the pricer's units; given, a round is added for
    balance too, not only for room (room.py). None: a round only when nothing has room."""
    pricer = pricer or DocumentPricer(strategy, shape, ulysses_size)
    lengths = [_check_length(i, n) for i, n in enumerate(lengths)]
    sizes = _check_sizes(sizes, world_size)
    t = max_tokens_per_rank
    need = [_need(i, n, sizes, t) for i, n in enumerate(lengths)]
    cost = [pricer(n, s) for n, s in zip(lengths, need)]
    total = sum(max(n - 1, 0) for n in lengths) if loss_tokens is None else int(loss_tokens)
    load = [0.0] * world_size
    table: List[Dict[int, MicroBatch]] = []          # round -> rank -> micro-batch
    groups = [(size, docs) for size in sizes if size > 1
              for docs in _pack([i for i in range(len(lengths)) if need[i] == size], lengths, size * t)]
    for size, docs in sorted(groups, key=lambda g: (-g[0], -sum(cost[i] for i in g[1]), g[1][0])):
        rnd, first = _free_block(table, size, world_size, load)
        mb = MicroBatch(Group(size, first), tuple(docs), tuple(lengths[i] for i in docs), total,
                        sum(cost[i] for i in docs))
        for r in mb.group.ranks:
            table[rnd][r] = mb
            load[r] += mb.cost
    placer = ShortPlacer(table, np.array(load, dtype=np.float64), t, total, pricer, fill_groups, round_price)
    for d in sorted((i for i, s in enumerate(need) if s == 1), key=lambda i: (-cost[i], i)):
        placer.place(d, lengths)
    rounds = tuple(_fill_empty(row, world_size, sizes[0], total) for row in table)
    return Schedule(rounds, world_size, t, total, tuple(float(x) for x in placer.load))


def _fill_empty(row: Dict[int, MicroBatch], world_size: int, smallest: int, total: int) -> Tuple[MicroBatch, ...]:
    """The round's micro-batch of every rank: where it has none, an empty one on its group of the
    smallest size (all of whose ranks are free: every size is a multiple of the smallest)."""
    for first in range(0, world_size, smallest):
        if first not in row:
            empty = MicroBatch(Group(smallest, first), (), (), total)
            for r in empty.group.ranks:
                row[r] = empty
    return tuple(row[r] for r in range(world_size))


def _free_block(table, size: int, world_size: int, load) -> Tuple[int, int]:
    """(round, first rank) of the first round with a free aligned block of ``size`` ranks, the
    block with the least cost so far; a new round if none is free."""
    for k, row in enumerate(table):
        blocks = [f for f in range(0, world_size, size) if all(r not in row for r in range(f, f + size))]
        if blocks:
            return k, min(blocks, key=lambda f: (sum(load[f:f + size]), f))
    table.append({})
    return len(table) - 1, min(range(0, world_size, size), key=lambda f: (sum(load[f:f + size]), f))


def _pack(docs: List[int], lengths, capacity: int) -> List[List[int]]:
    """Whole documents into micro-batches of at most ``capacity`` tokens: first fit, longest first;
    each micro-batch lists its documents in batch order."""
    bins: List[List[int]] = []
    room: List[int] = []
    for d in sorted(docs, key=lambda d: (-lengths[d], d)):
        k = next((k for k, free in enumerate(room) if free >= lengths[d]), None)
        if k is None:
            bins.append([])
            room.append(capacity)
            k = len(bins) - 1
        bins[k].append(d)
        room[k] -= lengths[d]
    return [sorted(b) for b in bins]


def _check_length(i: int, n) -> int:
    if isinstance(n, bool) or int(n) != n or n < 1:
        raise ValueError(f"document {i} has length {n!r}; lengths are whole numbers of tokens >= 1")
    return int(n)


def _check_sizes(sizes: Sequence[int], world_size: int) -> Tuple[int, ...]:
    sizes = tuple(sorted(set(int(s) for s in sizes)))
    bad = [s for s in sizes if s < 1 or world_size % s or s % sizes[0]]
    if not sizes or bad:
        raise ValueError(f"group sizes {list(sizes)} must divide the world size {world_size}, each a multiple of "
                         f"the smallest "
                         f"(group_sizes({world_size}) gives {list(group_sizes(world_size))})")
    return sizes


def _need(i: int, n: int, sizes: Tuple[int, ...], t: int) -> int:
    for s in sizes:
        if s * t >= n:
            return s
    raise ValueError(f"document {i} has {n} tokens, more than the largest group holds: {sizes[-1]} ranks x "
                     f"sequence_parallel.max_tokens_per_rank={t} = {sizes[-1] * t}; raise max_tokens_per_rank, "
                     f"add ranks, or cut documents to {sizes[-1] * t} tokens (the main job's --lengths does)")


__all__ = ["Group", "MicroBatch", "Schedule", "schedule"]
