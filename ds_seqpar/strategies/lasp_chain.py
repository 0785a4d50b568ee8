"""Which linear-attention states cross which rank boundaries: the plan LASP's exchanges follow,
for one sequence or for packed documents (the state restarts at every document start).

Notation as in lasp.py: P ranks, rank r holds tokens [r*L, (r+1)*L) (contiguous layout).

A rank's block is cut at every document start inside it into local *segments* (one segment
without documents). Per rank r:

    takes_in[r]   r > 0 and no document starts at r*L: the first segment continues a document
                  of earlier ranks, so it starts from state_in_r (else from zero)
    carry[r]      takes_in[r] and no document starts inside the block: the block is one segment,
                  and the state after it is lambda^L state_in_r + S_r
    sends[r]      takes_in[r+1]: the state after rank r's block is needed by rank r+1

S_r is the local state of r's LAST segment (from its start to the block end). Then

    state_in_r = sum over r' in chain(r) of lambda^(L (r-1-r')) S_r'

where chain(r) = r-1, r-2, ... walking back while the state passes through whole blocks: r' joins,
and r'-1 follows iff carry[r']. Without documents takes_in = [r > 0], carry = sends-to-next = True,
and chain(r) = all r' < r: lasp.py's formulas. The backward uses the same plan in reverse.

Pure arithmetic on the global cu_seqlens, so every rank derives the same plan; unit-tested
without processes.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

from ..sharding.documents import Documents


class LaspChain:
    def __init__(self, p: int, length: int, docs: Optional[Documents] = None):
        self.p, self.length = p, length
        starts = set(docs.starts_in(0, p * length)) if docs is not None else {0}
        self.segments: List[List[Tuple[int, int]]] = []
        self.takes_in, self.carry = [], []
        for r in range(p):
            lo, hi = r * length, (r + 1) * length
            cuts = sorted({t - lo for t in starts if lo < t < hi})
            edges = [0] + cuts + [length]
            self.segments.append(list(zip(edges, edges[1:])))
            takes = r > 0 and lo not in starts
            self.takes_in.append(takes)
            self.carry.append(takes and not cuts)
        self.sends = [r + 1 < p and self.takes_in[r + 1] for r in range(p)]

    def chain(self, r: int) -> List[int]:
        """The ranks whose local state S reaches state_in_r (nearest first); [] if not takes_in[r]."""
        out = []
        if not self.takes_in[r]:
            return out
        src = r - 1
        while src >= 0:
            out.append(src)
            if not self.carry[src]:
                break
            src -= 1
        return out

    @property
    def any_state_travels(self) -> bool:
        return any(self.takes_in)

    def state_hops(self) -> int:
        """States sent rank to rank in one forward (LASP-1): one per rank boundary a document crosses."""
        return sum(self.sends)


__all__ = ["LaspChain"]
