"""Where a short document goes (rounds.py's rule 4), found with arrays over (round, rank) so that a
global batch of tens of thousands of documents on 512 ranks is placed in seconds.

Rule 4: a document that fits on one rank goes where it leaves its busiest rank the least loaded:
into a one-rank micro-batch with room (at most T tokens), a free (round, rank) cell, or the room a
multi-rank micro-batch leaves under its group's capacity (split over that group, each rank paying
the document's price on that group); ties go to a one-rank micro-batch, then a free cell, then a
group, then the earliest round, then the lowest rank. A new round only when nothing has room:
every round is a forward and backward on every rank, so rounds are not free. With a
``round_price`` (what a round costs, in the pricer's units) a round is also added when every cell is
taken and the best place with room would leave its rank more than that above the least-loaded rank:
with rounds nearly full of tokens, room alone would decide where the costly documents go.

Arrays, [rounds, ranks]: ``free`` (the cell has no micro-batch), ``room`` (tokens a one-rank
micro-batch can still take; -1 where none); per multi-rank micro-batch its round, first rank, size
and room. Each document reads them once per option kind instead of visiting every cell.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from .batch import Group, MicroBatch


class ShortPlacer:
    """Places short documents into ``table`` (round -> rank -> MicroBatch), adding to ``load``."""

    def __init__(self, table: List[Dict[int, MicroBatch]], load: np.ndarray, t: int, total: int,
                 pricer: Callable[[int, int], float], fill_groups: bool, round_price: Optional[float] = None):
        self.table, self.load, self.t, self.total, self.pricer = table, load, t, total, pricer
        self.round_price = round_price
        world = load.size
        self.free = np.array([[r not in row for r in range(world)] for row in table], dtype=bool).reshape(-1, world)
        self.room = np.full(self.free.shape, -1, dtype=np.int64)
        multi = [(k, mb) for k, row in enumerate(table) for r, mb in row.items()
                 if mb.group.size > 1 and r == mb.group.first] if fill_groups else []
        self.m_round = np.array([k for k, _ in multi], dtype=np.int64)
        self.m_first = np.array([mb.group.first for _, mb in multi], dtype=np.int64)
        self.m_size = np.array([mb.group.size for _, mb in multi], dtype=np.int64)
        self.m_room = np.array([mb.group.size * t - mb.tokens for _, mb in multi], dtype=np.int64)

    def place(self, d: int, lengths) -> None:
        n = lengths[d]
        best = _min(self._one_rank(n), self._in_group(n))
        if best is not None and self.round_price is not None and not self.free.any():
            # every cell is taken and the places with room would leave their rank busier than a
            # fresh round's least-loaded rank by more than a round costs: when the rounds are nearly
            # full of tokens, room (not cost) decides the placement, and a round buys the balance back
            if best[0] - (float(self.load.min()) + self.pricer(n, 1)) > self.round_price:
                best = None
        if best is None:
            self._new_round()
            r = int(np.argmin(self.load))                    # the least loaded rank, the lowest on a tie
            best = (0.0, 1, len(self.table) - 1, r)
        _, kind, k, r = best
        mb = self.table[k].get(r)
        docs = tuple(sorted((mb.documents if mb else ()) + (d,)))
        group = mb.group if mb else Group(1, r)
        added = self.pricer(n, group.size)
        new = MicroBatch(group, docs, tuple(lengths[i] for i in docs), self.total, (mb.cost if mb else 0.0) + added)
        for x in group.ranks:
            self.table[k][x] = new
            self.load[x] += added
        if kind == 1:
            self.free[k, r], self.room[k, r] = False, self.t - n
        elif kind == 0:
            self.room[k, r] -= n
        else:
            self.m_room[(self.m_round == k) & (self.m_first == r)] -= n

    def _one_rank(self, n: int) -> Optional[Tuple[float, int, int, int]]:
        """The best one-rank option: (the rank's load after, 0 = a micro-batch with room | 1 = a free
        cell, round, rank)."""
        fits = self.room >= n                                                     # [rounds, ranks]
        has_mb, has_free = fits.any(axis=0), self.free.any(axis=0)                # [ranks]
        ok = has_mb | has_free
        if not ok.any():
            return None
        value = self.load + self.pricer(n, 1)
        low = ok & (value == value[ok].min())
        kind = np.where(has_mb, 0, 1)
        low &= kind == kind[low].min()
        k = np.where(has_mb, fits.argmax(axis=0), self.free.argmax(axis=0))
        low &= k == k[low].min()
        r = int(np.flatnonzero(low)[0])
        return float(value[r]), int(kind[r]), int(k[r]), r

    def _in_group(self, n: int) -> Optional[Tuple[float, int, int, int]]:
        """The best multi-rank micro-batch with room: (its busiest rank's load after, 2, round, first)."""
        best = None
        for g in np.unique(self.m_size[self.m_room >= n]):
            sel = np.flatnonzero((self.m_size == g) & (self.m_room >= n))
            busiest = self.load.reshape(-1, g).max(axis=1)[self.m_first[sel] // g] + self.pricer(n, int(g))
            order = np.lexsort((self.m_first[sel], self.m_round[sel], busiest))
            i = sel[order[0]]
            best = _min(best, (float(busiest[order[0]]), 2, int(self.m_round[i]), int(self.m_first[i])))
        return best

    def _new_round(self) -> None:
        self.table.append({})
        world = self.load.size
        self.free = np.vstack([self.free, np.ones((1, world), dtype=bool)])
        self.room = np.vstack([self.room, np.full((1, world), -1, dtype=np.int64)])


def _min(a, b):
    return b if a is None else a if b is None else min(a, b)


__all__ = ["ShortPlacer"]
