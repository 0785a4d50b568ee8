"""Which recurrent states cross which rank boundaries: the chain every state exchange (lasp_comm/) follows
(the own LM's LASP and the hybrids' linear layers alike), for one sequence or for packed documents (the state
restarts at every document start). Pure arithmetic on the layout and the global cu_seqlens, so every
rank derives the same chain; unit-tested without processes.

A *fragment* is a maximal run of consecutive global positions one rank holds, cut at every document
start inside it: ``(global start, length, offset in the local order)``. The contiguous layout gives one
run per rank (its *segments* once documents cut it), zigzag two. In global order, fragment f

    fed[f]        has a predecessor and does not start a document: it starts from the state the
                  fragments before it leave (else from zero)
    feeds[f]      its successor is fed: someone reads the state after f

and the state entering f folds the maps S_out = A . S_in + B of its *chain*: the fragments before it,
nearest first, walking back while each one is fed. A rank's *slots* are its fragments that feed another, in
global order: the only local states an all-gather has to carry (the last fragment's never is).

LaspChain is the contiguous view the own LM's LASP documents its formulas in (lasp.py): rank r holds
tokens [r*L, (r+1)*L), its first segment may take in, its last one may send, and

    state_in_r = sum over r' in chain(r) of lambda^(L (r-1-r')) S_r'

Without documents takes_in = [r > 0], sends = [r < P-1] and chain(r) = all r' < r.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from ..sharding.documents import Documents

Fragment = Tuple[int, int, int]          # (global start, length, offset in the local order)
Key = Tuple[int, int]                    # (rank, local fragment index)


def fragments(layout, seq_len: int) -> List[List[Fragment]]:
    """Per rank, its maximal runs of consecutive global positions, in local order."""
    out = []
    for r in range(layout.size):
        idx = layout.indices(seq_len, r).tolist()
        runs, offset = [], 0
        for i, pos in enumerate(idx):
            if i and pos == idx[i - 1] + 1:
                continue
            if runs:
                runs[-1] = (runs[-1][0], i - runs[-1][2], runs[-1][2])
            runs.append((pos, 0, i))
        runs[-1] = (runs[-1][0], len(idx) - runs[-1][2], runs[-1][2])
        out.append(runs)
    return out


def cut_at_documents(frags: Sequence[Sequence[Fragment]], bounds: Sequence[int]) -> List[List[Fragment]]:
    """The runs cut at every document start inside them (packed documents: ``bounds`` = the global
    cu_seqlens [0, l1, l1 + l2, ..., N]): no run then spans two documents."""
    starts = sorted(int(b) for b in bounds)
    out = []
    for fr in frags:
        pieces = []
        for start, n, off in fr:
            cuts = [start] + [b for b in starts if start < b < start + n] + [start + n]
            pieces += [(a, b - a, off + a - start) for a, b in zip(cuts[:-1], cuts[1:])]
        out.append(pieces)
    return out


def global_order(frags: Sequence[Sequence[Fragment]]) -> List[Key]:
    """(rank, local fragment index) of every fragment, by global start."""
    return sorted(((r, j) for r, fr in enumerate(frags) for j in range(len(fr))), key=lambda rj: frags[rj[0]][rj[1]][0])


class StateChain:
    """fed, feeds, chains and slots of every fragment (module doc); ``resets``: the global
    positions where a document starts."""

    def __init__(self, frags: Sequence[Sequence[Fragment]], resets=frozenset()):
        self.frags, self.p = frags, len(frags)
        self.order = global_order(frags)
        self.prev: Dict[Key, Optional[Key]] = {}
        self.next: Dict[Key, Optional[Key]] = {}
        for i, key in enumerate(self.order):
            self.prev[key] = self.order[i - 1] if i else None
            self.next[key] = self.order[i + 1] if i + 1 < len(self.order) else None
        self.fed = {key: self.prev[key] is not None and self.start(key) not in resets for key in self.order}
        self.feeds = {key: self.next[key] is not None and self.fed[self.next[key]] for key in self.order}
        self.slots = [[j for j in self.local(r) if self.feeds[r, j]] for r in range(self.p)]
        self.width = max(len(s) for s in self.slots)        # slots per rank an all-gather carries; 0: none

    def start(self, key: Key) -> int:
        return self.frags[key[0]][key[1]][0]

    def tokens(self, key: Key) -> int:
        return self.frags[key[0]][key[1]][1]

    def local(self, r: int) -> List[int]:
        """Rank r's fragment indices in global order."""
        return sorted(range(len(self.frags[r])), key=lambda j: self.frags[r][j][0])

    def chain_of(self, key: Key) -> List[Key]:
        """The fragments whose maps reach the state entering ``key``, nearest first ([] if it is not
        fed)."""
        out, at = [], key
        while self.fed[at]:
            at = self.prev[at]
            out.append(at)
        return out

    def slot(self, key: Key) -> int:
        return self.slots[key[0]].index(key[1])


class LaspChain(StateChain):
    """The contiguous layout's chain, per rank: ``segments`` (local [lo, hi) of each fragment),
    ``takes_in[r]`` (the first segment), ``carry[r]`` (one segment that takes in: the state after the
    block is lambda^L state_in + S_r), ``sends[r]`` (the last segment), ``chain(r)`` (ranks)."""

    def __init__(self, p: int, length: int, docs: Optional[Documents] = None):
        runs = [[(r * length, length, 0)] for r in range(p)]
        starts = docs.starts_in(0, p * length) if docs is not None else []
        super().__init__(cut_at_documents(runs, starts), frozenset(starts))
        self.length = length
        self.segments = [[(off, off + n) for _, n, off in fr] for fr in self.frags]
        self.takes_in = [self.fed[r, 0] for r in range(p)]
        self.carry = [self.takes_in[r] and len(self.frags[r]) == 1 for r in range(p)]
        self.sends = [self.feeds[r, len(self.frags[r]) - 1] for r in range(p)]

    def chain(self, r: int) -> List[int]:
        """The ranks whose last segment's state reaches rank r's state_in (nearest first)."""
        return [src for src, _ in self.chain_of((r, 0))]

    @property
    def any_state_travels(self) -> bool:
        return self.width > 0

    def state_hops(self) -> int:
        """States sent rank to rank in one forward (LASP-1): one per rank boundary a document crosses."""
        return sum(self.sends)


__all__ = ["Fragment", "StateChain", "LaspChain", "fragments", "cut_at_documents", "global_order"]
